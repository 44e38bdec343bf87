//! # idem-test: prove your handlers exactly-once, under the faults that break them
//!
//! idem keeps its promise only if your handlers keep theirs. A handler that
//! calls an HTTP API inside its transaction, takes its `key` from something
//! that changes between deliveries, or publishes with core NATS instead of
//! the outbox, is applied twice the first time the world misbehaves. This
//! crate runs **your** routers against a real nats-server and a real
//! PostgreSQL, injects those misbehaviours, and checks your tables
//! afterwards:
//!
//! ```no_run
//! use idem_runtime::{Route, Router, idempotent};
//! use idem_test::{Bed, Faults};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Credit { transfer_id: String, account: i64, amount: i64 }
//!
//! #[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
//! async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
//!     sqlx::query("INSERT INTO ledger (transfer_id, amount) VALUES ($1, $2)")
//!         .bind(&cmd.transfer_id)
//!         .bind(cmd.amount)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! fn router() -> Router {
//!     Router::new().route(
//!         Route::new("LEDGER", "ledger-credit")
//!             .filter_subject("ledger.credit")
//!             .create_stream(async_nats::jetstream::stream::Config {
//!                 name: "LEDGER".into(),
//!                 subjects: vec!["ledger.>".into()],
//!                 ..Default::default()
//!             }),
//!         credit,
//!     )
//! }
//!
//! async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
//!     sqlx::raw_sql("CREATE TABLE ledger (transfer_id text NOT NULL, amount bigint NOT NULL)")
//!         .execute(pool)
//!         .await?;
//!     Ok(())
//! }
//!
//! fn credits(n: usize) -> impl Iterator<Item = Credit> {
//!     (0..n).map(|i| Credit { transfer_id: format!("t-{i}"), account: 1, amount: 10 })
//! }
//!
//! #[idem_test::test(setup = migrate)]
//! async fn a_credit_is_applied_once_whatever_fails(bed: Bed) {
//!     bed.run(router())
//!         .publish_json("ledger.credit", credits(100))
//!         .with_faults(Faults::all())
//!         .until_settled()
//!         .await
//!         .assert_effects("SELECT count(*) FROM ledger", 100)
//!         .assert_no_duplicates("SELECT transfer_id FROM ledger")
//!         .assert_claims("ledger.credit.v1", 100)
//!         .assert_no_dead_letters();
//! }
//! # fn main() {}
//! ```
//!
//! When a handler is not safe, the assertion fails and says which faults
//! ran, what showed that each one happened, and which messages they
//! touched. The [guide] walks through it.
//!
//! # The parts
//!
//! - [`Bed`]: the servers (processes of the test's own, or `NATS_URL` and
//!   `DATABASE_URL`), a database with idem's schema, clients on both. The
//!   [`test`] attribute starts one, runs your set-up, and hands it to the
//!   test; [`Bed::start`] does the same by hand.
//! - [`Run`]: your routers under faults, from [`Bed::run`]: what to publish
//!   ([`Run::publish_json`]), which requests to send
//!   ([`Run::request_json`]), which [`Faults`] to inject.
//!   [`Run::until_settled`] waits until nothing is left to do and checks
//!   that every fault happened.
//! - [`Settled`]: assertions on your tables (effects, duplicates by a key,
//!   sums) and on idem's side (claims, dead letters, what was published,
//!   replies).
//! - [`unit`](mod@unit): a handler's body without NATS: a transaction on
//!   the test database and the outbox rows the call queued.
//! - [`harness`]: the servers and proxies underneath, for tests that drive
//!   them by hand.
//!
//! # How faults reach your router
//!
//! The kit enables idem-runtime's `fault-injection` feature (a
//! dev-dependency only, so your service is built without it) and installs
//! hooks on your router that act at three points of a message's path:
//! when a delivery arrives, when the handler returns, and after COMMIT.
//! Between the routers and PostgreSQL it puts a proxy that can cut a
//! connection right after the server ran a COMMIT. Server restarts are real
//! restarts of the kit's own processes. See [`Fault`] for each.
//!
//! # Requirements
//!
//! `nats-server` 2.10 or newer on PATH (or `NATS_SERVER_BIN`), and
//! PostgreSQL's `initdb` and `postgres` (in `/usr/lib/postgresql/15/bin`,
//! or `IDEM_PG_BINDIR`); or `NATS_URL` and `DATABASE_URL`. A missing one
//! fails the test with what to install. Each test starts its own servers
//! (about half a second) and a run under every fault takes seconds.

#![warn(missing_docs)]

mod bed;
mod drive;
mod faults;
pub mod harness;
mod plan;
mod report;
mod run;
mod settle;
mod settled;
pub mod unit;

#[doc(hidden)]
pub mod __private;

pub use bed::Bed;
pub use faults::{Fault, Faults};
pub use idem_test_macros::test;
pub use run::Run;
pub use settled::Settled;

#[doc = include_str!("../docs/testing-your-handlers.md")]
pub mod guide {}
