//! Chaos: the worker process (`src/bin/chaos_worker.rs`) is SIGKILLed and
//! restarted again and again while messages flow, PostgreSQL is restarted
//! with an immediate shutdown, and nats-server is SIGKILLed and restarted on
//! its store dir. At the end:
//!
//! - the ledger holds exactly one row per message, with the expected sum and
//!   balances, and one dedup row per message;
//! - the consumer has nothing pending and nothing awaiting ack.
//!
//! Each fault is checked to have happened: every kill is a SIGKILL of a
//! worker that had processed messages, and the worker that lived through each
//! server restart reports that it saw the server go and come back.
//!
//! Faults are placed by progress, not by the clock: each is due once the
//! ledger holds a given number of rows (evenly spread, with jitter), plus a
//! random delay. The publisher may run only half a fault-spacing ahead of
//! the next fault, so every fault meets messages in flight, and every new
//! worker has work waiting.
//!
//! A second test sends SIGTERM to a busy worker: it must exit 0 within its
//! grace period having settled what it started, and a fresh worker finishes
//! the rest, each message applied once.
//!
//! # Modes
//!
//! Quick by default (2,000 messages, 12 kills, about 30 s; CI runs it):
//!
//! ```sh
//! cargo nextest run -p idem-tests --test chaos
//! ```
//!
//! The long mode:
//!
//! ```sh
//! IDEM_CHAOS_MESSAGES=50000 cargo test -p idem-tests --test chaos -- --nocapture --test-threads 1
//! ```
//!
//! (`cargo test`, because nextest's 2-minute limit is meant for the quick
//! mode.) Other knobs: `IDEM_CHAOS_KILLS` (default: 12, or one per 2,000
//! messages if more), `IDEM_CHAOS_RATE` (messages published per second;
//! `0` publishes as fast as JetStream acks), `IDEM_CHAOS_SEED` (replays the
//! fault schedule a failed run printed), `IDEM_CHAOS_LOG_DIR` (keep the
//! workers' logs there; by default they go to a temp dir that is kept only
//! if the test fails), `IDEM_CHAOS_WORKER_LOG` (the workers' `RUST_LOG`).
//!
//! Both tests need servers of their own: with `NATS_URL` or `DATABASE_URL`
//! set they are skipped.

#[path = "chaos/worker.rs"]
mod worker;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_tests::{TestEnv, unique_name};
use sqlx::PgPool;

use worker::{Ended, Report, Worker};

/// The worker's handler name (`#[idempotent(name = ..)]` in the binary).
const HANDLER: &str = "chaos-credit-v1";
const DURABLE: &str = "chaos-credit";
const ACCOUNTS: u64 = 16;
/// How long a worker may take from spawn to its `started` line (it waits
/// for PostgreSQL if it is down).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the ledger may go without progress while messages are due.
const STALL_TIMEOUT: Duration = Duration::from_secs(45);
/// How long a worker may take to exit after SIGTERM.
const SIGTERM_GRACE: Duration = Duration::from_secs(30);

/// The account and amount of message `i`: deterministic, so the expected
/// sums are known.
fn credit(i: u64) -> (u64, i64) {
    (1 + i % ACCOUNTS, 1 + ((i * 7919) % 1000) as i64)
}

fn message_id(i: u64) -> String {
    format!("chaos-{i}")
}

/// What a run should end with.
struct Expected {
    messages: u64,
    sum: i64,
    balances: BTreeMap<i64, i64>,
}

impl Expected {
    fn for_messages(messages: u64) -> Expected {
        let mut balances = BTreeMap::new();
        let mut sum = 0;
        for i in 0..messages {
            let (account, amount) = credit(i);
            *balances.entry(account as i64).or_default() += amount;
            sum += amount;
        }
        Expected {
            messages,
            sum,
            balances,
        }
    }
}

/// Reads `name` from the environment, or `default`.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} does not parse")),
        Err(_) => default,
    }
}

/// A small seeded generator (SplitMix64) for the fault schedule, so that a
/// failed run can be replayed with the seed it printed.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }
}

fn seed() -> u64 {
    std::env::var("IDEM_CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("IDEM_CHAOS_SEED is a u64"))
        .unwrap_or_else(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64;
            nanos ^ ((std::process::id() as u64) << 32)
        })
}

/// Where the workers' logs go: `IDEM_CHAOS_LOG_DIR`, or a temp dir that is
/// removed if the test passes and kept (and named) if it fails.
struct LogDir {
    path: PathBuf,
    temp: Option<tempfile::TempDir>,
}

impl LogDir {
    fn new(test: &str) -> LogDir {
        if let Some(dir) = std::env::var_os("IDEM_CHAOS_LOG_DIR") {
            let path = PathBuf::from(dir).join(format!("{test}-{}", std::process::id()));
            std::fs::create_dir_all(&path)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
            eprintln!("chaos: worker logs in {}", path.display());
            return LogDir { path, temp: None };
        }
        let temp = tempfile::Builder::new()
            .prefix(&format!("idem-chaos-{test}-"))
            .tempdir()
            .expect("a temp dir for the worker logs");
        LogDir {
            path: temp.path().to_owned(),
            temp: Some(temp),
        }
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LogDir {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Some(temp) = self.temp.take()
        {
            eprintln!("chaos: worker logs kept in {}", temp.keep().display());
        }
    }
}

/// Servers, a stream, and what the workers need to find them.
struct Setup {
    env: TestEnv,
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    subject: String,
    worker_env: Vec<(String, String)>,
    logs: LogDir,
}

/// Starts the servers and creates the stream; `None` (the test is skipped)
/// if `NATS_URL` or `DATABASE_URL` point at servers the test cannot crash.
async fn setup(test: &str, extra_worker_env: &[(&str, &str)]) -> Option<Setup> {
    if std::env::var_os("NATS_URL").is_some() || std::env::var_os("DATABASE_URL").is_some() {
        eprintln!("skipped: NATS_URL or DATABASE_URL is set, and this test crashes its servers");
        return None;
    }
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    // A short timeout, so that a request lost in a NATS outage is retried
    // soon.
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(env.nats().await);
    let stream = unique_name("chaos");
    let subject = format!("{stream}.credit");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("the stream is created");
    let mut worker_env: Vec<(String, String)> = vec![
        ("NATS_URL".into(), env.nats_url().into()),
        ("DATABASE_URL".into(), env.database_url().into()),
        ("CHAOS_STREAM".into(), stream.clone()),
        ("CHAOS_DURABLE".into(), DURABLE.into()),
        ("CHAOS_ACK_WAIT_MS".into(), "2000".into()),
        ("CHAOS_CONCURRENCY".into(), "8".into()),
        (
            "RUST_LOG".into(),
            env_or("IDEM_CHAOS_WORKER_LOG", "warn,idem_runtime=info".to_owned()),
        ),
        ("RUST_BACKTRACE".into(), "1".into()),
    ];
    for (k, v) in extra_worker_env {
        worker_env.push(((*k).into(), (*v).into()));
    }
    Some(Setup {
        env,
        pool,
        js,
        stream,
        subject,
        worker_env,
        logs: LogDir::new(test),
    })
}

impl Setup {
    fn spawn_worker(&self, ordinal: usize) -> Worker {
        Worker::spawn(ordinal, &self.worker_env, self.logs.path())
    }

    /// Spawns a worker and waits for its `started` line.
    async fn start_worker(&self, ordinal: usize) -> Worker {
        let mut worker = self.spawn_worker(ordinal);
        if let Err(e) = worker
            .wait_for("print its started line", START_TIMEOUT, |_| true)
            .await
        {
            panic!("{e}\n{}", worker.log_tail(40));
        }
        worker
    }

    async fn ledger_rows(&self) -> i64 {
        // The pool reconnects after a PostgreSQL restart; retry meanwhile.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match sqlx::query_scalar("SELECT count(*) FROM chaos_ledger")
                .fetch_one(&self.pool)
                .await
            {
                Ok(rows) => return rows,
                // Before the first worker made the table.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => return 0,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("chaos: counting ledger rows failed ({e}); retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("cannot count ledger rows for a minute: {e}"),
            }
        }
    }

    /// The consumer's (num_pending, num_ack_pending, ack floor) and the
    /// stream's (last sequence, messages), or why they could not be read.
    async fn consumer_state(&self) -> Result<ConsumerState, String> {
        let mut stream = self
            .js
            .get_stream(&self.stream)
            .await
            .map_err(|e| format!("get stream: {e}"))?;
        let info = stream
            .info()
            .await
            .map_err(|e| format!("stream info: {e}"))?;
        let (last_sequence, messages) = (info.state.last_sequence, info.state.messages);
        let consumer = stream
            .consumer_info(DURABLE)
            .await
            .map_err(|e| format!("consumer info: {e}"))?;
        Ok(ConsumerState {
            num_pending: consumer.num_pending,
            num_ack_pending: consumer.num_ack_pending as u64,
            num_redelivered: consumer.num_redelivered as u64,
            ack_floor: consumer.ack_floor.stream_sequence,
            last_sequence,
            messages,
        })
    }

    /// Waits until the consumer has acked every message in the stream, and
    /// the stream holds `messages`. `worker` must stay alive meanwhile.
    async fn wait_drained(
        &self,
        worker: &mut Worker,
        messages: u64,
        timeout: Duration,
    ) -> Result<ConsumerState, String> {
        let deadline = Instant::now() + timeout;
        let mut last_note = Instant::now();
        loop {
            let state = self.consumer_state().await;
            if let Ok(state) = &state
                && state.messages >= messages
                && state.is_drained()
            {
                return Ok(state.clone());
            }
            if let Some(status) = worker.exited() {
                return Err(format!(
                    "worker #{} ended ({status}) before the consumer drained; consumer {state:?}",
                    worker.ordinal
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the consumer did not drain within {timeout:?}: {state:?}; worker #{} last report {:?}",
                    worker.ordinal,
                    worker.last()
                ));
            }
            if last_note.elapsed() > Duration::from_secs(10) {
                eprintln!(
                    "chaos: draining: consumer {state:?}, ledger {} rows",
                    self.ledger_rows().await
                );
                last_note = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How many messages the runtime's default dead-letter stream holds (0 if
    /// it does not exist).
    async fn dead_letters(&self) -> u64 {
        match self
            .js
            .get_stream(idem_runtime::dead_letter::DEFAULT_STREAM)
            .await
        {
            Ok(mut stream) => {
                stream
                    .info()
                    .await
                    .expect("dead-letter stream info")
                    .state
                    .messages
            }
            Err(_) => 0,
        }
    }

    /// Checks the end state against `expected`; returns every violation.
    async fn check_ledger(&self, expected: &Expected) -> Vec<String> {
        let mut violations = Vec::new();
        let (rows, distinct, sum): (i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT message_id), sum(amount)::bigint FROM chaos_ledger",
        )
        .fetch_one(&self.pool)
        .await
        .expect("the ledger is summed");
        let n = expected.messages as i64;
        if rows != n || distinct != n || sum != Some(expected.sum) {
            violations.push(format!(
                "ledger: {rows} rows, {distinct} distinct message ids, sum {sum:?}; \
                 expected {n}, {n}, Some({})",
                expected.sum
            ));
        }
        let doubled: Vec<(String, i64, Vec<i32>, Vec<i64>)> = sqlx::query_as(
            "SELECT message_id, count(*), array_agg(worker_pid), array_agg(delivered) \
             FROM chaos_ledger GROUP BY message_id HAVING count(*) > 1 ORDER BY 1 LIMIT 20",
        )
        .fetch_all(&self.pool)
        .await
        .expect("duplicates are listed");
        if !doubled.is_empty() {
            violations.push(format!(
                "applied more than once (message id, times, worker pids, delivery counts): {doubled:?}"
            ));
        }
        let missing: Vec<String> = sqlx::query_scalar(
            "SELECT 'chaos-' || i FROM generate_series(0, $1 - 1) AS i \
             WHERE NOT EXISTS (SELECT 1 FROM chaos_ledger WHERE message_id = 'chaos-' || i) \
             ORDER BY i LIMIT 20",
        )
        .bind(n)
        .fetch_all(&self.pool)
        .await
        .expect("missing messages are listed");
        if !missing.is_empty() {
            violations.push(format!("never applied (first 20): {missing:?}"));
        }
        let foreign: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM chaos_ledger WHERE message_id NOT LIKE 'chaos-%'",
        )
        .fetch_one(&self.pool)
        .await
        .expect("foreign rows are counted");
        if foreign != 0 {
            violations.push(format!(
                "{foreign} ledger rows have a message id that was never published"
            ));
        }
        let dedup_rows: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_processed_messages WHERE handler = $1")
                .bind(HANDLER)
                .fetch_one(&self.pool)
                .await
                .expect("dedup rows are counted");
        if dedup_rows != n {
            violations.push(format!(
                "{dedup_rows} dedup rows for {HANDLER}, expected {n}"
            ));
        }
        let balances: BTreeMap<i64, i64> =
            sqlx::query_as::<_, (i32, i64)>("SELECT id, balance FROM chaos_accounts ORDER BY id")
                .fetch_all(&self.pool)
                .await
                .expect("balances are read")
                .into_iter()
                .map(|(id, balance)| (id as i64, balance))
                .collect();
        if balances != expected.balances {
            violations.push(format!(
                "balances {balances:?}, expected {:?}",
                expected.balances
            ));
        }
        let dead_letters = self.dead_letters().await;
        if dead_letters != 0 {
            violations.push(format!(
                "{dead_letters} messages were dead-lettered instead of applied"
            ));
        }
        violations
    }
}

#[derive(Debug, Clone)]
#[allow(dead_code)] // read through Debug in failure messages
struct ConsumerState {
    num_pending: u64,
    num_ack_pending: u64,
    num_redelivered: u64,
    ack_floor: u64,
    last_sequence: u64,
    messages: u64,
}

impl ConsumerState {
    fn is_drained(&self) -> bool {
        self.num_pending == 0 && self.num_ack_pending == 0 && self.ack_floor >= self.last_sequence
    }
}

/// What the publisher did.
#[derive(Debug, Default)]
struct Published {
    messages: u64,
    /// Publishes that failed (no PubAck) and were sent again.
    retries: u64,
    /// PubAcks that said JetStream already had the message: a retry whose
    /// first attempt had been stored after all.
    duplicates: u64,
    took: Duration,
}

/// Publishes messages `0..messages` at `rate` per second (0: as fast as
/// JetStream acks), but never message `gate` or later until the gate moves.
/// Each is published until it gets a PubAck, so that publishing survives a
/// NATS restart; a retry keeps its `Nats-Msg-Id`, which JetStream dedups
/// within the stream's duplicate window.
async fn publish_all(
    js: jetstream::Context,
    subject: String,
    messages: u64,
    rate: f64,
    gate: Arc<AtomicU64>,
    progress: Arc<AtomicU64>,
) -> Published {
    let started = Instant::now();
    let mut report = Published::default();
    let mut paced_from = (started, 0);
    for i in 0..messages {
        if i >= gate.load(Ordering::Relaxed) {
            while i >= gate.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // No catching up on the time spent at the gate.
            paced_from = (Instant::now(), i);
        }
        if rate > 0.0 {
            let due = paced_from.0 + Duration::from_secs_f64((i - paced_from.1) as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let (account, amount) = credit(i);
        let payload: bytes::Bytes =
            serde_json::to_vec(&serde_json::json!({ "account": account, "amount": amount }))
                .expect("payload encodes")
                .into();
        let first_try = Instant::now();
        loop {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, message_id(i).as_str());
            let sent = js
                .publish_with_headers(subject.clone(), headers, payload.clone())
                .await;
            let acked = match sent {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match acked {
                Ok(ack) => {
                    if ack.duplicate {
                        report.duplicates += 1;
                    }
                    break;
                }
                Err(error) => {
                    assert!(
                        first_try.elapsed() < Duration::from_secs(90),
                        "publishing {} got no PubAck for 90 s: {error}",
                        message_id(i)
                    );
                    report.retries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        progress.store(i + 1, Ordering::Relaxed);
    }
    report.messages = messages;
    report.took = started.elapsed();
    report
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillWorker,
    RestartPostgres,
    RestartNats,
}

/// The faults in order, each due once the ledger holds that many rows:
/// spread evenly over the run, ±20 % of their spacing at random, with the
/// PostgreSQL restart a third of the way in and the NATS restart two thirds
/// in. Returns the spacing too.
fn schedule(messages: u64, kills: usize, rng: &mut Rng) -> (Vec<(u64, Fault)>, u64) {
    let mut faults = vec![Fault::KillWorker; kills];
    faults.insert(faults.len() / 3, Fault::RestartPostgres);
    faults.insert(faults.len() * 2 / 3, Fault::RestartNats);
    let spacing = messages / (faults.len() as u64 + 1);
    let faults = faults
        .into_iter()
        .enumerate()
        .map(|(k, fault)| {
            let at = spacing * (k as u64 + 1) + rng.between(0, spacing * 2 / 5) - spacing / 5;
            (at, fault)
        })
        .collect();
    (faults, spacing)
}

/// Figures of one chaos run, printed at the end.
#[derive(Debug, Default)]
struct Tally {
    workers_started: usize,
    kills: usize,
    /// Kills of a worker whose last report showed messages in flight.
    kills_in_flight: usize,
    pg_restarts: usize,
    pg_restarts_seen: usize,
    nats_restarts: usize,
    nats_restarts_seen: usize,
    ended: Vec<Ended>,
}

impl Tally {
    /// Sums the last reports of all workers that ended. Killed workers may
    /// have done a little more after their last report (every 200 ms).
    fn totals(&self) -> Report {
        let mut t = Report::default();
        for e in &self.ended {
            let r = &e.last;
            t.received += r.received;
            t.processed += r.processed;
            t.duplicates += r.duplicates;
            t.failed += r.failed;
            t.commit_failed += r.commit_failed;
            t.rejected += r.rejected;
            t.retried_in_process += r.retried_in_process;
            t.dead_lettered += r.dead_lettered;
            t.dead_letter_failed += r.dead_letter_failed;
            t.nats_disconnects += r.nats_disconnects;
            t.nats_reconnects += r.nats_reconnects;
            t.pg_outages += r.pg_outages;
            t.pg_recoveries += r.pg_recoveries;
            t.startup_failures += r.startup_failures;
        }
        t
    }
}

/// Drives the faults of `plan` while the publisher runs.
struct FaultDriver<'a> {
    setup: &'a mut Setup,
    worker: Option<Worker>,
    tally: Tally,
    rng: Rng,
    /// How far the publisher may go.
    gate: Arc<AtomicU64>,
    published: Arc<AtomicU64>,
}

impl FaultDriver<'_> {
    fn worker(&mut self) -> &mut Worker {
        self.worker.as_mut().expect("a worker is running")
    }

    /// Panics with `what` and everything that helps to understand it.
    async fn fail(&mut self, what: &str) -> ! {
        let (report, log) = match &self.worker {
            Some(w) => (format!("{:?}", w.last()), w.log_tail(40)),
            None => ("(no worker running)".into(), String::new()),
        };
        let consumer =
            tokio::time::timeout(Duration::from_secs(10), self.setup.consumer_state()).await;
        let rows = tokio::time::timeout(Duration::from_secs(10), self.setup.ledger_rows()).await;
        panic!(
            "{what}\n  published so far: {}\n  ledger rows: {rows:?}\n  consumer: {consumer:?}\n  \
             kills, PostgreSQL and NATS restarts so far: {:?}\n  current worker: {report}\n{log}",
            self.published.load(Ordering::Relaxed),
            (
                self.tally.kills,
                self.tally.pg_restarts,
                self.tally.nats_restarts
            ),
        );
    }

    async fn start_worker(&mut self) {
        self.tally.workers_started += 1;
        let worker = self.setup.start_worker(self.tally.workers_started).await;
        self.worker = Some(worker);
    }

    /// Waits until the ledger holds `rows` rows and the current worker has
    /// processed something, failing if the ledger stops growing.
    async fn wait_for_progress(&mut self, rows: u64) {
        let mut last = (self.setup.ledger_rows().await, Instant::now());
        loop {
            let now = self.setup.ledger_rows().await;
            let worker = self.worker();
            if now as u64 >= rows && worker.last().processed > 0 {
                return;
            }
            if let Some(status) = worker.exited() {
                let ordinal = worker.ordinal;
                self.fail(&format!("worker #{ordinal} ended on its own ({status})"))
                    .await;
            }
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > STALL_TIMEOUT {
                self.fail(&format!(
                    "no progress for {STALL_TIMEOUT:?}: the ledger is stuck at {now} rows, waiting for {rows}"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn kill_worker(&mut self) {
        let worker = self.worker.take().expect("a worker is running");
        let ended = worker.sigkill();
        assert!(
            ended.was_sigkilled(),
            "worker #{} (pid {}) ended with {} rather than by our SIGKILL",
            ended.ordinal,
            ended.pid,
            ended.status
        );
        self.tally.kills += 1;
        if ended.last.in_flight > 0 {
            self.tally.kills_in_flight += 1;
        }
        self.tally.ended.push(ended);
        // Now and then, leave the consumer without a worker for a moment.
        if self.rng.between(0, 2) == 0 {
            tokio::time::sleep(self.rng.millis(100, 1000)).await;
        }
        self.start_worker().await;
    }

    async fn restart_postgres(&mut self) {
        if let Err(e) = self
            .worker()
            .wait_for("see PostgreSQL up", Duration::from_secs(30), |r| {
                r.pg_probe_ok > 0
            })
            .await
        {
            self.fail(&e).await;
        }
        let before = self.worker().last();
        let pid = self.setup.env.postgres().pid();
        self.setup.env.postgres_mut().stop_immediate().await;
        // Load goes on: handlers fail and NAK, the publisher still publishes.
        tokio::time::sleep(self.rng.millis(300, 1500)).await;
        self.setup.env.postgres_mut().start_again().await;
        assert_ne!(pid, self.setup.env.postgres().pid(), "a new postmaster");
        self.tally.pg_restarts += 1;
        match self
            .worker()
            .wait_for(
                "see PostgreSQL go down and come back",
                Duration::from_secs(30),
                |r| r.pg_outages > before.pg_outages && r.pg_recoveries > before.pg_recoveries,
            )
            .await
        {
            Ok(after) => {
                self.tally.pg_restarts_seen += 1;
                eprintln!(
                    "chaos: PostgreSQL restarted; worker #{} saw it (failed {} -> {}, commit_failed {} -> {})",
                    self.worker().ordinal,
                    before.failed,
                    after.failed,
                    before.commit_failed,
                    after.commit_failed
                );
            }
            Err(e) => self.fail(&e).await,
        }
    }

    async fn restart_nats(&mut self) {
        if let Err(e) = self
            .worker()
            .wait_for("connect to NATS", Duration::from_secs(30), |r| {
                r.nats_connects > 0
            })
            .await
        {
            self.fail(&e).await;
        }
        let before = self.worker().last();
        let pid = self.setup.env.nats_server().pid();
        // SIGKILL: no shutdown, no final fsync (sync_interval: always makes
        // that safe for acknowledged writes).
        self.setup.env.nats_server_mut().kill();
        tokio::time::sleep(self.rng.millis(200, 1000)).await;
        self.setup.env.nats_server_mut().start_again().await;
        assert_ne!(pid, self.setup.env.nats_server().pid(), "a new nats-server");
        self.tally.nats_restarts += 1;
        match self
            .worker()
            .wait_for(
                "see NATS disconnect and reconnect",
                Duration::from_secs(30),
                |r| {
                    r.nats_disconnects > before.nats_disconnects
                        && r.nats_reconnects > before.nats_reconnects
                },
            )
            .await
        {
            Ok(_) => {
                self.tally.nats_restarts_seen += 1;
                eprintln!(
                    "chaos: nats-server SIGKILLed and restarted; worker #{} reconnected",
                    self.worker().ordinal
                );
            }
            Err(e) => self.fail(&e).await,
        }
    }

    /// Runs the faults in order. The publisher may run half a spacing ahead
    /// of the next fault and no further: messages are still flowing when the
    /// fault strikes, and the new worker has work waiting. (Consecutive
    /// faults are at least 0.6 spacings apart, so the ledger must grow past
    /// the previous gate, through the new worker, to reach the next one.)
    async fn run(&mut self, faults: &[(u64, Fault)], spacing: u64) {
        for &(at, fault) in faults {
            self.gate.store(at + spacing / 2, Ordering::Relaxed);
            self.wait_for_progress(at).await;
            tokio::time::sleep(self.rng.millis(0, 300)).await;
            match fault {
                Fault::KillWorker => self.kill_worker().await,
                Fault::RestartPostgres => self.restart_postgres().await,
                Fault::RestartNats => self.restart_nats().await,
            }
        }
        self.gate.store(u64::MAX, Ordering::Relaxed);
    }
}

/// Messages with unique ids, each crediting an account, while the worker is
/// SIGKILLed at random moments (at least 10 times) and restarted, PostgreSQL
/// is restarted with an immediate shutdown, and nats-server is SIGKILLed and
/// restarted on its store dir. Every message is applied exactly once and the
/// consumer ends with nothing pending.
#[tokio::test]
async fn worker_kills_and_server_crashes_apply_every_message_once() {
    chaos_run("kills", "1").await;
}

/// The same chaos, with the worker in batch mode (batches of up to 16).
#[tokio::test]
async fn worker_kills_and_server_crashes_apply_every_message_once_in_batch_mode() {
    chaos_run("kills-batch", "16").await;
}

async fn chaos_run(test: &str, batch: &str) {
    let started = Instant::now();
    let messages: u64 = env_or("IDEM_CHAOS_MESSAGES", 2_000);
    let kills: usize = env_or("IDEM_CHAOS_KILLS", 12.max(messages as usize / 2_000));
    // Quick mode spreads publishing over ~12 s, so that every fault meets
    // messages in flight; long mode publishes as fast as JetStream acks.
    let rate: f64 = env_or(
        "IDEM_CHAOS_RATE",
        if messages <= 5_000 {
            messages as f64 / 12.0
        } else {
            0.0
        },
    );
    let seed = seed();
    eprintln!(
        "chaos: {messages} messages, {kills} worker kills, publish rate {rate:.0}/s, \
         seed {seed} (replay with IDEM_CHAOS_SEED={seed})"
    );
    assert!(
        kills >= 10,
        "the run must kill the worker at least 10 times"
    );
    // 5 ms inside each transaction, so that a kill often finds messages
    // mid-transaction or committed and not yet acked.
    let Some(mut setup) = setup(
        test,
        &[("CHAOS_HANDLER_DELAY_MS", "5"), ("CHAOS_BATCH", batch)],
    )
    .await
    else {
        return;
    };
    let expected = Expected::for_messages(messages);
    let mut rng = Rng(seed);
    let (faults, spacing) = schedule(messages, kills, &mut rng);

    let published = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(AtomicU64::new(0));
    let publisher = publish_all(
        setup.js.clone(),
        setup.subject.clone(),
        messages,
        rate,
        gate.clone(),
        published.clone(),
    );
    let mut driver = FaultDriver {
        setup: &mut setup,
        worker: None,
        tally: Tally::default(),
        rng,
        gate,
        published: published.clone(),
    };
    driver.start_worker().await;
    let (publish_report, ()) = tokio::join!(publisher, driver.run(&faults, spacing));
    let faults_done = started.elapsed();

    // Drain with the last worker, then stop it gracefully.
    let drain_timeout = Duration::from_secs(60 + messages / 200);
    let mut last = driver.worker.take().expect("a worker is running");
    let drained = driver
        .setup
        .wait_drained(&mut last, messages, drain_timeout)
        .await;
    if let Err(e) = drained {
        driver.worker = Some(last);
        driver.fail(&e).await;
    }
    let (ended, shutdown_took) = match last.sigterm(SIGTERM_GRACE).await {
        Ok(ended) => ended,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        ended.status.code(),
        Some(0),
        "the last worker exits 0 on SIGTERM"
    );
    driver.tally.ended.push(ended);
    let tally = std::mem::take(&mut driver.tally);

    let consumer = setup
        .consumer_state()
        .await
        .expect("the consumer is readable");
    let violations = setup.check_ledger(&expected).await;
    let totals = tally.totals();
    eprintln!(
        "chaos: {messages} messages in {:.1?} (faults done at {:.1?}; published in {:.1?} with \
         {} retries, {} JetStream duplicates; last worker stopped {:.2?} after SIGTERM)\n\
         chaos: workers started {}, SIGKILLed {} ({} with messages in flight), \
         PostgreSQL restarts {} (seen {}), nats-server restarts {} (seen {})\n\
         chaos: worker totals: processed {}, duplicates skipped {}, failed {}, commit failed {}, \
         retried in process {}, rejected {}, dead-lettered {}, NATS disconnects {}, \
         PostgreSQL outages {}, start-ups retried {}\n\
         chaos: consumer {consumer:?}",
        started.elapsed(),
        faults_done,
        publish_report.took,
        publish_report.retries,
        publish_report.duplicates,
        shutdown_took,
        tally.workers_started,
        tally.kills,
        tally.kills_in_flight,
        tally.pg_restarts,
        tally.pg_restarts_seen,
        tally.nats_restarts,
        tally.nats_restarts_seen,
        totals.processed,
        totals.duplicates,
        totals.failed,
        totals.commit_failed,
        totals.retried_in_process,
        totals.rejected,
        totals.dead_lettered,
        totals.nats_disconnects,
        totals.pg_outages,
        totals.startup_failures,
    );

    assert!(
        violations.is_empty(),
        "exactly-once violated:\n  {}",
        violations.join("\n  ")
    );
    assert!(
        consumer.is_drained() && consumer.messages == messages,
        "the consumer still has work, or the stream has other than {messages} messages: {consumer:?}"
    );
    assert!(
        tally.kills >= kills && kills >= 10,
        "{} kills, {kills} planned",
        tally.kills
    );
    for e in &tally.ended[..tally.kills] {
        assert!(
            e.was_sigkilled() && e.last.processed > 0,
            "kill of worker #{} did not hit a working worker: {e:?}",
            e.ordinal
        );
    }
    assert_eq!(
        (tally.pg_restarts, tally.pg_restarts_seen),
        (1, 1),
        "PostgreSQL was restarted once, and the worker saw it"
    );
    assert_eq!(
        (tally.nats_restarts, tally.nats_restarts_seen),
        (1, 1),
        "nats-server was restarted once, and the worker saw it"
    );
    assert_eq!(
        (totals.rejected, totals.dead_lettered),
        (0, 0),
        "no message was rejected or dead-lettered"
    );
}

/// SIGTERM while the worker is busy: it exits 0 within its grace period,
/// having settled every message it started; a fresh worker finishes the rest,
/// and every message is applied exactly once.
#[tokio::test]
async fn sigterm_during_load_exits_zero_and_loses_nothing() {
    const MESSAGES: u64 = 1_000;
    let started = Instant::now();
    // 20 ms inside each transaction: 8 at a time, so at most ~400/s, and
    // messages are mid-transaction when SIGTERM comes.
    let Some(setup) = setup("sigterm", &[("CHAOS_HANDLER_DELAY_MS", "20")]).await else {
        return;
    };
    let expected = Expected::for_messages(MESSAGES);
    publish_all(
        setup.js.clone(),
        setup.subject.clone(),
        MESSAGES,
        0.0,
        Arc::new(AtomicU64::new(u64::MAX)),
        Arc::default(),
    )
    .await;

    let mut first = setup.start_worker(1).await;
    let busy = first
        .wait_for(
            "process a fifth of the messages with some in flight",
            Duration::from_secs(60),
            |r| r.processed >= MESSAGES / 5 && r.in_flight > 0,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (ended, took) = first
        .sigterm(SIGTERM_GRACE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        ended.status.code(),
        Some(0),
        "exit status after SIGTERM; log:\n{}",
        worker::log_tail(&setup.logs.path().join("worker-001.log"), 40)
    );
    let stopped = ended
        .stopped
        .clone()
        .expect("the worker reports that it stopped gracefully");
    let after_first = setup.consumer_state().await.expect("consumer state");
    let rows_after_first = setup.ledger_rows().await;
    assert!(
        stopped.processed < MESSAGES,
        "SIGTERM came while there was still work: {stopped:?}"
    );
    assert_eq!(
        stopped.in_flight, 0,
        "every message the worker had started was settled before it exited: {stopped:?}"
    );
    assert_eq!(
        rows_after_first as u64, stopped.processed,
        "the ledger holds exactly what the stopped worker reports as processed"
    );

    let mut second = setup.start_worker(2).await;
    setup
        .wait_drained(&mut second, MESSAGES, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", second.log_tail(40)));
    let (ended_second, _) = second
        .sigterm(SIGTERM_GRACE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ended_second.status.code(), Some(0));
    let second_report = ended_second.stopped.expect("the second worker stopped");

    let consumer = setup.consumer_state().await.expect("consumer state");
    let violations = setup.check_ledger(&expected).await;
    eprintln!(
        "chaos: SIGTERM at {} processed with {} in flight; exit 0 after {took:.2?}; \
         consumer then {after_first:?}\n\
         chaos: second worker: processed {}, duplicates skipped {}; total {:.1?}",
        busy.processed,
        busy.in_flight,
        second_report.processed,
        second_report.duplicates,
        started.elapsed()
    );
    assert!(
        violations.is_empty(),
        "exactly-once violated:\n  {}",
        violations.join("\n  ")
    );
    assert!(consumer.is_drained(), "consumer: {consumer:?}");
    assert_eq!(
        second_report.duplicates, 0,
        "the stopped worker acked everything it committed, so nothing it did comes back"
    );
    assert!(
        took < SIGTERM_GRACE,
        "shutdown took {took:?}, grace {SIGTERM_GRACE:?}"
    );
}
