//! Dead letters and their replays under production's ordinary accidents
//! (issue 18): a message too big to dead-letter as it is, a replay that
//! reaches the other routes of its subject, a dead letter of a partitioned
//! route, a message id that cannot be recorded exactly. Each test was
//! written first, failed against the runtime of the time (the figures are
//! in the commit that fixed it), and passes since its fix. The README's
//! "Failure handling" table points at them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use common::*;
use idem_runtime::partition::Partitions;
use idem_runtime::{
    BoxError, Delivery, Permanent, Route, Router, State, Stats, dead_letter, idempotent,
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

/// One delivery allowed, so JetStream's own limit (the route's plus a margin
/// of 3) is 4, reached in about 2 s when nobody settles the message.
fn given_up_route(stream: &str) -> Route {
    fast(Route::new(stream, "c"))
        .max_deliver(1)
        .ack_wait(Duration::from_millis(500))
        .heartbeat_every(Duration::from_millis(150))
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

/// Whether `refuses` still refuses: the bug the operator fixes before a replay.
#[derive(Clone)]
struct Bug(Arc<AtomicBool>);

impl Bug {
    fn present() -> Bug {
        Bug(Arc::new(AtomicBool::new(true)))
    }

    fn fix(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), BoxError> {
        if self.0.load(Ordering::SeqCst) {
            return Err(Permanent::new("refused by a bug").into());
        }
        Ok(())
    }
}

#[idempotent(name = "refuses")]
async fn refuses(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<Bug>,
    d: Deposit,
) -> Result<(), BoxError> {
    bug.check()?;
    record_effect(tx, "refuses", &d, delivery).await?;
    Ok(())
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

// ---------------------------------------------------------------------------
// 2. A replay reaches only the route that dead-lettered it (finding 6).
// ---------------------------------------------------------------------------

/// Deduplicated by the order (its `account`), refused while the bug lasts.
#[idempotent(name = "by-order", key = d.account)]
async fn by_order(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<Bug>,
    d: Deposit,
) -> Result<(), BoxError> {
    bug.check()?;
    record_effect(tx, "by-order", &d, delivery).await?;
    Ok(())
}

/// Deduplicated by `Nats-Msg-Id`; never fails.
#[idempotent(name = "by-header")]
async fn by_header(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "by-header", &d, delivery).await
}

/// On a stream that sources the first: another service's copy.
#[idempotent(name = "sourced")]
async fn sourced(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "sourced", &d, delivery).await
}

/// Route A (`by-order`, keyed by the order) and route B (`by-header`,
/// deduplicated by `Nats-Msg-Id`) on one stream, route C (`sourced`) on a
/// stream that sources it. One message (`Nats-Msg-Id: msg-0001`, order
/// `order-7`): B and C apply it, A dead-letters it. The operator fixes A
/// and replays its dead letter: A applies it once, and B and C, which
/// applied it already, must not apply it again (a replay that carries A's
/// key as its `Nats-Msg-Id` is new to them).
#[tokio::test]
async fn a_replay_is_applied_only_by_the_route_that_dead_lettered_it() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("REPLAYFOR", Duration::from_secs(120)).await;
    let copy = format!("{stream}_COPY");
    js.create_stream(stream::Config {
        name: copy.clone(),
        sources: Some(vec![stream::Source {
            name: stream.clone(),
            ..Default::default()
        }]),
        ..Default::default()
    })
    .await
    .unwrap();
    publish(&js, &subject, &deposit("order-7", 5), Some("msg-0001")).await;

    let bug = Bug::present();
    let router = Router::with_state(bug.clone())
        .route(fast(Route::new(&stream, "a")), by_order)
        .route(fast(Route::new(&stream, "b")), by_header)
        .route(fast(Route::new(&copy, "c")), sourced);
    let (handle, task) = spawn(router, nats, pool.clone());
    let (a, b, c) = (
        handle.stats("a").unwrap(),
        handle.stats("b").unwrap(),
        handle.stats("c").unwrap(),
    );
    eventually(
        "A dead-lettered, B and C applied",
        Duration::from_secs(30),
        || async { a.dead_lettered() == 1 && b.processed() == 1 && c.processed() == 1 },
    )
    .await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "order-7");

    bug.fix();
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is stored");
    // Every route has settled the replay (each received 2 messages).
    eventually(
        "every route settled the replay",
        Duration::from_secs(30),
        || async { a.received() == 2 && b.received() == 2 && c.received() == 2 },
    )
    .await;
    wait_all_acked(&js, &stream, "a").await;
    wait_all_acked(&js, &stream, "b").await;
    wait_all_acked(&js, &copy, "c").await;
    stop(handle, task).await;
    let effects = (
        ledger(&pool, "by-order").await.effects,
        ledger(&pool, "by-header").await.effects,
        ledger(&pool, "sourced").await.effects,
    );
    assert_eq!(
        effects,
        (1, 1, 1),
        "effects of (A, B, C): the replay of A's dead letter reached B and C"
    );
    assert_eq!(ledger(&pool, "by-header").await, Ledger::once_each(1));
    assert_eq!(ledger(&pool, "sourced").await, Ledger::once_each(1));
    assert_eq!(
        (
            b.replays_skipped(),
            c.replays_skipped(),
            a.replays_skipped()
        ),
        (1, 1, 0),
        "B and C acked the replay for A without running"
    );
    let id: String =
        sqlx::query_scalar("SELECT message_id FROM effects WHERE handler = 'by-order'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(id, "order-7", "A applied it under its key");
}

#[idempotent(name = "refuses-too")]
async fn refuses_too(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<Bug>,
    d: Deposit,
) -> Result<(), BoxError> {
    bug.check()?;
    record_effect(tx, "refuses-too", &d, delivery).await?;
    Ok(())
}

/// Two routes on one stream, both deduplicating by `Nats-Msg-Id`, both
/// dead-letter one message (`msg-0002`). After the fix the operator
/// replays both dead letters at once (past the stream's 1 s window of the
/// original): each must be stored, and each route apply the message once.
#[tokio::test]
async fn a_bulk_replay_of_two_routes_dead_letters_of_one_message_applies_each_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BULKREPLAY", Duration::from_secs(1)).await;
    publish(&js, &subject, &deposit("acct", 2), Some("msg-0002")).await;
    let bug = Bug::present();
    let router = Router::with_state(bug.clone())
        .route(fast(Route::new(&stream, "a")), refuses)
        .route(fast(Route::new(&stream, "b")), refuses_too);
    let (handle, task) = spawn(router, nats, pool.clone());
    let (a, b) = (handle.stats("a").unwrap(), handle.stats("b").unwrap());
    eventually("both dead-lettered it", Duration::from_secs(30), || async {
        a.dead_lettered() == 1 && b.dead_lettered() == 1
    })
    .await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 2);
    // Past the original's window.
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    bug.fix();
    let mut replays = Vec::new();
    for letter in &letters {
        replays.push(dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence).await);
    }
    let stored = replays.iter().filter(|replay| replay.is_ok()).count();
    assert_eq!(stored, 2, "both replays stored: {replays:?}");
    eventually(
        "both routes applied it",
        Duration::from_secs(30),
        || async { a.processed() == 1 && b.processed() == 1 },
    )
    .await;
    wait_all_acked(&js, &stream, "a").await;
    wait_all_acked(&js, &stream, "b").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "refuses").await, Ledger::once_each(1));
    assert_eq!(ledger(&pool, "refuses-too").await, Ledger::once_each(1));
}

/// A rolling rename: handler `refuses` dead-letters a message, and is then
/// replaced by `refuses-too` on a consumer of its own (the old one
/// deleted), which applies the stream from its start. A replay for
/// `refuses` would be skipped by every route, unnoticed: it is refused,
/// saying why. Replayed for the new name, it reaches that handler (not
/// skipped), whose claim finds the message it applied already.
#[tokio::test]
async fn a_replay_for_a_handler_no_route_runs_is_refused_and_can_be_retargeted() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RENAMED", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("acct", 6), Some("renamed-1")).await;
    let (handle, task) = spawn(
        Router::with_state(Bug::present()).route(fast(Route::new(&stream, "v1")), refuses),
        nats.clone(),
        pool.clone(),
    );
    let stats = handle.stats("v1").unwrap();
    eventually("dead-lettered", Duration::from_secs(30), || async {
        stats.dead_lettered() == 1
    })
    .await;
    stop(handle, task).await;
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer("v1")
        .await
        .unwrap();

    let fixed = Bug::present();
    fixed.fix();
    let (handle, task) = spawn(
        Router::with_state(fixed).route(fast(Route::new(&stream, "v2")), refuses_too),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("v2").unwrap();
    wait_all_acked(&js, &stream, "v2").await;
    assert_eq!(stats.processed(), 1, "the new handler applied the stream");
    let sequence = dead_letters(&js, &stream).await[0].sequence;
    let refused = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, sequence).await;
    assert!(
        matches!(&refused, Err(dead_letter::ReplayError::NoRouteForHandler { handler, .. }) if handler == "refuses"),
        "{refused:?}"
    );
    dead_letter::replay_with(
        &js,
        dead_letter::DEFAULT_STREAM,
        sequence,
        dead_letter::ReplayOptions::default().for_handler("refuses-too"),
    )
    .await
    .expect("replayed for the new name");
    eventually("the replay is settled", Duration::from_secs(30), || async {
        stats.duplicates() == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!((stats.replays_skipped(), stats.processed()), (0, 1));
    assert_eq!(ledger(&pool, "refuses").await.effects, 0);
    assert_eq!(ledger(&pool, "refuses-too").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// 3. Dead letters of partitioned routes (finding 7).
// ---------------------------------------------------------------------------

/// A partitioned route dead-letters a message (stored as
/// `<stream>.p.<n>.<key>`, which is what its dead letter records as the
/// original subject). After the fix, its replay must reach the stream and
/// be applied once, by the route of the key's partition.
#[tokio::test]
async fn a_dead_letter_of_a_partitioned_route_is_replayed_into_its_partition() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique("PARTS");
    let partitions = Partitions::new(format!("{stream}.*"), 2);
    js.create_stream(partitions.stream_config(&stream))
        .await
        .unwrap();
    publish(
        &js,
        &format!("{stream}.key-1"),
        &deposit("key-1", 4),
        Some("p-1"),
    )
    .await;

    let bug = Bug::present();
    let routes: Vec<Route> = partitions
        .routes(&stream, "apply")
        .into_iter()
        .map(fast)
        .collect();
    let (handle, task) = spawn(
        Router::with_state(bug.clone()).route_partitions(routes, refuses),
        nats,
        pool.clone(),
    );
    eventually("dead-lettered", Duration::from_secs(30), || async {
        dead_letters(&js, &stream).await.len() == 1
    })
    .await;
    let letters = dead_letters(&js, &stream).await;
    let stored_subject = header(&letters[0], "Idem-Original-Subject");
    assert!(
        stored_subject.starts_with(&format!("{stream}.p.")),
        "{stored_subject}"
    );

    bug.fix();
    let replayed = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence).await;
    let replayed = replayed.expect("the replay of a partitioned route's dead letter is stored");
    assert_eq!(replayed.stream, stream);
    let stored = js
        .get_stream(&stream)
        .await
        .unwrap()
        .get_raw_message(replayed.sequence)
        .await
        .unwrap();
    assert_eq!(
        stored.subject.as_str(),
        stored_subject,
        "the replay is stored in the same partition"
    );
    eventually("the replay is applied", Duration::from_secs(30), || async {
        ledger(&pool, "refuses").await.effects == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "refuses").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// 4. Message ids a header cannot carry exactly (finding 10).
// ---------------------------------------------------------------------------

/// Publishes `payload` with a raw header block, over a raw connection, so
/// that no client library checks the header. (As in attack.rs.)
async fn publish_raw(nats_url: &str, subject: &str, header: &[u8], payload: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = nats_url.trim_start_matches("nats://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut info = [0u8; 4096];
    let _ = socket.read(&mut info).await.unwrap();
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
        "the server took the raw publish: {}",
        String::from_utf8_lossy(&pong[..read])
    );
}

#[idempotent(name = "plain")]
async fn plain(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain", &d, delivery).await
}

/// An unrelated message `lf-x` is processed. Then one with
/// `Nats-Msg-Id: lf-x<LF>y` (a bare line feed, sent over a raw socket):
/// JetStream deduplicates on the whole value, the client cannot parse it
/// and JetStream gives up on it. Its dead letter must not record `lf-x`,
/// which a replay would be acked under as a duplicate of the unrelated
/// message (and so lost): the id is unknown, and a replay is refused.
#[tokio::test]
async fn a_nats_msg_id_with_a_line_feed_is_recorded_as_unknown() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("IDLF", Duration::from_secs(1)).await;
    publish(&js, &subject, &deposit("unrelated", 1), Some("lf-x")).await;
    let route = || {
        Route::new(&stream, "c")
            .ack_wait(Duration::from_secs(1))
            .max_deliver(1)
    };
    let (handle, task) = spawn(Router::new().route(route(), plain), nats, pool.clone());
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(1));

    publish_raw(
        env.nats_url(),
        &subject,
        b"NATS/1.0\r\nNats-Msg-Id: lf-x\ny\r\n\r\n",
        br#"{"account":"line-feed","amount":2}"#,
    )
    .await;
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
        "JetStream stored it: `lf-x<LF>y` is not `lf-x`"
    );
    // The poison drops the router's connection again and again: a client of
    // its own for the router, and a supervisor that restarts it.
    let letter = {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            assert!(
                Instant::now() < deadline,
                "the message was never dead-lettered"
            );
            let router = Router::new().route(route(), plain);
            let handle = router.handle();
            let run = tokio::spawn(router.run_until(
                env.nats().await,
                pool.clone(),
                std::future::pending(),
            ));
            let lettered = async {
                loop {
                    if let Some(letter) = dead_letters(&js, &stream).await.into_iter().next() {
                        return letter;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            };
            tokio::select! {
                _ = run => {}
                letter = lettered => {
                    handle.shutdown();
                    break letter;
                }
            }
        }
    };
    assert_eq!(header(&letter, "Idem-Failure"), "undeliverable");
    let recorded = (
        header(&letter, "Idem-Message-Id"),
        header(&letter, "Idem-Message-Id-Source"),
    );
    // Past the stream's window (1 s) of the unrelated `lf-x`.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let replay = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence).await;
    if replay.is_ok() {
        // What became of the replay, for the failure's message.
        let (handle, task) = spawn(
            Router::new().route(route(), plain),
            env.nats().await,
            pool.clone(),
        );
        wait_all_acked(&js, &stream, "c").await;
        stop(handle.clone(), task).await;
        let stats = handle.stats("c").unwrap();
        panic!(
            "recorded {recorded:?}; the replay was stored ({replay:?}) and settled: processed {}, duplicates {}; effects {:?}",
            stats.processed(),
            stats.duplicates(),
            ledger(&pool, "plain").await
        );
    }
    assert!(
        matches!(replay, Err(dead_letter::ReplayError::NoMessageId(_))),
        "recorded {recorded:?}; the replay gave {replay:?}"
    );
    assert_eq!(recorded, (String::new(), "unknown".to_owned()));

    // Known never to have been processed, it is replayed under a new id.
    let (handle, task) = spawn(
        Router::new().route(route(), plain),
        env.nats().await,
        pool.clone(),
    );
    dead_letter::replay_with(
        &js,
        dead_letter::DEFAULT_STREAM,
        letter.sequence,
        dead_letter::ReplayOptions::default().allow_new_message_id(),
    )
    .await
    .unwrap();
    eventually("the replay is applied", Duration::from_secs(30), || async {
        ledger(&pool, "plain").await.effects == 2
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(2));
}

/// `Nats-Msg-Id: fold-x` folded onto a second line (`<CRLF> y`): the
/// client joins the lines (`fold-x y`) and the pipeline claims the message
/// by that; JetStream itself reads only `fold-x`. The message is committed,
/// its ack lost, and JetStream gives up on it. Its dead letter (from the
/// raw stored message) must record the id the pipeline claimed it by, or
/// a replay would be applied a second time.
#[tokio::test]
async fn a_folded_nats_msg_id_is_recorded_as_the_pipeline_read_it() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("IDFOLD", Duration::from_millis(500)).await;
    publish_raw(
        env.nats_url(),
        &subject,
        b"NATS/1.0\r\nNats-Msg-Id: fold-x\r\n y\r\n\r\n",
        br#"{"account":"folded","amount":3}"#,
    )
    .await;
    let committed = Arc::new(AtomicU64::new(0));
    let hook_committed = committed.clone();
    let router = Router::new()
        .route(given_up_route(&stream), plain)
        .fault_hooks(
            idem_runtime::fault::FaultHooks::default().after_commit(move |_| {
                hook_committed.fetch_add(1, Ordering::SeqCst);
                idem_runtime::fault::AfterCommit::DropWithoutAck
            }),
        );
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    eventually("the message committed", Duration::from_secs(30), || async {
        committed.load(Ordering::SeqCst) == 1
    })
    .await;
    stop(handle, task).await;
    let claimed_by: String = sqlx::query_scalar("SELECT message_id FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claimed_by, "fold-x y", "the pipeline read the folded id");

    exhaust_deliveries(&nats, &stream, "c").await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), plain),
        nats,
        pool.clone(),
    );
    eventually("dead-lettered", Duration::from_secs(30), || async {
        !dead_letters(&js, &stream).await.is_empty()
    })
    .await;
    let letters = dead_letters(&js, &stream).await;
    let recorded = header(&letters[0], "Idem-Message-Id");
    // Past the window (500 ms): only the claim can tell.
    tokio::time::sleep(Duration::from_millis(700)).await;
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is stored");
    let stats = handle.stats("c").unwrap();
    eventually("the replay is settled", Duration::from_secs(30), || async {
        stats.processed() + stats.duplicates() == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(
        ledger(&pool, "plain").await,
        Ledger::once_each(1),
        "applied twice: claimed by {claimed_by:?}, recorded {recorded:?}"
    );
}
