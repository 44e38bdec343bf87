//! Claims, the core promise, against real servers: every message is applied
//! once, whatever is redelivered. Each test checks that the effects equal the
//! inputs with no duplicate, and that the fault it injects really happened.
//!
//! - `exactly_once`: publisher retries, crashes after commit, redelivery
//!   during an attempt, handler errors, two handlers, heartbeats; per message
//!   and in batches.
//! - `ids`: the id each message is claimed by, and ids that cannot be claimed.
//! - `redelivery`: a redelivery waiting on the claim of an attempt that rolls
//!   back.

mod exactly_once;
mod ids;
mod redelivery;
