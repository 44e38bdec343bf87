//! Test harness for idem's integration tests: a real `nats-server` with
//! JetStream and a real PostgreSQL for every test.
//!
//! The servers, the cluster and the COMMIT-cutting proxy are `idem-test`'s
//! ([`idem_test::harness`], what users' tests run on too), re-exported here
//! under the paths idem's tests have always used; this crate adds the
//! fixtures only idem's own suite needs.
//!
//! Each test gets servers of its own, on loopback, with random ports and
//! temp dirs, so tests run in parallel under both `cargo nextest run` (a
//! process per test) and `cargo test` (a thread per test). Servers are
//! killed and their dirs removed when the [`TestEnv`] drops, also when the
//! test panics; if the test process itself is killed, the kernel kills the
//! servers (`PR_SET_PDEATHSIG`) and the next run removes the dirs.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! // In tests/tests/<feature>/*.rs, under #[tokio::test]:
//! async fn survives_a_nats_crash() {
//!     let mut env = idem_tests::TestEnv::start().await;
//!     let pool = env.pool().await;
//!     let js = env.jetstream().await;
//!     // ... create a stream, run the handler, publish ...
//!     env.nats_server_mut().kill_and_restart().await;
//!     idem_tests::eventually("the database answers", Duration::from_secs(10), async || {
//!         let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
//!             .fetch_one(&pool)
//!             .await
//!             .unwrap();
//!         rows > 0
//!     })
//!     .await;
//!     # drop(js);
//! }
//! ```
//!
//! # Helpers
//!
//! - [`scenario`]: what most tests start from (servers, a prepared database,
//!   a stream), publishing, running routers, reading dead letters and acks
//!   back, and the small handlers and routes many tests share;
//!   `use idem_tests::scenario::*` is the one import a test needs.
//! - [`claims`]: claims and purges by hand, for the retention tests.
//! - [`pg_proxy`] and [`fault_proxy`]: proxies that cut a COMMIT, or pause,
//!   drop and reset connections.
//! - [`ack_events`]: every ack JetStream receives, parsed, with a probe.
//! - [`outbox`]: the streams an outbox relay publishes to, what they store,
//!   and a relay run as a task, on any database the outbox runs on.
//! - [`sqlite`]: SQLite files opened as the guide asks.
//! - [`worker_process`]: a worker binary run as a child process, its
//!   journal read back, SIGKILLed or held between COMMIT and ack.
//! - [`eventually`]: the one way to wait for a condition.
//!
//! # Environment
//!
//! - `NATS_URL`: use this NATS server instead of starting one. Tests share
//!   it, so they must use unique stream names ([`unique_name`]).
//! - `DATABASE_URL`: use this PostgreSQL server instead of starting one; each
//!   test still gets a fresh database, dropped afterwards.
//!
//!   With either set, tests that crash or restart a server cannot run: they
//!   are built as ignored (`tests/build.rs` sets `cfg(idem_external_servers)`),
//!   except under `CI`, where they run and fail ([`require_own_servers`]).
//! - `NATS_SERVER_BIN`: the nats-server binary (default: `nats-server` on
//!   PATH; v2.10 or newer, the project pins 2.15.1).
//! - `IDEM_PG_BINDIR`: the dir with `initdb` and `postgres` (default:
//!   `/usr/lib/postgresql/15/bin`).
//! - `RUST_LOG`: log filter for [`init_tracing`] (default `warn`).
//!
//! `scripts/setup.sh` installs the servers.

pub mod ack_events;
pub mod claims;
pub mod fault_proxy;
pub mod kill_run;
pub mod kill_worker;
mod logs;
pub mod outbox;
pub mod scenario;
pub mod seeded;
pub mod sqlite;
pub mod worker_process;

use async_nats::jetstream;
use tokio::sync::OnceCell;

pub use crate::fault_proxy::FaultProxy;
pub use crate::logs::{Logs, capture_logs};
pub use idem_test::harness::pg_proxy;
pub use idem_test::harness::{
    ClusterEnv, Mariadb, NatsCluster, NatsServer, Postgres, create_idem_streams_r3, die_with_test,
    eventually, init_tracing, unique_name,
};

/// A NATS server and a PostgreSQL database for one test.
///
/// Start it at the top of the test; it stops everything when dropped.
///
/// ```no_run
/// # async fn demo() {
/// let env = idem_tests::TestEnv::start().await;
/// let pool: sqlx::PgPool = env.pool().await;
/// let client: async_nats::Client = env.nats().await;
/// # drop((pool, client));
/// # }
/// ```
pub struct TestEnv {
    // A client for the harness's own queries (consumer_info); made on first
    // use. Declared first so it closes before the servers go.
    client: OnceCell<async_nats::Client>,
    nats: NatsServer,
    postgres: Postgres,
}

impl TestEnv {
    /// Starts (or, with `NATS_URL` / `DATABASE_URL`, connects to) both
    /// servers concurrently and waits until both are ready. Also calls
    /// [`init_tracing`].
    ///
    /// # Panics
    ///
    /// If either server does not become ready; the message includes the
    /// tail of the server's log. Whatever was already started is stopped.
    pub async fn start() -> TestEnv {
        init_tracing();
        let (nats, postgres) = tokio::join!(NatsServer::start(), Postgres::start());
        TestEnv {
            client: OnceCell::new(),
            nats,
            postgres,
        }
    }

    /// As [`TestEnv::start`], with a NATS server of the test's own whose
    /// `jetstream` block also holds `settings` (see
    /// [`NatsServer::start_with_jetstream`]).
    ///
    /// # Panics
    ///
    /// As [`TestEnv::start`], and if `NATS_URL` is set.
    pub async fn start_with_jetstream(settings: &str) -> TestEnv {
        init_tracing();
        let (nats, postgres) = tokio::join!(
            NatsServer::start_with_jetstream(settings),
            Postgres::start()
        );
        TestEnv {
            client: OnceCell::new(),
            nats,
            postgres,
        }
    }

    /// As [`TestEnv::start`], with a PostgreSQL server of the test's own run
    /// with `settings` (see [`Postgres::start_with`]).
    ///
    /// # Panics
    ///
    /// As [`TestEnv::start`], and if `DATABASE_URL` is set.
    pub async fn start_with_postgres(settings: &[&str]) -> TestEnv {
        init_tracing();
        let (nats, postgres) = tokio::join!(NatsServer::start(), Postgres::start_with(settings));
        TestEnv {
            client: OnceCell::new(),
            nats,
            postgres,
        }
    }

    /// The NATS URL, e.g. `nats://127.0.0.1:43781`.
    pub fn nats_url(&self) -> &str {
        self.nats.url()
    }

    /// The URL of this test's database, e.g.
    /// `postgres://postgres@127.0.0.1:23456/postgres`.
    pub fn database_url(&self) -> &str {
        self.postgres.url()
    }

    /// A new connection pool on this test's database.
    pub async fn pool(&self) -> sqlx::PgPool {
        self.postgres.pool().await
    }

    /// A new NATS client. It reconnects by itself after a server restart.
    pub async fn nats(&self) -> async_nats::Client {
        self.nats.client().await
    }

    /// A JetStream context on a new NATS client.
    pub async fn jetstream(&self) -> jetstream::Context {
        self.nats.jetstream().await
    }

    /// The NATS server.
    pub fn nats_server(&self) -> &NatsServer {
        &self.nats
    }

    /// The NATS server, to crash it: [`NatsServer::kill_and_restart`].
    pub fn nats_server_mut(&mut self) -> &mut NatsServer {
        &mut self.nats
    }

    /// The PostgreSQL server.
    pub fn postgres(&self) -> &Postgres {
        &self.postgres
    }

    /// The PostgreSQL server, to crash it: [`Postgres::restart_immediate`].
    pub fn postgres_mut(&mut self) -> &mut Postgres {
        &mut self.postgres
    }

    /// The server's view of a consumer: `num_pending` (not yet delivered),
    /// `num_ack_pending` (delivered, not acked), `num_redelivered`,
    /// `delivered` and `ack_floor` sequences.
    ///
    /// # Panics
    ///
    /// If the stream or consumer does not exist.
    ///
    /// ```no_run
    /// # async fn demo(env: idem_tests::TestEnv) {
    /// let info = env.consumer_info("ORDERS", "ledger").await;
    /// assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    /// # }
    /// ```
    pub async fn consumer_info(&self, stream: &str, consumer: &str) -> jetstream::consumer::Info {
        let client = self.client.get_or_init(|| self.nats.client()).await;
        consumer_info(&jetstream::new(client.clone()), stream, consumer).await
    }
}

/// The server's view of `consumer` on `stream`; see
/// [`TestEnv::consumer_info`].
///
/// # Panics
///
/// If the stream or consumer does not exist.
pub async fn consumer_info(
    js: &jetstream::Context,
    stream: &str,
    consumer: &str,
) -> jetstream::consumer::Info {
    let stream_handle = js
        .get_stream_no_info(stream)
        .await
        .unwrap_or_else(|e| panic!("cannot get stream {stream}: {e}"));
    stream_handle
        .consumer_info(consumer)
        .await
        .unwrap_or_else(|e| panic!("cannot get info of consumer {consumer} on {stream}: {e}"))
}

/// How a test's route batches: each exactly-once scenario runs in all three
/// (see [`in_every_mode!`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// One message per transaction (`Route::per_message`).
    PerMessage,
    /// Batches of up to this many (`Route::batch`).
    Fixed(usize),
    /// What a route does unless told otherwise: adaptive batches.
    Default,
}

/// Sets how a route batches, in a chain of `Route` settings.
pub trait Batched {
    /// The route with `batching`.
    fn batching(self, batching: Batching) -> Self;
}

impl Batched for idem_runtime::Route {
    fn batching(self, batching: Batching) -> Self {
        match batching {
            Batching::PerMessage => self.per_message(),
            Batching::Fixed(size) => self.batch(size),
            Batching::Default => self,
        }
    }
}

/// Runs each named scenario, an `async fn(batching: Batching)` of the
/// calling module, as three tests: `per_message::<scenario>`,
/// `batched::<scenario>` (fixed batches of `batch`) and
/// `adaptive::<scenario>` (the route's default, adaptive batching).
///
/// ```
/// use idem_tests::Batching;
///
/// async fn applies_once(batching: Batching) {
///     assert_ne!(batching, Batching::Fixed(0));
/// }
///
/// // Tests `per_message::applies_once`, `batched::applies_once` and
/// // `adaptive::applies_once`.
/// idem_tests::in_every_mode!(batch = 8; applies_once);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! in_every_mode {
    (batch = $batch:literal; $($scenario:ident),* $(,)?) => {
        mod per_message {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario($crate::Batching::PerMessage).await;
                }
            )*
        }

        mod batched {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario($crate::Batching::Fixed($batch)).await;
                }
            )*
        }

        mod adaptive {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario($crate::Batching::Default).await;
                }
            )*
        }
    };
}

/// Panics, saying why, if `NATS_URL` or `DATABASE_URL` is set: the calling
/// test crashes or restarts its servers, which it can only do to servers the
/// harness runs itself. Call it first in such a test, and mark the test
///
/// ```text
/// #[cfg_attr(
///     idem_external_servers,
///     ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
/// )]
/// ```
///
/// so that it is reported as ignored rather than run (`tests/build.rs` sets
/// that cfg when either variable is set, except under `CI`). Under `CI`, or
/// when a variable is set at run time only, the test runs and this panics:
/// a test that did not run must never count as passed.
///
/// ```
/// // With neither variable set, it returns.
/// if std::env::var_os("NATS_URL").is_none() && std::env::var_os("DATABASE_URL").is_none() {
///     idem_tests::require_own_servers();
/// }
/// ```
#[track_caller]
pub fn require_own_servers() {
    let set: Vec<String> = ["NATS_URL", "DATABASE_URL"]
        .into_iter()
        .filter_map(|var| Some(format!("{var}={:?}", std::env::var_os(var)?)))
        .collect();
    assert!(
        set.is_empty(),
        "this test crashes or restarts its servers, so it needs servers the harness runs \
         itself, but {} is set. Unset it to run this test. (Outside CI such tests are \
         built as ignored when these variables are set at build time; under CI they must run.)",
        set.join(" and ")
    );
}

/// Types the expansion snapshots (`tests/expand/`) and the README's example
/// use, kept here so that their own derives stay out of the snapshots.
pub mod fixtures {
    use idem_runtime::{Classify, ErrorClass, FromRef};

    /// A credit to one account, identified by its transfer.
    #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
    pub struct Credit {
        /// The transfer this credit belongs to: its dedup key.
        pub transfer_id: String,
        /// The account credited.
        pub account: i64,
        /// The amount, in cents.
        pub amount: i64,
    }

    /// The ledger service's state.
    #[derive(Debug, Clone, FromRef)]
    pub struct Ledger {
        /// The fee taken from each credit.
        pub fees: Fees,
    }

    /// The fee taken from each credit, in cents.
    #[derive(Debug, Clone, Copy)]
    pub struct Fees(pub i64);

    /// Why a credit failed.
    #[derive(Debug, thiserror::Error)]
    pub enum LedgerError {
        /// The account is not in the ledger; no retry can help.
        #[error("account {0} does not exist")]
        UnknownAccount(i64),
        /// The database failed.
        #[error(transparent)]
        Database(#[from] sqlx::Error),
    }

    impl Classify for LedgerError {
        fn class(&self) -> ErrorClass {
            match self {
                LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
                LedgerError::Database(error) => ErrorClass::of_sqlx(error),
            }
        }
    }
}

/// The README's Rust examples, compiled by `cargo test --doc -p idem-tests`.
/// The README sits outside every published crate (an `include_str!` of it
/// from `idem-runtime` would break `cargo package`), so it is checked here,
/// in a crate that is never published.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
