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

use std::io::IsTerminal;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, Route, Router, idempotent};
use serde_json::json;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// The route's concurrency when `CONCURRENCY` is not set: the documented
/// default of `Route::concurrency` (the guide's table of route settings),
/// which the API does not expose.
const DEFAULT_CONCURRENCY: usize = 8;

/// How long the ack of a held commit waits before it goes out after all.
const HOLD: Duration = Duration::from_secs(30);

/// How long a connection waits for SQLite's write lock. Several workers
/// share one file, and every transaction takes the lock at BEGIN.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(serde::Deserialize)]
struct Credit {
    account: i64,
    amount: i64,
}

/// Set by SIGUSR2: the next handler call pauses inside its transaction.
static PAUSE_NEXT: AtomicBool = AtomicBool::new(false);

/// Credits `cmd.amount` to `cmd.account`: a row in `ledger` and the sum in
/// `balances`, in idem's transaction.
#[idempotent(name = "sqlite-credit")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    journal_message("begin", delivery);
    if PAUSE_NEXT.swap(false, Ordering::SeqCst) {
        journal_message("paused", delivery);
        tokio::time::sleep(HOLD).await;
    }
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

/// The worker's settings, read from the environment.
struct Settings {
    nats_url: String,
    database_url: String,
    stream: String,
    durable: String,
    ack_wait: Duration,
    batch: Batch,
    concurrency: Option<usize>,
}

/// How the route groups messages into transactions.
enum Batch {
    /// The route's default: adaptive batches.
    Default,
    /// One message per transaction.
    PerMessage,
    /// Fixed batches of this size.
    Fixed(usize),
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let batch = match optional("BATCH")?.as_deref() {
            None | Some("default") => Batch::Default,
            Some(text) => match parse::<usize>("BATCH", text)? {
                0 => return Err("BATCH must be `default` or a size of at least 1, not 0".into()),
                1 => Batch::PerMessage,
                size => Batch::Fixed(size),
            },
        };
        let concurrency = match optional("CONCURRENCY")? {
            None => None,
            Some(text) => match parse::<usize>("CONCURRENCY", &text)? {
                0 => return Err("CONCURRENCY must be at least 1, not 0".into()),
                n => Some(n),
            },
        };
        let ack_wait = match optional("ACK_WAIT_MS")? {
            None => Duration::from_millis(2000),
            Some(text) => Duration::from_millis(parse("ACK_WAIT_MS", &text)?),
        };
        Ok(Settings {
            nats_url: required("NATS_URL")?,
            database_url: required("DATABASE_URL")?,
            stream: required("STREAM")?,
            durable: optional("DURABLE")?.unwrap_or_else(|| "sqlite-credit".into()),
            ack_wait,
            batch,
            concurrency,
        })
    }

    fn route(&self) -> Route {
        let route = Route::new(&self.stream, &self.durable).ack_wait(self.ack_wait);
        let route = match self.batch {
            Batch::Default => route,
            Batch::PerMessage => route.per_message(),
            Batch::Fixed(size) => route.batch(size),
        };
        match self.concurrency {
            Some(concurrency) => route.concurrency(concurrency),
            None => route,
        }
    }

    /// One connection per message or batch in flight, plus one to spare:
    /// what the guide's "Sizing the pool" asked when this was written (on
    /// SQLite two are enough, its SQLite chapter now says).
    fn pool_size(&self) -> u32 {
        let in_flight = self.concurrency.unwrap_or(DEFAULT_CONCURRENCY);
        u32::try_from(in_flight + 1).unwrap_or(u32::MAX)
    }
}

fn optional(name: &str) -> Result<Option<String>, String> {
    match std::env::var(name) {
        Ok(value) if value.is_empty() => Ok(None),
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not UTF-8")),
    }
}

fn required(name: &str) -> Result<String, String> {
    optional(name)?
        .ok_or_else(|| format!("{name} is required (see the module docs of sqlite_worker)"))
}

fn parse<T: FromStr>(name: &str, text: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    text.parse()
        .map_err(|e| format!("{name}={text:?} is not a valid number: {e}"))
}

/// Writes one journal line to stdout with a single `write(2)`, holding
/// stdout's lock so that no other writer of this process interleaves.
fn journal(line: serde_json::Value) {
    let mut text = line.to_string();
    text.push('\n');
    let _stdout = std::io::stdout().lock();
    let mut rest = text.as_bytes();
    while !rest.is_empty() {
        // SAFETY: `rest` is a live, initialised byte slice for the call.
        let written = unsafe { libc::write(libc::STDOUT_FILENO, rest.as_ptr().cast(), rest.len()) };
        if written < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Nobody reads the journal any more: nothing to keep it for.
            return;
        }
        // A line is far below PIPE_BUF, so this is only reached if a
        // regular file or a pipe took part of it, which neither does.
        rest = &rest[written as usize..];
    }
}

fn journal_message(event: &str, delivery: &Delivery) {
    journal(json!({
        "event": event,
        "pid": std::process::id(),
        "id": delivery.message_id().as_str(),
        "delivered": delivery.delivered(),
    }));
}

/// Journals each commit, and holds the ack of the first one after a
/// SIGUSR1 for [`HOLD`].
fn after_commit_hooks(hold_next: Arc<AtomicBool>) -> FaultHooks {
    FaultHooks::default().after_commit(move |delivery| {
        journal_message("committed", delivery);
        if hold_next.swap(false, Ordering::SeqCst) {
            journal_message("held", delivery);
            // The hook is synchronous and runs on a runtime thread: let the
            // runtime move its other tasks off this thread while it sleeps.
            tokio::task::block_in_place(|| std::thread::sleep(HOLD));
        }
        AfterCommit::Ack
    })
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
    let hold_next = Arc::new(AtomicBool::new(false));
    let mut usr1 = signal(SignalKind::user_defined1())
        .map_err(|e| format!("cannot listen for SIGUSR1: {e}"))?;
    let armed = hold_next.clone();
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            armed.store(true, Ordering::SeqCst);
        }
    });
    let mut usr2 = signal(SignalKind::user_defined2())
        .map_err(|e| format!("cannot listen for SIGUSR2: {e}"))?;
    tokio::spawn(async move {
        while usr2.recv().await.is_some() {
            PAUSE_NEXT.store(true, Ordering::SeqCst);
        }
    });

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
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,idem_runtime=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let outcome = match Settings::from_env() {
        Ok(settings) => run(settings).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqlite_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
