//! The retention floor against real servers: a route whose retention is
//! below its floor, or whose floor has no bound, is refused at start-up with
//! the computation in the message; one at or above it starts and records its
//! retention; and a dead letter whose original may have outlived its claim
//! is not replayed unless asked for.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::{
    Delivery, Error, Permanent, Route, Router, State, Unbounded, dead_letter, idempotent,
};
use idem_tests::scenario::*;

const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

#[idempotent(name = "kept")]
async fn kept(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "kept", &d, delivery).await
}

/// Servers, a database and a stream on `<stream>.deposit` with `max_age`.
async fn with_max_age(prefix: &str, max_age: Duration) -> Scenario {
    let scenario = scenario(prefix, MINUTE).await;
    scenario
        .js
        .update_stream(stream::Config {
            name: scenario.stream.clone(),
            subjects: vec![scenario.subject.clone()],
            duplicate_window: MINUTE,
            max_age,
            ..Default::default()
        })
        .await
        .expect("the stream takes its max_age");
    scenario
}

/// What `route` fails to start with.
async fn start_up_error(scenario: &Scenario, route: Route) -> Error {
    let router = Router::new().route(route, kept);
    tokio::time::timeout(
        Duration::from_secs(30),
        router.run_until(
            scenario.nats.clone(),
            scenario.pool.clone(),
            std::future::pending(),
        ),
    )
    .await
    .expect("start-up ends within 30 s")
    .expect_err("the route is refused")
}

/// The defaults (ack_wait 30 s, 10 deliveries, backoff 1 s doubling to
/// 5 min, handler timeout 5 min) on a stream with max_age 1 h: the floor is
/// 1 h, and a retention of 10 min is refused with the computation, before
/// the consumer is created or the retention recorded for the purge.
#[tokio::test]
async fn a_retention_below_its_floor_is_refused_showing_the_computation() {
    let scenario = with_max_age("FLOOR", HOUR).await;
    let route = Route::new(&scenario.stream, "c")
        .retention(10 * MINUTE)
        .publisher_retry_horizon(Duration::from_secs(30));
    let error = start_up_error(&scenario, route).await;
    let Error::RetentionBelowFloor {
        retention, floor, ..
    } = &error
    else {
        panic!("not a retention-floor refusal: {error}");
    };
    assert_eq!((*retention, *floor), (10 * MINUTE, HOUR));
    let text = error.to_string();
    for expected in [
        "route `c` keeps its claims for 10m (`Route::retention`), below its retention floor of 1h",
        "claiming transaction (claim wait, 1 handler call, COMMIT) 3 × handler_timeout 5m = 15m",
        "12 later deliveries (max_deliver 10 + 3 on the server, less the claiming one) × ack_wait 30s = 6m",
        "NAK backoff 1s+2s+4s+8s+16s+32s+1m 4s+2m 8s+4m 16s = 8m 31s, +20 % jitter = 10m 13.2s; span 31m 13.2s",
        "stream max_age 1h",
        "horizon 30s ≤ duplicate_window 1m, so JetStream drops retries = 0",
        "floor = 0 + max(31m 13.2s, 1h) = 1h",
        "Raise the retention to at least 1h",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in: {text}");
    }
    assert!(
        scenario
            .js
            .get_stream(&scenario.stream)
            .await
            .unwrap()
            .consumer_info("c")
            .await
            .is_err(),
        "the refused route's consumer was not created"
    );
    let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_handlers")
        .fetch_one(&scenario.pool)
        .await
        .unwrap();
    assert_eq!(
        registered, 0,
        "the refused route's handler and retention were not recorded"
    );
}

/// A floor with a term that has no bound is refused for a route with a
/// retention, naming the term and both ways out; accepting the term still
/// checks the rest of the floor.
#[tokio::test]
async fn an_unbounded_floor_is_refused_naming_the_term_and_the_way_out() {
    let forever = with_max_age("FOREVER", Duration::ZERO).await;
    let route = || {
        Route::new(&forever.stream, "c")
            .retention(24 * HOUR)
            .publisher_retry_horizon(Duration::ZERO)
    };
    let error = start_up_error(&forever, route()).await;
    assert!(
        matches!(&error, Error::RetentionFloorUnbounded { unbounded, .. } if unbounded == &[Unbounded::StreamMaxAge]),
        "{error}"
    );
    let text = error.to_string();
    for expected in [
        "route `c` keeps its claims for 1d (`Route::retention`), but its retention floor has no bound: the stream keeps messages forever (max_age 0), so a stored message can be redelivered or replayed",
        "span 31m 13.2s; stream max_age 0 (kept forever: replays at any time), unbounded",
        "floor unbounded (Unbounded::StreamMaxAge)",
        "Give the stream a max_age, or accept that duplicates arriving after the retention are processed again: `Route::accept_duplicates_after_retention(Unbounded::StreamMaxAge)`",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in: {text}");
    }

    // Accepted, the span is left: 31m 13.2s, above a retention of 10 min.
    let error = start_up_error(
        &forever,
        route()
            .retention(10 * MINUTE)
            .accept_duplicates_after_retention(Unbounded::StreamMaxAge),
    )
    .await;
    assert!(
        matches!(&error, Error::RetentionBelowFloor { floor, .. } if floor.as_millis() == 1_873_200),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("stream max_age 0 (kept forever: replays at any time), accepted, not counted; publisher copies: horizon 0 ≤ duplicate_window 1m, so JetStream drops retries = 0; floor = 0 + 31m 13.2s = 31m 13.2s"),
        "{error}"
    );

    // No handler timeout, and no publisher-retry horizon.
    let week = with_max_age("NOBOUND", 7 * 24 * HOUR).await;
    let error = start_up_error(
        &week,
        Route::new(&week.stream, "c")
            .retention(30 * 24 * HOUR)
            .without_handler_timeout(),
    )
    .await;
    assert!(
        matches!(&error, Error::RetentionFloorUnbounded { unbounded, .. }
            if unbounded == &[Unbounded::HandlerTimeout, Unbounded::PublisherRetryHorizon]),
        "{error}"
    );
    let text = error.to_string();
    for expected in [
        "the route has no handler timeout, so a transaction can run, and commit its claim, any time after the claim was stamped; and the route declares no publisher-retry horizon",
        "claiming transaction: no handler timeout, unbounded",
        "publisher copies: no publisher-retry horizon declared, unbounded",
        "Set `Route::handler_timeout`, or accept that duplicates arriving after the retention are processed again: `Route::accept_duplicates_after_retention(Unbounded::HandlerTimeout)`",
        "declare how long publishers retry with `Route::publisher_retry_horizon`, or accept that duplicates arriving after the retention are processed again: `Route::accept_duplicates_after_retention(Unbounded::PublisherRetryHorizon)`",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in: {text}");
    }
}

/// A retention at its floor starts, processes, and is recorded on the
/// consumer for its dead letters; a route without a retention is not
/// checked, even on a stream that keeps messages forever.
#[tokio::test]
async fn a_retention_at_its_floor_starts_and_is_recorded_on_the_consumer() {
    let scenario = with_max_age("ATFLOOR", HOUR).await;
    let route = Route::new(&scenario.stream, "c")
        .retention(HOUR)
        .publisher_retry_horizon(Duration::from_secs(30));
    let (handle, task) = spawn(
        Router::new().route(route, kept),
        scenario.nats.clone(),
        scenario.pool.clone(),
    );
    publish(
        &scenario.js,
        &scenario.subject,
        &deposit("a", 5),
        Some("k-1"),
    )
    .await;
    wait_all_acked(&scenario.js, &scenario.stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&scenario.pool, "kept").await, Ledger::once_each(1));
    let info = consumer_info(&scenario.js, &scenario.stream, "c").await;
    assert_eq!(
        info.config
            .metadata
            .get("idem.retention")
            .map(String::as_str),
        Some("3600s")
    );
    assert_eq!(info.config.metadata.get("idem.copy_spread"), None);

    let forever = with_max_age("UNCHECKED", Duration::ZERO).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&forever.stream, "c"), kept),
        forever.nats.clone(),
        forever.pool.clone(),
    );
    publish(&forever.js, &forever.subject, &deposit("a", 5), Some("k-1")).await;
    wait_all_acked(&forever.js, &forever.stream, "c").await;
    stop(handle, task).await;
    let info = consumer_info(&forever.js, &forever.stream, "c").await;
    assert_eq!(
        info.config
            .metadata
            .get("idem.retention")
            .map(String::as_str),
        Some("forever")
    );
}

/// Whether the bug that makes `refused` fail permanently is in.
#[derive(Clone)]
struct BugPresent(Arc<AtomicBool>);

#[idempotent(name = "refused")]
async fn refused(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<BugPresent>,
    d: Deposit,
) -> Result<(), Permanent> {
    if bug.0.load(Ordering::SeqCst) {
        return Err(Permanent::new(format!("account {} is closed", d.account)));
    }
    record_effect(tx, "refused", &d, delivery)
        .await
        .map_err(Permanent::new)
}

/// `Idem-Original-Stored-At` of a dead letter, as a time.
fn stored_at(letter: &jetstream::message::StreamMessage) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(
        &header(letter, "Idem-Original-Stored-At"),
        &time::format_description::well_known::Rfc3339,
    )
    .expect("Idem-Original-Stored-At is an RFC 3339 time")
}

/// The dead letters of `stream` once there are `n`.
async fn letters(
    js: &jetstream::Context,
    stream: &str,
    n: usize,
) -> Vec<jetstream::message::StreamMessage> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let letters = dead_letters(js, stream).await;
        if letters.len() >= n {
            return letters;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} dead letters were not stored within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A route with a retention of 6 s (its floor is 3.6 s: a 200 ms handler
/// timeout, ack_wait 1 s, one delivery, max_age 3 s). Its dead letters record
/// that retention and their original's storage time, which a dead letter of
/// a replay keeps. A dead letter replayed within 6 s of its original's
/// storage is replayed; one replayed later is refused, because its
/// original's claim may be purged, unless the replay allows it; the same
/// dead letter without `Idem-Retention` (as written before it existed) is
/// replayed as before.
#[tokio::test]
async fn a_dead_letter_older_than_its_retention_is_replayed_only_when_allowed() {
    const RETENTION: Duration = Duration::from_secs(6);
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("EXPIRED", MINUTE).await;
    js.update_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        // Replays republish the original's id: a short window lets the
        // test replay one id twice.
        duplicate_window: Duration::from_millis(100),
        max_age: Duration::from_secs(3),
        ..Default::default()
    })
    .await
    .expect("the stream takes its limits");
    // Per message: its floor, 3.6 s, is what the timing below is built on.
    let route = Route::new(&stream, "c")
        .per_message()
        .ack_wait(Duration::from_secs(1))
        .handler_timeout(Duration::from_millis(200))
        .max_deliver(1)
        .retention(RETENTION)
        .publisher_retry_horizon(Duration::ZERO);
    let stream_config = js
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    assert_eq!(
        route.retention_floor(&stream_config).value(),
        Some(Duration::from_millis(3600))
    );
    let bug = BugPresent(Arc::new(AtomicBool::new(true)));
    let (handle, task) = spawn(
        Router::with_state(bug.clone()).route(route, refused),
        nats.clone(),
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    // Once the router runs, so that the dead letters follow at once.
    wait_all_acked(&js, &stream, "c").await;
    publish(&js, &subject, &deposit("a", 1), None).await;
    publish(&js, &subject, &deposit("b", 2), None).await;
    let dead = letters(&js, &stream, 2).await;
    let (first, second) = (&dead[0], &dead[1]);
    for letter in [first, second] {
        assert_eq!(header(letter, "Idem-Failure"), "permanent");
        assert_eq!(header(letter, "Idem-Retention"), "6s");
        assert_eq!(header(letter, "Idem-Copy-Spread"), "");
    }
    // The dead letter's own Nats-Msg-Id ends with the original's storage
    // time, in Unix nanoseconds.
    let nanos: i128 = header(first, "Nats-Msg-Id")
        .rsplit(':')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("the dead letter's id ends with the storage time");
    assert_eq!(stored_at(first).unix_timestamp_nanos(), nanos);

    // Replayed while the bug is in, the first is dead-lettered again: the
    // new dead letter keeps the original's storage time, not the replay's.
    replay_until_stored(&js, first.sequence).await;
    let dead = letters(&js, &stream, 3).await;
    let again = &dead[2];
    assert_eq!(
        header(again, "Idem-Message-Id"),
        header(first, "Idem-Message-Id")
    );
    assert_eq!(stored_at(again), stored_at(first));

    // Fixed: the first is applied once, within its retention.
    bug.0.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await; // past the duplicate window
    replay_until_stored(&js, again.sequence).await;
    eventually(
        "the first is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 1 },
    )
    .await;

    // Past the retention, the second is refused for that reason alone.
    let past = stored_at(second) + RETENTION + Duration::from_millis(100);
    let wait = past - time::OffsetDateTime::now_utc();
    if wait.is_positive() {
        tokio::time::sleep(wait.unsigned_abs()).await;
    }
    let refused = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, second.sequence).await;
    let Err(
        error @ dead_letter::ReplayError::OutsideRetention {
            age: Some(age),
            retention,
            ..
        },
    ) = &refused
    else {
        panic!("not refused for its age: {refused:?}");
    };
    assert!(*age > RETENTION && *retention == RETENTION, "{error}");
    let text = error.to_string();
    assert!(
        text.contains(&format!("dead letter {}: its original was stored", second.sequence))
            && text.contains("ago, and its route keeps claims for 6s, so if the original was processed its claim may already be purged")
            && text.ends_with("replay with `ReplayOptions::allow_outside_retention`"),
        "{text}"
    );
    assert_eq!(stats.processed(), 1, "nothing was published");

    // The way out.
    dead_letter::replay_with(
        &js,
        dead_letter::DEFAULT_STREAM,
        second.sequence,
        dead_letter::ReplayOptions::default().allow_outside_retention(),
    )
    .await
    .expect("allowed, it is replayed");
    eventually(
        "the second is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 2 },
    )
    .await;

    // The same dead letter as an older runtime wrote it, without
    // Idem-Retention (and without the Nats-Msg-Id that would make the
    // dead-letter stream drop it): replayed as before, and skipped by its
    // claim.
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in second.headers.iter() {
        let name: &str = name.as_ref();
        if name == "Idem-Retention" || name.starts_with("Nats-") {
            continue;
        }
        for value in values {
            headers.append(name, value.as_str());
        }
    }
    let older = js
        .publish_with_headers(second.subject.to_string(), headers, second.payload.clone())
        .await
        .unwrap()
        .await
        .expect("the older-style dead letter is stored");
    tokio::time::sleep(Duration::from_millis(200)).await; // past the duplicate window
    replay_until_stored(&js, older.sequence).await;
    eventually(
        "the older one is skipped as a duplicate",
        Duration::from_secs(30),
        || async { stats.duplicates() == 1 },
    )
    .await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "refused").await, Ledger::once_each(2));
}
