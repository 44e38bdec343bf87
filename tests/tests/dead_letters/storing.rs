//! Dead letters are stored whatever stands in the way: a message too big to
//! dead-letter as it is, large headers, a dead-letter stream that refuses a
//! message or is gone for a while, a recreated stream whose positions repeat;
//! and a message whose deliveries ran out is dead-lettered and not delivered
//! again.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_runtime::{Delivery, Permanent, Route, Router, Stats, dead_letter, idempotent};
use idem_tests::scenario::*;

use crate::{Bug, refuses};

#[idempotent(name = "always-refuses")]
async fn always_refuses(
    _tx: &mut sqlx::PgTransaction<'_>,
    _d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    Err(Permanent::new("this handler refuses everything").into())
}

/// The same holds for dead letters, which JetStream deduplicates by an id
/// built from the original's position: a message of the recreated stream
/// must get a dead letter of its own, not be taken for the old one's.
#[tokio::test]
async fn a_recreated_stream_does_not_swallow_new_dead_letters() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RECREATEDL", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("before", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), always_refuses),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    js.delete_stream(&stream).await.unwrap();
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("after", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), always_refuses),
        nats,
        pool,
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(handle.stats("c").unwrap().dead_lettered(), 1);
    let letters = dead_letters(&js, &stream).await;
    let accounts: Vec<String> = letters
        .iter()
        .map(|letter| {
            serde_json::from_slice::<Deposit>(&letter.payload)
                .unwrap()
                .account
        })
        .collect();
    assert_eq!(
        accounts,
        ["before", "after"],
        "both dead letters are stored"
    );
}

// --- The dead-letter stream is unavailable -------------------------------

/// The dead-letter stream is gone for longer than any number of redeliveries
/// would cover. The message is held (its heartbeats keep it leased) and the
/// publish retried until the stream is back: it is dead-lettered on its
/// first delivery and never parked.
#[tokio::test]
async fn a_dead_letter_stream_outage_loses_nothing() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DLOUTAGE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(2),
            always_refuses,
        ),
        nats,
        pool.clone(),
    );
    let dead_letter_config = eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    js.delete_stream(dead_letter::DEFAULT_STREAM).await.unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("outage-1")).await;

    let stats = handle.stats("c").unwrap();
    // More failed publishes than the route's deliveries and JetStream's
    // backstop together would ever allow: the outage outlasted them.
    eventually(
        "the dead-letter publish failed 10 times",
        Duration::from_secs(30),
        || async { stats.dead_letter_failed() >= 10 },
    )
    .await;
    js.create_stream(dead_letter_config).await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert_eq!(stats.dead_lettered(), 1);
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "outage-1");
    assert_eq!(
        header(&letters[0], "Idem-Delivered"),
        "1",
        "held, never redelivered"
    );
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_redelivered),
        (0, 0, 0)
    );
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

#[idempotent(name = "near-limit")]
async fn near_limit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "near-limit", &d, delivery).await
}

/// What a route and its dead letters show, for a failing test's message.
async fn figures(
    js: &jetstream::Context,
    pool: &sqlx::PgPool,
    stream: &str,
    handler: &str,
    stats: &Stats,
) -> String {
    let info = consumer_info(js, stream, "c").await;
    format!(
        "dead letters {}, effects {}, num_ack_pending {}, num_pending {}, failed dead-letter publishes {}",
        dead_letters(js, stream).await.len(),
        ledger(pool, handler).await.effects,
        info.num_ack_pending,
        info.num_pending,
        stats.dead_letter_failed(),
    )
}

/// Waits up to `timeout` for `condition`, then fails with the figures.
async fn settle_or_report<F, Fut>(
    what: &str,
    timeout: Duration,
    mut condition: F,
    report: impl AsyncFn() -> String,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !condition().await {
        if started.elapsed() > timeout {
            panic!("{what}: not after {timeout:?}: {}", report().await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// 1. A dead letter that cannot fit as it is (finding 1).
// ---------------------------------------------------------------------------

/// A message 264 B under the server's `max_payload` that does not decode,
/// then a valid one, on a route that takes one message at a time. The dead
/// letter adds its `Idem-*` headers (about 530 B), so it cannot be
/// published as it is: the client refuses it (`MaxPayloadExceeded`). It
/// must still be dead-lettered (its payload moved where it fits, nothing of
/// it lost), and the valid message behind it processed.
async fn a_message_too_big_to_dead_letter_does_not_stop_its_route(batch: usize) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("TOOBIG", Duration::from_secs(120)).await;
    let max_payload = nats.server_info().max_payload;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "big-1");
    // Not JSON: undecodable, dead-lettered on its first delivery.
    let original = bytes::Bytes::from(vec![b'x'; max_payload - 264]);
    js.publish_with_headers(subject.clone(), headers, original.clone())
        .await
        .unwrap()
        .await
        .expect("the original fits");
    publish(&js, &subject, &deposit("behind", 1), Some("ok-1")).await;
    // And one 40 B under: its replay, with the replay's own headers, cannot
    // fit either.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "big-2");
    js.publish_with_headers(
        subject.clone(),
        headers,
        vec![b'y'; max_payload - 40].into(),
    )
    .await
    .unwrap()
    .await
    .expect("the original fits");

    let mut route = fast(Route::new(&stream, "c")).concurrency(1);
    if batch > 1 {
        route = route.batch(batch);
    }
    let (handle, task) = spawn(Router::new().route(route, near_limit), nats, pool.clone());
    let stats = handle.stats("c").unwrap();
    settle_or_report(
        "the big message dead-lettered and the one behind it processed",
        Duration::from_secs(30),
        || async {
            let Ok(info) = js
                .get_stream(&stream)
                .await
                .unwrap()
                .consumer_info("c")
                .await
            else {
                return false;
            };
            dead_letters(&js, &stream).await.len() == 2
                && ledger(&pool, "near-limit").await.effects == 1
                && info.num_ack_pending == 0
                && info.num_pending == 0
        },
        async || figures(&js, &pool, &stream, "near-limit", &stats).await,
    )
    .await;
    stop(handle, task).await;

    assert_eq!(ledger(&pool, "near-limit").await, Ledger::once_each(1));
    let letters = dead_letters(&js, &stream).await;
    let sequence_of = |id: &str| {
        letters
            .iter()
            .find(|letter| header(letter, "Idem-Message-Id") == id)
            .map(|letter| letter.sequence)
            .unwrap_or_else(|| panic!("{id} is dead-lettered"))
    };
    assert!(
        letters
            .iter()
            .all(|letter| header(letter, "Idem-Failure") == "undecodable")
    );
    assert_eq!(stats.dead_letter_failed(), 0, "too big is not an outage");

    // Its payload was moved where it fits, and none of it is lost.
    let letter = dead_letter::get(&js, dead_letter::DEFAULT_STREAM, sequence_of("big-1"))
        .await
        .unwrap();
    let moved = letter
        .payload_moved()
        .expect("the dead letter says its payload was moved");
    assert_eq!(moved.bucket, dead_letter::BUCKET);
    assert_eq!(moved.bytes, Some(original.len() as u64));
    assert!(letter.payload.is_empty());
    let kept = dead_letter::original(&js, &letter).await.unwrap();
    assert!(
        kept.payload == original,
        "the moved payload is the original, byte for byte"
    );
    // The replay of the one 40 B under would not fit beside the replay's
    // own headers: refused, with the sizes, and nothing published.
    let before = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    let refused = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, sequence_of("big-2")).await;
    match &refused {
        Err(dead_letter::ReplayError::TooLarge { size, limit, .. }) => {
            assert_eq!(*limit, max_payload);
            assert!(*size > max_payload, "{refused:?}");
            let text = refused.as_ref().unwrap_err().to_string();
            assert!(
                text.contains(&size.to_string()) && text.contains(&max_payload.to_string()),
                "{text}"
            );
        }
        other => panic!("the replay cannot fit: {other:?}"),
    }
    let after = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(before, after, "nothing was published");
}

#[tokio::test]
async fn a_message_too_big_to_dead_letter_does_not_stop_its_route_per_message() {
    a_message_too_big_to_dead_letter_does_not_stop_its_route(1).await;
}

#[tokio::test]
async fn a_message_too_big_to_dead_letter_does_not_stop_its_route_in_batches() {
    a_message_too_big_to_dead_letter_does_not_stop_its_route(8).await;
}

/// The stored message `sequence` of `stream`, as JetStream keeps it: its
/// raw header block and payload.
async fn raw_stored(js: &jetstream::Context, stream: &str, sequence: u64) -> (Vec<u8>, Vec<u8>) {
    use base64::Engine;
    #[derive(serde::Deserialize)]
    struct Got {
        message: stream::RawMessage,
    }
    let got: Got = js
        .request(
            format!("STREAM.MSG.GET.{stream}"),
            &serde_json::json!({ "seq": sequence }),
        )
        .await
        .unwrap();
    let decode = |text: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap()
    };
    (
        got.message
            .headers
            .as_deref()
            .map(decode)
            .unwrap_or_default(),
        decode(&got.message.payload),
    )
}

/// A message with 40 KB of headers and a payload that fills the rest of
/// `max_payload`, which JetStream gives up on (its workers kept dying). Its
/// dead letter (from the advisory) adds the base64 of the original header
/// block beside the parsed headers, about 93 KB in all: far too big as it
/// is. It must be dead-lettered all the same, and nothing of the original
/// lost (its header block and payload come back byte for byte), and the
/// advisory settled.
#[tokio::test]
async fn a_given_up_message_with_large_headers_is_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BIGHDRS", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), near_limit),
        nats.clone(),
        pool.clone(),
    );
    wait_for_stream(&js, dead_letter::DEFAULT_STREAM).await;
    stop(handle, task).await;

    let max_payload = nats.server_info().max_payload;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "big-headers-1");
    headers.insert("Blob", "h".repeat(40_000).as_str());
    let padding = "a".repeat(max_payload - 40_000 - 1_000);
    let payload = serde_json::to_vec(&deposit(&padding, 1)).unwrap();
    js.publish_with_headers(subject.clone(), headers, payload.into())
        .await
        .unwrap()
        .await
        .expect("the original fits");
    assert_eq!(exhaust_deliveries(&nats, &stream, "c").await, 4);

    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), near_limit),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    settle_or_report(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { dead_letters(&js, &stream).await.len() == 1 },
        async || {
            let advisories = js
                .get_stream(idem_runtime::ADVISORY_STREAM)
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages;
            format!(
                "dead letters {}, advisories still stored {advisories}, effects {}",
                dead_letters(&js, &stream).await.len(),
                ledger(&pool, "near-limit").await.effects
            )
        },
    )
    .await;
    stop(handle, task).await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Failure"), "undeliverable");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "big-headers-1");
    assert_eq!(stats.dead_letter_failed(), 0);
    assert_eq!(ledger(&pool, "near-limit").await.effects, 0);
    let advisories = js
        .get_stream(idem_runtime::ADVISORY_STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(advisories, 0, "the advisory was settled");

    // Nothing of the original is lost: its header block as stored and its
    // payload come back byte for byte.
    let letter = dead_letter::get(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .unwrap();
    assert!(letter.payload_moved().is_some());
    let kept = dead_letter::original(&js, &letter).await.unwrap();
    let (stored_block, stored_payload) = raw_stored(&js, &stream, 1).await;
    assert!(
        kept.header_block.as_deref() == Some(&stored_block[..]),
        "the header block, exactly"
    );
    assert!(kept.payload == stored_payload, "the payload, exactly");
    assert_eq!(
        kept.headers.get("Blob").map(|value| value.as_str().len()),
        Some(40_000)
    );
}

async fn wait_for_stream(js: &jetstream::Context, name: &str) {
    eventually(
        &format!("stream {name} exists"),
        Duration::from_secs(30),
        || async { js.get_stream(name).await.is_ok() },
    )
    .await;
}

/// A dead-letter stream of the operator's that refuses messages above
/// 16 KiB (`max_msg_size`) and a 100 KB message that fails permanently:
/// the server refuses its dead letter (a refusal of this message, not an
/// outage). Its payload is moved where it fits, and once the bug is fixed
/// the replay sends the original payload, applied once.
#[tokio::test]
async fn a_dead_letter_the_stream_refuses_is_stored_and_replays_its_original_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DLSMALL", Duration::from_secs(120)).await;
    let dead_stream = format!("{stream}_DEAD");
    let dead_subject = format!("{stream}.dead");
    js.create_stream(stream::Config {
        name: dead_stream.clone(),
        subjects: vec![dead_subject.clone()],
        max_message_size: 16 * 1024,
        ..Default::default()
    })
    .await
    .unwrap();
    let original = serde_json::to_vec(&deposit(&"b".repeat(100_000), 3)).unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "large-1");
    js.publish_with_headers(subject.clone(), headers, original.clone().into())
        .await
        .unwrap()
        .await
        .unwrap();
    publish(&js, &subject, &deposit("behind", 1), Some("behind-1")).await;

    let bug = Bug::present();
    let route = fast(Route::new(&stream, "c"))
        .concurrency(1)
        .dead_letter_subject(&dead_subject);
    let (handle, task) = spawn(
        Router::with_state(bug.clone()).route(route, refuses),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    let stored = async || {
        js.get_stream(&dead_stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages
    };
    settle_or_report(
        "both dead-lettered",
        Duration::from_secs(30),
        || async { stored().await == 2 },
        async || {
            format!(
                "dead letters {}, failed dead-letter publishes {}",
                stored().await,
                stats.dead_letter_failed()
            )
        },
    )
    .await;
    assert_eq!(stats.dead_letter_failed(), 0, "a refusal is not an outage");

    bug.fix();
    let replayed = dead_letter::replay(&js, &dead_stream, 1)
        .await
        .expect("the replay is published");
    let again = dead_letter::replay(&js, &dead_stream, 1).await;
    assert!(
        matches!(again, Err(dead_letter::ReplayError::InsideDuplicateWindow)),
        "a second replay is a JetStream duplicate: {again:?}"
    );
    eventually(
        "the replay is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 1 },
    )
    .await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "refuses").await, Ledger::once_each(1));
    let (_, replay_payload) = raw_stored(&js, &stream, replayed.sequence).await;
    assert_eq!(
        replay_payload, original,
        "the replay sent the original payload"
    );
    let amount: i64 = sqlx::query_scalar("SELECT amount FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(amount, 3);
}
