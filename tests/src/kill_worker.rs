//! What the kill run's workers (`src/bin/sqlite_worker.rs`,
//! `src/bin/mariadb_worker.rs`) share besides their database: their
//! settings from the environment, their journal on stdout, the
//! after-commit hook that journals and holds commits, and the signals that
//! aim a kill (see [`crate::kill_run`]). The SQLite worker's author wrote
//! these from the docs alone; they moved here when the MariaDB worker came.

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, Route};
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// The route's concurrency when `CONCURRENCY` is not set: the documented
/// default of `Route::concurrency` (the guide's table of route settings),
/// which the API does not expose.
const DEFAULT_CONCURRENCY: usize = 8;

/// How long the ack of a held commit, or a paused transaction, waits.
pub const HOLD: Duration = Duration::from_secs(30);

/// A credit, as the kill run publishes it.
#[derive(serde::Deserialize)]
pub struct Credit {
    pub account: i64,
    pub amount: i64,
}

/// Set by SIGUSR2: the next handler call pauses inside its transaction.
static PAUSE_NEXT: AtomicBool = AtomicBool::new(false);

/// In a handler, after journaling `begin`: if a SIGUSR2 asked for it,
/// journals `paused` and sleeps [`HOLD`] inside the transaction, so that a
/// SIGKILL lands mid-transaction.
pub async fn pause_if_asked(delivery: &Delivery) {
    if PAUSE_NEXT.swap(false, Ordering::SeqCst) {
        journal_message("paused", delivery);
        tokio::time::sleep(HOLD).await;
    }
}

/// The worker's settings, read from the environment.
pub struct Settings {
    pub nats_url: String,
    pub database_url: String,
    pub stream: String,
    pub durable: String,
    pub ack_wait: Duration,
    pub batch: Batch,
    pub concurrency: Option<usize>,
}

/// How the route groups messages into transactions.
pub enum Batch {
    /// The route's default: adaptive batches.
    Default,
    /// One message per transaction.
    PerMessage,
    /// Fixed batches of this size.
    Fixed(usize),
}

impl Settings {
    /// Reads the settings; `durable` is `DURABLE`'s default.
    pub fn from_env(durable: &str) -> Result<Self, String> {
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
            durable: optional("DURABLE")?.unwrap_or_else(|| durable.into()),
            ack_wait,
            batch,
            concurrency,
        })
    }

    /// The route these settings describe.
    pub fn route(&self) -> Route {
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
    pub fn pool_size(&self) -> u32 {
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
    optional(name)?.ok_or_else(|| format!("{name} is required (see the module docs of the worker)"))
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
pub fn journal(line: serde_json::Value) {
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

pub fn journal_message(event: &str, delivery: &Delivery) {
    journal(json!({
        "event": event,
        "pid": std::process::id(),
        "id": delivery.message_id().as_str(),
        "delivered": delivery.delivered(),
    }));
}

/// Journals each commit, and holds the ack of the first one after a
/// SIGUSR1 for [`HOLD`].
pub fn after_commit_hooks(hold_next: Arc<AtomicBool>) -> FaultHooks {
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

/// Listens for SIGUSR1 (hold the next commit's ack: see
/// [`after_commit_hooks`]) and SIGUSR2 (pause the next transaction: see
/// [`pause_if_asked`]); returns the flag SIGUSR1 sets. Call it first: both
/// signals' default action would kill the process.
pub fn listen_for_aim() -> Result<Arc<AtomicBool>, String> {
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
    Ok(hold_next)
}

/// A worker's `main`: logs to stderr, runs `run` with the settings, and
/// exits 1 with the reason on stderr if it fails.
pub async fn main<F, Fut>(name: &str, durable: &str, run: F) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,idem_runtime=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let outcome = match Settings::from_env(durable) {
        Ok(settings) => run(settings).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
