//! The route's pull requests against the limits the server puts on them: a
//! consumer's `max_batch` (from the server's `max_request_batch` limit, or
//! lowered under a running route) and `max_expires`. Before, a request the
//! server refused for a limit was refused again on every retry, and the
//! route took nothing, with only a debug log.

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::{Route, Router, status};
use idem_tests::TestEnv;
use idem_tests::scenario::*;

use super::latest_delivery;

/// The server's JetStream limit `max_request_batch: 8` becomes the route's
/// consumer's `max_batch`, below the 16 messages the route asks for
/// (concurrency 4 × batch 4), which the server refuses. Each request is
/// capped at 8, with one warning that names the limit; every message is
/// applied once, on its first delivery; `idem status` reports the cap; and
/// once the router has stopped, no pull request is left waiting.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test configures its own NATS server"
)]
async fn a_max_request_batch_below_the_routes_requests_caps_them_and_every_message_is_applied_once()
{
    const MESSAGES: i64 = 60;
    idem_tests::require_own_servers();
    let logs = idem_tests::capture_logs();
    let env = TestEnv::start_with_jetstream("limits { max_request_batch: 8 }").await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("CAPPED");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("m-{i}"))).await;
    }

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").concurrency(4).batch(4), no_ids),
        nats.clone(),
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    // The limit is the consumer's.
    let info = env.consumer_info(&stream, "c").await;
    assert_eq!(info.config.max_batch, 8, "the server's limit applies");
    let capped = logs.matching(&["WARN", "max_batch of 8", "route=\"c\""]);
    assert_eq!(capped.len(), 1, "one warning names the cap: {capped:#?}");
    assert!(
        capped[0].contains("lower the route's concurrency or batch (`Route::batch`)"),
        "a route that chose its batch is told to lower it: {capped:#?}"
    );
    let ours = status::consumers(&js)
        .await
        .unwrap()
        .into_iter()
        .find(|consumer| consumer.stream == stream)
        .expect("idem status lists the consumer");
    assert_eq!(
        (ours.pull_batch, ours.max_batch, ours.pull_capped()),
        (Some(16), Some(8), true),
        "idem status shows the cap: {ours:?}"
    );
    stop(handle, task).await;

    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(MESSAGES));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "none redelivered"
    );
    let info = env.consumer_info(&stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_waiting),
        (0, 0, 0),
        "nothing pending, and no pull request left on the server"
    );
}

/// An operator lowers a running route's consumer limits: requests of at most
/// 2 messages (the route asks for 4), living at most 1 s (the route's live
/// 2 s). The server refuses the next request for its size, and the pull
/// caps it and asks again; then for its expiry, and the pull is closed and
/// opened again with the consumer's limits read anew. Every message
/// published meanwhile is applied once, on its first delivery (none went
/// into an inbox no one read, to wait out ack_wait), and once the router
/// has stopped no pull request is left waiting.
#[tokio::test]
async fn request_limits_lowered_under_a_running_route_are_read_again_and_nothing_waits_out_ack_wait()
 {
    const MESSAGES: i64 = 40;
    let logs = idem_tests::capture_logs();
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LOWERED", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").concurrency(4), no_ids),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 0), Some("m-0")).await;
    wait_all_acked(&js, &stream, "c").await;

    // The route's pull is open, with a request of 4 waiting.
    let mut config = env.consumer_info(&stream, "c").await.config;
    assert_eq!((config.max_batch, config.max_expires), (0, Duration::ZERO));
    config.max_batch = 2;
    config.max_expires = Duration::from_secs(1);
    js.get_stream(&stream)
        .await
        .unwrap()
        .update_consumer(config)
        .await
        .expect("the consumer's limits are updated");
    let info = env.consumer_info(&stream, "c").await;
    assert_eq!(
        (info.config.max_batch, info.config.max_expires),
        (2, Duration::from_secs(1)),
        "the limits changed"
    );
    for i in 1..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("m-{i}"))).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    // Both refusals happened, and each was met as it should be.
    let capped = logs.matching(&["WARN", "max_batch of 2", "route=\"c\""]);
    assert_eq!(capped.len(), 1, "one warning names the cap: {capped:#?}");
    assert!(
        capped[0].contains(
            "give it a largest batch of its own (`Route::adaptive_batch`; at its defaults it \
             takes up to 64 messages a batch)"
        ),
        "a route left at its defaults is not told to lower a batch it never chose: {capped:#?}"
    );
    let reopened = logs.matching(&["WARN", "Exceeded MaxRequestExpires", "route=\"c\""]);
    assert!(
        !reopened.is_empty(),
        "the pull was reopened after the expiry was refused"
    );
    stop(handle, task).await;

    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(MESSAGES));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "none redelivered"
    );
    let info = env.consumer_info(&stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_waiting),
        (0, 0, 0),
        "nothing pending, and no pull request left on the server"
    );
}

/// Another client fills the consumer's wait list (`max_waiting`, 512
/// requests) before the route starts. The server then drops each of the
/// route's pull requests without a word: it tells a request that asks for
/// heartbeats nothing when its list is full. Each request leaves the pull's
/// books at its expiry; as no message came, none can have been filled, so
/// each counts as lost, and once that has lasted 10 s the route warns,
/// naming the wait list. Once the other client has gone, the route takes
/// messages again, and applies each once.
#[tokio::test]
async fn a_full_wait_list_that_drops_the_routes_requests_without_a_word_is_warned_about() {
    use futures_util::{FutureExt, StreamExt};
    const MESSAGES: i64 = 10;
    let logs = idem_tests::capture_logs();
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FULLWAIT", Duration::from_secs(120)).await;
    // The route's consumer, as the route creates it, so that the other
    // client can pull from it first.
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("c".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: 13,
            ..Default::default()
        })
        .await
        .unwrap();
    let filler = env.nats().await;
    let inbox = filler.new_inbox();
    let mut replies = filler.subscribe(format!("{inbox}.*")).await.unwrap();
    let request = serde_json::to_vec(&serde_json::json!({
        "batch": 1,
        "expires": Duration::from_secs(120).as_nanos() as u64,
    }))
    .unwrap();
    for i in 0..512 {
        filler
            .publish_with_reply(
                format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.c"),
                format!("{inbox}.{i}"),
                request.clone().into(),
            )
            .await
            .unwrap();
    }
    filler.flush().await.unwrap();
    eventually("the wait list is full", Duration::from_secs(10), || async {
        env.consumer_info(&stream, "c").await.num_waiting == 512
    })
    .await;

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    let warning = || logs.matching(&["WARN", "max_waiting", "without a word", "route=\"c\""]);
    eventually(
        "the route warns that its requests are dropped",
        Duration::from_secs(40),
        || async { !warning().is_empty() },
    )
    .await;
    // It happened: the list was still full of the other client's requests,
    // and none of them was answered.
    assert_eq!(env.consumer_info(&stream, "c").await.num_waiting, 512);
    assert!(
        replies.next().now_or_never().is_none(),
        "the other client's requests still wait"
    );
    assert_eq!(warning().len(), 1, "warned once: {:#?}", warning());

    // The other client goes; the route takes messages again. Its requests
    // stay on the wait list, and the server passes over a request only once
    // nobody listens on its reply subject: until the server has taken the
    // other client's unsubscribe, a message could still go to one of them,
    // and come back only after ack_wait as a redelivery. The server answers
    // the flush's PING after the UNSUB before it; a request to that subject
    // getting "no responders" shows it.
    replies.unsubscribe().await.unwrap();
    filler.flush().await.unwrap();
    drop(replies);
    drop(filler);
    eventually(
        "the server knows that nobody reads the other client's replies",
        Duration::from_secs(10),
        || {
            let nats = nats.clone();
            let subject = format!("{inbox}.0");
            async move {
                let asked = nats.request(subject, Vec::new().into());
                matches!(
                    tokio::time::timeout(Duration::from_secs(1), asked).await,
                    Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders
                )
            }
        },
    )
    .await;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("m-{i}"))).await;
    }
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(MESSAGES));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "none redelivered"
    );
    let info = env.consumer_info(&stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_waiting),
        (0, 0, 0),
        "nothing pending, and no pull request left on the server"
    );
}
