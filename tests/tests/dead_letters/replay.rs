//! Replaying dead letters: a replay is applied once, only by the route that
//! dead-lettered it (a partitioned route's into its partition); two routes'
//! dead letters of one message apply once each; a replay for a handler no
//! route runs is refused and can be retargeted; and a replay of a message that
//! was processed meanwhile, or committed before JetStream gave up on it, is a
//! duplicate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::partition::Partitions;
use idem_runtime::{BoxError, Delivery, FromRef, Route, Router, State, dead_letter, idempotent};
use idem_tests::scenario::*;

use crate::{Bug, refuses};

// --- Replaying what JetStream gave up on keeps the message id ------------

/// A message is committed but its ack is lost, and JetStream then gives up
/// on it. Its dead letter must carry the id it was deduplicated by, so that
/// replaying it is a duplicate, not a second effect.
#[tokio::test]
async fn replaying_a_given_up_message_that_was_committed_applies_it_once() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("ACKLOST", Duration::from_millis(500)).await;
    publish(&js, &subject, &deposit("a", 5), Some("acklost-1")).await;
    // The first worker commits, then "dies" before its ack.
    let committed = std::sync::Arc::new(AtomicU64::new(0));
    let hook_committed = committed.clone();
    let router = Router::new()
        .route(given_up_route(&stream), no_ids)
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
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(1));

    // Later workers keep dying on it until JetStream gives up.
    exhaust_deliveries(&nats, &stream, "c").await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats,
        pool.clone(),
    );
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "acklost-1");

    // The stream's duplicate window (500 ms) is long past: JetStream stores
    // the replay, and only the claim can tell it was processed.
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is stored");
    let stats = handle.stats("c").unwrap();
    eventually("the replay is skipped", Duration::from_secs(30), || async {
        stats.duplicates() == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(1));
}

// --- Undecodable messages keep their Nats-Msg-Id -------------------------

#[idempotent(name = "shape")]
async fn strict_shape(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "shape", &d, delivery).await
}

/// The same handler (same name, so same dedup rows) after a fix that
/// accepts the old shape too.
#[idempotent(name = "shape")]
async fn lenient_shape(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    v: serde_json::Value,
) -> Result<(), sqlx::Error> {
    let d = deposit(v["acct"].as_str().unwrap_or("?"), 1);
    record_effect(tx, "shape", &d, delivery).await
}

/// A payload the handler cannot decode is dead-lettered with its
/// `Nats-Msg-Id`. Two stored copies of it (a publisher retry after
/// JetStream's window) are both dead-lettered; replayed after the handler is
/// fixed, they are one message and apply once.
#[tokio::test]
async fn two_copies_of_an_undecodable_message_apply_once_when_replayed() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("UNDECODABLE", Duration::from_millis(500)).await;
    let publish_copy = || async {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, "old-shape-1");
        js.publish_with_headers(subject.clone(), headers, r#"{"acct":"x"}"#.into())
            .await
            .unwrap()
            .await
            .unwrap()
    };
    let first = publish_copy().await;
    // Past the stream's duplicate window, the publisher's retry is stored
    // again. (The server forgets an id on a timer, which a loaded machine
    // can run late: a copy it still drops is sent again, as a publisher
    // would.)
    tokio::time::sleep(Duration::from_millis(700)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let second = loop {
        let ack = publish_copy().await;
        if !ack.duplicate {
            break ack;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "JetStream kept dropping the copy as a duplicate"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((first.sequence, second.sequence), (1, 2));

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), strict_shape),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 2);
    for letter in &letters {
        assert_eq!(header(letter, "Idem-Failure"), "undecodable");
        assert_eq!(header(letter, "Idem-Message-Id"), "old-shape-1");
    }

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), lenient_shape),
        nats,
        pool.clone(),
    );
    for letter in &letters {
        // Apart by more than the stream's window, so that JetStream stores
        // both replays and the claim has to tell them apart.
        tokio::time::sleep(Duration::from_millis(700)).await;
        replay_until_stored(&js, letter.sequence).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
    assert_eq!(ledger(&pool, "shape").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// A replay of a processed message.

/// The state of the replay test: the bug the test fixes, and the runs the
/// test checks.
#[derive(Clone, FromRef)]
struct Replay {
    bug: ReplayBug,
    runs: ReplayRuns,
}

/// Whether the bug that makes `replayed` refuse every message is in.
#[derive(Clone)]
struct ReplayBug(Arc<AtomicBool>);

/// The stream sequences whose body ran.
#[derive(Clone, Default)]
struct ReplayRuns(Arc<Mutex<Vec<u64>>>);

#[idempotent(name = "replayed")]
async fn replayed(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<ReplayBug>,
    State(runs): State<ReplayRuns>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    runs.0.lock().unwrap().push(delivery.stream_sequence());
    if bug.0.load(Ordering::SeqCst) {
        return Err(idem_runtime::Permanent::new("refused by a bug").into());
    }
    record_effect(tx, "replayed", &d, delivery).await?;
    Ok(())
}

/// Publishes `deposit` with `id` until JetStream stores it (a publisher
/// retrying after the stream's duplicate window), and returns its sequence.
async fn publish_until_stored(
    js: &async_nats::jetstream::Context,
    subject: &str,
    d: &Deposit,
    id: &str,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ack = publish(js, subject, d, Some(id)).await;
        if !ack.duplicate {
            return ack.sequence;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "JetStream kept dropping {id} as a duplicate"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A message is dead-lettered by a bug, then processed when its publisher
/// retries after the fix. Replaying the dead letter afterwards, and
/// re-publishing the same id once more (both outside JetStream's duplicate
/// window, so both are stored), is acked as a duplicate each time: the body
/// does not run and the effect stays single.
#[tokio::test]
async fn a_replay_of_a_processed_message_is_acked_as_a_duplicate() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("REPLAYDONE", Duration::from_millis(300)).await;
    let order = deposit("a", 42);
    let first = publish(&js, &subject, &order, Some("order-1")).await;
    let state = Replay {
        bug: ReplayBug(Arc::new(AtomicBool::new(true))),
        runs: ReplayRuns::default(),
    };
    let (handle, task) = spawn(
        Router::with_state(state.clone()).route(fast(Route::new(&stream, "c")), replayed),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    wait_all_acked(&js, &stream, "c").await;
    assert_eq!(stats.dead_lettered(), 1, "the bug dead-lettered it");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "order-1");

    // The fix; then the publisher retries, after the window: processed.
    state.bug.0.store(false, Ordering::SeqCst);
    let retried = publish_until_stored(&js, &subject, &order, "order-1").await;
    wait_all_acked(&js, &stream, "c").await;
    assert_eq!(stats.processed(), 1);

    // The operator replays the dead letter, unaware it was processed.
    let replay = replay_until_stored(&js, letters[0].sequence).await;
    assert_eq!(replay.stream, stream);
    wait_all_acked(&js, &stream, "c").await;
    // And the publisher sends it once more, after the window again.
    let again = publish_until_stored(&js, &subject, &order, "order-1").await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    assert_eq!(
        (first.sequence, retried, replay.sequence, again),
        (1, 2, 3, 4),
        "JetStream stored every copy of order-1"
    );
    assert_eq!(
        (
            stats.received(),
            stats.dead_lettered(),
            stats.processed(),
            stats.duplicates()
        ),
        (4, 1, 1, 2),
        "the replay and the last copy were acked as duplicates"
    );
    assert_eq!(
        *state.runs.0.lock().unwrap(),
        vec![1, 2],
        "the body ran for the first copy (which failed) and the retry, never after"
    );
    assert_eq!(ledger(&pool, "replayed").await, Ledger::once_each(1));
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
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
    let stream = unique_name("PARTS");
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
