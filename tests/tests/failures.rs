//! Failure semantics against real servers: retries, dead letters, poison
//! input, bad message ids, ambiguous commits and start-up refusals. Each test
//! checks that nothing is lost and nothing is applied twice, and that the
//! fault it injects really happened.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use common::pg_proxy::{PgProxy, upstream_of};
use common::*;
use idem_runtime::{
    Classify, Delivery, Error, ErrorClass, Route, Router, State, Transient, dead_letter, idempotent,
};

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.into(),
        amount,
    }
}

/// Quick retries, so the tests wait milliseconds rather than seconds.
fn fast(route: Route) -> Route {
    route.backoff(Duration::from_millis(50), Duration::from_millis(200))
}

#[idempotent(name = "plain")]
async fn plain(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain", &d, delivery).await
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

#[idempotent(name = "always-fails")]
async fn always_fails(
    _tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    _d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    Err(format!("downstream unavailable (delivery {})", delivery.delivered()).into())
}

/// A message that keeps failing is dead-lettered on its last allowed
/// delivery, with its context, then TERMed: it is not delivered again.
#[tokio::test]
async fn exhausted_deliveries_are_dead_lettered_and_not_redelivered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("EXHAUST", Duration::from_secs(120)).await;
    let original = publish(&js, &subject, &deposit("a", 5), Some("doomed-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).max_deliver(3), always_fails),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.received(), stats.dead_lettered()), (3, 1));
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_redelivered),
        (0, 0, 0),
        "TERMed: nothing left to redeliver"
    );
    stop(handle.clone(), task).await;
    assert_eq!(stats.received(), 3, "not delivered a fourth time");

    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(header(letter, "Idem-Failure"), "exhausted");
    assert_eq!(header(letter, "Idem-Delivered"), "3");
    assert_eq!(header(letter, "Idem-Message-Id"), "doomed-1");
    assert_eq!(header(letter, "Idem-Original-Stream"), stream);
    assert_eq!(
        header(letter, "Idem-Original-Sequence"),
        original.sequence.to_string()
    );
    assert!(header(letter, "Idem-Error").contains("downstream unavailable (delivery 3)"));
    assert_eq!(ledger(&pool, "always-fails").await.dedup_rows, 0);
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

/// The connection drops while COMMIT is in flight: the server committed, the
/// worker cannot know. It must not ack; the redelivery finds the dedup row
/// and is skipped, and the pool stays healthy.
#[tokio::test]
async fn ambiguous_commit_is_not_acked_and_the_redelivery_is_skipped() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("AMBIGUOUS", Duration::from_secs(120)).await;
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .expect("pool through the proxy");

    proxy.cut_next_commit();
    publish(&js, &subject, &deposit("a", 1), Some("ambiguous-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), plain),
        nats,
        proxied.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        proxy.cuts(),
        1,
        "the connection was cut after COMMIT reached the server"
    );
    assert_eq!(stats.commit_failed(), 1, "the worker saw the COMMIT fail");
    assert_eq!(
        stats.duplicates(),
        1,
        "the redelivery found the committed claim"
    );
    assert_eq!(stats.processed(), 0);

    // The pool still works, and none of its connections is left in a
    // transaction.
    for i in 0..10 {
        publish(&js, &subject, &deposit("b", i), Some(&format!("after-{i}"))).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    let stuck: i64 = sqlx::query_scalar(
        // A transaction that wrote something (an empty one is how a route
        // keeps a connection for a moment between messages).
        "SELECT count(*) FROM pg_stat_activity
         WHERE state LIKE 'idle in transaction%' AND backend_xid IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stuck, 0);
    stop(handle, task).await;
    assert_eq!(stats.processed(), 10);
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(11));
}

/// A durable consumer that exists with other settings is not silently
/// reused or overwritten.
#[tokio::test]
async fn conflicting_consumer_is_refused_unless_update_is_asked_for() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("CONFLICT", Duration::from_secs(120)).await;
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("c".into()),
            ack_wait: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .unwrap();
    let error = Router::new()
        .route(Route::new(&stream, "c"), plain)
        .run_until(nats.clone(), pool.clone(), std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::ConsumerConflict { .. }), "{error}");
    assert!(error.to_string().contains("ack_wait: 5s -> 30s"), "{error}");

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").update_consumer(), plain),
        nats,
        pool,
    );
    eventually(
        "the consumer is updated",
        Duration::from_secs(30),
        || async {
            js.get_stream(&stream)
                .await
                .unwrap()
                .consumer_info("c")
                .await
                .is_ok_and(|info| info.config.ack_wait == Duration::from_secs(30))
        },
    )
    .await;
    stop(handle, task).await;
}

/// A route that names its own dead-letter subject needs a stream that
/// stores it; without one it is refused at start-up.
#[tokio::test]
async fn missing_dead_letter_stream_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("NODLQ", Duration::from_secs(120)).await;
    let error = Router::new()
        .route(
            Route::new(&stream, "c").dead_letter_subject("nowhere.dead"),
            plain,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::DeadLetterStreamMissing { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("nowhere.dead"), "{error}");
}

/// Publishes `payload` with a `Nats-Msg-Id` header that is not UTF-8, over a
/// raw connection: no NATS client library would send it.
async fn publish_non_utf8_header(nats_url: &str, subject: &str, payload: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = nats_url.trim_start_matches("nats://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut info = [0u8; 4096];
    let _ = socket.read(&mut info).await.unwrap();
    let header = b"NATS/1.0\r\nNats-Msg-Id: \xff\xfe-not-utf8\r\n\r\n";
    let mut frame = format!(
        "CONNECT {{\"verbose\":false,\"headers\":true,\"protocol\":1}}\r\nHPUB {subject} {} {}\r\n",
        header.len(),
        header.len() + payload.len()
    )
    .into_bytes();
    frame.extend_from_slice(header);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(b"\r\nPING\r\n");
    socket.write_all(&frame).await.unwrap();
    let mut pong = [0u8; 64];
    let read = socket.read(&mut pong).await.unwrap();
    assert!(
        String::from_utf8_lossy(&pong[..read]).contains("PONG"),
        "the server took the raw publish"
    );
}

/// A header that is not UTF-8 never reaches the handler: the client drops
/// its connection on it, and every message delivered with it is redelivered
/// too. JetStream stops after the backstop limit, and the router
/// dead-letters what it gave up on, raw headers kept. Nothing is lost: the
/// good message is either processed or dead-lettered beside it and replayed.
#[tokio::test]
async fn a_header_that_is_not_utf8_is_dead_lettered_and_nothing_is_lost() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NONUTF8", Duration::from_secs(120)).await;
    let poison = br#"{"account":"x","amount":1}"#;
    publish_non_utf8_header(env.nats_url(), &subject, poison).await;
    // No Nats-Msg-Id, so that a replay is not caught by JetStream's window.
    publish(&js, &subject, &deposit("a", 2), None).await;
    assert_eq!(
        js.get_stream(&stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        2,
        "both messages are stored"
    );

    // The poison drops the router's connection again and again; the checks
    // below use a connection of their own.
    let js = jetstream::new(env.nats().await);
    let route = Route::new(&stream, "c")
        .ack_wait(Duration::from_secs(1))
        .max_deliver(1);
    let (handle, task) = spawn(Router::new().route(route, plain), nats, pool.clone());
    let stats = handle.stats("c").unwrap();
    let letter_of = |letters: &[jetstream::message::StreamMessage], sequence: &str| {
        letters
            .iter()
            .find(|letter| header(letter, "Idem-Original-Sequence") == sequence)
            .cloned()
    };
    eventually(
        "the poison is dead-lettered, and the good message processed or dead-lettered",
        Duration::from_secs(60),
        || async {
            let letters = dead_letters(&js, &stream).await;
            letter_of(&letters, "1").is_some()
                && (stats.processed() == 1 || letter_of(&letters, "2").is_some())
        },
    )
    .await;

    let letters = dead_letters(&js, &stream).await;
    let letter = letter_of(&letters, "1").unwrap();
    assert_eq!(header(&letter, "Idem-Failure"), "undeliverable");
    assert_eq!(&letter.payload[..], poison);
    use base64::Engine;
    let original_headers = base64::engine::general_purpose::STANDARD
        .decode(header(&letter, "Idem-Original-Headers-Base64"))
        .unwrap();
    assert!(
        original_headers.windows(2).any(|pair| pair == b"\xff\xfe"),
        "the raw header block is kept"
    );
    // Its Nats-Msg-Id is not UTF-8, so the id it would have been
    // deduplicated by cannot be known: the dead letter says so, and a replay
    // is refused unless asked for.
    assert_eq!(header(&letter, "Idem-Message-Id"), "");
    assert_eq!(header(&letter, "Idem-Message-Id-Source"), "unknown");
    let refused = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence).await;
    assert!(
        matches!(refused, Err(dead_letter::ReplayError::NoMessageId(_))),
        "{refused:?}"
    );
    if let Some(good) = letter_of(&letters, "2") {
        // Redelivered with the poison each time, it ran out of deliveries
        // too; it keeps its id, and replayed, it is processed.
        assert_eq!(
            header(&good, "Idem-Message-Id"),
            stream_position(&js, &stream, 2).await
        );
        dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, good.sequence)
            .await
            .unwrap();
    }
    eventually(
        "the good message is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 1 },
    )
    .await;
    // Known never to have been processed, the poison is replayed under a
    // new id, without the header that made it undeliverable.
    dead_letter::replay_with(
        &js,
        dead_letter::DEFAULT_STREAM,
        letter.sequence,
        dead_letter::ReplayOptions::default().allow_new_message_id(),
    )
    .await
    .unwrap();
    eventually(
        "the replayed poison is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 2 },
    )
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(2));
}
