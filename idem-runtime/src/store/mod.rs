//! Everything that speaks SQL for idem's tables (private, but for
//! [`schema`]): the claim, the message's transaction and its checked COMMIT,
//! stored results, the outbox's rows and a relay's session, what operators
//! read, the connections a route keeps, what idem needs of PostgreSQL's
//! durability, the claims' generations and their purge, a relay's LISTEN
//! connection, and the schema's migrations. No other module sends SQL of
//! its own: this is the seam where another database's store would go (see
//! "Toward more databases" in ARCHITECTURE.md).

pub(crate) mod backend;
pub(crate) mod claim;
pub(crate) mod connections;
pub(crate) mod durability;
#[cfg(feature = "mariadb")]
pub(crate) mod mariadb;
pub(crate) mod migrations;
pub(crate) mod outbox;
pub(crate) mod purge;
pub(crate) mod reads;
pub(crate) mod results;
pub mod schema;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
pub(crate) mod transaction;
