//! A router's end: shutdown finishes what is in flight and hands back the
//! rest, ends after its grace period (also while NATS is away) and leaves the
//! application's pool open; `Router::run` exits 0 on SIGTERM after settling
//! what it holds; a dropped `run` future leaves nothing running.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem_runtime::outbox::Relay;
use idem_runtime::{Delivery, Route, Router, Unbounded, idempotent};
use idem_tests::ack_events::{AckKind, AckLog};
use idem_tests::scenario::*;

use crate::one;

// --- Shutdown ----------------------------------------------------------

#[idempotent(name = "never-ends")]
async fn never_ends(_tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> Result<(), sqlx::Error> {
    std::future::pending::<()>().await;
    Ok(())
}

/// Shutdown with a handler that never finishes, while the application holds
/// a connection of the same pool: `run` returns soon after the grace period,
/// and the application's pool stays open and usable.
#[tokio::test]
async fn shutdown_ends_after_the_grace_period_and_leaves_the_pool_open() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("GRACE", Duration::from_secs(120)).await;
    let mut held = pool.acquire().await.unwrap();
    let (handle, task) = spawn(
        Router::new()
            .route(Route::new(&stream, "c"), never_ends)
            .shutdown_grace(Duration::from_secs(1)),
        nats,
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("forever-1")).await;
    let stats = handle.stats("c").unwrap();
    eventually("the handler runs", Duration::from_secs(30), || async {
        stats.received() == 1
    })
    .await;

    handle.shutdown();
    let returned = tokio::time::timeout(Duration::from_secs(10), task).await;
    assert!(
        returned.is_ok(),
        "run returned within the 1 s grace period plus a small bound"
    );
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *held)
        .await
        .unwrap();
    assert_eq!(one, 1, "the application's own connection works");
    assert!(!pool.is_closed(), "the application's pool is still open");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(one, 1);
    // The cancelled handler's connection is closed, not returned: its
    // backend ends (and its transaction rolls back) once the server has read
    // the close, which a loaded machine may take a moment for.
    eventually(
        "the cancelled transaction is not left open",
        Duration::from_secs(10),
        || async {
            let stuck: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND state LIKE 'idle in transaction%'
                   AND backend_xid IS NOT NULL",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            stuck == 0
        },
    )
    .await;
}

// ---------------------------------------------------------------------------
// Shutdown while NATS is away: `run` never returns.
// ---------------------------------------------------------------------------

#[idempotent(name = "slow-forever")]
async fn slow_forever(_tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> Result<(), sqlx::Error> {
    std::future::pending::<()>().await;
    Ok(())
}

/// While NATS is away, async-nats stops draining its command channel
/// (2048 entries) until it reconnects, and `publish` waits for room. The
/// route's heartbeats (one `+WPI` per leased message per tick) fill it. At
/// shutdown, `pull::hand_back` NAKs what the pull fetched and did not start,
/// outside any bound: `run` hangs for as long as NATS is away, although it
/// promises to return "within the grace period plus a few seconds".
#[tokio::test]
async fn shutdown_while_nats_is_away_returns_within_the_grace_period() {
    let Scenario {
        mut env,
        pool,
        nats: _nats,
        js,
        stream,
        subject,
    } = scenario("NATSAWAY", Duration::from_secs(120)).await;
    for i in 0..200 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("away-{i}"))).await;
    }
    let router_client = env.nats().await;
    let (handle, task) = spawn(
        Router::new()
            .route(
                Route::new(&stream, "c")
                    .batch(50)
                    .concurrency(2)
                    .ack_wait(Duration::from_secs(30))
                    .heartbeat_every(Duration::from_millis(10)),
                slow_forever,
            )
            .shutdown_grace(Duration::from_secs(1)),
        router_client,
        pool,
    );
    let stats = handle.stats("c").unwrap();
    // Batches hold what had arrived when they formed (a first batch may
    // hold one message, and never ends), so wait for what matters: some
    // messages held by running batches, and at least a batch's worth more
    // fetched and waiting in the pull, which shutdown must hand back.
    eventually(
        "batches run and more messages wait in the pull",
        Duration::from_secs(30),
        || async {
            let held = stats.received();
            // (The consumer exists once a message is received.)
            held >= 1
                && consumer_info(&js, &stream, "c")
                    .await
                    .num_ack_pending
                    .saturating_sub(held as usize)
                    >= 50
        },
    )
    .await;

    // The fault: NATS goes away, and stays away.
    env.nats_server_mut().kill();
    tokio::time::sleep(Duration::from_secs(3)).await;

    handle.shutdown();
    let mut task = task;
    let returned = tokio::time::timeout(Duration::from_secs(20), &mut task).await;
    if returned.is_err() {
        // What it waits for: NATS. Once it is back, `run` returns.
        env.nats_server_mut().start_again().await;
        let then = tokio::time::timeout(Duration::from_secs(20), &mut task).await;
        panic!(
            "run did not return 20 s after shutdown with a 1 s grace period while NATS was \
             away; it returned once NATS was back: {}",
            then.is_ok()
        );
    }
}

// ---------------------------------------------------------------------------
// Router::run and SIGTERM.

/// A `run_worker` process and the lines it prints.
struct RunWorker {
    child: Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
}

impl RunWorker {
    fn spawn(env: &idem_tests::TestEnv, stream: &str) -> RunWorker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_run_worker"))
            .env("NATS_URL", env.nats_url())
            .env("DATABASE_URL", env.database_url())
            .env("RUN_STREAM", stream)
            .env("RUN_DURABLE", "c")
            .env("RUN_CONCURRENCY", IN_FLIGHT.to_string())
            .env("RUN_HOLD_MS", HOLD_MS.to_string())
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("run_worker starts");
        let stdout = child.stdout.take().expect("piped");
        let (send, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| serde_json::json!({ "event": "unparsed", "line": line }));
                if send.send(value).is_err() {
                    break;
                }
            }
        });
        RunWorker { child, lines }
    }

    /// The next line, within `timeout`; `None` once stdout closed.
    async fn next(&mut self, timeout: Duration) -> Option<serde_json::Value> {
        tokio::time::timeout(timeout, self.lines.recv())
            .await
            .expect("run_worker said nothing for too long")
    }

    fn sigterm(&self) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) on the pid of our own child, which we have not
        // reaped yet, so the pid cannot have been reused.
        let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(sent, 0, "SIGTERM sent");
    }

    /// Waits for the process to exit, and returns its status and the lines
    /// it printed meanwhile.
    async fn wait(mut self, timeout: Duration) -> (ExitStatus, Vec<serde_json::Value>) {
        let mut rest = Vec::new();
        while let Some(line) = self.next(timeout).await {
            rest.push(line);
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for run_worker") {
                return (status, rest);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "run_worker did not exit"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RunWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The run worker's concurrency.
const IN_FLIGHT: usize = 4;
/// How long the run worker's handler holds each message inside its
/// transaction: the margin within which the test must send SIGTERM.
const HOLD_MS: u64 = 3000;

fn handled_ids(lines: &[serde_json::Value]) -> Vec<String> {
    lines
        .iter()
        .filter(|line| line["event"] == "handling")
        .map(|line| line["id"].as_str().expect("an id").to_owned())
        .collect()
}

/// `Router::run` handles SIGTERM itself: sent while every slot holds a
/// message inside its transaction, the process exits 0 after those messages
/// committed and were acked. A second run finishes the rest, and every
/// message is applied once.
#[tokio::test]
async fn router_run_exits_zero_on_sigterm_after_settling_in_flight_messages() {
    const MESSAGES: usize = 12;
    let Scenario {
        env,
        pool,
        nats: _nats,
        js,
        stream,
        subject,
    } = scenario("RUNSIGTERM", Duration::from_secs(120)).await;
    let mut sequence_of = BTreeMap::new();
    for i in 0..MESSAGES {
        let id = format!("run-{i}");
        let ack = publish(&js, &subject, &deposit("a", i as i64), Some(&id)).await;
        sequence_of.insert(id, ack.sequence);
    }
    let acks = AckLog::start(env.nats().await, &stream, || false).await;

    let mut worker = RunWorker::spawn(&env, &stream);
    let mut started = Vec::new();
    while started.len() < IN_FLIGHT {
        let line = worker
            .next(Duration::from_secs(60))
            .await
            .expect("run_worker exited before its slots filled");
        started.push(line);
    }
    let in_flight = handled_ids(&started);
    assert_eq!(in_flight.len(), IN_FLIGHT, "{started:?}");
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        committed, 0,
        "SIGTERM comes while the messages are inside their transactions"
    );
    worker.sigterm();
    let (status, rest) = worker.wait(Duration::from_secs(60)).await;
    eprintln!("SIGTERM with {in_flight:?} in flight; exit {status}; then printed {rest:?}");
    assert_eq!(
        status.code(),
        Some(0),
        "exit status after SIGTERM: {status}"
    );
    assert!(
        rest.iter().any(|line| line["event"] == "stopped"),
        "Router::run returned Ok: {rest:?}"
    );
    assert!(
        handled_ids(&rest).is_empty(),
        "no message started after SIGTERM: {rest:?}"
    );

    let applied: BTreeSet<String> =
        sqlx::query_scalar("SELECT message_id FROM effects WHERE handler = 'run-worker'")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        applied,
        in_flight.iter().cloned().collect::<BTreeSet<_>>(),
        "exactly the in-flight messages committed"
    );
    // The acks were sent before the process exited; give the server a
    // moment to route them to the log's connection.
    eventually(
        "an ack of each in-flight message",
        Duration::from_secs(10),
        || async {
            in_flight
                .iter()
                .all(|id| !acks.of(sequence_of[id], AckKind::Ack).is_empty())
        },
    )
    .await;

    // A second run takes the rest.
    let mut second = RunWorker::spawn(&env, &stream);
    wait_all_acked(&js, &stream, "c").await;
    second.sigterm();
    let mut second_lines = Vec::new();
    while let Some(line) = second.next(Duration::from_secs(60)).await {
        second_lines.push(line);
    }
    let (status, _) = second.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(0), "the second run exits 0 too");
    let second_ids = handled_ids(&second_lines);
    assert_eq!(
        second_ids.len(),
        MESSAGES - IN_FLIGHT,
        "the second run ran the rest, and nothing the first finished"
    );
    assert!(second_ids.iter().all(|id| !in_flight.contains(id)));
    assert_eq!(
        ledger(&pool, "run-worker").await,
        Ledger::once_each(MESSAGES as i64)
    );
    for (id, sequence) in &sequence_of {
        assert_eq!(
            acks.of(*sequence, AckKind::Ack).len(),
            1,
            "{id} acked exactly once"
        );
    }
}

#[idempotent(name = "held")]
async fn held(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    // Long enough that the test sees them all in flight, even on a loaded machine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    record_effect(tx, "held", &d, delivery).await
}

/// Shutdown while messages are in flight: they finish, commit and are acked
/// before `run` returns; messages fetched but not started, and those the
/// pull's last requests deliver while it shuts down, are NAKed at once: no
/// pull request of the stopped worker is left on the server, and within
/// seconds nothing it was delivered awaits an ack, where a delivery into a
/// dropped inbox would wait out the 2-minute ack_wait. A second worker then
/// takes the rest, and every message is applied once.
#[tokio::test]
async fn shutdown_finishes_in_flight_and_hands_back_the_rest() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SHUTDOWN", Duration::from_secs(120)).await;
    // The pull asks for 4 at a time, and again at 2 owed: the first request
    // brings 4, which start; the second brings the last 2 and stays open
    // on the server, owing 2 more, when shutdown begins.
    const IN_FLIGHT: u64 = 4;
    const MESSAGES: u64 = 6;
    // Published once shutdown has begun: that open request takes them,
    // while the pull closes, and they must be handed back too.
    const LATE: u64 = 3;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("s-{i}"))).await;
    }
    let acks = AckLog::start(env.nats().await, &stream, || false).await;
    // Per message: the pull's request sizes above are one message per slot
    // (a batch stopped by shutdown has a test of its own below).
    let route = || {
        Route::new(&stream, "c")
            .per_message()
            .concurrency(IN_FLIGHT as usize)
            .ack_wait(Duration::from_secs(120))
    };
    let (handle, task) = spawn(
        Router::new().route(route(), held),
        nats.clone(),
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    eventually(
        "four messages in flight",
        Duration::from_secs(30),
        || async { stats.received() >= IN_FLIGHT },
    )
    .await;
    assert_eq!(
        stats.processed(),
        0,
        "shutdown starts while they are in flight"
    );
    handle.shutdown();
    for i in 0..LATE {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("late-{i}"))).await;
    }
    stop(handle.clone(), task).await;
    let taken = stats.received();
    assert_eq!(stats.processed(), taken, "every message taken was finished");
    assert!(
        taken < MESSAGES,
        "not every message was started before shutdown"
    );
    assert_eq!(ledger(&pool, "held").await.effects, taken as i64);

    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        info.num_waiting, 0,
        "no pull request of the stopped worker is left on the server"
    );
    let delivered = info.delivered.consumer_sequence;
    assert!(
        delivered > MESSAGES,
        "the closing pull was delivered messages published after shutdown began ({delivered} delivered), so the hand-back of what an open request brings is exercised"
    );
    // Every delivery it did not start was NAKed, once: 5 s is far below the
    // 120 s ack_wait.
    eventually(
        "every delivery the stopped worker did not start is handed back",
        Duration::from_secs(5),
        || async {
            let naks = acks
                .events()
                .iter()
                .filter(|event| event.kind == AckKind::Nak)
                .count() as u64;
            naks == delivered - taken
        },
    )
    .await;

    // The rest go to the next worker now, not after ack_wait.
    let next_started = std::time::Instant::now();
    let (next, next_task) = spawn(Router::new().route(route(), held), nats, pool.clone());
    wait_all_acked(&js, &stream, "c").await;
    assert!(
        next_started.elapsed() < Duration::from_secs(30),
        "the next worker took the rest within 30 s, far below the 120 s ack_wait"
    );
    stop(next.clone(), next_task).await;
    let next_stats = next.stats("c").unwrap();
    assert_eq!(next_stats.processed(), MESSAGES + LATE - taken);
    assert_eq!(
        next_stats.duplicates(),
        0,
        "nothing the first worker finished came back"
    );
    assert_eq!(
        ledger(&pool, "held").await,
        Ledger::once_each((MESSAGES + LATE) as i64)
    );
}

/// The ids whose `held_in_batch` handler started, in order.
#[derive(Clone, Default)]
struct Started(Arc<Mutex<Vec<String>>>);

impl Started {
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

#[idempotent(name = "held-in-batch")]
async fn held_in_batch(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    idem_runtime::State(started): idem_runtime::State<Started>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    started
        .0
        .lock()
        .unwrap()
        .push(delivery.message_id().as_str().to_owned());
    // Long enough that shutdown comes while the first one runs, even on a
    // loaded machine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    record_effect(tx, "held-in-batch", &d, delivery).await
}

/// Shutdown while a batch runs its first message: that message, taken
/// before shutdown, finishes and commits; no later handler of the batch
/// starts; the claims the batch made for the others are taken back in its
/// transaction, and they are NAKed at once. The next worker applies them,
/// and every message is applied once.
#[tokio::test]
async fn shutdown_stops_a_batch_between_handlers_and_hands_back_the_rest() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BATCHSTOP", Duration::from_secs(120)).await;
    const MESSAGES: u64 = 8;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("b-{i}"))).await;
    }
    let acks = AckLog::start(env.nats().await, &stream, || false).await;
    let route = || {
        Route::new(&stream, "c")
            .batch(MESSAGES as usize)
            .concurrency(1)
            .ack_wait(Duration::from_secs(120))
    };
    let started = Started::default();
    let (handle, task) = spawn(
        Router::with_state(started.clone()).route(route(), held_in_batch),
        nats.clone(),
        pool.clone(),
    );
    eventually(
        "the batch's first handler started",
        Duration::from_secs(30),
        || async { started.count() >= 1 },
    )
    .await;
    handle.shutdown();
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    let taken = stats.received();
    assert!(
        taken >= 2,
        "the batch held more than the message that ran: {stats:?}"
    );
    assert_eq!(
        started.count(),
        1,
        "no handler of the batch started after shutdown"
    );
    assert_eq!(stats.processed(), 1, "{stats:?}");
    assert_eq!(ledger(&pool, "held-in-batch").await.effects, 1);
    let claims: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_processed WHERE handler = 'held-in-batch'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        claims, 1,
        "the claims of the messages not started were taken back"
    );
    eventually(
        "every message of the batch that did not run is handed back",
        Duration::from_secs(5),
        || async {
            let naks = acks
                .events()
                .iter()
                .filter(|event| event.kind == AckKind::Nak)
                .count() as u64;
            naks >= taken - 1
        },
    )
    .await;

    let (next, next_task) = spawn(
        Router::with_state(Started::default()).route(route(), held_in_batch),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(next.clone(), next_task).await;
    let next_stats = next.stats("c").unwrap();
    assert_eq!(next_stats.processed(), MESSAGES - 1, "{next_stats:?}");
    assert_eq!(
        next_stats.duplicates(),
        0,
        "the message the first worker finished did not come back"
    );
    assert_eq!(
        ledger(&pool, "held-in-batch").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

/// Counts the updates of every gauge, by name and labels.
#[derive(Default)]
struct GaugeUpdates(Mutex<HashMap<String, Arc<Updates>>>);

#[derive(Default)]
struct Updates(AtomicU64);

impl metrics::GaugeFn for Updates {
    fn increment(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn decrement(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn set(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl metrics::Recorder for GaugeUpdates {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let mut gauges = self.0.lock().unwrap();
        metrics::Gauge::from_arc(gauges.entry(name).or_default().clone())
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

fn gauges() -> &'static GaugeUpdates {
    static GAUGES: OnceLock<&'static GaugeUpdates> = OnceLock::new();
    GAUGES.get_or_init(|| {
        let recorder: &'static GaugeUpdates = Box::leak(Box::default());
        metrics::set_global_recorder(recorder).expect("no other recorder in this test process");
        recorder
    })
}

fn updates_of(name: &str) -> u64 {
    gauges()
        .0
        .lock()
        .unwrap()
        .get(name)
        .map_or(0, |updates| updates.0.load(Ordering::SeqCst))
}

/// The application state of the teardown test: the test keeps a `Weak` of
/// its token, which lives as long as anything of the router holds the state.
struct App {
    _alive: Arc<()>,
}

/// A router whose `run` future is dropped (its task aborted) while its
/// handle lives on, as an application's does: within a few seconds nothing
/// it started runs any more. Its state is dropped (no task keeps a route's
/// pipeline), the relay's LISTEN connection is closed, and, over three poll
/// intervals, no consumer gauge is updated and the purge rotates no
/// generation (it would every 5 s).
#[tokio::test]
async fn nothing_the_router_started_outlives_its_dropped_run_future() {
    let gauges = gauges();
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("TEARDOWN", Duration::from_millis(100)).await;
    // The relay LISTENs only while the NOTIFY trigger is enabled: on, so
    // that its LISTEN connection is there to outlive the run, or not.
    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    let alive = Arc::new(());
    let watch = Arc::downgrade(&alive);
    // A 10 s retention: generations of 5 s, a purge every 1.25 s.
    let route = Route::new(&stream, "c")
        .ack_wait(Duration::from_secs(1))
        .handler_timeout(Duration::from_secs(1))
        .max_deliver(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(200))
        .publisher_retry_horizon(Duration::from_millis(100))
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
        .retention(Duration::from_secs(10));
    let router = Router::with_state(App { _alive: alive })
        .route(route, crate::deposit)
        .relay(Relay::new());
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool.clone(), std::future::pending()));
    publish(&js, &subject, &one(), Some("m-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    let pending_gauge = "idem_consumer_pending_messages{route=c}";
    let listening = async || -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%idem_outbox%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    eventually(
        "the router updates its gauges and listens",
        Duration::from_secs(30),
        async || updates_of(pending_gauge) > 0 && listening().await > 0,
    )
    .await;
    // Running: the purge rotates every generation (5 s).
    let generations = async || -> i32 {
        sqlx::query_scalar("SELECT max(gen) FROM idem_generations")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = generations().await;
    eventually("the purge rotates", Duration::from_secs(30), async || {
        generations().await > before
    })
    .await;

    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while (watch.upgrade().is_some() || listening().await > 0)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state_kept = watch.upgrade().is_some();
    let still_listening = listening().await;
    // Three poll intervals: a poll left running would update the gauges
    // three times, a purge rotate at least twice.
    let (updates, generation) = (updates_of(pending_gauge), generations().await);
    tokio::time::sleep(3 * idem_runtime::metrics::POLL_INTERVAL).await;
    let updated = updates_of(pending_gauge) - updates;
    let rotated = generations().await - generation;
    eprintln!(
        "10 s after the drop the state was {}kept and {still_listening} LISTEN connection(s) open; \
         in the 15 s after: {updated} consumer gauge update(s), {rotated} rotation(s)",
        if state_kept { "" } else { "not " }
    );
    assert!(
        !state_kept,
        "a task still holds the router's state (a route's pipeline)"
    );
    assert_eq!(
        still_listening, 0,
        "the relay's LISTEN connection is closed"
    );
    assert_eq!(
        updated, 0,
        "the consumer gauges were updated after the run future was dropped"
    );
    assert_eq!(
        rotated, 0,
        "the purge rotated after the run future was dropped"
    );
    drop((handle, gauges));
}
