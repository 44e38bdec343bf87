//! How a failure is classed, so that it costs only its own message: a payload
//! that does not decode, a permanent error, a panicking handler and a claim
//! that always fails with the same SQLSTATE are dead-lettered (or retried with
//! backoff) while the messages around them flow, each applied once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Classify, Delivery, ErrorClass, Route, Router, State, dead_letter, idempotent};
use idem_tests::scenario::*;
use idem_tests::{Batched, Batching};

// --- Handler panics --------------------------------------------------------

#[idempotent(name = "bomb")]
async fn bomb(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "bomb", &d, delivery).await?;
    assert!(d.account != "bomb", "the handler hit a bug");
    Ok(())
}

/// A handler panics on one message. Its neighbours, in a batch or not, are
/// applied once on their first delivery; the panicking message is retried
/// with backoff (not after ack_wait) and dead-lettered with the panic's
/// message once it runs out of deliveries.
async fn a_panicking_handler_fails_only_its_own_message(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PANIC", Duration::from_secs(120)).await;
    for i in 0..8 {
        let account = if i == 3 { "bomb" } else { "ok" };
        publish(&js, &subject, &deposit(account, i), Some(&format!("p-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .batching(batch)
                .concurrency(1)
                .max_deliver(3)
                .ack_wait(Duration::from_secs(30)),
            bomb,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    // In a batch, the panic is followed by a question on a connection of
    // its own (did the batch commit?), which is kept for the next message:
    // that one must not take it for a session that holds the prepared
    // claim (it once did, and its EXECUTE failed with 26000 and ran again).
    assert_eq!(
        handle.stats("c").unwrap().retried_in_process(),
        0,
        "no transaction ran again"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1, "only the panicking message");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "p-3");
    assert_eq!(header(&letters[0], "Idem-Failure"), "exhausted");
    assert!(header(&letters[0], "Idem-Error").contains("the handler hit a bug"));
    assert_eq!(ledger(&pool, "bomb").await, Ledger::once_each(7));
    let late: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE delivered > 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(late, 0, "every neighbour applied on its first delivery");
}

idem_tests::in_every_mode!(batch = 8; a_panicking_handler_fails_only_its_own_message);

// ---------------------------------------------------------------------------
// One message whose claim can never succeed stops its whole route.
// ---------------------------------------------------------------------------

/// Every failure of the claim was once taken for "the database could not be
/// used", whatever its SQLSTATE. In a database whose encoding is not UTF-8
/// (LATIN1 here, still common in old installations), a message id with a
/// character LATIN1 lacks fails the claim with 22P05 on every try: that one
/// message was held forever and paused its route. Now a claim's failure is
/// classed by its SQLSTATE: a data exception is this message's, so it is
/// dead-lettered, and the next message flows.
#[tokio::test]
async fn one_message_whose_claim_always_fails_does_not_stop_its_route() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LATIN1", Duration::from_secs(120)).await;
    sqlx::query(
        "CREATE DATABASE legacy TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let url = env.database_url();
    let legacy_url = format!("{}/legacy", &url[..url.rfind('/').unwrap()]);
    let legacy = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&legacy_url)
        .await
        .unwrap();
    prepare_database(&legacy).await;

    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), plain),
        nats,
        legacy.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("заказ-1")).await;
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claim of the first message failed",
        Duration::from_secs(30),
        || async { stats.failed() >= 1 },
    )
    .await;
    publish(&js, &subject, &deposit("b", 2), Some("order-2")).await;

    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.processed() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = consumer_info(&js, &stream, "c").await;
    let letters = dead_letters(&js, &stream).await.len();
    task.abort();
    assert!(
        stats.processed() == 1 && letters == 1,
        "the route stopped on one message: processed {}, dead letters {letters}, {} held \
         claims, pending {} (never delivered), ack pending {}",
        stats.processed(),
        stats.infrastructure_errors(),
        info.num_pending,
        info.num_ack_pending
    );
    assert_eq!(
        stats.infrastructure_errors(),
        0,
        "never taken for an outage"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert!(header(&letters[0], "Idem-Error").contains("22P05"));
}

/// A payload that does not decode is dead-lettered on its first delivery,
/// with the original payload and an error header, and the good messages
/// around it are all processed.
#[tokio::test]
async fn poison_payload_is_dead_lettered_once_and_good_messages_flow() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("POISON", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("good-1")).await;
    let poison = js
        .publish(subject.clone(), "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    for i in 2..=5 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("good-{i}"))).await;
    }

    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), plain),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.rejected(), stats.dead_lettered()), (1, 1));
    assert_eq!(
        stats.received(),
        6,
        "the poison was delivered once, never again"
    );
    assert_eq!(
        ledger(&pool, "plain").await.effects,
        5,
        "every good message applied"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(&letter.payload[..], b"{not json");
    assert_eq!(header(letter, "Idem-Failure"), "undecodable");
    assert_eq!(
        header(letter, "Idem-Original-Sequence"),
        poison.sequence.to_string()
    );
    assert_eq!(header(letter, "Idem-Original-Subject"), subject);
    assert_eq!(header(letter, "Idem-Handler"), "plain");
    assert_eq!(header(letter, "Idem-Delivered"), "1");
    assert!(header(letter, "Idem-Error").contains("does not decode"));
    assert!(!header(letter, "Idem-Dead-Lettered-At").is_empty());
}

/// The handler's own error type decides its class through `Classify`.
#[derive(Debug, thiserror::Error)]
enum LedgerError {
    #[error("account {0:?} is closed")]
    Closed(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Classify for LedgerError {
    fn class(&self) -> ErrorClass {
        match self {
            LedgerError::Closed(_) => ErrorClass::Permanent,
            LedgerError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// Whether the bug that makes `closed_accounts` refuse account "a" is in.
#[derive(Clone)]
struct BugPresent(Arc<AtomicBool>);

#[idempotent(name = "closed-accounts")]
async fn closed_accounts(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<BugPresent>,
    d: Deposit,
) -> Result<(), LedgerError> {
    if bug.0.load(Ordering::SeqCst) {
        return Err(LedgerError::Closed(d.account));
    }
    record_effect(tx, "closed-accounts", &d, delivery).await?;
    Ok(())
}

/// A permanent error (chosen by the error type) is dead-lettered on its
/// first delivery. Once the bug is fixed, replaying the dead letter applies
/// it once; a second replay inside JetStream's window is refused.
#[tokio::test]
async fn permanent_error_is_dead_lettered_at_once_and_replay_applies_it_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("REPLAY", Duration::from_secs(120)).await;
    // No Nats-Msg-Id: the id is `<stream>:1:<stored at>`, and the replay must
    // keep it.
    publish(&js, &subject, &deposit("a", 9), None).await;
    let bug = BugPresent(Arc::new(AtomicBool::new(true)));
    let router =
        Router::with_state(bug.clone()).route(fast(Route::new(&stream, "c")), closed_accounts);
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.received(), stats.dead_lettered()), (1, 1));
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert_eq!(
        header(&letters[0], "Idem-Message-Id"),
        stream_position(&js, &stream, 1).await
    );

    bug.0.store(false, Ordering::SeqCst);
    let replayed = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is published");
    assert_eq!(replayed.stream, stream);
    eventually(
        "the replay is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 1 },
    )
    .await;
    let again = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence).await;
    assert!(
        matches!(again, Err(dead_letter::ReplayError::InsideDuplicateWindow)),
        "{again:?}"
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    let ledger = ledger(&pool, "closed-accounts").await;
    assert_eq!(ledger, Ledger::once_each(1));
    let id: String = sqlx::query_scalar("SELECT message_id FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        id,
        stream_position(&js, &stream, 1).await,
        "the replay kept the original's id"
    );
}
