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

// The modules, bottom layer first; each imports only layers below it
// (scripts/check-module-cycles.py fails CI otherwise, and ARCHITECTURE.md
// walks through them):
//   codec, message_id, tasks    leaves: bytes, ids, task lifetimes
//   error                       what went wrong, and its class
//   observe, store              counters and metrics; all the SQL
//   handler, retention          what a handler is; how long claims are kept
//   route, fault                where messages come from; test-only hooks
//   reply, dead_letter, outbox  the features around a message
//   consume                     the path of one message
//   status                      what operators read
//   router                      start-up, running, shutdown
pub mod codec;
mod consume;
pub mod dead_letter;
pub mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod handler;
mod message_id;
pub mod observe;
pub mod outbox;
pub mod reply;
pub mod retention;
pub mod route;
mod router;
pub mod status;
mod store;
mod tasks;

pub use error::{BoxError, Error, HandlerError, HandlerResult, RejectedMessage};
pub use error::{Classify, ErrorClass, Permanent, Transient};
pub use handler::{Delivery, Handler, IntoHandler};
pub use handler::{FromBatch, FromDelivery, FromRef, Parameter, State};
pub use handler::{InvalidMessageId, MAX_MESSAGE_ID_LEN, MessageId, MessageIdSource};
pub use idem_macros::{FromRef, classify, idempotent};
pub use observe::Stats;
pub use reply::ReplyRoute;
pub use route::{AckMode, RetryPolicy, Route};
pub use router::{Router, RouterHandle};
pub use store::schema;

// The paths before the runtime was split into folders, kept for one release.
#[doc(hidden)]
pub use dead_letter::ADVISORY_STREAM;
#[doc(hidden)]
pub use handler::results;
#[doc(hidden)]
pub use observe::metrics;
#[cfg(feature = "otel")]
#[doc(hidden)]
pub use observe::trace;
#[doc(hidden)]
pub use retention::floor as retention_floor;
#[doc(hidden)]
pub use retention::{RetentionFloor, Unbounded, expiry};
#[doc(hidden)]
pub use route::partition;

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
    pub use crate::error::class::{Classifier, specialize};
    pub use crate::handler::results::{NoValue, encode, no_value};
    pub use crate::handler::{AsIs, ViaConstructor};
    pub use crate::store::claim::CLAIM_SQL;
    pub use inventory;
    pub use sqlx::PgTransaction;
    pub use std::string::ToString;
}
