//! The rule that keeps a handler out of batches: a handler that declares it
//! must have its transaction to itself (`#[idempotent(per_message)]`) runs
//! one message per transaction on a route left at the default, and a route
//! that asks for batches with it is refused at start-up.

use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::*;

/// Sets a transaction-local variable and reads it back: in a batch, the
/// next message's handler would see the value this one set.
#[idempotent(name = "alone", per_message)]
async fn alone(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    let before: Option<String> =
        sqlx::query_scalar("SELECT nullif(current_setting('app.seen', true), '')")
            .fetch_one(&mut **tx)
            .await?;
    if let Some(before) = before {
        return Err(format!("saw {before}, set by another message in this transaction").into());
    }
    sqlx::query("SELECT set_config('app.seen', $1, true)")
        .bind(delivery.message_id().as_str())
        .execute(&mut **tx)
        .await?;
    record_effect(tx, "alone", &d, delivery).await?;
    Ok(())
}

#[idempotent(name = "shares")]
async fn shares(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "shares", &d, delivery).await
}

/// How many transactions committed `handler`'s effects.
async fn transactions(pool: &sqlx::PgPool, handler: &str) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM effects WHERE handler = $1")
        .bind(handler)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs `handler` on a route left at its defaults (one slot) over a backlog
/// of 40 messages published before it starts.
async fn over_a_backlog<M>(
    prefix: &str,
    handler: impl idem_runtime::handler::IntoHandler<(), M>,
) -> (
    std::sync::Arc<idem_runtime::Stats>,
    sqlx::PgPool,
    idem_tests::TestEnv,
) {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario(prefix, Duration::from_secs(120)).await;
    for i in 0..40 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("m-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").concurrency(1), handler),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    (handle.stats("c").unwrap(), pool, env)
}

/// A per-message handler on a default route: each of 40 messages in a
/// transaction of its own, and none saw another's `SET LOCAL`; the same
/// backlog with a handler that declares nothing is taken in batches.
#[tokio::test]
async fn a_per_message_handler_has_its_transaction_to_itself_on_a_default_route() {
    let (stats, pool, _env) = over_a_backlog("ALONE", alone).await;
    assert_eq!((stats.processed(), stats.failed()), (40, 0), "{stats:?}");
    assert_eq!(stats.batches(), 0, "{stats:?}");
    assert_eq!(transactions(&pool, "alone").await, 40);
    assert_eq!(ledger(&pool, "alone").await, Ledger::once_each(40));

    let (stats, pool, _env) = over_a_backlog("SHARES", shares).await;
    assert_eq!(stats.processed(), 40, "{stats:?}");
    assert!(stats.batches() > 0, "the default batches: {stats:?}");
    assert!(
        transactions(&pool, "shares").await < 40,
        "some messages shared a transaction"
    );
    assert_eq!(ledger(&pool, "shares").await, Ledger::once_each(40));
}

/// A route that asks for batches, fixed or adaptive, with a handler that
/// must have its transaction to itself is refused at start-up, saying why.
#[tokio::test]
async fn batches_asked_for_a_per_message_handler_are_refused_at_start_up() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js: _,
        stream,
        subject: _,
    } = scenario("REFUSED", Duration::from_secs(120)).await;
    for route in [
        Route::new(&stream, "c").batch(8),
        Route::new(&stream, "c").adaptive_batch(8),
    ] {
        let error = tokio::time::timeout(
            Duration::from_secs(10),
            Router::new().route(route, alone).run_until(
                nats.clone(),
                pool.clone(),
                std::future::pending(),
            ),
        )
        .await
        .expect("a configuration error fails at once")
        .unwrap_err();
        assert!(
            matches!(error, idem_runtime::Error::Config { .. }),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .contains("must have its transaction to itself"),
            "{error}"
        );
    }
}
