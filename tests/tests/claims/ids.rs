//! The id a message is claimed by: an explicit key over `Nats-Msg-Id`, then
//! the header, then the stream position (which a recreated stream must not
//! repeat); and ids that cannot be claimed (empty, too long, none from the
//! key, a key that panics or holds a line break) are dead-lettered as `bad-
//! message-id` on the first delivery.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::{BoxError, Delivery, MessageIdSource, Permanent, Route, Router, idempotent};
use idem_tests::scenario::*;

/// Messages without `Nats-Msg-Id` fall back to an id built from their stream
/// sequence. Sequences restart at 1 when a stream is deleted and recreated:
/// the new messages must not be mistaken for the old ones.
#[tokio::test]
async fn a_recreated_stream_does_not_skip_new_messages_without_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RECREATE", Duration::from_secs(120)).await;
    for i in 0..5 {
        publish(&js, &subject, &deposit("before", i), None).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    js.delete_stream(&stream).await.unwrap();
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    for i in 0..5 {
        let ack = publish(&js, &subject, &deposit("after", i), None).await;
        assert_eq!(ack.sequence, i as u64 + 1, "the sequences start over");
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (5, 0));
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(10));
}

// ---------------------------------------------------------------------------
// A key expression that panics: the message is never dead-lettered, and
// the given-up watcher of the route dies on it.
// ---------------------------------------------------------------------------

/// How often the key below was computed. A `static`, not router state: a
/// `key = ...` expression sees the payload and the delivery, not the state.
static KEY_CALLS: AtomicUsize = AtomicUsize::new(0);

/// The first 8 bytes of the account: a bug for short accounts.
fn first_eight(account: &str) -> &str {
    KEY_CALLS.fetch_add(1, Ordering::SeqCst);
    &account[..8]
}

#[idempotent(name = "panicky-key", key = first_eight(&d.account))]
async fn panicky_key(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "panicky-key", &d, delivery).await
}

/// A key expression that panics once killed the message's task before it
/// was settled, on every delivery, until JetStream gave up; the given-up
/// watcher then panicked on the same key and died. Now the key runs under
/// `catch_unwind`: the message is dead-lettered on its first delivery
/// (`bad-message-id`, the panic's text in `Idem-Error`), and the route, and
/// its watcher, go on.
#[tokio::test]
async fn a_key_that_panics_is_dead_lettered_at_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEYPANIC", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), panicky_key),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("short", 1), Some("kp-1")).await;
    publish(&js, &subject, &deposit("long enough", 1), Some("kp-2")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert!(
        KEY_CALLS.load(Ordering::SeqCst) >= 2,
        "the key ran, and panicked once"
    );
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.received(), stats.processed()),
        (2, 1),
        "delivered once each"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "bad-message-id");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "kp-1");
    assert!(header(&letters[0], "Idem-Error").contains("the handler's key panicked"));
    assert_eq!(ledger(&pool, "panicky-key").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// A key with a line break: the dead-letter publish panics.
// ---------------------------------------------------------------------------

#[idempotent(name = "refuses-by-key", key = d.account)]
async fn refuses_by_key(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> Result<(), BoxError> {
    Err(Permanent::new(format!("account {:?} is closed", d.account)).into())
}

/// A key with a line break ("free text" keys, `{:#?}` keys) once passed as a
/// message id, and the dead letter's `Idem-Message-Id` header then panicked
/// in async-nats, on every delivery. Now an id with a line break is refused
/// when it is resolved: the message is dead-lettered on its first delivery
/// as `bad-message-id` (its dead letter carries the id it could be
/// deduplicated by before the key, its stream position).
#[tokio::test]
async fn a_key_with_a_line_break_is_dead_lettered_at_once() {
    let Scenario {
        env: _env,
        pool: _pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEYCRLF", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), refuses_by_key),
        nats.clone(),
        _pool,
    );
    publish(&js, &subject, &deposit("line 1\nline 2", 1), None).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.received(), stats.rejected(), stats.dead_lettered()),
        (1, 1, 1)
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "bad-message-id");
    assert!(header(&letters[0], "Idem-Error").contains("line break"));
    assert_eq!(
        header(&letters[0], "Idem-Message-Id-Source"),
        "stream-position"
    );
}

#[idempotent(name = "keyed", key = d.account)]
async fn keyed(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "keyed", &d, delivery).await
}

/// Empty and oversized `Nats-Msg-Id`s, and a key that yields nothing, are
/// dead-lettered as `bad-message-id`; they are never claimed, and the
/// runtime goes on.
#[tokio::test]
async fn bad_message_ids_are_dead_lettered_with_a_reason() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BADID", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("")).await;
    let oversized = "x".repeat(idem_runtime::MAX_MESSAGE_ID_LEN + 1);
    publish(&js, &subject, &deposit("b", 1), Some(&oversized)).await;
    publish(&js, &subject, &deposit("c", 1), Some("fine")).await;

    let keyed_subject = format!("{stream}.keyed");
    let keyed_stream = format!("{stream}_KEYED");
    create_stream(&js, &keyed_stream, &keyed_subject, Duration::from_secs(120)).await;
    publish(&js, &keyed_subject, &deposit("", 1), None).await;
    publish(&js, &keyed_subject, &deposit("d", 1), None).await;

    let (handle, task) = spawn(
        Router::new()
            .route(fast(Route::new(&stream, "c")), plain)
            .route(fast(Route::new(&keyed_stream, "k")), keyed),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    wait_all_acked(&js, &keyed_stream, "k").await;
    stop(handle.clone(), task).await;

    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert_eq!(header(letter, "Idem-Failure"), "bad-message-id");
    }
    assert!(header(&letters[0], "Idem-Error").contains("empty"));
    assert!(header(&letters[1], "Idem-Error").contains("bytes"));
    let keyed_letters = dead_letters(&js, &keyed_stream).await;
    assert_eq!(keyed_letters.len(), 1);
    assert_eq!(header(&keyed_letters[0], "Idem-Failure"), "bad-message-id");
    assert_eq!(ledger(&pool, "plain").await.effects, 1);
    assert_eq!(ledger(&pool, "keyed").await.effects, 1);
    assert_eq!(
        handle.stats("c").unwrap().received(),
        3,
        "none was redelivered"
    );
}

#[idempotent(name = "by-account", key = d.account)]
async fn by_account(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    assert_eq!(delivery.message_id().source(), MessageIdSource::Key);
    record_effect(tx, "by-account", &d, delivery).await
}

/// An explicit `key = ...` takes precedence over `Nats-Msg-Id`: messages with
/// different header ids but the same key are applied once.
#[tokio::test]
async fn explicit_key_dedups_across_different_nats_msg_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEY", Duration::from_secs(120)).await;
    for (i, account) in ["a", "b", "a", "a", "b", "c"].iter().enumerate() {
        publish(
            &js,
            &subject,
            &deposit(account, 1),
            Some(&format!("hdr-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), by_account),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (3, 3));
    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY message_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids, ["a", "b", "c"]);
}

/// Without a key, the `Nats-Msg-Id` header is the id, and without that,
/// `<stream>:<sequence>:<stored at>`.
#[tokio::test]
async fn header_then_stream_sequence_are_the_fallback_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("IDS", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("from-header")).await;
    publish(&js, &subject, &deposit("b", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), ids),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY account")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        ids,
        vec![
            "from-header".to_owned(),
            stream_position(&js, &stream, 2).await
        ]
    );
}
