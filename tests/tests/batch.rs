//! Batch mode against real servers: one claim statement and one COMMIT per
//! batch, with each message still applied exactly once, and a failing
//! message never failing its neighbours.

mod common;

use std::time::Duration;

use common::*;
use idem_runtime::{Delivery, Permanent, Route, Router, idempotent};

#[idempotent(name = "picky")]
async fn picky(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    // Write first, then fail: the batch's writes must all roll back.
    record_effect(tx, "picky", &d, delivery).await?;
    if d.account == "refused" {
        return Err(Permanent::new("this account refuses deposits").into());
    }
    Ok(())
}

/// One message of a batch fails permanently. The batch is rolled back and
/// rerun one message per transaction: the failing one is dead-lettered and
/// every other one is applied once.
#[tokio::test]
async fn a_failing_message_does_not_fail_its_batch_neighbours() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NEIGHBOURS", Duration::from_secs(120)).await;
    const MESSAGES: i64 = 40;
    // Publish before the router starts, so that batches are full.
    for i in 0..MESSAGES {
        let account = if i == 17 { "refused" } else { "ok" };
        let deposit = Deposit {
            account: account.into(),
            amount: i,
        };
        publish(&js, &subject, &deposit, Some(&format!("n-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").batch(16).concurrency(2), picky),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert!(
        stats.batches() >= 1,
        "some batches committed whole: {stats:?}"
    );
    assert_eq!(
        stats.batch_fallbacks(),
        1,
        "exactly the batch with the bad message fell back"
    );
    assert_eq!((stats.processed(), stats.dead_lettered()), (39, 1));
    assert_eq!(ledger(&pool, "picky").await, Ledger::once_each(39));
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE account = 'refused'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refused, 0, "the failing message's write was rolled back");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "n-17");
}

#[idempotent(name = "by-account", key = d.account)]
async fn by_account(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "by-account", &d, delivery).await
}

/// Duplicates inside one batch, and across batches, are claimed by the one
/// batch statement: each id is applied once and every message is acked.
#[tokio::test]
async fn duplicates_within_and_across_batches_apply_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BATCHDUP", Duration::from_secs(120)).await;
    const MESSAGES: usize = 100;
    const ACCOUNTS: usize = 30;
    for i in 0..MESSAGES {
        let deposit = Deposit {
            account: format!("acct-{}", i % ACCOUNTS),
            amount: 1,
        };
        publish(&js, &subject, &deposit, Some(&format!("m-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c").batch(32).concurrency(2),
            by_account,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.received(), MESSAGES as u64);
    assert_eq!(
        (stats.processed(), stats.duplicates()),
        (ACCOUNTS as u64, (MESSAGES - ACCOUNTS) as u64)
    );
    assert!(stats.batches() >= 1);
    assert_eq!(stats.batch_fallbacks(), 0);
    assert_eq!(
        ledger(&pool, "by-account").await,
        Ledger::once_each(ACCOUNTS as i64)
    );
}
