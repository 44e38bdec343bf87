//! The core promise, against a real nats-server and PostgreSQL: every message
//! is applied once, whatever is redelivered. Each test checks that the
//! effects equal the inputs with no duplicate, and that the fault it injects
//! really happened.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, Route, Router, State, idempotent};
use idem_tests::scenario::*;
use idem_tests::{Batched, Batching};

fn deposit(amount: i64) -> Deposit {
    Deposit {
        account: "acct-1".into(),
        amount,
    }
}

#[idempotent(name = "retry-window")]
async fn retry_window(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "retry-window", &d, delivery).await
}

/// Scenario 1: a publisher retries after JetStream's duplicate window, so the
/// same `Nats-Msg-Id` is stored twice. One effect; both messages acked.
async fn publisher_retry_after_duplicate_window_is_applied_once(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RETRY", Duration::from_millis(300)).await;

    let first = publish(&js, &subject, &deposit(10), Some("payment-1")).await;
    assert!(!first.duplicate);
    let inside_window = publish(&js, &subject, &deposit(10), Some("payment-1")).await;
    assert!(
        inside_window.duplicate,
        "JetStream drops a retry inside its window"
    );
    // Keep retrying, as a publisher would, until JetStream stores it again.
    let mut retry = inside_window;
    while retry.duplicate {
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = publish(&js, &subject, &deposit(10), Some("payment-1")).await;
    }
    assert_eq!(
        (first.sequence, retry.sequence),
        (1, 2),
        "the same Nats-Msg-Id is stored twice"
    );

    let router = Router::new().route(Route::new(&stream, "credit").batching(batch), retry_window);
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &stream, "credit").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("credit").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
    assert_eq!(ledger(&pool, "retry-window").await, Ledger::once_each(1));
}

#[idempotent(name = "crash-after-commit")]
async fn crash_after_commit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "crash-after-commit", &d, delivery).await
}

/// Scenario 2: the worker commits, then dies before it acks. The hook makes
/// the runtime drop each message after its first COMMIT without any ack, as
/// a crash would; JetStream redelivers after ack_wait. One effect each.
async fn crash_after_commit_before_ack_is_applied_once(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("CRASH", Duration::from_secs(120)).await;
    const MESSAGES: usize = 5;
    for i in 0..MESSAGES {
        publish(
            &js,
            &subject,
            &deposit(i as i64),
            Some(&format!("crash-{i}")),
        )
        .await;
    }

    let faults = FaultHooks::default().after_commit(|delivery| {
        if delivery.delivered() == 1 {
            AfterCommit::DropWithoutAck
        } else {
            AfterCommit::Ack
        }
    });
    let router = Router::new()
        .route(
            Route::new(&stream, "credit")
                .batching(batch)
                .ack_wait(Duration::from_secs(1)),
            crash_after_commit,
        )
        .fault_hooks(faults);
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &stream, "credit").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("credit").unwrap();
    assert_eq!(
        stats.dropped_by_fault(),
        MESSAGES as u64,
        "every first delivery was committed and never acked"
    );
    assert_eq!(stats.processed(), MESSAGES as u64);
    assert_eq!(
        stats.duplicates(),
        MESSAGES as u64,
        "every redelivery found its dedup row"
    );
    assert_eq!(
        ledger(&pool, "crash-after-commit").await,
        Ledger::once_each(MESSAGES as i64)
    );
    let redelivered_effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE delivered > 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(redelivered_effects, 0, "no redelivery ran the body");
}

/// Whether the first attempt saw the redelivery blocked on its claim.
#[derive(Clone, Default)]
struct SawBlockedClaim(Arc<AtomicBool>);

#[idempotent(name = "racing-redelivery")]
async fn racing_redelivery(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(saw_blocked_claim): State<SawBlockedClaim>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if delivery.delivered() == 1 {
        // Stay inside the transaction until another backend waits on the
        // lock of this transaction's claim: the redelivery that ack_wait
        // triggers, blocked on the unique key.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let waiters: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid))",
            )
            .fetch_one(&mut **tx)
            .await?;
            if waiters > 0 {
                saw_blocked_claim.0.store(true, Ordering::SeqCst);
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(sqlx::Error::Protocol(
                    "no redelivery blocked on the claim within 30 s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    record_effect(tx, "racing-redelivery", &d, delivery).await
}

/// Scenario 3: ack_wait expires while the first attempt is still inside its
/// transaction (heartbeats off), and a redelivery runs beside it, on a
/// second worker on the same consumer or on the first one's other slot. It
/// waits on the unique key, then skips. (Each worker has two slots: a
/// worker whose every slot is busy keeps what it fetches parked until one
/// frees, so a redelivery it fetched would wait there, not race.)
async fn redelivery_during_first_attempt_waits_on_claim_then_skips(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RACE", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit(7), Some("race-1")).await;

    let route = || {
        Route::new(&stream, "credit")
            .batching(batch)
            .ack_wait(Duration::from_secs(1))
            .without_heartbeat()
            .allow_redelivery_while_running()
            .concurrency(2)
    };
    // Both workers share the flag: either may take the first attempt.
    let saw_blocked_claim = SawBlockedClaim::default();
    let (first, first_task) = spawn(
        Router::with_state(saw_blocked_claim.clone()).route(route(), racing_redelivery),
        nats.clone(),
        pool.clone(),
    );
    let (second, second_task) = spawn(
        Router::with_state(saw_blocked_claim.clone()).route(route(), racing_redelivery),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "credit").await;
    stop(first.clone(), first_task).await;
    stop(second.clone(), second_task).await;

    assert!(
        saw_blocked_claim.0.load(Ordering::SeqCst),
        "the redelivery blocked on the claim while the first attempt was open"
    );
    let (a, b) = (
        first.stats("credit").unwrap(),
        second.stats("credit").unwrap(),
    );
    assert_eq!(a.processed() + b.processed(), 1);
    // With heartbeats off, ack_wait can expire again while the blocked
    // redelivery waits, so there may be more than one; each one skipped.
    assert!(
        a.duplicates() + b.duplicates() >= 1,
        "the blocked redelivery skipped"
    );
    assert_eq!(a.failed() + b.failed(), 0);
    assert_eq!(
        ledger(&pool, "racing-redelivery").await,
        Ledger::once_each(1)
    );
}

/// What each later attempt saw before it wrote: (effects of this message,
/// dedup rows of this message including its own fresh claim).
#[derive(Clone, Default)]
struct SeenByRetry(Arc<Mutex<Vec<(i64, i64)>>>);

#[derive(Debug, thiserror::Error)]
#[error("injected failure on delivery {0}")]
struct InjectedFailure(u64);

#[idempotent(name = "fails-once")]
async fn fails_once(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(seen_by_retry): State<SeenByRetry>,
    d: Deposit,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if delivery.delivered() == 1 {
        // The write happens, then the handler fails: it must be rolled back.
        record_effect(tx, "fails-once", &d, delivery).await?;
        return Err(InjectedFailure(delivery.delivered()).into());
    }
    let seen: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM effects WHERE message_id = $1),
                (SELECT count(*) FROM idem_processed WHERE handler = 'fails-once' AND key = idem_key('fails-once', $1))",
    )
    .bind(delivery.message_id().as_str())
    .fetch_one(&mut **tx)
    .await?;
    seen_by_retry.0.lock().unwrap().push(seen);
    record_effect(tx, "fails-once", &d, delivery).await?;
    Ok(())
}

/// Scenario 4: the handler writes, then fails. Nothing of its writes and no
/// dedup row survive; the redelivery then applies the message once.
async fn handler_error_leaves_nothing_and_redelivery_applies_once(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FAIL", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit(3), Some("fail-1")).await;

    let seen_by_retry = SeenByRetry::default();
    let router = Router::with_state(seen_by_retry.clone()).route(
        Route::new(&stream, "credit")
            .batching(batch)
            .backoff(Duration::from_millis(200), Duration::from_secs(1)),
        fails_once,
    );
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &stream, "credit").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("credit").unwrap();
    assert_eq!(
        (stats.failed(), stats.processed(), stats.duplicates()),
        (1, 1, 0),
        "one failure, then one success, and no duplicate: the failed claim did not persist"
    );
    assert_eq!(
        *seen_by_retry.0.lock().unwrap(),
        vec![(0, 1)],
        "the retry saw no effect of the failed attempt, and only its own claim"
    );
    assert_eq!(ledger(&pool, "fails-once").await, Ledger::once_each(1));
    let delivered: i64 = sqlx::query_scalar("SELECT delivered FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(delivered, 2, "the surviving effect is the redelivery's");
}

#[idempotent(name = "audit")]
async fn audit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "audit", &d, delivery).await
}

#[idempotent(name = "notify")]
async fn notify(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "notify", &d, delivery).await
}

/// Scenario 5: two handlers consume the same messages through their own
/// durable consumers. The handler name keeps their claims apart: one effect
/// each, per message.
async fn two_handlers_on_one_message_apply_once_each(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FANOUT", Duration::from_secs(120)).await;
    const MESSAGES: i64 = 20;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit(i), Some(&format!("fan-{i}"))).await;
    }
    let router = Router::new()
        .route(Route::new(&stream, "audit").batching(batch), audit)
        .route(Route::new(&stream, "notify").batching(batch), notify);
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &stream, "audit").await;
    wait_all_acked(&js, &stream, "notify").await;
    stop(handle.clone(), task).await;

    for handler in ["audit", "notify"] {
        let stats = handle.stats(handler).unwrap();
        assert_eq!(
            (stats.processed(), stats.duplicates()),
            (MESSAGES as u64, 0)
        );
        assert_eq!(
            ledger(&pool, handler).await,
            Ledger::once_each(MESSAGES),
            "handler {handler}"
        );
    }
}

/// ack_wait for the heartbeat scenario: 2 s leaves heartbeats (every 667 ms)
/// a margin even on a loaded 2-core CI machine.
const SLOW_ACK_WAIT: Duration = Duration::from_secs(2);

#[idempotent(name = "slow")]
async fn slow(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    // Three times the test's ack_wait.
    tokio::time::sleep(SLOW_ACK_WAIT * 3).await;
    record_effect(tx, "slow", &d, delivery).await
}

/// Runs `slow` on one message with ack_wait 2 s and returns the route's
/// stats. `heartbeat` turns `+WPI` heartbeats on or off.
async fn run_slow_handler(
    heartbeat: bool,
    batch: Batching,
) -> (std::sync::Arc<idem_runtime::Stats>, Ledger) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SLOW", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit(1), Some("slow-1")).await;
    let mut route = Route::new(&stream, "credit")
        .batching(batch)
        .ack_wait(SLOW_ACK_WAIT)
        .concurrency(4);
    if !heartbeat {
        route = route.without_heartbeat().allow_redelivery_while_running();
    }
    let (handle, task) = spawn(Router::new().route(route, slow), nats, pool.clone());
    wait_all_acked(&js, &stream, "credit").await;
    stop(handle.clone(), task).await;
    (handle.stats("credit").unwrap(), ledger(&pool, "slow").await)
}

/// Scenario 6: a handler that runs for 3× ack_wait, with heartbeats on, is
/// delivered once.
async fn heartbeats_keep_a_long_handler_from_redelivery(batch: Batching) {
    let (stats, ledger) = run_slow_handler(true, batch).await;
    assert_eq!(stats.received(), 1, "delivered exactly once");
    assert_eq!((stats.processed(), stats.duplicates()), (1, 0));
    assert_eq!(ledger, Ledger::once_each(1));
}

/// The control for scenario 6: without heartbeats the same handler is
/// redelivered mid-work, which proves the test above can see a redelivery.
async fn without_heartbeats_a_long_handler_is_redelivered_but_applied_once(batch: Batching) {
    let (stats, ledger) = run_slow_handler(false, batch).await;
    assert!(
        stats.received() >= 2,
        "redelivered while running: {stats:?}"
    );
    assert_eq!(stats.processed(), 1);
    assert_eq!(stats.duplicates(), stats.received() - 1);
    assert_eq!(ledger, Ledger::once_each(1));
}

// Every scenario runs in per-message mode and in batch mode.
idem_tests::in_every_mode!(
    batch = 16;
    publisher_retry_after_duplicate_window_is_applied_once,
    crash_after_commit_before_ack_is_applied_once,
    redelivery_during_first_attempt_waits_on_claim_then_skips,
    handler_error_leaves_nothing_and_redelivery_applies_once,
    two_handlers_on_one_message_apply_once_each,
    heartbeats_keep_a_long_handler_from_redelivery,
    without_heartbeats_a_long_handler_is_redelivered_but_applied_once,
);
