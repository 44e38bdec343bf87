//! Hardening: paths that once broke the promise "nothing lost, nothing
//! applied twice" without any test noticing. Each test here was written
//! first, failed against the runtime of the time, and passes since its fix.
//! The README's "Failure handling" table points at them.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::pg_proxy::{PgProxy, upstream_of};
use common::*;
use futures_util::StreamExt;
use idem_runtime::{Delivery, Permanent, Route, Router, State, Transient, dead_letter, idempotent};
use sqlx::Connection as _;

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

// --- 1. A handler that swallows a failed statement -------------------------

#[idempotent(name = "swallows")]
async fn swallows(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "swallows", &d, delivery).await?;
    // The classic mistake: "insert, and ignore it if it fails". PostgreSQL
    // has now aborted the whole transaction, effect and claim included.
    let _ = sqlx::query("INSERT INTO effects (handler) VALUES (NULL)")
        .execute(&mut **tx)
        .await;
    Ok(())
}

/// A handler that ignores a failed statement and returns `Ok` has lost its
/// transaction: PostgreSQL turns the COMMIT into a rollback and reports
/// success. No such message may be acked as processed: each one is
/// dead-lettered with an error that says what happened, and nothing (no
/// effect, no claim) is half-applied.
async fn a_swallowed_sql_error_is_never_acked_as_processed(batch: usize) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SWALLOW", Duration::from_secs(120)).await;
    const MESSAGES: usize = 10;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("sw-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).batch(batch), swallows),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), 0, "nothing was acked as processed");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), MESSAGES, "every message is dead-lettered");
    for letter in &letters {
        assert_eq!(header(letter, "Idem-Failure"), "permanent");
        assert!(
            header(letter, "Idem-Error").contains("aborted"),
            "the error says what happened: {}",
            header(letter, "Idem-Error")
        );
        assert_eq!(header(letter, "Idem-Delivered"), "1");
    }
    assert_eq!(ledger(&pool, "swallows").await, Ledger::once_each(0));
}

/// The message ids a handler has run for: it misbehaves on the first run
/// of each.
#[derive(Clone, Default)]
struct FirstRuns(Arc<Mutex<HashSet<String>>>);

impl FirstRuns {
    /// Records a run of `delivery`'s message: whether it is the first.
    fn first(&self, delivery: &Delivery) -> bool {
        self.0
            .lock()
            .unwrap()
            .insert(delivery.message_id().to_string())
    }
}

#[idempotent(name = "swallows-once")]
async fn swallows_once(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(swallowed_once): State<FirstRuns>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "swallows-once", &d, delivery).await?;
    let first = swallowed_once.first(delivery);
    if first {
        let _ = sqlx::query("INSERT INTO effects (handler) VALUES (NULL)")
            .execute(&mut **tx)
            .await;
    }
    Ok(())
}

/// A swallowed error that does not come back on a retry (a lost race, say)
/// costs a retry, not the message: each message is applied once.
async fn a_swallowed_error_that_clears_is_retried_and_applied_once(batch: usize) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SWALLOW1", Duration::from_secs(120)).await;
    const MESSAGES: usize = 10;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("s1-{i}"))).await;
    }
    let swallowed_once = FirstRuns::default();
    let (handle, task) = spawn(
        Router::with_state(swallowed_once.clone())
            .route(fast(Route::new(&stream, "c")).batch(batch), swallows_once),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let seen = swallowed_once.0.lock().unwrap().clone();
    assert_eq!(seen.len(), MESSAGES, "each message swallowed an error once");
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "swallows-once").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

// --- 2. A stream deleted and recreated --------------------------------------

#[idempotent(name = "no-ids")]
async fn no_ids(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "no-ids", &d, delivery).await
}

/// Messages without `Nats-Msg-Id` fall back to an id built from their stream
/// sequence. Sequences restart at 1 when a stream is deleted and recreated:
/// the new messages must not be mistaken for the old ones.
#[tokio::test]
async fn a_recreated_stream_does_not_skip_new_messages_without_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RECREATE", Duration::from_secs(120)).await;
    for i in 0..5 {
        publish(&js, &subject, &deposit("before", i), None).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    js.delete_stream(&stream).await.unwrap();
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    for i in 0..5 {
        let ack = publish(&js, &subject, &deposit("after", i), None).await;
        assert_eq!(ack.sequence, i as u64 + 1, "the sequences start over");
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (5, 0));
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(10));
}

#[idempotent(name = "always-refuses")]
async fn always_refuses(
    _tx: &mut sqlx::PgTransaction<'_>,
    _d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    Err(Permanent::new("this handler refuses everything").into())
}

/// The same holds for dead letters, which JetStream deduplicates by an id
/// built from the original's position: a message of the recreated stream
/// must get a dead letter of its own, not be taken for the old one's.
#[tokio::test]
async fn a_recreated_stream_does_not_swallow_new_dead_letters() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RECREATEDL", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("before", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), always_refuses),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    js.delete_stream(&stream).await.unwrap();
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("after", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), always_refuses),
        nats,
        pool,
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(handle.stats("c").unwrap().dead_lettered(), 1);
    let letters = dead_letters(&js, &stream).await;
    let accounts: Vec<String> = letters
        .iter()
        .map(|letter| {
            serde_json::from_slice::<Deposit>(&letter.payload)
                .unwrap()
                .account
        })
        .collect();
    assert_eq!(
        accounts,
        ["before", "after"],
        "both dead letters are stored"
    );
}

// --- 3. The dead-letter stream is unavailable -------------------------------

/// The dead-letter stream is gone for longer than any number of redeliveries
/// would cover. The message is held (its heartbeats keep it leased) and the
/// publish retried until the stream is back: it is dead-lettered on its
/// first delivery and never parked.
#[tokio::test]
async fn a_dead_letter_stream_outage_loses_nothing() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DLOUTAGE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(2),
            always_refuses,
        ),
        nats,
        pool.clone(),
    );
    let dead_letter_config = eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    js.delete_stream(dead_letter::DEFAULT_STREAM).await.unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("outage-1")).await;

    let stats = handle.stats("c").unwrap();
    // More failed publishes than the route's deliveries and JetStream's
    // backstop together would ever allow: the outage outlasted them.
    eventually(
        "the dead-letter publish failed 10 times",
        Duration::from_secs(30),
        || async { stats.dead_letter_failed() >= 10 },
    )
    .await;
    js.create_stream(dead_letter_config).await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(stats.dead_lettered(), 1);
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "outage-1");
    assert_eq!(
        header(&letters[0], "Idem-Delivered"),
        "1",
        "held, never redelivered"
    );
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_redelivered),
        (0, 0, 0)
    );
}

/// The config of `name`, once the router has created it.
async fn eventually_get_stream(js: &jetstream::Context, name: &str) -> jetstream::stream::Config {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut stream) = js.get_stream(name).await {
            return stream.info().await.unwrap().config.clone();
        }
        assert!(Instant::now() < deadline, "stream {name} never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The route for the tests where JetStream gives up: one delivery allowed,
/// so JetStream's own limit (the route's plus a margin of 3) is 4.
fn given_up_route(stream: &str) -> Route {
    fast(Route::new(stream, "c"))
        .max_deliver(1)
        .ack_wait(Duration::from_millis(500))
        .heartbeat_every(Duration::from_millis(150))
}

/// JetStream stops redelivering a message (the workers that took it kept
/// dying) while no router runs. Its advisory is stored, so a router started
/// later still dead-letters the message: it is never silently parked.
#[tokio::test]
async fn a_message_jetstream_gave_up_on_while_no_router_ran_is_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("GIVENUP", Duration::from_secs(120)).await;
    // A first start creates the consumer (and whatever else idem needs).
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats.clone(),
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    stop(handle, task).await;

    publish(&js, &subject, &deposit("a", 1), Some("parked-1")).await;
    assert_eq!(exhaust_deliveries(&nats, &stream, "c").await, 4);

    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats,
        pool.clone(),
    );
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    stop(handle, task).await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "undeliverable");
    assert_eq!(header(&letters[0], "Idem-Original-Sequence"), "1");
    assert_eq!(ledger(&pool, "no-ids").await.effects, 0);
}

// --- 4. Replaying what JetStream gave up on keeps the message id ------------

/// A message is committed but its ack is lost, and JetStream then gives up
/// on it. Its dead letter must carry the id it was deduplicated by, so that
/// replaying it is a duplicate, not a second effect.
#[tokio::test]
async fn replaying_a_given_up_message_that_was_committed_applies_it_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ACKLOST", Duration::from_millis(500)).await;
    publish(&js, &subject, &deposit("a", 5), Some("acklost-1")).await;
    // The first worker commits, then "dies" before its ack.
    let committed = std::sync::Arc::new(AtomicU64::new(0));
    let hook_committed = committed.clone();
    let router = Router::new()
        .route(given_up_route(&stream), no_ids)
        .fault_hooks(
            idem_runtime::fault::FaultHooks::default().after_commit(move |_| {
                hook_committed.fetch_add(1, Ordering::SeqCst);
                idem_runtime::fault::AfterCommit::DropWithoutAck
            }),
        );
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    eventually("the message committed", Duration::from_secs(30), || async {
        committed.load(Ordering::SeqCst) == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(1));

    // Later workers keep dying on it until JetStream gives up.
    exhaust_deliveries(&nats, &stream, "c").await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats,
        pool.clone(),
    );
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "acklost-1");

    // The stream's duplicate window (500 ms) is long past: JetStream stores
    // the replay, and only the claim can tell it was processed.
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is stored");
    let stats = handle.stats("c").unwrap();
    eventually("the replay is skipped", Duration::from_secs(30), || async {
        stats.duplicates() == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(1));
}

// --- 5. Undecodable messages keep their Nats-Msg-Id -------------------------

#[idempotent(name = "shape")]
async fn strict_shape(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "shape", &d, delivery).await
}

/// The same handler (same name, so same dedup rows) after a fix that
/// accepts the old shape too.
#[idempotent(name = "shape")]
async fn lenient_shape(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    v: serde_json::Value,
) -> Result<(), sqlx::Error> {
    let d = deposit(v["acct"].as_str().unwrap_or("?"), 1);
    record_effect(tx, "shape", &d, delivery).await
}

/// A payload the handler cannot decode is dead-lettered with its
/// `Nats-Msg-Id`. Two stored copies of it (a publisher retry after
/// JetStream's window) are both dead-lettered; replayed after the handler is
/// fixed, they are one message and apply once.
#[tokio::test]
async fn two_copies_of_an_undecodable_message_apply_once_when_replayed() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("UNDECODABLE", Duration::from_millis(500)).await;
    let publish_copy = || async {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, "old-shape-1");
        js.publish_with_headers(subject.clone(), headers, r#"{"acct":"x"}"#.into())
            .await
            .unwrap()
            .await
            .unwrap()
    };
    let first = publish_copy().await;
    // Past the stream's duplicate window, the publisher's retry is stored
    // again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = publish_copy().await;
    assert_eq!((first.sequence, second.sequence), (1, 2));
    assert!(!second.duplicate);

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), strict_shape),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert_eq!(header(letter, "Idem-Failure"), "undecodable");
        assert_eq!(header(letter, "Idem-Message-Id"), "old-shape-1");
    }

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), lenient_shape),
        nats,
        pool.clone(),
    );
    for letter in &letters {
        // Apart by more than the stream's window, so that JetStream stores
        // both replays and the claim has to tell them apart.
        tokio::time::sleep(Duration::from_millis(700)).await;
        dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence)
            .await
            .expect("the replay is stored");
    }
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
    assert_eq!(ledger(&pool, "shape").await, Ledger::once_each(1));
}

// --- 6. A statement stuck in the database -----------------------------------

#[idempotent(name = "locker")]
async fn locker(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if d.account == "locked" {
        sqlx::query("SELECT id FROM hot_rows WHERE id = 1 FOR UPDATE")
            .execute(&mut **tx)
            .await?;
    }
    record_effect(tx, "locker", &d, delivery).await
}

/// Backends of this database waiting on a lock, other than the caller's.
async fn backends_waiting_on_a_lock(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A handler blocked on a row lock past `handler_timeout` is stopped in the
/// database too: its statement does not go on waiting, holding the route's
/// only slot and a connection, and the next message runs while the lock is
/// still held. Once it is released the blocked message is applied once.
#[tokio::test]
async fn a_statement_stuck_on_a_lock_is_stopped_at_the_handler_timeout() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("STUCK", Duration::from_secs(120)).await;
    sqlx::raw_sql("CREATE TABLE hot_rows (id int PRIMARY KEY); INSERT INTO hot_rows VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM hot_rows WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .handler_timeout(Duration::from_secs(1))
                .concurrency(1),
            locker,
        ),
        nats,
        pool.clone(),
    );
    publish(&js, &subject, &deposit("locked", 1), Some("locked-1")).await;
    eventually(
        "the handler waits on the lock",
        Duration::from_secs(30),
        || async { backends_waiting_on_a_lock(&pool).await == 1 },
    )
    .await;
    let (stuck, stuck_since): (i32, f64) = sqlx::query_as(
        "SELECT pid, extract(epoch FROM query_start)::float8 FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND pid <> pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    publish(&js, &subject, &deposit("free", 1), Some("free-1")).await;
    let stats = handle.stats("c").unwrap();
    eventually(
        "the next message runs while the lock is held",
        Duration::from_secs(20),
        || async { ledger(&pool, "locker").await.effects == 1 },
    )
    .await;
    assert!(stats.failed() >= 1, "the locked message timed out");
    // The statement that waited is gone, while the lock is still held: the
    // server cancelled it (statement_timeout), or the watchdog ended its
    // backend (its client closed the connection). Its backend may be back
    // in the pool, and its retries may wait on the lock again, but each
    // in a statement of its own.
    eventually(
        "the stuck statement is gone",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE pid = $1 AND extract(epoch FROM query_start)::float8 = $2",
            )
            .bind(stuck)
            .bind(stuck_since)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;

    holder.rollback().await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "locker").await, Ledger::once_each(2));
}

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
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .unwrap();
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

// --- 7. Shutdown ----------------------------------------------------------

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
    let stuck: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'
           AND backend_xid IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stuck, 0, "the cancelled transaction is not left open");
}

// --- 8. Heartbeats in a batch fallback ---------------------------------------

/// What the `fallback` handler saw, shared by its runs and the test.
#[derive(Clone, Default)]
struct FallbackFlags {
    /// Whether the "fails" message's second delivery has started.
    redelivery_started: Arc<AtomicBool>,
    /// Whether the slow neighbour ran in a transaction of its own (the
    /// batch's fallback) and saw the redelivery start before it finished.
    slow_in_fallback: Arc<AtomicBool>,
    slow_saw_redelivery: Arc<AtomicBool>,
}

#[idempotent(name = "fallback")]
async fn fallback(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(flags): State<FallbackFlags>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    match d.account.as_str() {
        "fails" if delivery.delivered() == 1 => {
            return Err(Transient::new("fails on its first delivery").into());
        }
        "fails" => flags.redelivery_started.store(true, Ordering::SeqCst),
        "slow" => {
            // The claims this transaction made: one in the fallback, where
            // each message runs on its own.
            let claims: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_claims
                 WHERE xmin = pg_current_xact_id()::xid",
            )
            .fetch_one(&mut **tx)
            .await?;
            flags.slow_in_fallback.store(claims == 1, Ordering::SeqCst);
            // "fails" was NAKed with a 1 s backoff just before: it comes
            // back long before ack_wait (20 s), while this still runs and
            // heartbeats go out every 100 ms.
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if flags.redelivery_started.load(Ordering::SeqCst) {
                    flags.slow_saw_redelivery.store(true, Ordering::SeqCst);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        _ => {}
    }
    record_effect(tx, "fallback", &d, delivery).await?;
    Ok(())
}

/// In a batch's fallback, a message NAKed with a backoff is no longer
/// heartbeaten (a `+WPI` after the NAK would push its redelivery out to
/// ack_wait): it is redelivered after its backoff while its neighbours
/// still run. Checked on the wire: no delivery gets a heartbeat after it
/// was settled.
#[tokio::test]
async fn a_message_nacked_in_a_batch_fallback_is_redelivered_after_its_backoff() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FALLBACKHB", Duration::from_secs(120)).await;
    let acks = AckLog::start(&nats, &stream).await;
    for (i, account) in ["ok", "fails", "slow", "ok"].iter().enumerate() {
        publish(&js, &subject, &deposit(account, 1), Some(&format!("f-{i}"))).await;
    }
    let flags = FallbackFlags::default();
    let (handle, task) = spawn(
        Router::with_state(flags.clone()).route(
            Route::new(&stream, "c")
                .backoff(Duration::from_secs(1), Duration::from_secs(1))
                .batch(4)
                .concurrency(2)
                .ack_wait(Duration::from_secs(20))
                .heartbeat_every(Duration::from_millis(100)),
            fallback,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(handle.stats("c").unwrap().batch_fallbacks(), 1);
    assert!(
        flags.slow_in_fallback.load(Ordering::SeqCst),
        "the slow message ran in the fallback of the batch that failed"
    );
    assert!(acks.count("+WPI") > 0, "heartbeats were sent");
    assert!(acks.count("-NAK") > 0, "the failing message was NAKed");
    assert_eq!(
        acks.heartbeats_after_settling(),
        Vec::<(String, Vec<String>)>::new(),
        "no heartbeat after a delivery was settled"
    );
    assert!(
        flags.slow_saw_redelivery.load(Ordering::SeqCst),
        "the NAKed message was redelivered while its neighbour still ran"
    );
    assert_eq!(ledger(&pool, "fallback").await, Ledger::once_each(4));
}

// --- 9. Handler panics --------------------------------------------------------

#[idempotent(name = "bomb")]
async fn bomb(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "bomb", &d, delivery).await?;
    assert!(d.account != "bomb", "the handler hit a bug");
    Ok(())
}

/// A handler panics on one message. Its neighbours, in a batch or not, are
/// applied once on their first delivery; the panicking message is retried
/// with backoff (not after ack_wait) and dead-lettered with the panic's
/// message once it runs out of deliveries.
async fn a_panicking_handler_fails_only_its_own_message(batch: usize) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PANIC", Duration::from_secs(120)).await;
    for i in 0..8 {
        let account = if i == 3 { "bomb" } else { "ok" };
        publish(&js, &subject, &deposit(account, i), Some(&format!("p-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .batch(batch)
                .concurrency(1)
                .max_deliver(3)
                .ack_wait(Duration::from_secs(30)),
            bomb,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1, "only the panicking message");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "p-3");
    assert_eq!(header(&letters[0], "Idem-Failure"), "exhausted");
    assert!(header(&letters[0], "Idem-Error").contains("the handler hit a bug"));
    assert_eq!(ledger(&pool, "bomb").await, Ledger::once_each(7));
    let late: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE delivered > 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(late, 0, "every neighbour applied on its first delivery");
}

// --- 10. Infrastructure errors and constraint races -------------------------

/// The dedup table disappears (dropped, renamed, a wrong `search_path`):
/// every claim fails with 42P01. That is the database's fault, not the
/// messages': nothing is dead-lettered and no delivery is used up while it
/// lasts, and once the table is back every message is applied once.
#[tokio::test]
async fn a_missing_dedup_table_dead_letters_nothing() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NOTABLE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(2).concurrency(2),
            no_ids,
        ),
        nats,
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    for i in 0..6 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("nt-{i}"))).await;
    }
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claims failed again and again",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 20 },
    )
    .await;
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(stats.failed(), 0, "no delivery was used up");

    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(6));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
}

/// While the database cannot be used, the route takes no new messages; the
/// ones it had fetched and not started must not lose a delivery to the
/// outage either. They were once handed back (NAKed) when the route paused:
/// each came back as its next delivery, so that on a route allowed one
/// delivery (`max_deliver(1)`) they arrived past the limit and were
/// dead-lettered as `exhausted`, never having run.
#[tokio::test]
async fn messages_fetched_during_a_database_outage_use_up_no_delivery() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FETCHED", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(1).concurrency(2),
            no_ids,
        ),
        nats,
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    for i in 0..6 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("f-{i}"))).await;
    }
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claims failed again and again",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 10 },
    )
    .await;
    // The fault: more messages were fetched than the two held ones.
    let fetched = consumer_info(&js, &stream, "c")
        .await
        .delivered
        .stream_sequence;
    assert!(
        fetched > 2,
        "the route fetched messages behind the held ones: {fetched}"
    );
    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let letters: Vec<String> = dead_letters(&js, &stream)
        .await
        .iter()
        .map(|letter| {
            format!(
                "{} ({}, delivered {})",
                header(letter, "Idem-Message-Id"),
                header(letter, "Idem-Failure"),
                header(letter, "Idem-Delivered")
            )
        })
        .collect();
    assert_eq!(letters, Vec::<String>::new(), "nothing was dead-lettered");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(6));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.delivered.consumer_sequence, info.num_redelivered),
        (6, 0),
        "JetStream delivered each message once"
    );
}

/// The highest delivery count among `handler`'s applied effects: 1 when
/// every message was applied on its first delivery. A message NAKed while
/// held (`Interrupted`, at shutdown) uses up a delivery without counting
/// as failed, so `Stats::failed` alone does not show it.
async fn latest_delivery(pool: &sqlx::PgPool, handler: &str) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(delivered), 0) FROM effects WHERE handler = $1")
        .bind(handler)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[idempotent(name = "check-then-insert")]
async fn check_then_insert(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(race_lost): State<FirstRuns>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM accounts WHERE id = $1)")
        .bind(&d.account)
        .fetch_one(&mut **tx)
        .await?;
    let first = race_lost.first(delivery);
    if first {
        // Another transaction creates the account between our check and our
        // insert, and commits: READ COMMITTED lets both through the check.
        let mut other = sqlx::PgConnection::connect(&database_url(tx).await).await?;
        sqlx::query("INSERT INTO accounts (id) VALUES ($1)")
            .bind(&d.account)
            .execute(&mut other)
            .await?;
    }
    if !exists {
        sqlx::query("INSERT INTO accounts (id) VALUES ($1)")
            .bind(&d.account)
            .execute(&mut **tx)
            .await?;
    }
    record_effect(tx, "check-then-insert", &d, delivery).await
}

/// A URL for a second connection to the same database as `tx`.
async fn database_url(tx: &mut sqlx::PgTransaction<'_>) -> String {
    let (port, database): (i32, String) =
        sqlx::query_as("SELECT current_setting('port')::int, current_database()")
            .fetch_one(&mut **tx)
            .await
            .unwrap();
    format!("postgres://postgres@127.0.0.1:{port}/{database}")
}

/// A unique violation from the handler's own insert, after a check that
/// raced with another transaction, clears on a retry: it is retried in
/// process instead of dead-lettered at once, and applied once.
#[tokio::test]
async fn a_unique_violation_from_a_lost_race_is_retried_and_applied_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RACE23505", Duration::from_secs(120)).await;
    sqlx::query("CREATE TABLE accounts (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    for i in 0..3 {
        publish(
            &js,
            &subject,
            &deposit(&format!("acct-{i}"), 1),
            Some(&format!("r-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::with_state(FirstRuns::default())
            .route(fast(Route::new(&stream, "c")), check_then_insert),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.retried_in_process() >= 3,
        "each message lost the race once"
    );
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "check-then-insert").await,
        Ledger::once_each(3)
    );
}

#[idempotent(name = "always-duplicate")]
async fn always_duplicate(
    tx: &mut sqlx::PgTransaction<'_>,
    _d: Deposit,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO accounts (id) VALUES ('taken')")
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A unique violation that does not clear is dead-lettered after the
/// in-process retries, on the message's first delivery.
#[tokio::test]
async fn a_unique_violation_that_persists_is_dead_lettered_after_its_retries() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DUP23505", Duration::from_secs(120)).await;
    sqlx::raw_sql(
        "CREATE TABLE accounts (id text PRIMARY KEY); INSERT INTO accounts VALUES ('taken')",
    )
    .execute(&pool)
    .await
    .unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("taken-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), always_duplicate),
        nats,
        pool,
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.retried_in_process(), 2, "three tries in all");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert_eq!(header(&letters[0], "Idem-Delivered"), "1");
    assert!(header(&letters[0], "Idem-Error").contains("23505"));
}

// --- 11. Past the delivery limit while an attempt still runs ---------------

/// Whether the past-limit redelivery waited on the running attempt's claim.
#[derive(Clone, Default)]
struct PastLimitWaited(Arc<AtomicBool>);

#[idempotent(name = "outlives-its-lease")]
async fn outlives_its_lease(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(past_limit_waited): State<PastLimitWaited>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if delivery.delivered() == 1 {
        // Stay in the transaction until the redelivery, past the limit of 1,
        // waits on this claim.
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            let waiters: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid))",
            )
            .fetch_one(&mut **tx)
            .await?;
            if waiters > 0 {
                past_limit_waited.0.store(true, Ordering::SeqCst);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    record_effect(tx, "outlives-its-lease", &d, delivery).await
}

/// A redelivery past the delivery limit arrives while the first attempt
/// still runs (heartbeats off, ack_wait short). It must not dead-letter a
/// message that is about to commit: its check waits on the claim, finds it
/// committed, and acks.
#[tokio::test]
async fn a_message_past_its_limit_waits_for_an_attempt_still_running() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PASTLIMIT", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("late-1")).await;
    let route = || {
        fast(Route::new(&stream, "c"))
            .max_deliver(1)
            .ack_wait(Duration::from_secs(1))
            .without_heartbeat()
            .allow_redelivery_while_running()
            .concurrency(1)
    };
    // Both workers share the flag: either may take the first attempt.
    let past_limit_waited = PastLimitWaited::default();
    let (first, first_task) = spawn(
        Router::with_state(past_limit_waited.clone()).route(route(), outlives_its_lease),
        nats.clone(),
        pool.clone(),
    );
    let (second, second_task) = spawn(
        Router::with_state(past_limit_waited.clone()).route(route(), outlives_its_lease),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(first, first_task).await;
    stop(second, second_task).await;
    assert!(
        past_limit_waited.0.load(Ordering::SeqCst),
        "the past-limit redelivery waited on the running attempt's claim"
    );
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "outlives-its-lease").await,
        Ledger::once_each(1)
    );
}

// --- 12. Smaller items ---------------------------------------------------------

#[idempotent(name = "deferred")]
async fn deferred(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "deferred", &d, delivery).await?;
    // Checked only at COMMIT, which then fails: the server answered, so the
    // outcome is known, and nothing was committed.
    sqlx::query("INSERT INTO children (parent) VALUES (42)")
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A COMMIT that the server refused (a deferred constraint) is a failure
/// whose outcome is known: it is classed and counted like any other
/// failure, not NAKed as "unknown" until the delivery limit runs out.
#[tokio::test]
async fn a_commit_refused_by_a_deferred_constraint_is_a_known_failure() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEFERRED", Duration::from_secs(120)).await;
    sqlx::raw_sql(
        "CREATE TABLE parents (id int PRIMARY KEY);
         CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&pool)
    .await
    .unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("orphan-child-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).max_deliver(2), deferred),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.commit_failed(), 0, "not an unknown outcome");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert_eq!(header(&letters[0], "Idem-Delivered"), "1");
    assert!(header(&letters[0], "Idem-Error").contains("23503"));
    assert_eq!(ledger(&pool, "deferred").await, Ledger::once_each(0));
}

/// A PostgreSQL restart under steady traffic: the attempts that meet it are
/// retried without using up deliveries.
#[tokio::test]
async fn a_postgres_restart_under_traffic_uses_up_no_delivery() {
    let Scenario {
        mut env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PGRESTART", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).concurrency(8), no_ids),
        nats,
        worker_pool(env.database_url()).await,
    );
    let publisher = publish_steadily(&js, &subject, 300);
    let stats = handle.stats("c").unwrap();
    eventually("traffic flows", Duration::from_secs(30), || async {
        stats.processed() >= 50
    })
    .await;
    let before = stats.processed();
    env.postgres_mut().restart_immediate().await;
    publisher.await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert!(
        stats.processed() > before,
        "processing went on after the restart"
    );
    assert!(
        stats.infrastructure_errors() + stats.retried_in_process() + stats.commit_failed() > 0,
        "the router saw the restart"
    );
    assert_eq!(stats.failed(), 0, "no delivery was used up by the restart");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(300));
    // A COMMIT the restart cut has an unknown outcome: NAKed, and if it
    // had not committed, applied on its next delivery. Nothing else may
    // take a second delivery.
    let redelivered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM effects WHERE handler = 'no-ids' AND delivered > 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        redelivered as u64 <= stats.commit_failed(),
        "{redelivered} messages were applied on a later delivery, and only {} COMMITs were of unknown outcome",
        stats.commit_failed()
    );
}

/// The connections a route keeps between messages die (the server ended
/// them). The next message must not take one dead kept connection after
/// another until it runs out of tries: no delivery is used up, and every
/// message is applied once.
#[tokio::test]
async fn dead_kept_connections_use_up_no_delivery() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEADCONN", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).concurrency(8), no_ids),
        nats,
        worker_pool(env.database_url()).await,
    );
    let stats = handle.stats("c").unwrap();
    let (mut published, mut terminated) = (0, 0);
    for _ in 0..5 {
        // A burst leaves the route keeping several connections...
        for _ in 0..16 {
            publish(
                &js,
                &subject,
                &deposit("burst", published),
                Some(&format!("d-{published}")),
            )
            .await;
            published += 1;
        }
        eventually(
            "the burst is processed",
            Duration::from_secs(30),
            || async { stats.processed() == published as u64 },
        )
        .await;
        // ...which the server ends at once, before the route gives them
        // back to the pool (after 250 ms unused).
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = 'idem-worker'
               AND state IN ('idle', 'idle in transaction')",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        terminated += killed.into_iter().filter(|&killed| killed).count();
        // One message alone meets them.
        publish(
            &js,
            &subject,
            &deposit("alone", published),
            Some(&format!("d-{published}")),
        )
        .await;
        published += 1;
        wait_all_acked(&js, &stream, "c").await;
    }
    stop(handle.clone(), task).await;
    assert!(terminated >= 10, "the worker's connections were terminated");
    assert!(
        stats.infrastructure_errors() + stats.retried_in_process() > 0,
        "the router met dead connections"
    );
    assert_eq!(stats.failed(), 0, "no delivery was used up");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(published));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
}

/// A pool of its own for the worker, named so the test can find its
/// connections in `pg_stat_activity`.
async fn worker_pool(database_url: &str) -> sqlx::PgPool {
    let options: sqlx::postgres::PgConnectOptions = database_url.parse().unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.application_name("idem-worker"))
        .await
        .unwrap()
}

/// Publishes `count` messages with distinct ids, one every 5 ms.
fn publish_steadily(
    js: &jetstream::Context,
    subject: &str,
    count: i64,
) -> tokio::task::JoinHandle<()> {
    let js = js.clone();
    let subject = subject.to_owned();
    tokio::spawn(async move {
        for i in 0..count {
            publish(
                &js,
                &subject,
                &deposit("a", i),
                Some(&format!("steady-{i}")),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// The route's consumer is deleted under it. The pull loop must not spin
/// re-issuing pulls as fast as it can: it backs off, and picks up again
/// once the consumer is back.
#[tokio::test]
async fn a_deleted_consumer_does_not_make_the_pull_loop_spin() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NOCONSUMER", Duration::from_secs(120)).await;
    let route = || Route::new(&stream, "c");
    let (handle, task) = spawn(
        Router::new().route(route(), no_ids),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("before")).await;
    wait_all_acked(&js, &stream, "c").await;

    let mut pulls = nats
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.c"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer("c")
        .await
        .unwrap();
    // Pull requests the route sends in 3 s without its consumer, and the
    // CPU time this process (the router's) spends meanwhile.
    let cpu_before = process_cpu_time();
    let window = tokio::time::sleep(Duration::from_secs(3));
    tokio::pin!(window);
    let mut requests = 0;
    loop {
        tokio::select! {
            _ = &mut window => break,
            Some(_) = pulls.next() => requests += 1,
        }
    }
    let cpu = process_cpu_time() - cpu_before;
    assert!(requests >= 1, "the route kept trying to pull");
    assert!(
        cpu < Duration::from_millis(1500),
        "{cpu:?} of CPU in 3 s: the pull loop spins"
    );
    assert!(
        requests <= 30,
        "{requests} pull requests in 3 s: the pull loop spins"
    );

    // An operator recreates the consumer; the route picks up again.
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(route_consumer_config())
        .await
        .unwrap();
    publish(&js, &subject, &deposit("a", 2), Some("after")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(2));
}

/// The CPU time (user and system) this process has used.
fn process_cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// The consumer `Route::new(_, "c")` creates, with its default settings.
fn route_consumer_config() -> jetstream::consumer::pull::Config {
    jetstream::consumer::pull::Config {
        durable_name: Some("c".into()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: 13,
        ..Default::default()
    }
}

/// Something that is not a JetStream delivery reaches the route's pull
/// (here, a plain message published to the pull's reply inbox). It cannot
/// be deduplicated or redelivered, so it is dead-lettered, not dropped.
#[tokio::test]
async fn a_message_that_is_not_a_jetstream_delivery_is_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("NOTJS", Duration::from_secs(120)).await;
    // The route's pull requests name the inbox its messages come to.
    let mut pulls = nats
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.c"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    let pull = tokio::time::timeout(Duration::from_secs(30), pulls.next())
        .await
        .expect("the route pulls")
        .unwrap();
    let inbox = pull.reply.expect("a pull request has a reply inbox");
    nats.publish(inbox, r#"{"account":"stray","amount":1}"#.into())
        .await
        .unwrap();
    nats.flush().await.unwrap();
    eventually(
        "the stray message is dead-lettered",
        Duration::from_secs(30),
        || async { handle.stats("c").unwrap().dead_lettered() == 1 },
    )
    .await;
    stop(handle, task).await;
    let letters = dead_letters_with_failure(&js, "not-a-jetstream-delivery").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(
        &letters[0].payload[..],
        br#"{"account":"stray","amount":1}"#
    );
    assert_eq!(ledger(&pool, "no-ids").await.effects, 0);
}

/// The dead letters with `Idem-Failure: failure`, from any stream.
async fn dead_letters_with_failure(
    js: &jetstream::Context,
    failure: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut dead = js.get_stream(dead_letter::DEFAULT_STREAM).await.unwrap();
    let last = dead.info().await.unwrap().state.last_sequence;
    let mut letters = Vec::new();
    for sequence in 1..=last {
        if let Ok(letter) = dead.get_raw_message(sequence).await
            && header(&letter, "Idem-Failure") == failure
        {
            letters.push(letter);
        }
    }
    letters
}

// --- Prepared statements the session lost ----------------------------------

/// Drops the session's prepared statements (idem's and sqlx's) on the first
/// run of each message: "commits" returns `Ok` after, which the COMMIT's
/// check then meets; "fails" returns an error, which leaves its kept
/// connection to the next message's claim.
#[idempotent(name = "deallocates")]
async fn deallocates(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(first_runs): State<FirstRuns>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if first_runs.first(delivery) && d.account != "plain" {
        sqlx::raw_sql("DEALLOCATE ALL").execute(&mut **tx).await?;
        if d.account == "fails" {
            return Err(Transient::new("fails after dropping the prepared statements").into());
        }
        return Ok(());
    }
    record_effect(tx, "deallocates", &d, delivery).await?;
    Ok(())
}

/// The claim and the COMMIT's check are the session's prepared statements.
/// A session that lost them (a handler ran `DEALLOCATE ALL`; a pooler moved
/// the connection) costs a retry on another connection, never a message:
/// each is applied once, none is dead-lettered.
#[tokio::test]
async fn lost_prepared_statements_cost_a_retry_not_a_message() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEALLOC", Duration::from_secs(120)).await;
    // One at a time, so that the connection a message leaves is the next
    // one's.
    let accounts = [
        "commits", "plain", "fails", "plain", "commits", "plain", "fails", "plain",
    ];
    for (i, account) in accounts.iter().enumerate() {
        publish(
            &js,
            &subject,
            &deposit(account, 1),
            Some(&format!("dl-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::with_state(FirstRuns::default())
            .route(fast(Route::new(&stream, "c")).concurrency(1), deallocates),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    // Each "commits" meets its missing check once; each "fails" leaves its
    // connection to a claim that meets the missing statement once.
    assert!(
        stats.retried_in_process() == 4,
        "the missing statements were met and retried: {}",
        stats.retried_in_process()
    );
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "deallocates").await,
        Ledger::once_each(accounts.len() as i64)
    );
}

macro_rules! both_modes {
    ($($scenario:ident),* $(,)?) => {
        mod per_message {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(1).await;
                }
            )*
        }
        mod batched {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(8).await;
                }
            )*
        }
    };
}

both_modes!(
    a_swallowed_sql_error_is_never_acked_as_processed,
    a_swallowed_error_that_clears_is_retried_and_applied_once,
    a_panicking_handler_fails_only_its_own_message,
);
