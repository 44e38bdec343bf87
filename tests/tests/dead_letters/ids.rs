//! Which id a dead letter records when the client and JetStream read `Nats-
//! Msg-Id` differently (a lower-case header name, a line feed, a folded line),
//! so that a replay is deduplicated by the id the message was claimed by.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Delivery, Route, Router, dead_letter, idempotent};
use idem_tests::scenario::*;

// ---------------------------------------------------------------------------
// A lower-case `nats-msg-id`: the given-up dead letter records an id the
// message was never deduplicated by; its replay applies it again.
// ---------------------------------------------------------------------------

#[idempotent(name = "lower-id")]
async fn lower_id(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "lower-id", &d, delivery).await
}

/// The pipeline reads `Nats-Msg-Id` through async-nats, whose header names
/// are case-sensitive: a message published with `nats-msg-id: X` (as some
/// clients and proxies write it) is deduplicated by its stream position. The
/// given-up watcher (`undeliverable::raw_nats_msg_id`) matches the name
/// case-insensitively and records `X` as the id. The message is committed,
/// its ack lost, and JetStream gives up on it; the operator replays the dead
/// letter, `replay` publishes it under `Nats-Msg-Id: X`, the claim on `X` is
/// fresh, and the deposit is applied a second time.
#[tokio::test]
async fn a_lower_case_nats_msg_id_makes_a_given_up_replay_apply_twice() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LOWERID", Duration::from_millis(500)).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("nats-msg-id", "order-77");
    js.publish_with_headers(
        subject.clone(),
        headers,
        serde_json::to_vec(&deposit("a", 5)).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    // The first worker commits, then "dies" before its ack.
    let committed = Arc::new(AtomicU64::new(0));
    let hook_committed = committed.clone();
    let router = Router::new()
        .route(given_up_route(&stream), lower_id)
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
    assert_eq!(ledger(&pool, "lower-id").await, Ledger::once_each(1));
    let deduplicated_by = stream_position(&js, &stream, 1).await;
    let by_stream_position: bool = sqlx::query_scalar(
        "SELECT key = idem_key('lower-id', $1) FROM idem_processed WHERE handler = 'lower-id'",
    )
    .bind(&deduplicated_by)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        by_stream_position,
        "the pipeline deduplicated it by its stream position"
    );

    // Later workers keep dying on it until JetStream gives up.
    exhaust_deliveries(&nats, &stream, "c").await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), lower_id),
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
    let recorded = header(&letters[0], "Idem-Message-Id");

    // Past the stream's duplicate window (500 ms), the replay is stored and
    // only the claim can tell that it was processed.
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
        ledger(&pool, "lower-id").await,
        Ledger::once_each(1),
        "applied twice: the message was deduplicated by {deduplicated_by:?}, its dead letter \
         recorded {recorded:?}, and the replay was deduplicated by that"
    );
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
