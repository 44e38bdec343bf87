//! # idem: effectively-once message handling for JetStream and PostgreSQL
//!
//! A handler runs inside one PostgreSQL transaction whose first statement
//! *claims* the message: it inserts `(handler, message id)` into a dedup table
//! with a unique key. The business writes and the claim commit together or not
//! at all, and the message is acked only after the commit. A redelivery of a
//! processed message finds the row and is acked without running the body; a
//! redelivery that races the first attempt waits on the unique key, then does
//! the same.
//!
//! ```no_run
//! use idem_runtime::{Route, Router, idempotent};
//!
//! #[derive(serde::Deserialize)]
//! struct Credit { account: i64, amount: i64 }
//!
//! #[idempotent(name = "credit-v1")]
//! async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(cmd.amount)
//!         .bind(cmd.account)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let nats = async_nats::connect("127.0.0.1:4222").await?;
//! let pool = sqlx::PgPool::connect("postgres://localhost/ledger").await?;
//! idem_runtime::schema::migrate(&pool).await?;
//! Router::new()
//!     .route(Route::new("LEDGER", "credit").filter_subject("ledger.credit"), credit)
//!     .run(nats, pool)
//!     .await?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
// On docs.rs (`--cfg docsrs`, see Cargo.toml), each feature-gated item is
// marked with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod ack;
mod batch;
mod claim;
pub mod codec;
mod connections;
pub mod dead_letter;
mod delivery;
mod durability;
mod error;
pub mod expiry;
mod failure;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod handler;
mod header_block;
mod health;
mod heartbeat;
mod message_id;
pub mod metrics;
pub mod outbox;
pub mod partition;
mod pipeline;
mod pull;
pub mod reply;
pub mod results;
pub mod retention_floor;
mod retry;
mod route;
mod router;
pub mod schema;
mod shutdown;
mod state;
mod stats;
pub mod status;
#[cfg(feature = "otel")]
pub mod trace;
mod transaction;
mod undeliverable;

pub use ack::AckMode;
pub use delivery::Delivery;
pub use error::{BoxError, Error, HandlerError, HandlerResult, RejectedMessage};
pub use failure::{Classify, ErrorClass, Permanent, Transient};
pub use handler::{Handler, IntoHandler};
pub use idem_macros::{FromRef, classify, idempotent};
pub use message_id::{InvalidMessageId, MAX_MESSAGE_ID_LEN, MessageId, MessageIdSource};
pub use reply::ReplyRoute;
pub use retention_floor::{RetentionFloor, Unbounded};
pub use retry::RetryPolicy;
pub use route::Route;
pub use router::{Router, RouterHandle};
pub use state::{FromBatch, FromDelivery, FromRef, Parameter, State};
pub use stats::Stats;
pub use undeliverable::ADVISORY_STREAM;

/// The sqlx this version of idem is built on: name it as `idem_runtime::sqlx`
/// to be sure your handlers use the same one.
pub use sqlx;

/// The async-nats this version of idem is built on.
pub use async_nats;

/// What `#[idempotent]` and `#[classify]` expansions call. Not a public
/// API: it may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::__handler_error as handler_error;
    pub use crate::claim::CLAIM_SQL;
    pub use crate::failure::{Classifier, specialize};
    pub use crate::handler::{AsIs, ViaConstructor};
    pub use crate::results::{NoValue, encode, no_value};
    pub use inventory;
    pub use sqlx::PgTransaction;
    pub use std::string::ToString;
}
