//! A redelivery that arrives while the first attempt still holds the claim
//! waits on it: when the first attempt rolls back, the waiting one applies the
//! message, once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, State, Transient, idempotent};
use idem_tests::scenario::*;

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
///
/// Per message: a redelivery in a batch waits at most the batch's
/// `lock_timeout`, then runs alone (the batched variants of
/// `exactly_once::redelivery_during_first_attempt_waits_on_claim_then_skips`
/// cover that path).
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
            .per_message()
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
