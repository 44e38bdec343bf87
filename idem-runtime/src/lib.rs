//! # idem: effectively-once JetStream message handling on PostgreSQL or SQLite
//!
//! A consumer takes a message from JetStream, writes to its database,
//! commits, and then crashes before it acks. JetStream redelivers the
//! message and the work happens twice. A redelivery can also arrive while
//! the first attempt is still running, because `ack_wait` expired. idem
//! closes both gaps.
//!
//! A handler runs inside one PostgreSQL transaction (or SQLite or MariaDB,
//! with the feature `sqlite` or `mariadb`) whose first statement *claims*
//! the message: it inserts
//! `(handler, message id)` into a dedup table with a unique key.
//!
//! - The claim and the business writes commit together, or not at all.
//! - The message is acked only after the commit.
//! - A redelivery of a processed message finds the row: the body is skipped
//!   and the message acked.
//! - A redelivery that races the first attempt waits on the unique key until
//!   the first attempt commits, then skips. (If the first attempt rolls back,
//!   the second proceeds.) It never double-applies. On SQLite it waits for
//!   the database's one write lock instead.
//!
//! # A handler
//!
//! ```no_run
//! use idem_runtime::{Route, Router, idempotent};
//!
//! #[derive(serde::Deserialize)]
//! struct Credit { transfer_id: String, account: i64, amount: i64 }
//!
//! /// Credits an account once per transfer.
//! #[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
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
//! idem_runtime::schema::migrate(&pool).await?; // the dedup schema, once at start-up
//! Router::new()
//!     .route(Route::new("LEDGER", "ledger-credit").filter_subject("ledger.credit"), credit)
//!     .run(nats, pool) // until Ctrl-C or SIGTERM
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! The handler's name (`ledger.credit.v1`) and the message's id (here the
//! transfer, else its `Nats-Msg-Id`, else its stream position) make the
//! dedup key. The runtime does the rest: it begins the transaction, claims,
//! calls the body only for a fresh claim, checks that the transaction is
//! still the one that claimed, commits, and acks. A failed message is
//! retried, held or dead-lettered by its error's class.
//!
//! # The guide
//!
//! The [`guide`] explains each part, with examples that are compiled as
//! doctests:
//!
//! | chapter | what it covers |
//! |---|---|
//! | [Writing handlers](guide::writing_handlers) | parameters, return types, codecs, the message id, routes, pool size, the path of a message |
//! | [Errors and retries](guide::errors_and_retries) | error classes, [`RetryPolicy`], held messages, the policy's share of the retention floor |
//! | [Batch](guide::batch) | [`Route::batch`] and batch handlers |
//! | [Request/reply](guide::request_reply) | stored results and [`ReplyRoute`] |
//! | [Outbox](guide::outbox) | publishing if, and only if, the transaction commits |
//! | [Retention](guide::retention) | how claims are stored and expire, the purge, the retention floor |
//! | [Failure handling](guide::failure_handling) | every failure path, the test that proves it, dead letters, durability |
//! | [Running at scale](guide::running_at_scale) | many workers, clusters, per-key ordering |
//! | [Operating](guide::operating) | counters, the `idem` command, metrics, tracing |
//! | [Performance](guide::performance) | the benchmarks |
//! | [SQLite](guide/sqlite/index.html) (feature `sqlite`) | handlers on a SQLite file with `Router::sqlite`, and what differs from PostgreSQL |
//! | [MariaDB](guide/mariadb/index.html) (feature `mariadb`) | handlers on MariaDB with `Router::mariadb`, and what differs from PostgreSQL |
//!
//! # A map of the crate
//!
//! The root holds what nearly every service names; the rest lives in the
//! module of its concern.
//!
//! Binding handlers to messages:
//!
//! - [`Router`] binds handlers to routes and runs them; [`RouterHandle`]
//!   (from [`Router::handle`]) reads its [`Stats`] and stops it.
//! - [`Route`] is one durable JetStream consumer and its settings, with a
//!   [`RetryPolicy`] and an [`AckMode`]; [`route::partition`] keeps per-key
//!   order. [`ReplyRoute`] answers core NATS requests ([`reply`] holds its
//!   error replies).
//!
//! Writing a handler:
//!
//! - [`idempotent`] turns an `async fn` into a
//!   [handler](handler::Handler); [`State`] and [`FromRef`] hand it parts
//!   of the application state; [`Delivery`] is what it may know of its
//!   message, [`MessageId`] the id it is deduplicated by. [`handler`] holds
//!   the traits behind them, and [`handler::results`] reads back the values
//!   handlers stored. [`codec`] decodes a payload and encodes a value.
//! - [`HandlerError`], [`Permanent`] and [`Transient`] say what a failure
//!   means, and [`classify`] lets an error type say it
//!   ([`error`] holds the classes); [`Error`] is what a router's start-up
//!   or run returns.
//! - [`outbox`] queues messages in the handler's transaction and relays them
//!   after COMMIT.
//!
//! Operating a service:
//!
//! - [`schema`] creates and checks the dedup tables.
//! - [`retention`]: [`retention::floor`] computes the shortest safe
//!   retention, [`retention::expiry`] rotates and purges the claims.
//! - [`dead_letter`] lists, replays and discards dead letters.
//! - [`status`] reports what consumers and dedup tables hold;
//!   [`observe::metrics`] names every metric. With the feature `otel`,
//!   `observe::trace` carries W3C trace context across services.
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `prost` | off | `codec = protobuf`: `codec::Protobuf` for any `prost::Message` |
//! | `otel` | off | trace context across services, through the outbox too (`idem_runtime::trace`) |
//! | `sqlite` | off | handlers on a SQLite file: `Router::sqlite`, `status::sqlite` and the guide's SQLite chapter; the outbox too |
//! | `mariadb` | off | handlers on MariaDB 10.11+ (InnoDB): `Router::mariadb` and the guide's MariaDB chapter; the outbox too |
//! | `fault-injection` | off | hooks the integration tests use to inject faults; never in production |
//!
//! idem re-exports the [`sqlx`] and [`async_nats`] it is built on, so that
//! your versions match.

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
pub mod guide;
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

pub use error::{Error, HandlerError, Permanent, Transient};
pub use handler::{Delivery, FromRef, MessageId, State};
pub use idem_macros::{FromRef, classify, idempotent};
pub use observe::Stats;
pub use reply::ReplyRoute;
pub use route::{AckMode, RetryPolicy, Route};
pub use router::{Router, RouterHandle};
pub use store::schema;

// The paths from before the runtime was split into folders, kept for one
// release (see CHANGELOG.md): each now lives in the module named.
#[doc(hidden)]
pub use dead_letter::ADVISORY_STREAM;
#[doc(hidden)]
pub use error::{BoxError, Classify, ErrorClass, HandlerResult, RejectedMessage};
#[doc(hidden)]
pub use handler::results;
#[doc(hidden)]
pub use handler::{FromBatch, FromDelivery, Handler, IntoHandler, Parameter};
#[doc(hidden)]
pub use handler::{InvalidMessageId, MAX_MESSAGE_ID_LEN, MessageIdSource};
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
    pub use crate::handler::expansion::{DatabaseOf, NoValue, OnDatabase, encode, no_value};
    pub use crate::handler::{AsIs, ViaConstructor};
    pub use crate::store::claim::CLAIM_SQL;
    pub use inventory;
    pub use sqlx::PgTransaction;
    pub use sqlx::Transaction;
    pub use std::string::ToString;
}
