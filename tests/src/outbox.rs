//! What the outbox's tests share (`tests/tests/outbox/`, the compliance
//! suite's outbox part, idem-cli's tests): a stream the relay publishes to
//! and what it stores, the outbox's pending rows, and a relay run as a task
//! until the test stops it, on any database the outbox runs on
//! ([`OutboxDatabase`]).
//!
//! ```no_run
//! use idem_runtime::outbox::Relay;
//! use idem_tests::outbox::{out_stream, spawn_relay, stop_relay, stored_count};
//!
//! # async fn demo(
//! #     js: async_nats::jetstream::Context,
//! #     nats: async_nats::Client,
//! #     pool: sqlx::SqlitePool,
//! # ) {
//! let out = out_stream(&js, "PAID").await;
//! let (stop, task) = spawn_relay(Relay::new(), nats, pool);
//! // ... queue rows for `<out>.paid`, wait for them ...
//! stop_relay(stop, task).await;
//! assert_eq!(stored_count(&js, &out).await, 0);
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::outbox::{self, Lag, Relay, RelayError};
use sqlx::Pool;
use tokio::sync::oneshot;

use crate::scenario::{create_stream, header};
use crate::unique_name;

/// A database the outbox runs on (PostgreSQL, SQLite, MariaDB), for helpers
/// written once for all three: `idem_runtime::outbox`'s relay and lag are
/// generic over these databases, but through a bound only the runtime can
/// name, so they are reached here through this trait. (Queuing needs no
/// more than `for<'c> sqlx::Transaction<'c, DB>: outbox::Transactional`.)
pub trait OutboxDatabase: sqlx::Database {
    /// [`Relay::run_until`] on `pool`.
    fn run_relay(
        relay: Relay,
        nats: async_nats::Client,
        pool: Pool<Self>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = Result<(), RelayError>> + Send + 'static;

    /// [`outbox::lag`] of `pool`'s outbox.
    fn lag(pool: &Pool<Self>) -> impl Future<Output = Result<Lag, sqlx::Error>> + Send;
}

/// [`OutboxDatabase`] on each database: the same calls.
macro_rules! outbox_database {
    ($($database:ty),* $(,)?) => {
        $(
            impl OutboxDatabase for $database {
                async fn run_relay(
                    relay: Relay,
                    nats: async_nats::Client,
                    pool: Pool<Self>,
                    shutdown: impl Future<Output = ()> + Send + 'static,
                ) -> Result<(), RelayError> {
                    relay.run_until(nats, pool, shutdown).await
                }

                async fn lag(pool: &Pool<Self>) -> Result<Lag, sqlx::Error> {
                    outbox::lag(pool).await
                }
            }
        )*
    };
}

outbox_database!(sqlx::Postgres, sqlx::Sqlite, sqlx::MySql);

/// A stream for the outbox's messages, named `prefix` and a unique suffix:
/// it stores `<name>.>`, with a 120 s duplicate window. Returns its name.
pub async fn out_stream(js: &jetstream::Context, prefix: &str) -> String {
    out_stream_with_window(js, prefix, Duration::from_secs(120)).await
}

/// [`out_stream`] with a duplicate window of `window`.
pub async fn out_stream_with_window(
    js: &jetstream::Context,
    prefix: &str,
    window: Duration,
) -> String {
    let name = unique_name(prefix);
    create_stream(js, &name, &format!("{name}.>"), window).await;
    name
}

/// Every message `stream` stores, in stream order (by sequence; the
/// sequences of deleted messages are skipped).
///
/// # Panics
///
/// If the stream does not exist.
pub async fn stored(
    js: &jetstream::Context,
    stream: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut handle = js.get_stream(stream).await.expect("stream exists");
    let last = handle
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut messages = Vec::new();
    for sequence in 1..=last {
        if let Ok(message) = handle.get_raw_message(sequence).await {
            messages.push(message);
        }
    }
    messages
}

/// The `Nats-Msg-Id` of every message `stream` stores, in stream order.
///
/// # Panics
///
/// If the stream does not exist.
pub async fn stored_ids(js: &jetstream::Context, stream: &str) -> Vec<String> {
    stored(js, stream)
        .await
        .iter()
        .map(|message| header(message, "Nats-Msg-Id"))
        .collect()
}

/// How many messages `stream` stores.
///
/// # Panics
///
/// If the stream does not exist.
pub async fn stored_count(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .expect("stream exists")
        .info()
        .await
        .expect("stream info")
        .state
        .messages
}

/// The outbox rows of `pool` not yet published.
///
/// # Panics
///
/// If the lag cannot be read.
pub async fn pending_rows<DB: OutboxDatabase>(pool: &Pool<DB>) -> i64 {
    DB::lag(pool).await.expect("the lag reads").pending
}

/// A relay's task, as [`spawn_relay`] starts it.
pub type RelayTask = tokio::task::JoinHandle<Result<(), RelayError>>;

/// Runs `relay` on `pool` in a task of its own until the sender returned
/// fires (or is dropped); stop it with [`stop_relay`].
pub fn spawn_relay<DB: OutboxDatabase>(
    relay: Relay,
    nats: async_nats::Client,
    pool: Pool<DB>,
) -> (oneshot::Sender<()>, RelayTask) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(DB::run_relay(relay, nats, pool, async move {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Stops a relay [`spawn_relay`] started, and waits for it to return.
///
/// # Panics
///
/// If it does not stop within 30 s, panics, or returns an error.
pub async fn stop_relay(stop: oneshot::Sender<()>, task: RelayTask) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay stops within 30 s")
        .expect("the relay task does not panic")
        .expect("the relay returns Ok");
}

/// Begins a transaction on `pool` that locks `idem_outbox` in `mode` (`EXCLUSIVE`:
/// plain reads still run; `ACCESS EXCLUSIVE`: none does), as a psql session left
/// open would, and returns it with its backend's pid.
pub async fn lock_outbox(pool: &sqlx::PgPool, mode: &str) -> (sqlx::PgTransaction<'static>, i32) {
    let mut holder = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE idem_outbox IN {mode} MODE"
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    (holder, pid)
}
