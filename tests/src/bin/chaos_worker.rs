//! The worker process the chaos tests (`tests/tests/chaos/main.rs`) start,
//! SIGKILL, SIGTERM and start again.
//!
//! It credits accounts from JetStream messages with one `#[idempotent]`
//! handler under [`Router`], until SIGTERM or Ctrl-C, and reports what it sees
//! on stdout, one JSON object per line, for the test to read:
//!
//! - `{"event":"started",..}` once the database is prepared, before the
//!   router starts;
//! - `{"event":"stats",..}` whenever a counter changed (checked every 10 ms)
//!   and at least every `CHAOS_REPORT_MS`, with the route's `Stats` and
//!   what the worker observed of the servers: NATS connection events and the
//!   outages of a `SELECT 1` probe on PostgreSQL;
//! - the journal, one line per event of one message, written as it happens:
//!   `{"event":"begin","id":..,"delivered":..,"seq":..}` when the handler
//!   body starts (its claim was fresh: the transaction is open), and
//!   `{"event":"committed",..}` from the runtime's after-commit hook, after
//!   COMMIT and before the ack;
//! - `{"event":"held",..}` after `committed` when the hook holds the
//!   message (see SIGUSR1 below);
//! - `{"event":"stopped",..}` after the router returned from a graceful
//!   shutdown, just before the process exits 0.
//!
//! Each line goes out in one `write(2)` to the stdout pipe, so a SIGKILL
//! loses no line already written: the journal of a killed worker says which
//! transactions it had open and which commits it had not acked.
//!
//! **SIGUSR1** arms a hold: the next commit's after-commit hook journals
//! `held` and then blocks (up to 30 s) before the ack, so that a test can
//! SIGKILL the worker between COMMIT and ack for certain rather than by luck.
//! Only the window is widened: the COMMIT and the kill are real.
//!
//! Logs go to stderr (`RUST_LOG`, default `warn,idem_runtime=info`).
//!
//! **`CHAOS_PROFILE=day-two`** runs more beside the credit route, for the
//! chaos suite's day-two mode (`tests/tests/chaos/day_two.rs`): the credit
//! handler also queues a notice per credit in the outbox, a second route
//! shares the credit subject, a request/reply route answers orders, and an
//! outbox relay runs beside them. See `chaos_worker/day_two.rs`.
//!
//! # Environment
//!
//! | variable | default | |
//! |---|---|---|
//! | `NATS_URL`, `DATABASE_URL` | required | `NATS_URL` may list a cluster's nodes, comma-separated |
//! | `CHAOS_STREAM` | `CHAOS` | the stream; it must exist |
//! | `CHAOS_DURABLE` | `chaos-credit` | the durable consumer, created or updated at start |
//! | `CHAOS_ACK_WAIT_MS` | 2000 | short, so a killed worker's messages come back fast |
//! | `CHAOS_CONCURRENCY` | 8 | |
//! | `CHAOS_BATCH` | 1 | `Route::batch`: 1 is per-message mode |
//! | `CHAOS_HANDLER_DELAY_MS` | 0 | extra time each handler spends inside its transaction |
//! | `CHAOS_REPORT_MS` | 200 | the longest gap between two stats lines |
//! | `CHAOS_NATS_PING_MS` | async-nats's (60 s) | the client's PING interval: three unanswered PINGs drop the connection |
//! | `CHAOS_PG_PROBE_TIMEOUT_MS` | 1000 | how long the `SELECT 1` probe waits before it counts a failure |
//! | `CHAOS_PG_DEADLOCK_TIMEOUT_MS` | 50 | the router's sessions' `deadlock_timeout` (PostgreSQL's default is 1 s) |
//!
//! In batch mode, concurrent batches upsert the same account rows in
//! different orders and deadlock now and then; PostgreSQL aborts one (40P01)
//! and the runtime reruns its messages one per transaction. That path is
//! worth exercising, but with the default `deadlock_timeout` every deadlock
//! stalls the batches involved for a full second.
//! | `CHAOS_SHUTDOWN_GRACE_MS` | 10000 | how long shutdown waits for in-flight messages |
//! | `CHAOS_PROFILE` | `kill` | `day-two` adds the routes and the relay of `chaos_worker/day_two.rs`, configured by its own variables |
//!
//! The business table, `chaos_ledger`, has no unique key: a message applied
//! twice shows up as two rows.

use std::io::Write;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, FromRef, Route, Router, RouterHandle, State, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{Connection, PgTransaction};
use tokio::sync::watch;

/// The handler's name in the dedup table; the test counts dedup rows by it.
const HANDLER: &str = "chaos-credit-v1";

/// Day-two profile: more routes, an outbox and a relay.
#[path = "chaos_worker/day_two.rs"]
mod day_two;

/// One credit. The message id is the `Nats-Msg-Id` header.
#[derive(Debug, Deserialize)]
struct Credit {
    account: i32,
    amount: i64,
    /// The credit's own reference, which the day-two profile's second
    /// route dedups by (`key = cmd.reference`).
    #[serde(default, rename = "ref")]
    reference: String,
}

/// How long each handler waits inside its transaction
/// (`CHAOS_HANDLER_DELAY_MS`).
#[derive(Clone, Copy)]
struct HandlerDelay(Duration);

/// The router's state: each handler takes its part.
#[derive(Clone, FromRef)]
struct WorkerState {
    delay: HandlerDelay,
    day_two: day_two::Settings,
}

/// Set by SIGUSR1: hold the next commit before its ack.
static HOLD_NEXT: AtomicBool = AtomicBool::new(false);

/// How long a held commit waits for the SIGKILL before it acks after all.
const HOLD_FOR: Duration = Duration::from_secs(30);

/// Writes one line to stdout in one `write(2)`, so that a SIGKILL cannot
/// leave half of it (the pipe keeps what was written).
fn emit(mut line: String) {
    line.push('\n');
    let mut stdout = std::io::stdout().lock();
    // Stdout is line-buffered: a whole line goes straight to the pipe.
    stdout
        .write_all(line.as_bytes())
        .expect("the test reads stdout");
}

/// One journal line: an event of one message.
#[derive(Serialize)]
struct JournalLine<'a> {
    event: &'static str,
    pid: u32,
    id: &'a str,
    delivered: u64,
    seq: u64,
}

fn journal(event: &'static str, delivery: &Delivery) {
    emit(
        serde_json::to_string(&JournalLine {
            event,
            pid: std::process::id(),
            id: delivery.message_id().as_str(),
            delivered: delivery.delivered(),
            seq: delivery.stream_sequence(),
        })
        .expect("a journal line serializes"),
    );
}

/// The after-commit hook: journals the commit and, if SIGUSR1 armed it,
/// holds the message between COMMIT and ack until the test kills us.
fn after_commit(delivery: &Delivery) -> AfterCommit {
    journal("committed", delivery);
    if HOLD_NEXT.swap(false, Ordering::SeqCst) {
        journal("held", delivery);
        // Blocks this runtime thread only; the others go on.
        tokio::task::block_in_place(|| std::thread::sleep(HOLD_FOR));
        tracing::warn!(message_id = %delivery.message_id(), "held past COMMIT for {HOLD_FOR:?} without a kill; acking");
    }
    AfterCommit::Ack
}

/// Records one ledger row per applied credit (with the delivery and the
/// worker's pid, so a double-apply can be traced) and adds to the balance.
#[idempotent(name = "chaos-credit-v1")]
async fn credit(
    tx: &mut PgTransaction<'_>,
    State(HandlerDelay(delay)): State<HandlerDelay>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    // The claim was fresh: this transaction is open until COMMIT or rollback.
    journal("begin", delivery);
    apply_credit(tx, delivery, &cmd).await?;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    Ok(())
}

/// The credit's effect: its ledger row and the balance. Shared by both
/// profiles' credit handlers.
async fn apply_credit(
    tx: &mut PgTransaction<'_>,
    delivery: &Delivery,
    cmd: &Credit,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO chaos_ledger (message_id, account, amount, stream_seq, delivered, worker_pid) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(delivery.message_id().as_str())
    .bind(cmd.account)
    .bind(cmd.amount)
    .bind(delivery.stream_sequence() as i64)
    .bind(delivery.delivered() as i64)
    .bind(std::process::id() as i32)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO chaos_accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = chaos_accounts.balance + EXCLUDED.balance",
    )
    .bind(cmd.account)
    .bind(cmd.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS chaos_ledger (
    message_id text        NOT NULL,
    account    integer     NOT NULL,
    amount     bigint      NOT NULL,
    stream_seq bigint      NOT NULL,
    delivered  bigint      NOT NULL,
    worker_pid integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_accounts (
    id      integer PRIMARY KEY,
    balance bigint  NOT NULL
);
";

struct Config {
    nats_url: String,
    database_url: String,
    stream: String,
    durable: String,
    ack_wait: Duration,
    concurrency: usize,
    batch: usize,
    handler_delay: Duration,
    report_every: Duration,
    shutdown_grace: Duration,
    nats_ping: Option<Duration>,
    pg_probe_timeout: Duration,
    pg_deadlock_timeout_ms: u64,
    /// `CHAOS_PROFILE=day-two`: its settings.
    day_two: Option<day_two::Config>,
}

impl Config {
    fn from_env() -> Result<Config, String> {
        let required = |name: &str| std::env::var(name).map_err(|_| format!("{name} must be set"));
        Ok(Config {
            nats_url: required("NATS_URL")?,
            database_url: required("DATABASE_URL")?,
            stream: env_or("CHAOS_STREAM", "CHAOS".to_owned())?,
            durable: env_or("CHAOS_DURABLE", "chaos-credit".to_owned())?,
            ack_wait: Duration::from_millis(env_or("CHAOS_ACK_WAIT_MS", 2000)?),
            concurrency: env_or("CHAOS_CONCURRENCY", 8)?,
            batch: env_or("CHAOS_BATCH", 1)?,
            handler_delay: Duration::from_millis(env_or("CHAOS_HANDLER_DELAY_MS", 0)?),
            report_every: Duration::from_millis(env_or("CHAOS_REPORT_MS", 200)?),
            shutdown_grace: Duration::from_millis(env_or("CHAOS_SHUTDOWN_GRACE_MS", 10_000)?),
            nats_ping: match env_or("CHAOS_NATS_PING_MS", 0)? {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            pg_probe_timeout: Duration::from_millis(env_or("CHAOS_PG_PROBE_TIMEOUT_MS", 1000)?),
            pg_deadlock_timeout_ms: env_or("CHAOS_PG_DEADLOCK_TIMEOUT_MS", 50)?,
            day_two: match env_or("CHAOS_PROFILE", "kill".to_owned())?.as_str() {
                "kill" => None,
                "day-two" => Some(day_two::Config::from_env()?),
                other => return Err(format!("CHAOS_PROFILE={other:?}: kill or day-two")),
            },
        })
    }

    /// `NATS_URL` as a list: a cluster's nodes, comma-separated, so that
    /// the client reconnects to a live node when its own dies.
    fn nats_urls(&self) -> Result<Vec<async_nats::ServerAddr>, String> {
        self.nats_url
            .split(',')
            .map(|url| {
                url.trim()
                    .parse()
                    .map_err(|e| format!("NATS_URL {url:?}: {e}"))
            })
            .collect()
    }

    /// A connection per message in flight, plus the relay's and the purge's
    /// (and in the day-two profile, the other routes').
    fn pool_size(&self) -> u32 {
        let day_two = self
            .day_two
            .as_ref()
            .map_or(0, |d| d.connections(self.concurrency));
        (self.concurrency + 2 + day_two) as u32
    }

    fn route(&self) -> Route {
        Route::new(&self.stream, &self.durable)
            .ack_wait(self.ack_wait)
            .concurrency(self.concurrency)
            .batch(self.batch)
    }
}

fn env_or<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name}={value:?} does not parse")),
        Err(_) => Ok(default),
    }
}

/// What the worker saw of its servers, beyond the route's own counters.
#[derive(Default)]
struct Observed {
    nats_connects: AtomicU64,
    nats_disconnects: AtomicU64,
    /// `Connected` events that followed a `Disconnected` one.
    nats_reconnects: AtomicU64,
    nats_down: AtomicBool,
    pg_probe_ok: AtomicU64,
    pg_probe_failures: AtomicU64,
    /// Probe went from success to failure.
    pg_outages: AtomicU64,
    /// Probe went from failure back to success after an outage.
    pg_recoveries: AtomicU64,
    /// Failed probes by cause: no answer within the timeout, a connection
    /// reset (ECONNRESET), anything else (EOF, refused, ...).
    pg_probe_timeouts: AtomicU64,
    pg_probe_resets: AtomicU64,
    pg_probe_other: AtomicU64,
    /// Router start-ups that failed (a server was down) and were retried.
    startup_failures: AtomicU64,
}

impl Observed {
    fn on_nats_event(&self, event: &async_nats::Event) {
        match event {
            async_nats::Event::Connected => {
                self.nats_connects.fetch_add(1, Ordering::Relaxed);
                if self.nats_down.swap(false, Ordering::Relaxed) {
                    self.nats_reconnects.fetch_add(1, Ordering::Relaxed);
                }
            }
            async_nats::Event::Disconnected => {
                self.nats_disconnects.fetch_add(1, Ordering::Relaxed);
                self.nats_down.store(true, Ordering::Relaxed);
            }
            _ => {}
        }
        tracing::warn!(%event, "nats connection event");
    }
}

/// One stats line.
#[derive(Serialize, PartialEq, Eq)]
struct Report {
    event: &'static str,
    pid: u32,
    received: u64,
    processed: u64,
    duplicates: u64,
    failed: u64,
    commit_failed: u64,
    rejected: u64,
    retried_in_process: u64,
    infrastructure_errors: u64,
    abandoned_transactions: u64,
    dead_lettered: u64,
    dead_letter_failed: u64,
    batches: u64,
    largest_batch: u64,
    batch_fallbacks: u64,
    /// Received but not yet settled one way or another.
    in_flight: u64,
    nats_connects: u64,
    nats_disconnects: u64,
    nats_reconnects: u64,
    pg_probe_ok: u64,
    pg_probe_failures: u64,
    pg_outages: u64,
    pg_recoveries: u64,
    pg_probe_timeouts: u64,
    pg_probe_resets: u64,
    pg_probe_other: u64,
    startup_failures: u64,
    /// The day-two profile's other routes and relay (zeros otherwise).
    #[serde(flatten)]
    day_two: day_two::Counters,
}

/// Every router this process ran (one per start-up attempt), and the names
/// its routes' counters are under.
struct Routers {
    /// The credit route's durable.
    durable: String,
    day_two: Option<day_two::Config>,
    handles: Mutex<Vec<RouterHandle>>,
}

type AllStats = Arc<Routers>;

fn report(event: &'static str, stats: &AllStats, observed: &Observed) {
    emit(serde_json::to_string(&snapshot(event, stats, observed)).expect("a report serializes"));
}

fn snapshot(event: &'static str, stats: &AllStats, observed: &Observed) -> Report {
    let (mut received, mut processed, mut duplicates) = (0, 0, 0);
    let (mut failed, mut commit_failed, mut rejected) = (0, 0, 0);
    let (mut retried_in_process, mut dead_lettered, mut dead_letter_failed) = (0, 0, 0);
    let (mut batches, mut largest_batch, mut batch_fallbacks) = (0, 0, 0);
    let (mut infrastructure_errors, mut abandoned_transactions) = (0, 0);
    let handles = stats.handles.lock().expect("stats lock");
    for s in handles.iter().filter_map(|h| h.stats(&stats.durable)) {
        infrastructure_errors += s.infrastructure_errors();
        abandoned_transactions += s.abandoned_transactions();
        received += s.received();
        processed += s.processed();
        duplicates += s.duplicates();
        failed += s.failed();
        commit_failed += s.commit_failed();
        rejected += s.rejected();
        retried_in_process += s.retried_in_process();
        dead_lettered += s.dead_lettered();
        dead_letter_failed += s.dead_letter_failed();
        batches += s.batches();
        largest_batch = largest_batch.max(s.largest_batch());
        batch_fallbacks += s.batch_fallbacks();
    }
    let settled = processed + duplicates + failed + commit_failed + rejected;
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    Report {
        event,
        pid: std::process::id(),
        received,
        processed,
        duplicates,
        failed,
        commit_failed,
        rejected,
        retried_in_process,
        infrastructure_errors,
        abandoned_transactions,
        dead_lettered,
        dead_letter_failed,
        batches,
        largest_batch,
        batch_fallbacks,
        in_flight: received.saturating_sub(settled),
        nats_connects: load(&observed.nats_connects),
        nats_disconnects: load(&observed.nats_disconnects),
        nats_reconnects: load(&observed.nats_reconnects),
        pg_probe_ok: load(&observed.pg_probe_ok),
        pg_probe_failures: load(&observed.pg_probe_failures),
        pg_outages: load(&observed.pg_outages),
        pg_recoveries: load(&observed.pg_recoveries),
        pg_probe_timeouts: load(&observed.pg_probe_timeouts),
        pg_probe_resets: load(&observed.pg_probe_resets),
        pg_probe_other: load(&observed.pg_probe_other),
        startup_failures: load(&observed.startup_failures),
        day_two: stats
            .day_two
            .as_ref()
            .map(|config| day_two::Counters::of(config, &handles))
            .unwrap_or_default(),
    }
}

/// Prints a stats line whenever a counter changed (checked every 10 ms, so
/// a killed worker's last line is at most that old) and at least every
/// `every`.
async fn report_changes(stats: AllStats, observed: Arc<Observed>, every: Duration) {
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    let mut last: Option<(Report, Instant)> = None;
    loop {
        ticks.tick().await;
        let now = snapshot("stats", &stats, &observed);
        if let Some((before, at)) = &last
            && *before == now
            && at.elapsed() < every
        {
            continue;
        }
        emit(serde_json::to_string(&now).expect("a report serializes"));
        last = Some((now, Instant::now()));
    }
}

/// Why a probe failed.
enum ProbeFailure {
    Timeout,
    Reset,
    Other,
}

impl ProbeFailure {
    fn of(error: &sqlx::Error) -> ProbeFailure {
        match error {
            sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                ProbeFailure::Reset
            }
            _ => ProbeFailure::Other,
        }
    }
}

/// Runs `SELECT 1` every 100 ms on a connection of its own (not the router's
/// pool, so it never competes with handlers) and counts outages and
/// recoveries, and failures by cause.
async fn probe_postgres(url: String, timeout: Duration, observed: Arc<Observed>) {
    let mut conn: Option<PgConnection> = None;
    let mut was_up: Option<bool> = None;
    let mut had_outage = false;
    loop {
        let mut failure = None;
        if conn.is_none() {
            match tokio::time::timeout(timeout, PgConnection::connect(&url)).await {
                Ok(Ok(c)) => conn = Some(c),
                Ok(Err(e)) => failure = Some(ProbeFailure::of(&e)),
                Err(_) => failure = Some(ProbeFailure::Timeout),
            }
        }
        if let Some(c) = conn.as_mut() {
            match tokio::time::timeout(timeout, sqlx::query("SELECT 1").execute(&mut *c)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failure = Some(ProbeFailure::of(&e)),
                Err(_) => failure = Some(ProbeFailure::Timeout),
            }
            if failure.is_some() {
                conn = None;
            }
        }
        let up = failure.is_none();
        match failure {
            None => observed.pg_probe_ok.fetch_add(1, Ordering::Relaxed),
            Some(failure) => {
                observed.pg_probe_failures.fetch_add(1, Ordering::Relaxed);
                match failure {
                    ProbeFailure::Timeout => &observed.pg_probe_timeouts,
                    ProbeFailure::Reset => &observed.pg_probe_resets,
                    ProbeFailure::Other => &observed.pg_probe_other,
                }
                .fetch_add(1, Ordering::Relaxed)
            }
        };
        match (was_up, up) {
            (Some(true), false) => {
                had_outage = true;
                observed.pg_outages.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("postgres probe: down");
            }
            (Some(false), true) if had_outage => {
                observed.pg_recoveries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("postgres probe: back up");
            }
            _ => {}
        }
        was_up = Some(up);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Resolves on SIGTERM or Ctrl-C, for the whole life of the process. The
/// router gets it through `run_until` (what `Router::run` does with its own
/// listener), because a listener of our own also covers the pauses between
/// start-up attempts.
async fn os_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut sigterm = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    tokio::select! {
        _ = sigterm.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Retries `attempt` every 300 ms until it succeeds or the worker is told to
/// stop (then `None`).
async fn retry<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    what: &str,
    stop: &watch::Receiver<bool>,
    mut attempt: impl FnMut() -> F,
) -> Option<T> {
    loop {
        match attempt().await {
            Ok(value) => return Some(value),
            Err(error) => tracing::warn!(%error, "{what} failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            _ = stopped(stop.clone()) => return None,
        }
    }
}

async fn prepare_database(pool: &PgPool, day_two: bool) -> Result<(), Box<dyn std::error::Error>> {
    idem_runtime::schema::migrate(pool).await?;
    sqlx::raw_sql(SCHEMA).execute(pool).await?;
    if day_two {
        sqlx::raw_sql(day_two::SCHEMA).execute(pool).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,idem_runtime=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // First, before anything can be slow: SIGUSR1's default action would
    // kill the process.
    let mut usr1 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
        .expect("SIGUSR1 handler installs");
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            HOLD_NEXT.store(true, Ordering::SeqCst);
            tracing::warn!("SIGUSR1: holding the next commit before its ack");
        }
    });
    let config = Config::from_env()?;

    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        os_signal().await;
        tracing::info!("SIGTERM or Ctrl-C: shutting down");
        stop_tx.send_replace(true);
    });

    let observed = Arc::new(Observed::default());
    let events = observed.clone();
    // Reconnect every 100 ms rather than with the default backoff (up to
    // 4 s), so that the test's NATS outages stay short.
    let mut nats_options = async_nats::ConnectOptions::new();
    if let Some(ping) = config.nats_ping {
        nats_options = nats_options.ping_interval(ping);
    }
    let nats = nats_options
        .name("idem-chaos-worker")
        .retry_on_initial_connect()
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis(if attempts <= 1 { 0 } else { 100 })
        })
        .event_callback(move |event| {
            events.on_nats_event(&event);
            std::future::ready(())
        })
        .connect(config.nats_urls()?)
        .await?;
    let connect: PgConnectOptions = config.database_url.parse()?;
    let connect = connect.options([(
        "deadlock_timeout",
        format!("{}ms", config.pg_deadlock_timeout_ms),
    )]);
    let pool = PgPoolOptions::new()
        .max_connections(config.pool_size())
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(connect);
    tokio::spawn(probe_postgres(
        config.database_url.clone(),
        config.pg_probe_timeout,
        observed.clone(),
    ));

    let all_stats: AllStats = Arc::new(Routers {
        durable: config.durable.clone(),
        day_two: config.day_two.clone(),
        handles: Mutex::default(),
    });
    let state = WorkerState {
        delay: HandlerDelay(config.handler_delay),
        day_two: day_two::Settings::of(config.day_two.as_ref()),
    };
    if retry("preparing the database", &stop, || {
        prepare_database(&pool, config.day_two.is_some())
    })
    .await
    .is_none()
    {
        report("stopped", &all_stats, &observed);
        return Ok(());
    }
    report("started", &all_stats, &observed);
    let reporter = tokio::spawn(report_changes(
        all_stats.clone(),
        observed.clone(),
        config.report_every,
    ));

    // Start-up fails while a server is down (schema check, consumer
    // creation); try again until it succeeds or we are told to stop.
    loop {
        let router = match &config.day_two {
            None => Router::with_state(state.clone()).route(config.route(), credit),
            Some(_) => day_two::router(state.clone(), config.route(), &config),
        }
        .shutdown_grace(config.shutdown_grace)
        .fault_hooks(FaultHooks::default().after_commit(after_commit));
        all_stats
            .handles
            .lock()
            .expect("stats lock")
            .push(router.handle());
        match router
            .run_until(nats.clone(), pool.clone(), stopped(stop.clone()))
            .await
        {
            Ok(()) => break,
            Err(error) => {
                observed.startup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "router start-up failed; retrying");
            }
        }
        if *stop.borrow() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    reporter.abort();
    // The router has acked every message it finished; make sure those acks
    // leave the process before it exits.
    match tokio::time::timeout(Duration::from_secs(5), nats.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "flushing the NATS connection at exit failed"),
        Err(_) => tracing::warn!("flushing the NATS connection at exit timed out"),
    }
    report("stopped", &all_stats, &observed);
    tracing::info!(handler = HANDLER, "stopped");
    Ok(())
}
