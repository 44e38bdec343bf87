//! The servers and proxies a [`Bed`](crate::Bed) is built on, for tests that
//! drive them by hand: a real `nats-server` with JetStream, a real
//! PostgreSQL, a 3-node JetStream cluster, and a proxy that cuts a COMMIT
//! after the server ran it. idem's own integration tests use them through
//! `idem_tests`.
//!
//! Each server is a process of the test's own, on loopback, with a random
//! port and a temp dir, so tests run in parallel under both `cargo nextest
//! run` (a process per test) and `cargo test` (a thread per test). Servers
//! are killed and their dirs removed on drop, also when the test panics; if
//! the test process itself is killed, the kernel kills the servers
//! (`PR_SET_PDEATHSIG`) and the next run removes the dirs.
//!
//! ```no_run
//! # async fn demo() {
//! use idem_test::harness::{NatsServer, Postgres};
//!
//! let (mut nats, mut postgres) = tokio::join!(NatsServer::start(), Postgres::start());
//! let pool = postgres.pool().await;
//! nats.kill_and_restart().await; // a crash: same port, same store
//! postgres.restart_immediate().await; // committed rows survive
//! # drop(pool);
//! # }
//! ```
//!
//! # Environment
//!
//! - `NATS_URL`: use this NATS server instead of starting one. Tests share
//!   it, so they must use unique stream names ([`unique_name`]); a test
//!   that restarts it panics.
//! - `DATABASE_URL`: use this PostgreSQL server instead of starting one;
//!   each test still gets a fresh database, dropped afterwards.
//! - `NATS_SERVER_BIN`: the nats-server binary (default: `nats-server` on
//!   PATH; 2.10 or newer, the project pins 2.15.1).
//! - `IDEM_PG_BINDIR`: the dir with `initdb` and `postgres` (default:
//!   `/usr/lib/postgresql/15/bin`).
//! - With the `mariadb` feature, [`Mariadb`] runs Debian's `mariadbd`
//!   from `/usr/sbin`, reached through a unix socket only.
//! - `IDEM_TEST_TMPDIR`: where servers keep their files (default: `/dev/shm`
//!   when usable, else the system temp dir).

mod cluster;
#[cfg(feature = "mariadb")]
mod mariadb;
mod nats;
pub mod pg_proxy;
mod postgres;
mod process;

use std::future::Future;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use cluster::{ClusterEnv, NatsCluster, create_idem_streams_r3};
#[cfg(feature = "mariadb")]
pub use mariadb::Mariadb;
pub use nats::NatsServer;
pub use pg_proxy::PgProxy;
pub use postgres::Postgres;
pub use process::die_with_test;

/// A name no other test uses: `prefix` plus a process-unique counter and a
/// random suffix, e.g. `orders_3_5f2c9a1b`. Only letters, digits and `_`
/// (given such a prefix), so it is valid as a stream, consumer, subject
/// token, or SQL identifier. Useful against a shared `NATS_URL` server.
///
/// ```
/// let a = idem_test::harness::unique_name("ORDERS");
/// let b = idem_test::harness::unique_name("ORDERS");
/// assert!(a.starts_with("ORDERS_") && a != b);
/// ```
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{n}_{:08x}", process::random_u64() as u32)
}

/// Polls `condition` every 20 ms until it returns `true`; `what` says what
/// is awaited, for the message if it never comes.
///
/// Accepts async closures (`async || ...`) and closures returning a future
/// (`|| async { ... }`).
///
/// # Panics
///
/// If `condition` is still `false` after `timeout`. The message names the
/// caller's file and line, and `what`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
///
/// let polls = AtomicU32::new(0);
/// idem_test::harness::eventually("the third poll", Duration::from_secs(1), async || {
///     polls.fetch_add(1, Ordering::SeqCst) >= 2
/// })
/// .await;
/// assert_eq!(polls.load(Ordering::SeqCst), 3);
/// # }
/// ```
#[track_caller]
pub fn eventually<F>(what: &str, timeout: Duration, mut condition: F) -> impl Future<Output = ()>
where
    F: AsyncFnMut() -> bool,
{
    // An `async fn` cannot be #[track_caller] on stable; take the location
    // here, before the future exists.
    let caller = Location::caller();
    async move {
        let deadline = tokio::time::Instant::now() + timeout;
        while !condition().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "eventually at {caller}: condition still false after {timeout:?}, waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Installs a `tracing` subscriber that writes through the test harness's
/// output capture, filtered by `RUST_LOG` (default `warn`). Safe to call
/// many times; only the first call in a process has an effect (and none if
/// the test installed a subscriber of its own first).
///
/// ```
/// idem_test::harness::init_tracing();
/// idem_test::harness::init_tracing(); // no effect the second time
/// ```
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}
