//! The relay's drain, whose cycles overlap (`Relay::drain`, what a running
//! relay's fresh lane runs): one relay still keeps the order rows were
//! queued in, across early takes and takes cut by `max_cycle_bytes`; a row
//! that fails is set aside while the rows after it go out in order; the
//! drain uses two connections, not one per cycle; and a drain dropped in
//! the middle of a cycle releases its rows at once, without waiting for the
//! server's idle timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_runtime::outbox::{Outbox, Relay};
use idem_tests::FaultProxy;
use idem_tests::fault_proxy::Direction;
use idem_tests::outbox::{out_stream, pending_rows, stored_count, stored_ids};
use idem_tests::scenario::*;
use sqlx::PgPool;

/// Queues one message per entry of `pads` for `subject` (a string of that
/// many bytes), in one committed transaction with ids from `key`; returns
/// the ids in queue order.
async fn queue_sized(pool: &PgPool, key: &str, subject: &str, pads: &[usize]) -> Vec<String> {
    let outbox: Outbox = Outbox::keyed(key);
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for pad in pads {
        ids.push(
            outbox
                .send(&mut tx, subject, &"x".repeat(*pad))
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    ids
}

/// A pool that counts the connections taken from it: idle ones reused, and
/// new ones opened.
async fn counting_pool(url: &str) -> (PgPool, Arc<AtomicU64>) {
    let taken = Arc::new(AtomicU64::new(0));
    let (on_acquire, on_connect) = (taken.clone(), taken.clone());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .before_acquire(move |_, _| {
            on_acquire.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Ok(true) })
        })
        .after_connect(move |_, _| {
            on_connect.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Ok(()) })
        })
        .connect(url)
        .await
        .expect("the relay's pool connects");
    (pool, taken)
}

#[tokio::test]
async fn one_drain_keeps_the_queue_order_across_early_and_cut_takes() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.jetstream().await;
    let out = out_stream(&js, "OBDRAIN").await;
    let subject = format!("{out}.paid");
    // Batches of 8 within 1,000 bytes: small rows fill a take (and the next
    // is taken early, beside its PubAcks); rows of 300 bytes cut it at 3
    // (the rest of its 8 stay locked, so the next take must wait).
    let small = vec![20; 40];
    let big = vec![300; 20];
    let mut expected = Vec::new();
    expected.extend(queue_sized(&pool, "drain-a", &subject, &small).await);
    expected.extend(queue_sized(&pool, "drain-b", &subject, &big).await);
    expected.extend(queue_sized(&pool, "drain-c", &subject, &small).await);
    let mixed: Vec<usize> = (0..24).map(|i| if i % 5 == 0 { 300 } else { 20 }).collect();
    expected.extend(queue_sized(&pool, "drain-d", &subject, &mixed).await);

    let (relay_pool, taken) = counting_pool(env.database_url()).await;
    let relay = Relay::new().batch_size(8).max_cycle_bytes(1000);
    let before = taken.load(Ordering::Relaxed);
    let drained = relay.drain(&js, &relay_pool).await.expect("the drain runs");
    let taken = taken.load(Ordering::Relaxed) - before;
    println!("{drained:?}, {taken} connections taken");

    assert_eq!(drained.published, expected.len());
    assert_eq!((drained.failed, drained.failing), (0, 0));
    assert!(drained.nats_away.is_none());
    assert!(
        drained.cycles > expected.len() / 8,
        "takes were cut by bytes: {} cycles for {} rows",
        drained.cycles,
        expected.len()
    );
    assert_eq!(taken, 2, "a drain takes two connections for all its cycles");
    assert_eq!(pending_rows(&pool).await, 0);
    assert_eq!(
        stored_ids(&js, &out).await,
        expected,
        "the stream holds every row once, in queue order"
    );
    assert_eq!(relay.stats().published(), expected.len() as u64);
}

#[tokio::test]
async fn a_failing_row_is_set_aside_and_the_rows_after_it_go_out_in_order() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.jetstream().await;
    let out = out_stream(&js, "OBDRAINF").await;
    let good = format!("{out}.paid");
    // No stream stores it: JetStream answers each publish with an error.
    let missing = format!("{}.paid", unique_name("OBNOWHERE"));
    let mut expected = Vec::new();
    for n in 0..6 {
        expected.extend(queue_sized(&pool, &format!("good-{n}"), &good, &[10; 7]).await);
        queue_sized(&pool, &format!("bad-{n}"), &missing, &[10]).await;
    }

    let relay = Relay::new().batch_size(8);
    let drained = relay.drain(&js, &pool).await.expect("the drain runs");
    println!("{drained:?}");
    assert_eq!(drained.published, expected.len());
    assert_eq!(
        (drained.failed, drained.failing),
        (6, 6),
        "each bad row failed once and is recorded as failing"
    );
    assert!(drained.nats_away.is_none(), "NATS answered throughout");
    assert_eq!(stored_ids(&js, &out).await, expected);
    let lag = idem_runtime::outbox::lag(&pool).await.unwrap();
    assert_eq!((lag.pending, lag.failing), (6, 6), "only the bad rows wait");
    assert_eq!(lag.failures[0].subject, missing);
}

#[tokio::test]
async fn a_drain_dropped_while_its_pubacks_are_out_releases_its_rows_at_once() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.jetstream().await;
    let out = out_stream(&js, "OBDROP").await;
    let subject = format!("{out}.paid");
    let expected = queue_sized(&pool, "drop", &subject, &[10; 30]).await;

    // The relay's NATS connection goes through a proxy that holds
    // everything: its publishes go out, and no PubAck comes back.
    let proxy = FaultProxy::start("nats", env.nats_url());
    let stuck_nats = async_nats::connect(proxy.url_for(env.nats_url()))
        .await
        .expect("the relay connects through the proxy");
    let stuck_js = jetstream::new(stuck_nats.clone());
    proxy.pause(Direction::Both);
    let relay = Relay::new().batch_size(8);
    let dropped = tokio::time::timeout(Duration::from_secs(1), relay.drain(&stuck_js, &pool)).await;
    assert!(dropped.is_err(), "the drain was waiting for its PubAcks");
    let locked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
          WHERE l.locktype = 'transactionid' AND a.datname = current_database()
            AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    println!("transactions holding row locks just after the drop: {locked}");
    drop(stuck_js);
    drop(stuck_nats);
    drop(proxy);

    // Its sessions are closed with the drain: another relay takes the rows
    // within seconds, not after the server's 60 s idle timeout.
    let dropped_at = Instant::now();
    let other = Relay::new().batch_size(8);
    let mut published = 0;
    while published < expected.len() {
        assert!(
            dropped_at.elapsed() < Duration::from_secs(20),
            "the dropped drain's rows stayed locked for 20 s ({published} of {} out)",
            expected.len()
        );
        published += other
            .drain(&js, &pool)
            .await
            .expect("the drain runs")
            .published;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "rows of the dropped drain published again {:?} after the drop",
        dropped_at.elapsed()
    );
    assert_eq!(pending_rows(&pool).await, 0);
    assert_eq!(stored_count(&js, &out).await, expected.len() as u64);
    assert_eq!(stored_ids(&js, &out).await, expected);
}
