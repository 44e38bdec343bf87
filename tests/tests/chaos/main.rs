//! Chaos: the worker process (`src/bin/chaos_worker.rs`) runs the ledger
//! handler while messages flow, and the test breaks what it depends on.
//!
//! **Kill mode** (`worker_kills_and_server_crashes_*`): the worker is
//! SIGKILLed and restarted again and again, PostgreSQL is restarted with an
//! immediate shutdown, and nats-server is SIGKILLed and restarted on its
//! store dir.
//!
//! **Network mode** (`network_faults_*`, see `chaos/network.rs`): the
//! worker reaches PostgreSQL and nats-server only through fault proxies
//! (`idem_tests::fault_proxy`), which pause traffic (one way or both), drop
//! connections (FIN) or reset them (RST), each kind on each server, in an
//! order drawn from the seed.
//!
//! **Cluster mode** (`cluster::cluster_*`, see `chaos/cluster.rs`): three
//! workers share an R3 durable on a 3-node JetStream cluster while the
//! stream's leader, and later the consumer's, is SIGKILLed and restarted on
//! its store, workers are SIGKILLed at random, and PostgreSQL restarts once;
//! it prints what each fault cost (how long processing stalled, how many
//! redeliveries the claim absorbed).
//!
//! **Day-two mode** (`day_two_*`, see `chaos/day_two.rs`): ordinary
//! operational accidents while credits, order requests and outbox rows flow
//! (a subject deployed before its stream, messages near `max_payload`, a
//! purge killed mid-expiry, a transaction left open in another database, a
//! handler renamed in a rolling deploy, a dead letter replayed while another
//! route shares its subject, nats-server away for longer than the relay's
//! back-off), with a liveness invariant besides exactly-once: after each
//! accident every route, the relay and the purge make progress again within
//! a stated bound. Its own docs list its checks, knobs and long mode.
//!
//! Kill and network modes run the worker in per-message mode and in batch
//! mode. At the end:
//!
//! - the ledger holds exactly one row per message, with the expected sum and
//!   balances, and one dedup row per message;
//! - the consumer has nothing pending and nothing awaiting ack;
//! - nothing was rejected or dead-lettered.
//!
//! # Proof that the faults landed
//!
//! A fault that misses proves nothing, so each is checked to have met the
//! work. The worker journals each message's `begin` (handler body started:
//! transaction open) and `committed` (after COMMIT, before the ack) on its
//! stdout, one `write(2)` per line, so a SIGKILL loses none of it; an ack
//! tap (`chaos/acks.rs`) records every ack JetStream receives, with the
//! delivery it settles and when that delivery was made; the ledger records
//! which worker (pid) committed which delivery of each message.
//!
//! - **Kills with transactions open:** the killed worker journaled `begin`
//!   without `committed` for a message that another worker applied later. At
//!   least half of the kills must show it. Every other kill is aimed (it
//!   waits for the journal to show a transaction begin, then kills at once);
//!   the others strike wherever the schedule's random delay falls.
//! - **A kill between COMMIT and ack:** the ledger row of a message was
//!   written by a worker that was then SIGKILLed, and the tap saw a later
//!   delivery of it, made after that worker died, acked without a second
//!   row: the claim absorbed a redelivery of committed work. Such kills
//!   happen by luck now and then; one kill per run makes sure of it: the test
//!   sends SIGUSR1, the worker's after-commit hook journals `held` and blocks
//!   before the ack, and the test SIGKILLs it there.
//! - **PostgreSQL restart:** while PostgreSQL is down, the router's own
//!   counters (failed, retried in process, commit failed, held for the database) must move, not
//!   only the worker's side probe; then the probe must see it come back.
//! - **nats-server restart:** the worker's client reports the disconnect and
//!   the reconnect.
//! - **Network faults:** the proxy counts what it did (connections dropped
//!   or reset, bytes held by each pause), and each fault must have done
//!   something; the worker must see each one (its PostgreSQL probe fails and
//!   recovers; its NATS client disconnects and reconnects), and the router's
//!   own counters must move across the PostgreSQL cuts.
//! - **Batch mode:** the router committed batches, at least one with more
//!   than one message.
//!
//! Faults are placed by progress, not by the clock: each is due once the
//! ledger holds a given number of rows (evenly spread, with jitter), plus a
//! random delay. The publisher may run only half a fault-spacing ahead of
//! the next fault, so every fault meets messages in flight, and every new
//! worker has work waiting.
//!
//! A further test sends SIGTERM to a busy worker: it must exit 0 within its
//! grace period having settled what it started, and a fresh worker finishes
//! the rest, each message applied once.
//!
//! # Modes
//!
//! Quick by default (2,000 messages; 12 kills, or 12 network faults; each
//! test 15 to 35 s, network mode in batch mode up to about 50 s while its
//! pull stalls after a NATS reconnect; CI runs them):
//!
//! ```sh
//! cargo nextest run -p idem-tests --test chaos
//! ```
//!
//! The long modes:
//!
//! ```sh
//! IDEM_CHAOS_MESSAGES=50000 cargo test -p idem-tests --test chaos -- --nocapture --test-threads 1 worker_kills
//! IDEM_CHAOS_MESSAGES=20000 cargo test -p idem-tests --test chaos -- --nocapture --test-threads 1 network_faults
//! ```
//!
//! (`cargo test`, because nextest's time limit is meant for the quick
//! mode.) Other knobs: `IDEM_CHAOS_KILLS` (default: 12, or one per 2,000
//! messages if more), `IDEM_CHAOS_NET_FAULTS` (default: 12, or one per 1,000
//! messages if more; rounded up to a multiple of the 6 kinds),
//! `IDEM_CHAOS_RATE` (messages published per second; `0` publishes as fast
//! as JetStream acks; the default spreads quick mode over 12 s and is `0`
//! above 5,000 messages), `IDEM_CHAOS_SEED` (replays the fault schedule a
//! failed run printed), `IDEM_CHAOS_LOG_DIR` (keep the workers' logs and
//! reports there; by default they go to a temp dir that is kept only if the
//! test fails), `IDEM_CHAOS_WORKER_LOG` (the workers' `RUST_LOG`).
//!
//! The tests need servers of their own: with `NATS_URL` or `DATABASE_URL`
//! set they are built as ignored (reported as skipped), except under `CI`,
//! where they fail loudly (see `tests/build.rs`).

mod acks;
mod cluster;
mod day_two;
mod network;
mod pipeline;

use idem_tests::seeded::{Rng, env_or, seed};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_tests::{TestEnv, unique_name};
use sqlx::PgPool;

use acks::{AckTap, Settled};
use idem_tests::worker_process::{self as worker, Ended, Report, Worker};
use network::{NetFault, Proxies};

/// The worker binary.
const CHAOS_WORKER: &str = env!("CARGO_BIN_EXE_chaos_worker");
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

/// Message `i`'s own reference, in its payload: what the day-two mode's
/// second route on the subject dedups by (`key = cmd.reference`), where the
/// credit route dedups by the `Nats-Msg-Id`.
fn credit_ref(i: u64) -> String {
    format!("r-{i}")
}

/// What a run should end with.
struct Expected {
    messages: u64,
    sum: i64,
    balances: BTreeMap<i64, i64>,
    /// Messages in the dead-letter stream (the day-two mode's accidents
    /// make some; no other mode may).
    dead_letters: u64,
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
            dead_letters: 0,
        }
    }
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
    /// Every ack the consumer receives.
    tap: AckTap,
    /// Network mode: the worker reaches the servers only through these.
    proxies: Option<Proxies>,
    /// Day-two mode: its traffic, streams and watch.
    day_two: Option<day_two::Context>,
}

/// How the worker reaches the servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Direct,
    /// Through a fault proxy for each server.
    Proxied,
}

/// Starts the servers and creates the stream. Panics if `NATS_URL` or
/// `DATABASE_URL` point at servers the test cannot crash.
async fn setup(test: &str, extra_worker_env: &[(&str, &str)], route: Route) -> Option<Setup> {
    idem_tests::require_own_servers();
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
    let tap = AckTap::start(env.nats_url(), &stream, DURABLE).await;
    let proxies = (route == Route::Proxied).then(|| Proxies::start(&env));
    let (nats_url, database_url) = match &proxies {
        Some(p) => (
            p.nats.url_for(env.nats_url()),
            p.postgres.url_for(env.database_url()),
        ),
        None => (env.nats_url().to_owned(), env.database_url().to_owned()),
    };
    let mut worker_env: Vec<(String, String)> = vec![
        ("NATS_URL".into(), nats_url),
        ("DATABASE_URL".into(), database_url),
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
        tap,
        proxies,
        day_two: None,
    })
}

impl Setup {
    fn spawn_worker(&self, ordinal: usize) -> Worker {
        Worker::spawn(
            CHAOS_WORKER.as_ref(),
            ordinal,
            &self.worker_env,
            self.logs.path(),
        )
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
        ledger_rows(&self.pool).await
    }

    /// The consumer's (num_pending, num_ack_pending, ack floor) and the
    /// stream's (last sequence, messages), or why they could not be read.
    async fn consumer_state(&self) -> Result<ConsumerState, String> {
        consumer_state(&self.js, &self.stream).await
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

    /// Every ledger row by message id (the last, if a message has more than
    /// one: `check_ledger` reports those).
    async fn ledger(&self) -> HashMap<String, LedgerRow> {
        read_ledger(&self.pool).await
    }

    /// Checks the end state against `expected`; returns every violation.
    async fn check_ledger(&self, expected: &Expected) -> Vec<String> {
        check_ledger(&self.pool, &self.js, expected).await
    }
}

/// How many rows the ledger holds (0 before a worker created it), waiting
/// out a PostgreSQL restart.
async fn ledger_rows(pool: &PgPool) -> i64 {
    // The pool reconnects after a PostgreSQL restart; retry meanwhile.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match sqlx::query_scalar("SELECT count(*) FROM chaos_ledger")
            .fetch_one(pool)
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
async fn consumer_state(js: &jetstream::Context, stream: &str) -> Result<ConsumerState, String> {
    let mut stream = js
        .get_stream(stream)
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
        delivered_consumer_seq: consumer.delivered.consumer_sequence,
        num_pending: consumer.num_pending,
        num_ack_pending: consumer.num_ack_pending as u64,
        num_redelivered: consumer.num_redelivered as u64,
        ack_floor: consumer.ack_floor.stream_sequence,
        last_sequence,
        messages,
    })
}

/// Every ledger row by message id (the last, if a message has more than
/// one: `check_ledger` reports those).
async fn read_ledger(pool: &PgPool) -> HashMap<String, LedgerRow> {
    sqlx::query_as::<_, (String, i64, i64, i32)>(
        "SELECT message_id, stream_seq, delivered, worker_pid FROM chaos_ledger",
    )
    .fetch_all(pool)
    .await
    .expect("the ledger is read")
    .into_iter()
    .map(|(id, seq, delivered, pid)| {
        let row = LedgerRow {
            stream_seq: seq as u64,
            delivered: delivered as u64,
            worker_pid: pid as u32,
        };
        (id, row)
    })
    .collect()
}

/// How many messages the runtime's default dead-letter stream holds (0 if
/// it does not exist).
async fn dead_letters(js: &jetstream::Context) -> u64 {
    match js
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
async fn check_ledger(pool: &PgPool, js: &jetstream::Context, expected: &Expected) -> Vec<String> {
    let mut violations = Vec::new();
    let (rows, distinct, sum): (i64, i64, Option<i64>) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT message_id), sum(amount)::bigint FROM chaos_ledger",
    )
    .fetch_one(pool)
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
    .fetch_all(pool)
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
    .fetch_all(pool)
    .await
    .expect("missing messages are listed");
    if !missing.is_empty() {
        violations.push(format!("never applied (first 20): {missing:?}"));
    }
    let foreign: i64 =
        sqlx::query_scalar("SELECT count(*) FROM chaos_ledger WHERE message_id NOT LIKE 'chaos-%'")
            .fetch_one(pool)
            .await
            .expect("foreign rows are counted");
    if foreign != 0 {
        violations.push(format!(
            "{foreign} ledger rows have a message id that was never published"
        ));
    }
    let dedup_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_processed WHERE handler = $1")
            .bind(HANDLER)
            .fetch_one(pool)
            .await
            .expect("dedup rows are counted");
    if dedup_rows != n {
        violations.push(format!(
            "{dedup_rows} dedup rows for {HANDLER}, expected {n}"
        ));
    }
    let balances: BTreeMap<i64, i64> =
        sqlx::query_as::<_, (i32, i64)>("SELECT id, balance FROM chaos_accounts ORDER BY id")
            .fetch_all(pool)
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
    let dead_letters = dead_letters(js).await;
    if dead_letters != expected.dead_letters {
        violations.push(format!(
            "{dead_letters} messages are in the dead-letter stream, expected {}",
            expected.dead_letters
        ));
    }
    violations
}

/// Which delivery of a message committed its effect, in which worker.
#[derive(Debug, Clone, Copy)]
struct LedgerRow {
    stream_seq: u64,
    delivered: u64,
    worker_pid: u32,
}

/// Redeliveries of committed work that the claim absorbed, as the tap saw
/// them: acks of a later delivery than the one that committed (a second
/// effect would be a second ledger row). By message id.
fn absorbed_redeliveries(
    ledger: &HashMap<String, LedgerRow>,
    acks: &HashMap<u64, Vec<acks::TapAck>>,
) -> HashMap<String, Vec<acks::TapAck>> {
    ledger
        .iter()
        .filter_map(|(id, row)| {
            let later: Vec<_> = acks
                .get(&row.stream_seq)?
                .iter()
                .filter(|a| a.settled == Settled::Ack && a.delivered > row.delivered)
                .copied()
                .collect();
            (!later.is_empty()).then(|| (id.clone(), later))
        })
        .collect()
}

#[derive(Debug, Clone)]
#[allow(dead_code)] // read through Debug in failure messages
struct ConsumerState {
    /// The consumer sequence of its latest delivery.
    delivered_consumer_seq: u64,
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
        let payload: bytes::Bytes = serde_json::to_vec(
            &serde_json::json!({ "account": account, "amount": amount, "ref": credit_ref(i) }),
        )
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
    /// SIGKILL at the moment the schedule reached.
    KillWorker,
    /// SIGKILL as soon as the journal shows a transaction begin.
    KillMidTransaction,
    /// SIGUSR1, wait for the worker to hold a commit before its ack, SIGKILL.
    KillAfterCommit,
    RestartPostgres,
    RestartNats,
    Network(NetFault),
    DayTwo(day_two::Accident),
}

/// Spreads `faults` over the run: each is due once the ledger holds that
/// many rows, evenly spaced, ±20 % of the spacing at random. Returns the
/// spacing too.
fn place<F>(messages: u64, faults: Vec<F>, rng: &mut Rng) -> (Vec<(u64, F)>, u64) {
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

/// Kill mode: `kills` worker kills, every other one aimed at an open
/// transaction, one (at random) held between COMMIT and ack, with the
/// PostgreSQL restart a third of the way in and the NATS restart two thirds
/// in.
fn kill_schedule(messages: u64, kills: usize, rng: &mut Rng) -> (Vec<(u64, Fault)>, u64) {
    let mut faults: Vec<Fault> = (0..kills)
        .map(|k| {
            if k % 2 == 0 {
                Fault::KillWorker
            } else {
                Fault::KillMidTransaction
            }
        })
        .collect();
    faults[rng.between(0, kills as u64 - 1) as usize] = Fault::KillAfterCommit;
    faults.insert(faults.len() / 3, Fault::RestartPostgres);
    faults.insert(faults.len() * 2 / 3, Fault::RestartNats);
    place(messages, faults, rng)
}

/// The held kill: which worker, and the message it held after COMMIT.
#[derive(Debug, Clone)]
#[allow(dead_code)] // stream_seq and absorbed_after are read through Debug
struct HeldKill {
    ordinal: usize,
    pid: u32,
    message_id: String,
    stream_seq: u64,
    /// How long after the kill a later worker acked its redelivery.
    absorbed_after: Duration,
}

/// The PostgreSQL restart, as the worker that lived through it saw it.
#[derive(Debug, Clone, Default)]
#[allow(dead_code)] // down_for is read through Debug
struct PgRestart {
    /// The worker running meanwhile.
    ordinal: usize,
    /// Its router's failed + retried in process + commit failed, before the
    /// stop and once PostgreSQL was back.
    router_failures: (u64, u64),
    /// How long PostgreSQL was down.
    down_for: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Stall {
    lasted: Duration,
    from: Duration,
    last_fault: Option<Fault>,
}

/// Figures of one chaos run, printed at the end.
#[derive(Debug, Default)]
struct Tally {
    workers_started: usize,
    kills: usize,
    held: Option<HeldKill>,
    pg_restarts: Vec<PgRestart>,
    nats_restarts: usize,
    nats_restarts_seen: usize,
    /// The workers that lived through a NATS restart.
    nats_restart_workers: Vec<usize>,
    /// By killed worker's pid: the consumer's last delivery (its consumer
    /// sequence) as read after the worker was reaped. Any later delivery
    /// went to a later worker.
    delivered_before_death: HashMap<u32, u64>,
    network: network::Tally,
    day_two: day_two::Tally,
    ended: Vec<Ended>,
    /// The longest the ledger went without growing while rows were due:
    /// how long, from when (into the run), and the fault done last before
    /// it (the cause may be an earlier one: compare the fault timeline). Not
    /// asserted (speed is not the invariant), but a long one after a NATS
    /// reconnect points at a stuck pull.
    longest_stall: Option<Stall>,
}

impl Tally {
    /// The longest stall, for people.
    fn longest_stall(&self) -> String {
        match self.longest_stall {
            Some(stall) => format!(
                "{:.1?} from {:.1?} into the run ({})",
                stall.lasted,
                stall.from,
                match stall.last_fault {
                    Some(fault) => format!("the last fault before it: {fault:?}"),
                    None => "before the first fault".into(),
                }
            ),
            None => "none measured".into(),
        }
    }

    /// Sums the last reports of all workers that ended (a killed worker's
    /// last stats line is at most 10 ms older than its death), and takes the
    /// largest batch.
    fn totals(&self) -> Report {
        let mut t = Report::default();
        for e in &self.ended {
            let r = e.stopped.as_ref().unwrap_or(&e.last);
            t.received += r.received;
            t.processed += r.processed;
            t.duplicates += r.duplicates;
            t.failed += r.failed;
            t.commit_failed += r.commit_failed;
            t.rejected += r.rejected;
            t.retried_in_process += r.retried_in_process;
            t.infrastructure_errors += r.infrastructure_errors;
            t.abandoned_transactions += r.abandoned_transactions;
            t.dead_lettered += r.dead_lettered;
            t.dead_letter_failed += r.dead_letter_failed;
            t.batches += r.batches;
            t.largest_batch = t.largest_batch.max(r.largest_batch);
            t.batch_fallbacks += r.batch_fallbacks;
            t.nats_disconnects += r.nats_disconnects;
            t.nats_reconnects += r.nats_reconnects;
            t.pg_outages += r.pg_outages;
            t.pg_recoveries += r.pg_recoveries;
            t.pg_probe_failures += r.pg_probe_failures;
            t.pg_probe_timeouts += r.pg_probe_timeouts;
            t.pg_probe_resets += r.pg_probe_resets;
            t.pg_probe_other += r.pg_probe_other;
            t.startup_failures += r.startup_failures;
        }
        t
    }
}

/// Drives the faults of a schedule while the publisher runs.
struct FaultDriver<'a> {
    setup: &'a mut Setup,
    worker: Option<Worker>,
    tally: Tally,
    rng: Rng,
    /// How far the publisher may go.
    gate: Arc<AtomicU64>,
    published: Arc<AtomicU64>,
    /// The fault done last.
    last_fault: Option<Fault>,
    /// When the run started.
    started: Instant,
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
        let proxies = self
            .setup
            .proxies
            .as_ref()
            .map(|p| format!("{:?}", (p.postgres.counts(), p.nats.counts())))
            .unwrap_or_default();
        panic!(
            "{what}\n  published so far: {}\n  ledger rows: {rows:?}\n  consumer: {consumer:?}\n  \
             kills, PostgreSQL and NATS restarts, network faults so far: {:?}\n  \
             proxies (postgres, nats): {proxies}\n  current worker: {report}\n{log}",
            self.published.load(Ordering::Relaxed),
            (
                self.tally.kills,
                self.tally.pg_restarts.len(),
                self.tally.nats_restarts,
                self.tally.network.faults.len()
            ),
        );
    }

    /// Lets the publisher go `more` messages past what it has published, so
    /// that work arrives while a fault is on even if it had reached the gate.
    fn let_more_through(&self, more: u64) {
        self.gate.fetch_max(
            self.published.load(Ordering::Relaxed) + more,
            Ordering::Relaxed,
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
                let gap = last.1.elapsed();
                if self.tally.longest_stall.is_none_or(|s| gap > s.lasted) {
                    self.tally.longest_stall = Some(Stall {
                        lasted: gap,
                        from: last.1.duration_since(self.started),
                        last_fault: self.last_fault,
                    });
                }
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

    /// SIGKILLs the worker and starts another. `KillMidTransaction` first
    /// waits for the journal to show a transaction begin. `KillAfterCommit`
    /// first has the worker hold a commit before its ack (SIGUSR1) and kills
    /// it there, and at the end waits until the tap sees a later worker ack
    /// the held message's redelivery (before any other fault can interfere).
    async fn kill_worker(&mut self, kill: Fault) {
        if kill == Fault::KillMidTransaction {
            self.let_more_through(8);
            if let Err(e) = self
                .worker()
                .wait_for_open_transaction(Duration::from_secs(10))
                .await
            {
                self.fail(&e).await;
            }
        }
        let held = if kill == Fault::KillAfterCommit {
            self.let_more_through(32);
            self.worker().hold_next_commit();
            match self.worker().wait_for_held(Duration::from_secs(30)).await {
                Ok(id) => Some(id),
                Err(e) => self.fail(&e).await,
            }
        } else {
            None
        };
        let worker = self.worker.take().expect("a worker is running");
        let ended = worker.sigkill();
        let killed_at = Instant::now();
        assert!(
            ended.was_sigkilled(),
            "worker #{} (pid {}) ended with {} rather than by our SIGKILL",
            ended.ordinal,
            ended.pid,
            ended.status
        );
        // The dead worker gets no more deliveries, and can ack none it
        // would get: a delivery past this one that is acked went to a later
        // worker.
        let mut last_delivery = Err(String::new());
        for _ in 0..50 {
            last_delivery = self.setup.consumer_state().await;
            if last_delivery.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let last_before_death = match last_delivery {
            Ok(state) => state.delivered_consumer_seq,
            Err(e) => self.fail(&format!("consumer info after a kill: {e}")).await,
        };
        self.tally
            .delivered_before_death
            .insert(ended.pid, last_before_death);
        let (ordinal, pid) = (ended.ordinal, ended.pid);
        self.tally.kills += 1;
        self.tally.ended.push(ended);
        // Now and then, leave the consumer without a worker for a moment.
        if self.rng.between(0, 2) == 0 {
            tokio::time::sleep(self.rng.millis(100, 1000)).await;
        }
        self.start_worker().await;
        let Some((message_id, stream_seq)) = held else {
            return;
        };
        // JetStream redelivers it after ack_wait; the new worker's claim
        // finds the row and acks. The tap keeps its copy of that ack at most
        // once, so wait for it here, before a server restart could lose it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.setup.tap.acked_after(stream_seq, last_before_death) {
            if Instant::now() > deadline {
                self.fail(&format!(
                    "no worker acked a redelivery of {message_id} (stream seq {stream_seq}) within \
                     30 s of killing worker #{ordinal}, which held it after COMMIT"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.tally.held = Some(HeldKill {
            ordinal,
            pid,
            message_id,
            stream_seq,
            absorbed_after: killed_at.elapsed(),
        });
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
        let stopped = Instant::now();
        self.setup.env.postgres_mut().stop_immediate().await;
        // Load goes on: handlers fail and NAK, the publisher still publishes.
        // It stays down until the router itself has met the outage.
        self.let_more_through(16);
        let down_at_least = self.rng.millis(300, 1500);
        if let Err(e) = self
            .worker()
            .wait_for(
                "see PostgreSQL down in its own transactions (failed, retried, commit failed or held)",
                Duration::from_secs(30),
                |r| r.router_failures() > before.router_failures(),
            )
            .await
        {
            self.fail(&e).await;
        }
        tokio::time::sleep(down_at_least.saturating_sub(stopped.elapsed())).await;
        let down_for = stopped.elapsed();
        self.setup.env.postgres_mut().start_again().await;
        assert_ne!(pid, self.setup.env.postgres().pid(), "a new postmaster");
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
                let restart = PgRestart {
                    ordinal: self.worker().ordinal,
                    router_failures: (before.router_failures(), after.router_failures()),
                    down_for,
                };
                eprintln!(
                    "chaos: PostgreSQL down for {down_for:.1?}; worker #{} saw it in its router \
                     (failed {} -> {}, retried in process {} -> {}, commit failed {} -> {}) and its probe",
                    restart.ordinal,
                    before.failed,
                    after.failed,
                    before.retried_in_process,
                    after.retried_in_process,
                    before.commit_failed,
                    after.commit_failed
                );
                self.tally.pg_restarts.push(restart);
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
        let ordinal = self.worker().ordinal;
        self.tally.nats_restart_workers.push(ordinal);
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
        for (k, &(at, fault)) in faults.iter().enumerate() {
            self.gate.store(at + spacing / 2, Ordering::Relaxed);
            let waiting = Instant::now();
            self.wait_for_progress(at).await;
            eprintln!(
                "chaos: {:.1?}: fault {}/{}, {fault:?}, due at {at} rows (waited {:.1?} for them)",
                self.started.elapsed(),
                k + 1,
                faults.len(),
                waiting.elapsed()
            );
            tokio::time::sleep(self.rng.millis(0, 300)).await;
            match fault {
                Fault::KillWorker | Fault::KillMidTransaction | Fault::KillAfterCommit => {
                    self.kill_worker(fault).await
                }
                Fault::RestartPostgres => self.restart_postgres().await,
                Fault::RestartNats => self.restart_nats().await,
                Fault::Network(fault) => self.network_fault(fault).await,
                Fault::DayTwo(accident) => self.accident(accident).await,
            }
            self.last_fault = Some(fault);
        }
        self.gate.store(u64::MAX, Ordering::Relaxed);
    }

    /// Drains the consumer with the last worker, stops it with SIGTERM (it
    /// must exit 0), and reads the end state.
    async fn finish(&mut self, expected: &Expected) -> Finished {
        let messages = expected.messages;
        let drain_timeout = Duration::from_secs(60 + messages / 200);
        let mut last = self.worker.take().expect("a worker is running");
        let drained = self
            .setup
            .wait_drained(&mut last, messages, drain_timeout)
            .await;
        if let Err(e) = drained {
            self.worker = Some(last);
            self.fail(&e).await;
        }
        if self.setup.day_two.is_some() {
            // Its other traffic stops, and what it left settles, before the
            // last worker (and with it the relay) stops.
            self.worker = Some(last);
            self.settle_day_two().await;
            last = self.worker.take().expect("a worker is running");
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
        self.tally.ended.push(ended);
        let consumer = self
            .setup
            .consumer_state()
            .await
            .expect("the consumer is readable");
        let violations = self.setup.check_ledger(expected).await;
        let ledger = self.setup.ledger().await;
        let acks = self.setup.tap.by_sequence();
        let absorbed = absorbed_redeliveries(&ledger, &acks);
        Finished {
            tally: std::mem::take(&mut self.tally),
            consumer,
            violations,
            shutdown_took,
            ledger,
            acks,
            absorbed,
        }
    }
}

/// The end state of a run.
struct Finished {
    tally: Tally,
    consumer: ConsumerState,
    violations: Vec<String>,
    shutdown_took: Duration,
    ledger: HashMap<String, LedgerRow>,
    acks: HashMap<u64, Vec<acks::TapAck>>,
    /// Redeliveries of committed work that the claim absorbed, by message.
    absorbed: HashMap<String, Vec<acks::TapAck>>,
}

impl Finished {
    /// The checks every mode shares: exactly once, nothing left, nothing
    /// dead-lettered, and batching seen in batch mode.
    fn assert_exactly_once(&self, messages: u64, batch: usize) {
        assert!(
            self.violations.is_empty(),
            "exactly-once violated:\n  {}",
            self.violations.join("\n  ")
        );
        assert!(
            self.consumer.is_drained() && self.consumer.messages == messages,
            "the consumer still has work, or the stream has other than {messages} messages: {:?}",
            self.consumer
        );
        let totals = self.tally.totals();
        assert_eq!(
            (totals.rejected, totals.dead_lettered),
            (0, 0),
            "no message was rejected or dead-lettered"
        );
        if batch > 1 {
            assert!(
                totals.batches > 0 && totals.largest_batch > 1,
                "batch mode committed batches, some of more than one message: {} batches, largest {}",
                totals.batches,
                totals.largest_batch
            );
        } else {
            assert_eq!(totals.batches, 0, "per-message mode commits no batches");
        }
    }
}

/// What the kills hit, read from the journals, the ledger and the tap.
#[derive(Debug, Default)]
struct KillEvidence {
    /// Kills whose worker had transactions open: messages it began and never
    /// committed, which another worker applied later.
    mid_transaction: usize,
    open_transactions: usize,
    /// Kills that left committed work unacked, which a later worker's claim
    /// absorbed: the worker wrote the message's ledger row, and a delivery
    /// made after its death was acked without a second row.
    between_commit_and_ack: usize,
    committed_unacked: usize,
    /// Of those, committed but not yet journaled as such: killed between
    /// COMMIT and the after-commit hook.
    committed_unjournaled: usize,
    /// Whether the held kill's message was among them.
    held_absorbed: bool,
}

impl KillEvidence {
    fn of(finished: &Finished) -> KillEvidence {
        let tally = &finished.tally;
        let mut by_pid: HashMap<u32, Vec<(&String, &LedgerRow)>> = HashMap::new();
        for (id, row) in &finished.ledger {
            by_pid.entry(row.worker_pid).or_default().push((id, row));
        }
        // A transaction that failed (PostgreSQL down) and was NAKed to a
        // later worker also shows as begun and not committed: the worker that
        // lived through the restart does not count for open transactions.
        let pg_workers: Vec<usize> = tally.pg_restarts.iter().map(|r| r.ordinal).collect();
        let mut evidence = KillEvidence::default();
        for killed in tally.ended.iter().filter(|e| e.was_sigkilled()) {
            let applied_by = |id: &String| finished.ledger.get(id).map(|row| row.worker_pid);
            let open: Vec<&String> = killed
                .journal
                .open()
                .filter(|id| applied_by(id).is_some_and(|pid| pid != killed.pid))
                .collect();
            if !open.is_empty() && !pg_workers.contains(&killed.ordinal) {
                evidence.mid_transaction += 1;
                evidence.open_transactions += open.len();
            }
            // Committed by this worker, its own delivery never acked (as far
            // as the server heard), and a delivery made after its death
            // acked without a second row.
            let Some(&last_before_death) = tally.delivered_before_death.get(&killed.pid) else {
                continue;
            };
            let unacked: Vec<&String> = by_pid
                .get(&killed.pid)
                .into_iter()
                .flatten()
                .filter(|(id, row)| {
                    let acked_own = finished.acks.get(&row.stream_seq).is_some_and(|acks| {
                        acks.iter()
                            .any(|a| a.settled == Settled::Ack && a.delivered == row.delivered)
                    });
                    let absorbed_later = finished.absorbed.get(*id).is_some_and(|acks| {
                        acks.iter().any(|a| a.consumer_seq > last_before_death)
                    });
                    !acked_own && absorbed_later
                })
                .map(|(id, _)| *id)
                .collect();
            // An ack lost in a NATS restart looks the same; the held kill
            // is certain either way, from the worker's journal.
            let held_here = tally.held.as_ref().is_some_and(|h| h.pid == killed.pid);
            if !unacked.is_empty()
                && (held_here || !tally.nats_restart_workers.contains(&killed.ordinal))
            {
                evidence.between_commit_and_ack += 1;
                evidence.committed_unacked += unacked.len();
                evidence.committed_unjournaled += unacked
                    .iter()
                    .filter(|id| !killed.journal.committed.contains(**id))
                    .count();
            }
            if let Some(held) = &tally.held
                && held.pid == killed.pid
            {
                evidence.held_absorbed = unacked.contains(&&held.message_id);
            }
        }
        evidence
    }
}

/// Messages with unique ids, each crediting an account, while the worker is
/// SIGKILLed at random moments (at least 10 times; once between COMMIT and
/// ack) and restarted, PostgreSQL is restarted with an immediate shutdown,
/// and nats-server is SIGKILLed and restarted on its store dir. Every
/// message is applied exactly once and the consumer ends with nothing
/// pending.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_and_server_crashes_apply_every_message_once() {
    chaos_run("kills", 1).await;
}

/// The same chaos, with the worker in batch mode (batches of up to 16).
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn worker_kills_and_server_crashes_apply_every_message_once_in_batch_mode() {
    chaos_run("kills-batch", 16).await;
}

/// Messages flow while the fault proxies between the worker and PostgreSQL
/// and nats-server pause traffic, drop connections and reset them, each kind
/// on each server at least twice. Every message is applied exactly once.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn network_faults_apply_every_message_once() {
    network::run("network", 1).await;
}

/// The same network faults, with the worker in batch mode (batches of up
/// to 16).
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn network_faults_apply_every_message_once_in_batch_mode() {
    network::run("network-batch", 16).await;
}

/// Ordinary operational accidents while credits, order requests and outbox
/// rows flow (see `chaos/day_two.rs`): a subject deployed before its stream,
/// undecodable messages near `max_payload`, a purge killed mid-expiry, a
/// transaction left open in another database, a handler renamed in a
/// rolling deploy, a dead letter replayed while another route shares its
/// subject, and nats-server away for longer than the relay's back-off. After
/// each, every route, the relay and the purge make progress within the
/// bound; at the end every effect is applied once and nothing is pending.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn day_two_accidents_stop_nothing_and_apply_every_effect_once() {
    day_two::run("day-two").await;
}

/// The default publish rate: quick mode spreads publishing over ~12 s, so
/// that every fault meets messages in flight; long mode publishes as fast
/// as JetStream acks.
fn publish_rate(messages: u64) -> f64 {
    env_or(
        "IDEM_CHAOS_RATE",
        if messages <= 5_000 {
            messages as f64 / 12.0
        } else {
            0.0
        },
    )
}

/// Runs `faults` against a worker while `expected.messages` are published,
/// then drains and reads the end state.
async fn drive(
    setup: &mut Setup,
    expected: &Expected,
    rate: f64,
    rng: Rng,
    faults: &[(u64, Fault)],
    spacing: u64,
) -> (Finished, Published, Duration) {
    let started = Instant::now();
    let published = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(AtomicU64::new(0));
    let publisher = publish_all(
        setup.js.clone(),
        setup.subject.clone(),
        expected.messages,
        rate,
        gate.clone(),
        published.clone(),
    );
    let mut driver = FaultDriver {
        setup,
        worker: None,
        tally: Tally::default(),
        rng,
        gate,
        published,
        last_fault: None,
        started,
    };
    driver.start_worker().await;
    let (publish_report, ()) = tokio::join!(publisher, driver.run(faults, spacing));
    let faults_done = started.elapsed();
    (driver.finish(expected).await, publish_report, faults_done)
}

async fn chaos_run(test: &str, batch: usize) {
    let started = Instant::now();
    let messages: u64 = env_or("IDEM_CHAOS_MESSAGES", 2_000);
    let kills: usize = env_or("IDEM_CHAOS_KILLS", 12.max(messages as usize / 2_000));
    let rate = publish_rate(messages);
    let seed = seed();
    eprintln!(
        "chaos: {messages} messages, {kills} worker kills, batch {batch}, publish rate {rate:.0}/s, \
         seed {seed} (replay with IDEM_CHAOS_SEED={seed})"
    );
    assert!(
        kills >= 10,
        "the run must kill the worker at least 10 times"
    );
    // 5 ms inside each transaction, so that a kill often finds messages
    // mid-transaction.
    let batch_env = batch.to_string();
    let Some(mut setup) = setup(
        test,
        &[
            ("CHAOS_HANDLER_DELAY_MS", "5"),
            ("CHAOS_BATCH", batch_env.as_str()),
        ],
        Route::Direct,
    )
    .await
    else {
        return;
    };
    let expected = Expected::for_messages(messages);
    let mut rng = Rng(seed);
    let (faults, spacing) = kill_schedule(messages, kills, &mut rng);
    let (finished, publish_report, faults_done) =
        drive(&mut setup, &expected, rate, rng, &faults, spacing).await;
    let evidence = KillEvidence::of(&finished);
    let tally = &finished.tally;
    let totals = tally.totals();
    eprintln!(
        "chaos: {messages} messages in {:.1?} (faults done at {faults_done:.1?}; published in {:.1?} \
         with {} retries, {} JetStream duplicates; last worker stopped {:.2?} after SIGTERM)\n\
         chaos: workers started {}, SIGKILLed {}: {} with transactions open ({} transactions), \
         {} between COMMIT and ack ({} committed messages unacked, {} of them before the \
         after-commit hook; held kill {:?} absorbed: {})\n\
         chaos: PostgreSQL restarts {:?}, nats-server restarts {} (seen {})\n\
         chaos: longest stall of the ledger while rows were due: {}\n\
         chaos: redeliveries of committed work absorbed by the claim (ack tap): {} messages; \
         tap saw {} acks\n\
         chaos: worker totals: processed {}, duplicates skipped {}, failed {}, commit failed {}, \
         retried in process {}, batches {} (largest {}, fallbacks {}), rejected {}, \
         dead-lettered {}, NATS disconnects {}, PostgreSQL outages {}, start-ups retried {}\n\
         chaos: consumer {:?}",
        started.elapsed(),
        publish_report.took,
        publish_report.retries,
        publish_report.duplicates,
        finished.shutdown_took,
        tally.workers_started,
        tally.kills,
        evidence.mid_transaction,
        evidence.open_transactions,
        evidence.between_commit_and_ack,
        evidence.committed_unacked,
        evidence.committed_unjournaled,
        tally.held,
        evidence.held_absorbed,
        tally.pg_restarts,
        tally.nats_restarts,
        tally.nats_restarts_seen,
        tally.longest_stall(),
        finished.absorbed.len(),
        finished.acks.values().map(Vec::len).sum::<usize>(),
        totals.processed,
        totals.duplicates,
        totals.failed,
        totals.commit_failed,
        totals.retried_in_process,
        totals.batches,
        totals.largest_batch,
        totals.batch_fallbacks,
        totals.rejected,
        totals.dead_lettered,
        totals.nats_disconnects,
        totals.pg_outages,
        totals.startup_failures,
        finished.consumer,
    );

    finished.assert_exactly_once(messages, batch);
    assert!(
        tally.kills >= kills && kills >= 10,
        "{} kills, {kills} planned",
        tally.kills
    );
    for e in tally.ended.iter().filter(|e| e.was_sigkilled()) {
        assert!(
            !e.journal.committed.is_empty(),
            "kill of worker #{} did not hit a working worker: {e:?}",
            e.ordinal
        );
    }
    assert!(
        evidence.mid_transaction * 2 >= tally.kills,
        "at least half of the kills must land with transactions open; {} of {} did: {evidence:?}",
        evidence.mid_transaction,
        tally.kills
    );
    let held = tally.held.as_ref().expect("one kill held a commit");
    assert_eq!(
        finished.ledger.get(&held.message_id).map(|r| r.worker_pid),
        Some(held.pid),
        "the held message was committed by the worker that held it: {held:?}"
    );
    let held_row = finished.ledger.get(&held.message_id);
    let held_acks = held_row.and_then(|row| finished.acks.get(&row.stream_seq));
    let held_death = tally.delivered_before_death.get(&held.pid);
    assert!(
        evidence.held_absorbed && evidence.between_commit_and_ack >= 1,
        "the kill between COMMIT and ack ({held:?}) left committed work that a later worker's \
         claim absorbed; the tap saw no acked redelivery of {} after worker #{} died \
         (the consumer's last delivery then: {held_death:?}): {evidence:?}\n  its ledger row {held_row:?}\n  the acks of it: {held_acks:?}",
        held.message_id,
        held.ordinal
    );
    match tally.pg_restarts.as_slice() {
        [restart] => assert!(
            restart.router_failures.1 > restart.router_failures.0,
            "the router saw the PostgreSQL restart in its own transactions: {restart:?}"
        ),
        other => panic!("PostgreSQL was restarted once: {other:?}"),
    }
    assert_eq!(
        (tally.nats_restarts, tally.nats_restarts_seen),
        (1, 1),
        "nats-server was restarted once, and the worker saw it"
    );
}

/// SIGTERM while the worker is busy: it exits 0 within its grace period,
/// having settled every message it started; a fresh worker finishes the rest,
/// and every message is applied exactly once.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn sigterm_during_load_exits_zero_and_loses_nothing() {
    const MESSAGES: u64 = 1_000;
    let started = Instant::now();
    // 20 ms inside each transaction: 8 at a time, so at most ~400/s, and
    // messages are mid-transaction when SIGTERM comes.
    let Some(setup) = setup(
        "sigterm",
        &[("CHAOS_HANDLER_DELAY_MS", "20")],
        Route::Direct,
    )
    .await
    else {
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
