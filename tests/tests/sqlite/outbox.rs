//! The outbox's relay beside a route that keeps SQLite's one write lock
//! busy. The relay's transactions do not queue with the route's messages
//! for the lock (those take turns in the router); they wait in SQLite's
//! busy handler. This checks that they are not starved there.

use std::time::{Duration, Instant};

use idem_runtime::outbox::{self, Outbox, OutboxError, Relay};
use idem_runtime::{Delivery, Route, Router, idempotent};
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
