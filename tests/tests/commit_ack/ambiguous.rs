//! A COMMIT whose outcome the worker cannot know: the connection drops while
//! it is in flight (per message and in batches), its backend is left orphaned
//! holding the claim, or its answer never comes. No message is acked on the
//! strength of it; the redelivery finds the claim and is skipped, or applies
//! the message once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::{Delivery, FromRef, Route, Router, State, idempotent};
use idem_tests::ack_events;
use idem_tests::pg_proxy::{PgProxy, upstream_of};
use idem_tests::scenario::*;

#[idempotent(name = "orphaned")]
async fn orphaned(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "orphaned", &d, delivery).await
}

/// The connection is lost just as COMMIT is sent, and the COMMIT never
/// reaches the server: its backend stays in the transaction, holding the
/// claim, as behind a network partition. The redelivery's claim must not
/// wait on it until TCP keepalive gives up: the server ends the orphan, and
/// the message is applied once.
#[tokio::test]
async fn an_orphaned_backend_does_not_block_the_redelivery() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ORPHAN", Duration::from_secs(120)).await;
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = pool_through(&proxy, env.database_url()).await;
    proxy.orphan_next_commit();
    publish(&js, &subject, &deposit("a", 1), Some("orphan-1")).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).handler_timeout(Duration::from_secs(1)),
            orphaned,
        ),
        nats,
        proxied,
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(proxy.orphans(), 1, "a backend was orphaned mid-transaction");
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.commit_failed(), 1);
    assert_eq!(stats.processed(), 1);
    assert_eq!(ledger(&pool, "orphaned").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// A COMMIT that never gets an answer (network partition): the message is
// heartbeated forever, and the route's slot with it.
// ---------------------------------------------------------------------------

/// A pool of 4 connections (one for the router's metrics poll, three for
/// messages) through `proxy`.
async fn pool_through(proxy: &PgProxy, database_url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(database_url))
        .await
        .expect("pool through the proxy")
}

/// The route of the partition tests: one message at a time, a 1 s
/// handler timeout (the watchdog: 8 s), redelivery after 2 s.
fn partition_route(stream: &str) -> Route {
    fast(Route::new(stream, "c"))
        .handler_timeout(Duration::from_secs(1))
        .ack_wait(Duration::from_secs(2))
        .concurrency(1)
}

#[idempotent(name = "partitioned")]
async fn partitioned(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "partitioned", &d, delivery).await
}

/// BEGIN, the claim and COMMIT run with no client-side bound (by design:
/// "no timer or select! is ever held around BEGIN or COMMIT"), and sqlx sets
/// no TCP keepalive. When the answer to a COMMIT never comes (a partition,
/// a frozen host), the message's task waits forever while the route's
/// heartbeats keep its lease: JetStream never redelivers it, the
/// server-side `idle_in_transaction_session_timeout` rolls its claim back,
/// and nobody ever processes it. With `concurrency(1)` the whole route
/// stops: the next message is never taken either.
#[tokio::test]
async fn a_commit_that_is_never_answered_leaves_the_message_leased_forever() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PARTITION", Duration::from_secs(120)).await;
    // The proxy swallows the COMMIT and from then on forwards nothing on
    // that connection, keeping both sockets open (`PgProxy`'s blackhole).
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = pool_through(&proxy, env.database_url()).await;
    proxy.blackhole_next_commit();
    let acks = AckLog::start(&nats, &stream).await;
    let (handle, task) = spawn(
        Router::new().route(partition_route(&stream), partitioned),
        nats,
        proxied,
    );
    publish(&js, &subject, &deposit("a", 1), Some("cut-1")).await;
    publish(&js, &subject, &deposit("b", 1), Some("cut-2")).await;
    eventually(
        "the first COMMIT went into the partition",
        Duration::from_secs(30),
        || async { proxy.swallowed() == 1 },
    )
    .await;

    // Ten times ack_wait, and the server ended the orphaned backend (after
    // the handler timeout plus 1 s) long ago.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = consumer_info(&js, &stream, "c").await;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        if Instant::now() >= deadline {
            let stats = handle.stats("c").unwrap();
            let claims: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_processed WHERE handler = 'partitioned'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            task.abort();
            panic!(
                "stuck: 20 s after the partition neither message is settled: pending {}, ack \
                 pending {}, redelivered {}; processed {}, failed {}; claims committed {claims}; \
                 effects {:?}; on the wire: {} +WPI, {} +ACK, {} -NAK",
                info.num_pending,
                info.num_ack_pending,
                info.num_redelivered,
                stats.processed(),
                stats.failed(),
                ledger(&pool, "partitioned").await,
                acks.count("+WPI"),
                acks.count("") + acks.count("+ACK"),
                acks.count("-NAK"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "partitioned").await, Ledger::once_each(2));
}

/// Three silent partitions in a row, each on its own connection (the
/// proxy swallows a COMMIT and keeps the connection open and mute), on a
/// pool that leaves the route's messages three connections. Each message
/// is settled once the watchdog gives up on its transaction, but if its
/// connection stayed with the task that still waits for an answer, three
/// such would hold every connection the messages may use, and the route
/// would stop for good. Each is closed once it has had as long again, so
/// the route goes on: every message, the three that met a partition and
/// two after them, is applied once.
#[tokio::test]
async fn silent_partitions_do_not_use_up_the_routes_connections() {
    const PARTITIONED: usize = 3;
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SILENT", Duration::from_secs(300)).await;
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    // One connection for the metrics poll, three for messages.
    let proxied = pool_through(&proxy, env.database_url()).await;
    let (handle, task) = spawn(
        Router::new().route(partition_route(&stream), partitioned),
        nats,
        proxied,
    );
    for i in 0..PARTITIONED {
        proxy.blackhole_next_commit();
        publish(
            &js,
            &subject,
            &deposit("a", 1),
            Some(&format!("silent-{i}")),
        )
        .await;
        eventually(
            "the COMMIT went into the partition",
            Duration::from_secs(60),
            || async { proxy.swallowed() == i + 1 },
        )
        .await;
    }
    for i in PARTITIONED..PARTITIONED + 2 {
        publish(
            &js,
            &subject,
            &deposit("a", 1),
            Some(&format!("silent-{i}")),
        )
        .await;
    }
    eventually(
        "every message is applied, the route going on after the partitions",
        Duration::from_secs(120),
        || async { ledger(&pool, "partitioned").await.effects == (PARTITIONED + 2) as i64 },
    )
    .await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(proxy.swallowed(), PARTITIONED, "each partition happened");
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.abandoned_transactions() >= PARTITIONED as u64,
        "the watchdog gave up on each partitioned transaction: {stats:?}"
    );
    assert_eq!(
        ledger(&pool, "partitioned").await,
        Ledger::once_each((PARTITIONED + 2) as i64)
    );
}

/// The connection drops while COMMIT is in flight: the server committed, the
/// worker cannot know. It must not ack; the redelivery finds the dedup row
/// and is skipped, and the pool stays healthy.
#[tokio::test]
async fn ambiguous_commit_is_not_acked_and_the_redelivery_is_skipped() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("AMBIGUOUS", Duration::from_secs(120)).await;
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = pool_through(&proxy, env.database_url()).await;

    proxy.cut_next_commit();
    publish(&js, &subject, &deposit("a", 1), Some("ambiguous-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), plain),
        nats,
        proxied.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        proxy.cuts(),
        1,
        "the connection was cut after COMMIT reached the server"
    );
    assert_eq!(stats.commit_failed(), 1, "the worker saw the COMMIT fail");
    assert_eq!(
        stats.duplicates(),
        1,
        "the redelivery found the committed claim"
    );
    assert_eq!(stats.processed(), 0);

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
    assert_eq!(stuck, 0);
    stop(handle, task).await;
    assert_eq!(stats.processed(), 10);
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(11));
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
    let proxied = pool_through(&proxy, env.database_url()).await;

    // Published before the router starts, so that batches are full.
    let mut sequence_of = BTreeMap::new();
    for i in 0..MESSAGES {
        let id = format!("amb-{i}");
        let ack = publish(&js, &subject, &deposit("a", i as i64), Some(&id)).await;
        sequence_of.insert(id, ack.sequence);
    }
    let probe = proxy.clone();
    let acks = ack_events::AckLog::start(env.nats().await, &stream, move || probe.cuts() > 0).await;
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
        let acked = acks.of(sequence_of[id], ack_events::AckKind::Ack);
        assert_eq!(acked.len(), 1, "{id} acked once: {:?}", acks.events());
        assert!(
            acked[0].probe,
            "{id} was acked only after the cut, once its own claim had found the row"
        );
    }
    for (id, sequence) in &sequence_of {
        assert_eq!(
            acks.of(*sequence, ack_events::AckKind::Ack).len(),
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
