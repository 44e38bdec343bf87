//! Everything that speaks SQL for the dedup table (private, but for
//! [`schema`]): the claim, the message's transaction and its checked COMMIT,
//! the connections a route keeps, what idem needs of PostgreSQL's durability,
//! and the schema's migrations.

pub(crate) mod claim;
pub(crate) mod connections;
pub(crate) mod durability;
pub mod schema;
pub(crate) mod transaction;
