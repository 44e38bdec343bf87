//! The rows of the README's failure table that had no test of their own,
//! against real servers: a message past `max_deliver`, an ambiguous COMMIT
//! in batch mode, a replay of a processed message, a first attempt that
//! rolls back while its redelivery waits, and `Router::run`'s own SIGTERM
//! handling. Each test checks that nothing is lost and nothing applied
//! twice, and that the fault it injects really happened.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use common::pg_proxy::{PgProxy, upstream_of};
use common::*;
use futures_util::StreamExt;
use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, FromRef, Route, Router, State, Transient, dead_letter, idempotent};

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.into(),
        amount,
    }
}

/// Quick retries, so the tests wait milliseconds rather than seconds.
fn fast(route: Route) -> Route {
    route.backoff(Duration::from_millis(50), Duration::from_millis(200))
}

// ---------------------------------------------------------------------------
// What JetStream hears back: every ack, NAK, TERM and progress heartbeat.

/// How a delivery was settled, read from the body the consumer sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AckKind {
    Ack,
    Nak,
    Term,
    Progress,
    Other,
}

/// One message sent to a delivery's reply subject (`$JS.ACK...`).
#[derive(Debug, Clone)]
struct AckEvent {
    stream_sequence: u64,
    /// The delivery count of the delivery it settles.
    delivered: u64,
    kind: AckKind,
    /// What the test's probe said when it arrived.
    probe: bool,
}

/// Records the acks of one stream's consumers, from a connection of its own,
/// as the server receives them.
struct AckLog {
    events: Arc<Mutex<Vec<AckEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AckLog {
    /// Subscribes before returning, so no ack sent afterwards is missed.
    /// `probe` is evaluated as each event arrives.
    async fn start(
        client: async_nats::Client,
        stream: &str,
        probe: impl Fn() -> bool + Send + 'static,
    ) -> AckLog {
        let mut acks = client
            .subscribe("$JS.ACK.>")
            .await
            .expect("subscribe to acks");
        client.flush().await.expect("the subscription is live");
        let events = Arc::new(Mutex::new(Vec::new()));
        let log = events.clone();
        let stream = stream.to_owned();
        let task = tokio::spawn(async move {
            let _client = client;
            while let Some(message) = acks.next().await {
                let Some((name, delivered, stream_sequence)) =
                    parse_ack_subject(message.subject.as_str())
                else {
                    continue;
                };
                if name != stream {
                    continue;
                }
                let body = &message.payload[..];
                let kind = if body.is_empty() || body.starts_with(b"+ACK") {
                    AckKind::Ack
                } else if body.starts_with(b"-NAK") {
                    AckKind::Nak
                } else if body.starts_with(b"+TERM") {
                    AckKind::Term
                } else if body.starts_with(b"+WPI") {
                    AckKind::Progress
                } else {
                    AckKind::Other
                };
                log.lock().unwrap().push(AckEvent {
                    stream_sequence,
                    delivered,
                    kind,
                    probe: probe(),
                });
            }
        });
        AckLog { events, task }
    }

    fn events(&self) -> Vec<AckEvent> {
        self.events.lock().unwrap().clone()
    }

    /// The events of `kind` for stream sequence `sequence`.
    fn of(&self, sequence: u64, kind: AckKind) -> Vec<AckEvent> {
        self.events()
            .into_iter()
            .filter(|e| e.stream_sequence == sequence && e.kind == kind)
            .collect()
    }
}

impl Drop for AckLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `(stream, delivered, stream sequence)` of an ack subject, in either
/// format of ADR-15: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...` (7
/// tokens after the prefix) or with `<domain>.<account hash>.` in front (9
/// or more).
fn parse_ack_subject(subject: &str) -> Option<(String, u64, u64)> {
    let tokens: Vec<&str> = subject.strip_prefix("$JS.ACK.")?.split('.').collect();
    let first = match tokens.len() {
        7 => 0,
        n if n >= 9 => 2,
        _ => return None,
    };
    Some((
        tokens[first].to_owned(),
        tokens[first + 2].parse().ok()?,
        tokens[first + 3].parse().ok()?,
    ))
}

#[test]
fn ack_subjects_of_both_formats_parse() {
    assert_eq!(
        parse_ack_subject("$JS.ACK.ORDERS.c.4.17.9.1700000000000000000.0"),
        Some(("ORDERS".into(), 4, 17))
    );
    assert_eq!(
        parse_ack_subject("$JS.ACK.hub.ACC.ORDERS.c.2.5.3.1700000000000000000.0.tok"),
        Some(("ORDERS".into(), 2, 5))
    );
    assert_eq!(parse_ack_subject("$JS.ACK.ORDERS.c"), None);
}

// ---------------------------------------------------------------------------
// Past max_deliver.

/// Every run of the `past-limit` body: (message id, delivery count).
#[derive(Clone, Default)]
struct PastLimitRuns(Arc<Mutex<Vec<(String, u64)>>>);

#[idempotent(name = "past-limit")]
async fn past_limit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(runs): State<PastLimitRuns>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    runs.0.lock().unwrap().push((
        delivery.message_id().as_str().to_owned(),
        delivery.delivered(),
    ));
    record_effect(tx, "past-limit", &d, delivery).await
}

/// A message that arrives past `max_deliver`, its earlier deliveries never
/// finished, is decided without running the handler: acked if its dedup row
/// exists (an earlier attempt committed, then died before its ack), else
/// dead-lettered as `exhausted` and TERMed. The test takes the earlier
/// deliveries itself, with a raw fetch on the same durable that never acks,
/// and checks the delivery counts JetStream reported.
#[tokio::test]
async fn a_message_past_max_deliver_is_acked_if_processed_else_dead_lettered_unrun() {
    const MAX_DELIVER: u64 = 3;
    // Long enough that the first router is stopped before its dropped
    // message comes back to it; short enough for three redeliveries.
    const ACK_WAIT: Duration = Duration::from_secs(2);
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PASTLIMIT", Duration::from_secs(120)).await;
    let route = || {
        Route::new(&stream, "c")
            .ack_wait(ACK_WAIT)
            .max_deliver(MAX_DELIVER)
    };
    // Both routers record into the same log.
    let runs = PastLimitRuns::default();

    // 1. An attempt commits, then "dies" before its ack (the fault hook
    //    drops the message after COMMIT): the dedup row exists.
    let done = publish(&js, &subject, &deposit("a", 1), Some("committed-then-died")).await;
    let first = Router::with_state(runs.clone())
        .route(route(), past_limit)
        .fault_hooks(FaultHooks::default().after_commit(|_| AfterCommit::DropWithoutAck));
    let (handle, task) = spawn(first, nats.clone(), pool.clone());
    let first_stats = handle.stats("c").unwrap();
    eventually(
        "the first attempt commits and drops its message",
        Duration::from_secs(30),
        || async { first_stats.dropped_by_fault() == 1 },
    )
    .await;
    stop(handle, task).await;
    assert_eq!(
        (first_stats.received(), first_stats.processed()),
        (1, 1),
        "committed once, and not redelivered to the first router"
    );

    // 2. A message no attempt ever finished.
    let never = publish(&js, &subject, &deposit("b", 2), Some("never-finished")).await;

    // 3. Earlier attempts that never finish: fetch on the same durable and
    //    never ack, until each message has been delivered MAX_DELIVER times.
    let consumer = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_consumer::<pull::Config>("c")
        .await
        .expect("the router created the durable");
    let mut seen: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut unacked = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while ![done.sequence, never.sequence]
        .iter()
        .all(|seq| seen.get(seq).and_then(|d| d.last()) == Some(&MAX_DELIVER))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "JetStream did not redeliver as expected within 60 s: {seen:?}"
        );
        // Expires before ack_wait, so that no fetch can see a message
        // redelivered twice.
        // One message per fetch, so that the loop stops at the delivery that
        // completes the set.
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(ACK_WAIT / 2)
            .messages()
            .await
            .expect("fetch");
        while let Some(message) = batch.next().await {
            let message = message.expect("a delivery");
            let info = message.info().expect("JetStream metadata");
            seen.entry(info.stream_sequence)
                .or_default()
                .push(info.delivered as u64);
            unacked.push(message);
        }
    }
    eprintln!("deliveries taken by the raw fetch, by stream sequence: {seen:?}");
    assert_eq!(
        seen.get(&done.sequence),
        Some(&vec![2, 3]),
        "the committed message: delivery 1 went to the first router"
    );
    assert_eq!(
        seen.get(&never.sequence),
        Some(&vec![1, 2, 3]),
        "the other message"
    );
    drop(unacked);

    // 4. The router gets both past the limit.
    let acks = AckLog::start(env.nats().await, &stream, || false).await;
    let (handle, task) = spawn(
        Router::with_state(runs.clone()).route(route(), past_limit),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (
            stats.received(),
            stats.processed(),
            stats.duplicates(),
            stats.dead_lettered(),
            stats.failed()
        ),
        (2, 0, 1, 1, 0)
    );
    let acked = acks.of(done.sequence, AckKind::Ack);
    assert_eq!(acked.len(), 1, "{:?}", acks.events());
    assert_eq!(
        acked[0].delivered,
        MAX_DELIVER + 1,
        "the committed message was acked on its delivery past the limit"
    );
    let termed = acks.of(never.sequence, AckKind::Term);
    assert_eq!(termed.len(), 1, "{:?}", acks.events());
    assert_eq!(termed[0].delivered, MAX_DELIVER + 1);
    assert!(acks.of(never.sequence, AckKind::Ack).is_empty());

    assert_eq!(
        *runs.0.lock().unwrap(),
        vec![("committed-then-died".to_owned(), 1)],
        "the handler ran once, for the first attempt, and never past the limit"
    );
    assert_eq!(
        ledger(&pool, "past-limit").await,
        Ledger::once_each(1),
        "one effect and one claim: the unfinished message was never claimed"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1, "only the unfinished message");
    let letter = &letters[0];
    assert_eq!(header(letter, "Idem-Failure"), "exhausted");
    assert_eq!(header(letter, "Idem-Message-Id"), "never-finished");
    assert_eq!(
        header(letter, "Idem-Delivered"),
        (MAX_DELIVER + 1).to_string()
    );
    assert_eq!(
        header(letter, "Idem-Original-Sequence"),
        never.sequence.to_string()
    );
    assert!(
        header(letter, "Idem-Error").contains("past the limit"),
        "{}",
        header(letter, "Idem-Error")
    );
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_redelivered),
        (0, 0, 0),
        "nothing left to redeliver"
    );
}

// ---------------------------------------------------------------------------
// An ambiguous COMMIT in batch mode.

/// The state of the ambiguous batch test: the cut the handler arms, and
/// what its runs saw.
#[derive(Clone, FromRef)]
struct AmbiguousBatch {
    cut: BatchCut,
    runs: BatchRuns,
}

/// The cut of one batch's COMMIT, which the handler arms.
#[derive(Clone)]
struct BatchCut {
    /// The proxy in front of the database, for the handler to arm.
    proxy: Arc<PgProxy>,
    /// Set once the handler has armed the cut.
    armed: Arc<AtomicBool>,
    /// The transaction (xid) whose COMMIT is cut.
    xid: Arc<Mutex<Option<String>>>,
}

/// Every run of the body: (message id, its transaction's xid).
#[derive(Clone, Default)]
struct BatchRuns(Arc<Mutex<Vec<(String, String)>>>);

#[idempotent(name = "ambiguous-batch")]
async fn ambiguous_batch(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(cut): State<BatchCut>,
    State(runs): State<BatchRuns>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    // The batch's claims are this transaction's own rows.
    let (claims, xid): (i64, String) = sqlx::query_as(
        "SELECT count(*), pg_current_xact_id()::xid::text FROM idem_claims
         WHERE xmin = pg_current_xact_id()::xid",
    )
    .fetch_one(&mut **tx)
    .await?;
    // Cut the COMMIT of the first batch that claimed more than one message:
    // it is this transaction's next COMMIT.
    if claims >= 2 && !cut.armed.swap(true, Ordering::SeqCst) {
        cut.proxy.cut_next_commit();
        *cut.xid.lock().unwrap() = Some(xid.clone());
    }
    runs.0
        .lock()
        .unwrap()
        .push((delivery.message_id().as_str().to_owned(), xid));
    record_effect(tx, "ambiguous-batch", &d, delivery).await
}

/// Batch mode: the connection drops while the batch's COMMIT is in flight,
/// after the server committed it. No message of the batch is acked on the
/// strength of that COMMIT: each is run again in a transaction of its own,
/// whose claim finds the committed row, and only then acked. Every message is
/// applied once, and the pool stays healthy.
#[tokio::test]
async fn batch_ambiguous_commit_is_resolved_per_message_and_applied_once() {
    const MESSAGES: usize = 8;
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("AMBIGBATCH", Duration::from_secs(120)).await;
    let state = AmbiguousBatch {
        cut: BatchCut {
            proxy: Arc::new(PgProxy::start(upstream_of(env.database_url())).await),
            armed: Arc::default(),
            xid: Arc::default(),
        },
        runs: BatchRuns::default(),
    };
    let proxy = state.cut.proxy.clone();
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .expect("pool through the proxy");

    // Published before the router starts, so that batches are full.
    let mut sequence_of = BTreeMap::new();
    for i in 0..MESSAGES {
        let id = format!("amb-{i}");
        let ack = publish(&js, &subject, &deposit("a", i as i64), Some(&id)).await;
        sequence_of.insert(id, ack.sequence);
    }
    let probe = proxy.clone();
    let acks = AckLog::start(env.nats().await, &stream, move || probe.cuts() > 0).await;
    let (handle, task) = spawn(
        Router::with_state(state.clone()).route(
            fast(Route::new(&stream, "c"))
                .batch(MESSAGES)
                .concurrency(1),
            ambiguous_batch,
        ),
        nats,
        proxied.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();

    assert_eq!(
        proxy.cuts(),
        1,
        "the connection was cut after the batch's COMMIT reached the server"
    );
    let cut_tx = state
        .cut
        .xid
        .lock()
        .unwrap()
        .clone()
        .expect("a batch was cut");
    let runs = state.runs.0.lock().unwrap().clone();
    let cut_batch: BTreeSet<String> = runs
        .iter()
        .filter(|(_, xid)| *xid == cut_tx)
        .map(|(id, _)| id.clone())
        .collect();
    eprintln!(
        "cut transaction {cut_tx} held {cut_batch:?}; acks: {:?}",
        acks.events()
    );
    assert!(
        cut_batch.len() >= 2,
        "the cut batch held several messages: {runs:?}"
    );
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE xmin::text = $1")
        .bind(&cut_tx)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        committed as usize,
        cut_batch.len(),
        "the server did commit the cut batch"
    );
    let ids_run: Vec<&String> = runs.iter().map(|(id, _)| id).collect();
    assert_eq!(
        ids_run.len(),
        ids_run.iter().collect::<BTreeSet<_>>().len(),
        "no body ran twice: {runs:?}"
    );
    assert_eq!(ids_run.len(), MESSAGES);
    assert_eq!(
        stats.batch_fallbacks(),
        1,
        "the cut batch fell back to one transaction per message"
    );
    assert_eq!(
        stats.duplicates(),
        cut_batch.len() as u64,
        "each message of the cut batch found its own committed claim"
    );
    assert_eq!(stats.processed(), (MESSAGES - cut_batch.len()) as u64);
    assert_eq!((stats.failed(), stats.dead_lettered()), (0, 0));
    for id in &cut_batch {
        let acked = acks.of(sequence_of[id], AckKind::Ack);
        assert_eq!(acked.len(), 1, "{id} acked once: {:?}", acks.events());
        assert!(
            acked[0].probe,
            "{id} was acked only after the cut, once its own claim had found the row"
        );
    }
    for (id, sequence) in &sequence_of {
        assert_eq!(
            acks.of(*sequence, AckKind::Ack).len(),
            1,
            "{id} acked exactly once"
        );
    }

    // The pool still works, and none of its connections is left in a
    // transaction.
    for i in 0..10 {
        publish(&js, &subject, &deposit("b", i), Some(&format!("after-{i}"))).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    let stuck: i64 = sqlx::query_scalar(
        // A transaction that wrote something (an empty one is how a route
        // keeps a connection for a moment between messages).
        "SELECT count(*) FROM pg_stat_activity
         WHERE state LIKE 'idle in transaction%' AND backend_xid IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stuck, 0, "no connection left inside a transaction");
    stop(handle, task).await;
    assert_eq!(stats.processed() + stats.duplicates(), MESSAGES as u64 + 10);
    assert_eq!(
        ledger(&pool, "ambiguous-batch").await,
        Ledger::once_each(MESSAGES as i64 + 10)
    );
}

// ---------------------------------------------------------------------------
// A replay of a processed message.

/// The state of the replay test: the bug the test fixes, and the runs the
/// test checks.
#[derive(Clone, FromRef)]
struct Replay {
    bug: ReplayBug,
    runs: ReplayRuns,
}

/// Whether the bug that makes `replayed` refuse every message is in.
#[derive(Clone)]
struct ReplayBug(Arc<AtomicBool>);

/// The stream sequences whose body ran.
#[derive(Clone, Default)]
struct ReplayRuns(Arc<Mutex<Vec<u64>>>);

#[idempotent(name = "replayed")]
async fn replayed(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<ReplayBug>,
    State(runs): State<ReplayRuns>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    runs.0.lock().unwrap().push(delivery.stream_sequence());
    if bug.0.load(Ordering::SeqCst) {
        return Err(idem_runtime::Permanent::new("refused by a bug").into());
    }
    record_effect(tx, "replayed", &d, delivery).await?;
    Ok(())
}

/// Publishes `deposit` with `id` until JetStream stores it (a publisher
/// retrying after the stream's duplicate window), and returns its sequence.
async fn publish_until_stored(
    js: &async_nats::jetstream::Context,
    subject: &str,
    d: &Deposit,
    id: &str,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ack = publish(js, subject, d, Some(id)).await;
        if !ack.duplicate {
            return ack.sequence;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "JetStream kept dropping {id} as a duplicate"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A message is dead-lettered by a bug, then processed when its publisher
/// retries after the fix. Replaying the dead letter afterwards, and
/// re-publishing the same id once more (both outside JetStream's duplicate
/// window, so both are stored), is acked as a duplicate each time: the body
/// does not run and the effect stays single.
#[tokio::test]
async fn a_replay_of_a_processed_message_is_acked_as_a_duplicate() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("REPLAYDONE", Duration::from_millis(300)).await;
    let order = deposit("a", 42);
    let first = publish(&js, &subject, &order, Some("order-1")).await;
    let state = Replay {
        bug: ReplayBug(Arc::new(AtomicBool::new(true))),
        runs: ReplayRuns::default(),
    };
    let (handle, task) = spawn(
        Router::with_state(state.clone()).route(fast(Route::new(&stream, "c")), replayed),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    wait_all_acked(&js, &stream, "c").await;
    assert_eq!(stats.dead_lettered(), 1, "the bug dead-lettered it");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "order-1");

    // The fix; then the publisher retries, after the window: processed.
    state.bug.0.store(false, Ordering::SeqCst);
    let retried = publish_until_stored(&js, &subject, &order, "order-1").await;
    wait_all_acked(&js, &stream, "c").await;
    assert_eq!(stats.processed(), 1);

    // The operator replays the dead letter, unaware it was processed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let replay = loop {
        match dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence).await {
            Ok(replay) => break replay,
            Err(dead_letter::ReplayError::InsideDuplicateWindow) => {
                assert!(tokio::time::Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("replay failed: {error}"),
        }
    };
    assert_eq!(replay.stream, stream);
    wait_all_acked(&js, &stream, "c").await;
    // And the publisher sends it once more, after the window again.
    let again = publish_until_stored(&js, &subject, &order, "order-1").await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    assert_eq!(
        (first.sequence, retried, replay.sequence, again),
        (1, 2, 3, 4),
        "JetStream stored every copy of order-1"
    );
    assert_eq!(
        (
            stats.received(),
            stats.dead_lettered(),
            stats.processed(),
            stats.duplicates()
        ),
        (4, 1, 1, 2),
        "the replay and the last copy were acked as duplicates"
    );
    assert_eq!(
        *state.runs.0.lock().unwrap(),
        vec![1, 2],
        "the body ran for the first copy (which failed) and the retry, never after"
    );
    assert_eq!(ledger(&pool, "replayed").await, Ledger::once_each(1));
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
}

// ---------------------------------------------------------------------------
// The first attempt rolls back while its redelivery waits.

/// What the attempts of `rolls-back-first` saw.
#[derive(Debug, Default)]
struct RaceLog {
    /// Claims of the message the first attempt saw in its own transaction.
    first_saw_claims: Option<i64>,
    /// The backend that waited on the first attempt's claim.
    waiter: Option<i32>,
    /// (backend, delivery count) of each later attempt whose body ran.
    applied: Vec<(i32, u64)>,
}

/// The [`RaceLog`] both workers of the test write to.
#[derive(Clone, Default)]
struct Race(Arc<Mutex<RaceLog>>);

#[idempotent(name = "rolls-back-first")]
async fn rolls_back_first(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(race): State<Race>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if delivery.delivered() == 1 {
        let claims: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_processed
             WHERE handler = 'rolls-back-first' AND key = idem_key('rolls-back-first', $1)",
        )
        .bind(delivery.message_id().as_str())
        .fetch_one(&mut **tx)
        .await?;
        race.0.lock().unwrap().first_saw_claims = Some(claims);
        // A write that must not survive.
        record_effect(tx, "rolls-back-first", &d, delivery).await?;
        // Stay inside the transaction until another backend waits on its
        // claim: the redelivery that ack_wait triggers.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let waiter: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity
                 WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid)) LIMIT 1",
            )
            .fetch_optional(&mut **tx)
            .await?;
            if let Some(pid) = waiter {
                race.0.lock().unwrap().waiter = Some(pid);
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err("no redelivery blocked on the claim within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        return Err(Transient::new("the first attempt fails after its redelivery blocked").into());
    }
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await?;
    race.0
        .lock()
        .unwrap()
        .applied
        .push((backend, delivery.delivered()));
    record_effect(tx, "rolls-back-first", &d, delivery).await?;
    Ok(())
}

/// The first attempt claims the message, then fails while a redelivery
/// (ack_wait expired, heartbeats off) waits on its claim, as
/// `pg_blocking_pids` shows. The first attempt rolls back, so the waiting
/// attempt's claim goes through and it applies the message, once.
#[tokio::test]
async fn when_the_first_attempt_rolls_back_the_waiting_redelivery_proceeds() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ROLLBACKRACE", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 7), Some("race-1")).await;
    let route = || {
        fast(Route::new(&stream, "c"))
            .ack_wait(Duration::from_secs(1))
            .without_heartbeat()
            .allow_redelivery_while_running()
            .concurrency(1)
    };
    let race = Race::default();
    let (first, first_task) = spawn(
        Router::with_state(race.clone()).route(route(), rolls_back_first),
        nats.clone(),
        pool.clone(),
    );
    let (second, second_task) = spawn(
        Router::with_state(race.clone()).route(route(), rolls_back_first),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(first.clone(), first_task).await;
    stop(second.clone(), second_task).await;

    let race = std::mem::take(&mut *race.0.lock().unwrap());
    eprintln!("{race:?}");
    assert_eq!(
        race.first_saw_claims,
        Some(1),
        "the first attempt held the claim"
    );
    let waiter = race
        .waiter
        .expect("a redelivery blocked on the first attempt's claim");
    assert_eq!(
        race.applied.len(),
        1,
        "one later attempt ran the body: {race:?}"
    );
    let (applier, delivered) = race.applied[0];
    assert_eq!(
        applier, waiter,
        "the attempt that waited on the claim is the one that applied it"
    );
    assert!(delivered >= 2, "applied by a redelivery: {race:?}");
    let (a, b) = (first.stats("c").unwrap(), second.stats("c").unwrap());
    assert_eq!(a.failed() + b.failed(), 1, "the first attempt failed once");
    assert_eq!(a.processed() + b.processed(), 1);
    assert_eq!(a.dead_lettered() + b.dead_lettered(), 0);
    assert_eq!(
        ledger(&pool, "rolls-back-first").await,
        Ledger::once_each(1)
    );
    let kept: i64 = sqlx::query_scalar("SELECT delivered FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        kept as u64, delivered,
        "the first attempt's write was rolled back"
    );
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
