//! Batch mode: one claim statement and one COMMIT per batch, each message
//! still applied once; a failing message does not fail its neighbours, and a
//! message NAKed in the fallback is redelivered after its backoff, not
//! heartbeaten.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Delivery, Permanent, Route, Router, State, Transient, idempotent};
use idem_tests::scenario::*;

// --- Heartbeats in a batch fallback ---------------------------------------

/// What the `fallback` handler saw, shared by its runs and the test.
#[derive(Clone, Default)]
struct FallbackFlags {
    /// Whether the "fails" message's second delivery has started.
    redelivery_started: Arc<AtomicBool>,
    /// Whether the slow neighbour ran in the fallback of the failed batch
    /// of 4 (in one of its halves) and saw the redelivery start before it
    /// finished.
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
            // The claims this transaction made: fewer than the batch's 4 in
            // the fallback, which tries the failed batch again in halves.
            let claims: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_claims
                 WHERE xmin = pg_current_xact_id()::xid",
            )
            .fetch_one(&mut **tx)
            .await?;
            flags.slow_in_fallback.store(claims < 4, Ordering::SeqCst);
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
