//! The COMMIT and the ack after it, against real servers: a message is acked
//! only after its transaction committed durably, never on a COMMIT whose
//! outcome is unknown or that did not commit what it claimed.
//!
//! - `ambiguous`: COMMITs cut in flight, orphaned, or never answered.
//! - `commit_check`: COMMITs that PostgreSQL turned into a rollback or
//!   refused, and handlers that committed by themselves.
//! - `durability`: the ack follows a durable COMMIT, whatever
//!   `synchronous_commit` says.
//! - `acks`: what JetStream is told about a message past its delivery limit.

mod acks;
mod ambiguous;
mod commit_check;
mod durability;
