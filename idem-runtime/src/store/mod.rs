//! Everything that speaks SQL for idem's tables (private, but for
//! [`schema`]): the claim, the message's transaction and its checked COMMIT,
//! stored results, the outbox's rows and a relay's session, what operators
//! read, the connections a route keeps, what idem needs of PostgreSQL's
//! durability, and the schema's migrations.
//!
//! (The relays' LISTEN is still in `outbox/wake.rs`, and the purge's
//! statements in `retention/`: moving them here is the next step of the
//! store seam that more databases need; see ARCHITECTURE.md.)

pub(crate) mod claim;
pub(crate) mod connections;
pub(crate) mod durability;
pub(crate) mod outbox;
pub(crate) mod reads;
pub(crate) mod results;
pub mod schema;
pub(crate) mod transaction;
