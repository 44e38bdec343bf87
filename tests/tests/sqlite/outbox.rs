//! The outbox's relay on SQLite: beside a route that keeps the one write
//! lock busy (the relay's transactions do not queue with the route's
//! messages for the lock, which take turns in the router, but wait in
//! SQLite's busy handler: they must not be starved there), and dropped
//! while it holds a lease on its rows (it must give the lease back).

use std::time::{Duration, Instant};

use idem_runtime::outbox::{self, Outbox, OutboxError, Relay};
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::fault_proxy::{Direction, FaultProxy};
use idem_tests::scenario::{Deposit, create_stream, eventually, fast, stop, wait_all_acked};
use idem_tests::unique_name;

use crate::{Bed, Tx, spawn};

/// Records the deposit and queues it for `<account>.credited`.
#[idempotent(name = "queue-each")]
async fn queue_each(
    tx: &mut Tx<'_>,
    delivery: &Delivery,
    outbox: Outbox,
    d: Deposit,
) -> Result<(), OutboxError> {
    sqlx::query("INSERT INTO effects (handler, msg_id, account, amount) VALUES (?1, ?2, ?3, ?4)")
        .bind("queue-each")
        .bind(delivery.message_id().as_str())
        .bind(&d.account)
        .bind(d.amount)
        .execute(&mut **tx)
        .await?;
    outbox
        .send(tx, &format!("{}.credited", d.account), &d)
        .await?;
    Ok(())
}

/// A backlog of messages, each queuing one outbox row, runs one
/// transaction after another on the file; the router's relay publishes
/// beside them, while the backlog runs (it is not starved of the write
/// lock), and every row goes out once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_beside_a_busy_route_publishes_while_it_runs() {
    const MESSAGES: i64 = 1_500;
    let bed = Bed::start("SQOBOX").await;
    let out = unique_name("SQOBOXOUT");
    create_stream(&bed.js, &out, &format!("{out}.>"), Duration::from_secs(120)).await;
    for i in 0..MESSAGES {
        let id = format!("b-{i}");
        idem_tests::scenario::publish(
            &bed.js,
            &bed.subject,
            &idem_tests::scenario::deposit(&out, i),
            Some(&id),
        )
        .await;
    }
    let relay = Relay::new();
    let stats = relay.stats();
    let router = Router::sqlite()
        .route(fast(Route::new(&bed.stream, "c")).per_message(), queue_each)
        .relay(relay);
    let started = Instant::now();
    let (handle, task) = spawn(router, &bed.nats, &bed.pool);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    let backlog = started.elapsed();
    let published_by_then = stats.published();
    eventually("the outbox drains", Duration::from_secs(60), || async {
        outbox::lag(&bed.pool).await.unwrap().pending == 0
    })
    .await;
    let drained = started.elapsed();
    stop(handle, task).await;
    tracing::info!(
        ?backlog,
        ?drained,
        published_by_then,
        cycles = stats.cycles(),
        "the relay beside a busy route"
    );
    assert!(
        published_by_then > 0,
        "the relay published while the route's backlog ran"
    );
    assert_eq!(
        (stats.published(), stats.duplicates()),
        (MESSAGES as u64, 0),
        "every row went out once"
    );
}

/// A relay whose cycle is dropped while it waits for its PubAcks (its task
/// aborted, as at a panic or a cancelled drain) gives its lease back at
/// once: another relay, on the other pool, takes the rows within seconds,
/// not after the lease's 60 s, and each goes out once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_dropped_while_its_pubacks_are_out_gives_its_lease_back() {
    const ROWS: usize = 30;
    let bed = Bed::start("SQLEASE").await;
    let out = idem_tests::outbox::out_stream(&bed.js, "SQLEASEOUT").await;
    let subject = format!("{out}.paid");
    let outbox: Outbox = Outbox::keyed("lease");
    let mut tx = bed.pool.begin().await.unwrap();
    let mut expected = Vec::new();
    for i in 0..ROWS {
        expected.push(outbox.send(&mut tx, &subject, &i).await.unwrap());
    }
    tx.commit().await.unwrap();

    // The stuck relay's NATS connection goes through a proxy that holds
    // what the server sends: its publishes are stored, and no PubAck comes
    // back.
    let proxy = FaultProxy::start("nats", bed.nats_server.url());
    let stuck_nats = async_nats::connect(proxy.url_for(bed.nats_server.url()))
        .await
        .expect("the relay connects through the proxy");
    let stuck_js = async_nats::jetstream::new(stuck_nats.clone());
    proxy.pause(Direction::ToClient);
    let pool = bed.pool.clone();
    let stuck = tokio::spawn(async move {
        Relay::new()
            .batch_size(8)
            .drain(&stuck_js, &pool)
            .await
            .map(|drain| drain.published)
    });
    eventually(
        "the stuck relay holds leased rows",
        Duration::from_secs(20),
        || async { leased_rows(&bed.second_pool).await > 0 },
    )
    .await;
    let leased = leased_rows(&bed.second_pool).await;
    assert!(!stuck.is_finished(), "the relay waits for its PubAcks");
    stuck.abort();
    assert!(
        stuck.await.unwrap_err().is_cancelled(),
        "the relay was dropped, not finished"
    );
    let dropped_at = Instant::now();
    drop(stuck_nats);
    drop(proxy);

    // Another relay, on the other pool (another worker), takes the rows at
    // once, not when the lease ends.
    let other = Relay::new().batch_size(8);
    let mut published = 0;
    let mut duplicates = 0;
    while published < ROWS {
        assert!(
            dropped_at.elapsed() < Duration::from_secs(20),
            "the dropped relay's rows stayed leased for 20 s ({published} of {ROWS} out, {} leased)",
            leased_rows(&bed.second_pool).await
        );
        let drain = other
            .drain(&bed.js, &bed.second_pool)
            .await
            .expect("the drain runs");
        published += drain.published;
        duplicates += drain.duplicates;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = dropped_at.elapsed();
    // The stuck relay's publishes were stored: the other relay's copies of
    // them came back duplicates, and the stream kept one of each.
    assert!(
        duplicates > 0,
        "the stuck relay's publishes reached the stream"
    );
    println!(
        "{leased} rows were leased when the relay was dropped; all went out again {took:?} after, {duplicates} of them duplicates"
    );
    assert_eq!(idem_tests::outbox::pending_rows(&bed.pool).await, 0);
    assert_eq!(
        idem_tests::outbox::stored_count(&bed.js, &out).await,
        ROWS as u64,
        "one copy of each in the stream"
    );
    // As a set: the dropped relay's two cycles give their leases back in
    // two tasks of their own, and the other relay may take the rows of the
    // second before those of the first (several relays keep no order; see
    // the outbox guide's "Ordering").
    let mut stored = idem_tests::outbox::stored_ids(&bed.js, &out).await;
    stored.sort();
    expected.sort();
    assert_eq!(stored, expected, "every queued message, once");
}

/// Rows a live lease holds.
async fn leased_rows(pool: &sqlx::SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE leased_until >= unixepoch('subsec')")
        .fetch_one(pool)
        .await
        .expect("the outbox reads")
}
