//! Adaptive batching ([`Route::adaptive_batch`]) and the split fallback:
//! an idle route runs each message alone, a backlog grows the batches, and
//! a failing message costs its batch a few halves, not a transaction for
//! each neighbour.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Delivery, Permanent, Route, Router, State, idempotent};
use idem_tests::scenario::*;

#[idempotent(name = "adaptive")]
async fn adaptive(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "adaptive", &d, delivery).await
}

/// Messages that arrive one at a time, each after the last was acked, run
/// one per transaction: none waits for a batch to fill.
#[tokio::test]
async fn an_idle_adaptive_route_runs_each_message_alone() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ADAPTIDLE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").adaptive_batch(64), adaptive),
        nats,
        pool.clone(),
    );
    const MESSAGES: i64 = 5;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: "a".into(),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("idle-{i}"))).await;
        wait_all_acked(&js, &stream, "c").await;
    }
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), MESSAGES as u64);
    assert_eq!(
        stats.batches(),
        0,
        "no message that came alone ran as a batch: {stats:?}"
    );
    assert_eq!(ledger(&pool, "adaptive").await, Ledger::once_each(MESSAGES));
}

/// A backlog waiting when the route starts is taken in batches that grow
/// past one message, and every message is still applied once.
#[tokio::test]
async fn under_a_backlog_an_adaptive_route_grows_its_batches() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ADAPTGROW", Duration::from_secs(120)).await;
    const MESSAGES: i64 = 600;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: format!("acct-{}", i % 50),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("grow-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c").adaptive_batch(64).concurrency(2),
            adaptive,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), MESSAGES as u64, "{stats:?}");
    assert!(
        stats.largest_batch() >= 8,
        "the batches grew under the backlog: {stats:?}"
    );
    assert!(stats.largest_batch() <= 64, "never past the cap: {stats:?}");
    assert_eq!(stats.batch_fallbacks(), 0);
    assert_eq!(ledger(&pool, "adaptive").await, Ledger::once_each(MESSAGES));
}

/// What the `halves` handler saw when the bad message first ran.
#[derive(Clone, Default)]
struct FirstFailure {
    /// How many claims the bad message's first transaction held: the size
    /// of the batch it failed.
    batch: Arc<Mutex<Option<i64>>>,
}

#[idempotent(name = "halves")]
async fn halves(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(seen): State<FirstFailure>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if d.account == "bad" {
        let claims: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_claims WHERE xmin = pg_current_xact_id()::xid",
        )
        .fetch_one(&mut **tx)
        .await?;
        seen.batch.lock().unwrap().get_or_insert(claims);
        return Err(Permanent::new("this account refuses deposits").into());
    }
    record_effect(tx, "halves", &d, delivery).await?;
    Ok(())
}

/// A batch of 8 whose last message fails for good: its halves are tried
/// again as batches, so its 7 good neighbours commit in 3 transactions
/// ([0..4), [4, 5], [6]) where a fallback of one transaction per message
/// would take 7. The bad one is dead-lettered, each good one applied once.
#[tokio::test]
async fn a_failing_message_costs_its_batch_halves_not_a_transaction_per_neighbour() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("HALVES", Duration::from_secs(120)).await;
    for i in 0..8 {
        let account = if i == 7 { "bad" } else { "ok" };
        let deposit = Deposit {
            account: account.into(),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("h-{i}"))).await;
    }
    let seen = FirstFailure::default();
    let (handle, task) = spawn(
        Router::with_state(seen.clone())
            .route(Route::new(&stream, "c").batch(8).concurrency(1), halves),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let batch = seen.batch.lock().unwrap().expect("the bad message ran");
    assert_eq!(
        batch, 8,
        "the bad message first failed in a batch of all 8 (published before the route started)"
    );
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.processed(), stats.dead_lettered()),
        (7, 1),
        "{stats:?}"
    );
    assert_eq!(stats.batch_fallbacks(), 1, "{stats:?}");
    assert_eq!(ledger(&pool, "halves").await, Ledger::once_each(7));
    let transactions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM effects WHERE handler = 'halves'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        transactions, 3,
        "the 7 good neighbours committed in the halves [0..4), [4, 5] and [6]"
    );
}
