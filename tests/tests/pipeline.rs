//! The example pipeline (`examples/pipeline`: orders -> payments -> orders,
//! through the transactional outbox) in-process against a real nats-server
//! and PostgreSQL, with two replicas of each service (a router and a relay
//! each) and duplicates injected on its input, inside JetStream's duplicate
//! window and after it.

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::outbox::{Relay, RelayError, RelayStats};
use idem_runtime::{Router, RouterHandle};
use pipeline_example::demo::{publish_orders, wait_settled};
use pipeline_example::{orders, payments};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One replica of a service: its router and the relay beside it.
struct Replica {
    router: RouterHandle,
    router_task: JoinHandle<Result<(), idem_runtime::Error>>,
    relay: RelayStats,
    stop_relay: oneshot::Sender<()>,
    relay_task: JoinHandle<Result<(), RelayError>>,
}

async fn start(router: Router, env: &idem_tests::TestEnv) -> Replica {
    // Each replica has connections of its own, as a process would.
    let (nats, pool) = (env.nats().await, env.pool().await);
    let relay = Relay::new();
    let stats = relay.stats();
    let (stop_relay, stopped) = oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run_until(nats.clone(), pool.clone(), async {
        let _ = stopped.await;
    }));
    let handle = router.handle();
    let router_task = tokio::spawn(router.run_until(nats, pool, std::future::pending()));
    Replica {
        router: handle,
        router_task,
        relay: stats,
        stop_relay,
        relay_task,
    }
}

impl Replica {
    async fn stop(self) {
        self.router.shutdown();
        let within = Duration::from_secs(30);
        tokio::time::timeout(within, self.router_task)
            .await
            .expect("the router stops within 30 s")
            .expect("the router task does not panic")
            .expect("the router returns Ok");
        let _ = self.stop_relay.send(());
        tokio::time::timeout(within, self.relay_task)
            .await
            .expect("the relay stops within 30 s")
            .expect("the relay task does not panic")
            .expect("the relay returns Ok");
    }
}

#[tokio::test]
async fn each_order_is_charged_once_and_paid_once_end_to_end() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    let js = jetstream::new(env.nats().await);
    orders::migrate(&pool).await.expect("orders schema");
    payments::migrate(&pool).await.expect("payments schema");
    let mut replicas = Vec::new();
    for _ in 0..2 {
        replicas.push(start(orders::router(), &env).await);
        replicas.push(start(payments::router(), &env).await);
    }
    pipeline_example::demo::wait_for_streams(&js, Duration::from_secs(30))
        .await
        .expect("the services create their streams");

    let n = 200;
    let sent = publish_orders(&js, 1..1 + n).await.expect("orders publish");
    let tally = wait_settled(&js, &pool, &(1..1 + n), Duration::from_secs(60))
        .await
        .expect("the pipeline settles");

    // The faults happened: JetStream dropped the duplicates inside its
    // window, stored those after it, and the claims skipped the latter.
    assert_eq!(
        sent.published,
        n as usize + sent.within_window + sent.after_window
    );
    assert_eq!(sent.dropped_by_jetstream, sent.within_window);
    assert_eq!(tally.placed_messages, n as usize + sent.after_window);
    let skipped: u64 = replicas
        .iter()
        .filter_map(|r| r.router.stats("orders-place"))
        .map(|stats| stats.duplicates())
        .sum();
    assert_eq!(
        skipped, sent.after_window as u64,
        "claims skipped the late duplicates"
    );
    // Each order written, charged and marked paid once, one orders.paid
    // each in the stream, the outbox empty, no dead letters.
    assert!(tally.exactly_once(n as usize), "{tally:?}");
    // The relays published one payments.requested and one orders.paid per
    // order, and JetStream never had one already.
    let published: u64 = replicas.iter().map(|r| r.relay.published()).sum();
    let duplicates: u64 = replicas.iter().map(|r| r.relay.duplicates()).sum();
    assert_eq!((published, duplicates), (2 * n as u64, 0));

    for replica in replicas {
        replica.stop().await;
    }
}
