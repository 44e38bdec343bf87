//! Failures that clear on a retry: transient errors (redelivered),
//! serialization failures and unique violations from a lost race (retried in
//! process), and a unique violation that persists (dead-lettered after its
//! retries). Each message is applied once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, State, Transient, idempotent};
use idem_tests::scenario::*;
use sqlx::Connection as _;

// It waits for another transaction inside its own (`per_message`): in a
// batch, that one could wait on a row an earlier message of the batch
// inserted, and neither would go on.
#[idempotent(name = "check-then-insert", per_message)]
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

/// How often a handler's body ran.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicU32>);

#[idempotent(name = "flaky")]
async fn flaky(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(calls): State<Calls>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    calls.0.fetch_add(1, Ordering::SeqCst);
    if delivery.delivered() < 3 {
        return Err(
            Transient::new(format!("not yet, on delivery {}", delivery.delivered())).into(),
        );
    }
    record_effect(tx, "flaky", &d, delivery).await?;
    Ok(())
}

/// A handler that fails transiently twice, then succeeds: one effect, on
/// the third delivery.
#[tokio::test]
async fn transient_failures_are_retried_until_one_effect_on_the_third_delivery() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FLAKY", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 5), Some("flaky-1")).await;
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone()).route(fast(Route::new(&stream, "c")), flaky),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.received(), stats.failed(), stats.processed()),
        (3, 2, 1)
    );
    assert_eq!(calls.0.load(Ordering::SeqCst), 3);
    let delivered: i64 = sqlx::query_scalar("SELECT delivered FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(delivered, 3);
    assert_eq!(ledger(&pool, "flaky").await, Ledger::once_each(1));
    assert!(dead_letters(&js, &stream).await.is_empty());
}

#[idempotent(name = "conflicted")]
async fn conflicted(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(calls): State<Calls>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if calls.0.fetch_add(1, Ordering::SeqCst) == 0 {
        // A real 40001 from the server, as a serializable conflict raises.
        sqlx::query("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
            .execute(&mut **tx)
            .await?;
    }
    record_effect(tx, "conflicted", &d, delivery).await
}

/// A serialization failure is retried in-process, inside the same delivery.
#[tokio::test]
async fn serialization_failure_is_retried_in_process() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SERIAL", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("serial-1")).await;
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone()).route(Route::new(&stream, "c"), conflicted),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(calls.0.load(Ordering::SeqCst), 2, "the 40001 happened");
    assert_eq!(
        (
            stats.received(),
            stats.retried_in_process(),
            stats.failed(),
            stats.processed()
        ),
        (1, 1, 0, 1)
    );
    assert_eq!(ledger(&pool, "conflicted").await.effects, 1);
}
