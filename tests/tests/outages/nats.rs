//! NATS failing under a running route: a restarted server, whose pull
//! requests are gone, is asked again as soon as the client reconnects; the
//! route's consumer deleted under it: the pull loop does not spin, it backs
//! off, and it picks up again once the consumer is back.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use idem_runtime::{Route, Router};
use idem_tests::scenario::*;

/// The NATS server is killed and started again (its store kept, its pull
/// requests gone). A message published the moment it is back is processed
/// within 1 s of the router's client reconnecting: the pull asks again at
/// once, instead of waiting for missed idle heartbeats.
#[tokio::test]
async fn a_restarted_server_is_pulled_from_within_a_second_of_the_reconnect() {
    let Scenario {
        mut env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("RECONNECT", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("before")).await;
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    // When the router's client reconnects, to within 5 ms. The route is
    // timed from the later of that and the moment the message below is
    // stored: a reconnect before it was published leaves the route nothing
    // to take until then (on a loaded machine, the harness's restart and a
    // new client can take longer than the 1 s under test).
    let statistics = nats.statistics();
    let connected_before = statistics.connects.load(Ordering::Relaxed);
    let reconnect = tokio::spawn(async move {
        while statistics.connects.load(Ordering::Relaxed) == connected_before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Instant::now()
    });

    // The fault: the server dies, and comes back on the same port and store.
    env.nats_server_mut().kill_and_restart().await;
    // Published by a client of its own as soon as JetStream answers, so it
    // waits in the stream for the router's pull.
    let publisher = jetstream::new(env.nats().await);
    publish(&publisher, &subject, &deposit("a", 2), Some("after")).await;
    let stored = Instant::now();
    let reconnected = tokio::time::timeout(Duration::from_secs(30), reconnect)
        .await
        .expect("the router's client reconnects within 30 s")
        .unwrap();
    eventually(
        "the message published after the restart is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 2 },
    )
    .await;
    let taken_after = reconnected.max(stored).elapsed();
    eprintln!(
        "from reconnect ({:?} after the message was stored) to the first message processed: {taken_after:?}",
        reconnected.saturating_duration_since(stored)
    );
    assert!(
        taken_after < Duration::from_secs(1),
        "the route took a message {taken_after:?} after its client reconnected and the message was stored, not within 1 s"
    );
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(2));
}

/// The route's consumer is deleted under it. The pull loop must not spin
/// re-issuing pulls as fast as it can: it backs off, and picks up again
/// once the consumer is back.
#[tokio::test]
async fn a_deleted_consumer_does_not_make_the_pull_loop_spin() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NOCONSUMER", Duration::from_secs(120)).await;
    let route = || Route::new(&stream, "c");
    let (handle, task) = spawn(
        Router::new().route(route(), no_ids),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("before")).await;
    wait_all_acked(&js, &stream, "c").await;

    let mut pulls = nats
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.c"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer("c")
        .await
        .unwrap();
    // Pull requests the route sends in 3 s without its consumer, and the
    // CPU time this process (the router's) spends meanwhile.
    let cpu_before = process_cpu_time();
    let window = tokio::time::sleep(Duration::from_secs(3));
    tokio::pin!(window);
    let mut requests = 0;
    loop {
        tokio::select! {
            _ = &mut window => break,
            Some(_) = pulls.next() => requests += 1,
        }
    }
    let cpu = process_cpu_time() - cpu_before;
    assert!(requests >= 1, "the route kept trying to pull");
    assert!(
        cpu < Duration::from_millis(1500),
        "{cpu:?} of CPU in 3 s: the pull loop spins"
    );
    assert!(
        requests <= 30,
        "{requests} pull requests in 3 s: the pull loop spins"
    );

    // An operator recreates the consumer; the route picks up again.
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(route_consumer_config())
        .await
        .unwrap();
    publish(&js, &subject, &deposit("a", 2), Some("after")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(2));
}

/// The CPU time (user and system) this process has used.
fn process_cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// The consumer `Route::new(_, "c")` creates, with its default settings.
fn route_consumer_config() -> jetstream::consumer::pull::Config {
    jetstream::consumer::pull::Config {
        durable_name: Some("c".into()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: 13,
        ..Default::default()
    }
}
