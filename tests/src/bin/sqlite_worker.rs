//! A worker on SQLite that credits accounts, for a kill run that SIGKILLs
//! and restarts it. It was written from the guide and the rustdoc alone.
//!
//! Each message of the stream's subjects carries `{"account": <i64>,
//! "amount": <i64>}` and its id in `Nats-Msg-Id`. One handler,
//! `sqlite-credit`, inserts a row into `ledger` (no unique key: a message
//! applied twice shows as two rows) and adds the amount to `balances`, in
//! the transaction idem claims the message in.
//!
//! # Environment
//!
//! | variable | default | what it sets |
//! |---|---|---|
//! | `NATS_URL` | required | the nats-server |
//! | `DATABASE_URL` | required | `sqlite://PATH`; the file is created if missing |
//! | `STREAM` | required | the stream to read; it must exist |
//! | `DURABLE` | `sqlite-credit` | the durable consumer |
//! | `ACK_WAIT_MS` | 2000 | the consumer's ack_wait |
//! | `BATCH` | `default` | `default`: the route's adaptive batches; `1`: one message per transaction; `N`: fixed batches of N |
//! | `CONCURRENCY` | the route's (8) | messages, or batches, in flight |
//! | `RUST_LOG` | `warn,idem_runtime=info` | the log filter; logs go to stderr |
//!
//! Several copies may start at once on one file: each opens it and creates
//! the tables (idem's with `schema::migrate`, then its own) holding an
//! exclusive `flock` on `PATH.start-up.lock`, which it then releases.
//!
//! # Journal
//!
//! One JSON object per line on stdout, each written with one `write(2)`,
//! so that a SIGKILL never leaves half a line:
//!
//! | event | when |
//! |---|---|
//! | `{"event":"started","pid":P}` | just before the router runs |
//! | `{"event":"begin","pid":P,"id":ID,"delivered":N}` | first thing in the handler body: a fresh claim, its transaction open |
//! | `{"event":"committed","pid":P,"id":ID,"delivered":N}` | after COMMIT, before the ack (the after-commit fault hook) |
//! | `{"event":"held","pid":P,"id":ID,"delivered":N}` | after `committed`, for the first commit after a SIGUSR1: its ack then waits 30 s, so that a SIGKILL lands between COMMIT and ack |
//! | `{"event":"paused","pid":P,"id":ID,"delivered":N}` | after `begin`, for the first handler call after a SIGUSR2: it then sleeps 30 s inside its transaction, so that a SIGKILL lands mid-transaction (added by the kill run's author, not from the docs) |
//! | `{"event":"stopped","pid":P}` | after a graceful shutdown (SIGTERM, Ctrl-C), before exiting 0 |
//!
//! A redelivery whose claim finds the message processed journals nothing
//! (no COMMIT: the runtime rolls back and acks). In a batch, the hook runs
//! for each message of the committed batch in turn, so while one is held
//! the `committed` lines of the messages after it wait too: after a kill, a
//! `begin` without `committed` may still have committed.
//!
//! A missing variable or a failed start-up exits 1 with the reason on
//! stderr.
//!
//! What it shares with the MariaDB worker (the settings, the journal, the
//! hook and the signals) moved to `idem_tests::kill_worker`.

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use idem_runtime::{Delivery, Router, idempotent};
use idem_tests::kill_worker::{
    Credit, Settings, after_commit_hooks, journal, journal_message, listen_for_aim, pause_if_asked,
};
use serde_json::json;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// How long a connection waits for SQLite's write lock. Several workers
/// share one file, and every transaction takes the lock at BEGIN.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Credits `cmd.amount` to `cmd.account`: a row in `ledger` and the sum in
/// `balances`, in idem's transaction.
#[idempotent(name = "sqlite-credit")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    journal_message("begin", delivery);
    pause_if_asked(delivery).await;
    sqlx::query("INSERT INTO ledger (msg_id, account, amount, pid) VALUES (?, ?, ?, ?)")
        .bind(delivery.message_id().as_str())
        .bind(cmd.account)
        .bind(cmd.amount)
        .bind(i64::from(std::process::id()))
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO balances (account, balance) VALUES (?, ?)
         ON CONFLICT (account) DO UPDATE SET balance = balances.balance + excluded.balance",
    )
    .bind(cmd.account)
    .bind(cmd.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Opens the database and creates idem's schema and the business tables,
/// one worker at a time (see [`StartUpLock`]).
async fn open_database(settings: &Settings) -> Result<sqlx::SqlitePool, String> {
    let options = SqliteConnectOptions::from_str(&settings.database_url)
        .map_err(|e| {
            format!(
                "DATABASE_URL={:?} is not a SQLite URL: {e}",
                settings.database_url
            )
        })?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(BUSY_TIMEOUT);
    let start_up = StartUpLock::take(options.get_filename()).await?;
    let pool = SqlitePoolOptions::new()
        .max_connections(settings.pool_size())
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot open {}: {e}", settings.database_url))?;
    idem_runtime::schema::migrate(&pool)
        .await
        .map_err(|e| format!("cannot create idem's dedup schema: {e}"))?;
    // BEGIN IMMEDIATE takes the write lock first (waiting up to the busy
    // timeout), so that the statements never fail on a stale read.
    let mut tx = pool
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(|e| format!("cannot take the database's write lock: {e}"))?;
    for statement in [
        "CREATE TABLE IF NOT EXISTS ledger (
             msg_id TEXT NOT NULL, account INTEGER NOT NULL,
             amount INTEGER NOT NULL, pid INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS balances (
             account INTEGER PRIMARY KEY, balance INTEGER NOT NULL)",
    ] {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("cannot create the business tables: {e}"))?;
    }
    tx.commit()
        .await
        .map_err(|e| format!("cannot create the business tables: {e}"))?;
    drop(start_up);
    Ok(pool)
}

/// An exclusive `flock` on `<database>.start-up.lock`, held while a worker
/// opens the file and creates the tables, and released when dropped (or
/// by the kernel when the process dies).
///
/// Workers that start together on a new file otherwise fail: one's switch
/// to WAL gets `database is locked` at once (SQLite does not wait out a
/// lock upgrade that could deadlock; the guide says so). (`schema::migrate`
/// once failed that way too, with "table idem_handlers already exists"; it
/// is safe from several workers at once now.) The lock is on a file of its
/// own:
/// closing a descriptor of the database file would drop SQLite's own
/// POSIX locks of this process.
struct StartUpLock {
    _held: std::fs::File,
}

impl StartUpLock {
    async fn take(database: &std::path::Path) -> Result<Self, String> {
        let mut path = database.as_os_str().to_owned();
        path.push(".start-up.lock");
        let path = std::path::PathBuf::from(path);
        let shown = path.display().to_string();
        tokio::task::spawn_blocking(move || {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            file.lock()?;
            Ok::<_, std::io::Error>(StartUpLock { _held: file })
        })
        .await
        .map_err(|e| format!("taking the start-up lock {shown} failed: {e}"))?
        .map_err(|e| format!("cannot take the start-up lock {shown}: {e}"))
    }
}

async fn run(settings: Settings) -> Result<(), String> {
    // Before anything else: SIGUSR1's default action would kill the process.
    let hold_next = listen_for_aim()?;
    let pool = open_database(&settings).await?;
    let nats = async_nats::connect(&settings.nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {}: {e}", settings.nats_url))?;

    let router = Router::sqlite()
        .route(settings.route(), credit)
        .fault_hooks(after_commit_hooks(hold_next));
    journal(json!({"event": "started", "pid": std::process::id()}));
    router
        .run(nats, pool.clone())
        .await
        .map_err(|e| format!("the router failed: {e}"))?;
    pool.close().await;
    journal(json!({"event": "stopped", "pid": std::process::id()}));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    idem_tests::kill_worker::main("sqlite_worker", "sqlite-credit", run).await
}
