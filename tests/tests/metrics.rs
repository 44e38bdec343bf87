//! The example services' `/metrics`, scraped over HTTP while real messages
//! flow: the counters must equal what happened, the histograms must have
//! one observation per processed message (per handler call), and the
//! gauges must show what the servers show.
//!
//! The services run as processes (`pipeline_service orders|payments`, the
//! same code as the example's `orders` and `payments` binaries), because the
//! metrics recorder is process-global: each process installs its exporter,
//! on a port the test chose, through `IDEM_METRICS_ADDR`.

use std::fs::File;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use idem_tests::{TestEnv, wait_until};
use pipeline_example::demo::wait_for_streams;
use pipeline_example::metrics::{Metrics, scrape};
use pipeline_example::{ORDERS_STREAM, OrderPaid, OrderPlaced, PAYMENTS_STREAM, PaymentRequested};

/// Orders placed, each once.
const ORDERS: usize = 40;
/// `payments.requested` published again, under new message ids, for orders
/// already charged: the payments handler's key (the order) makes them
/// duplicates.
const DUPLICATES: usize = 5;
/// `orders.paid` for orders that do not exist: a permanent error, dead-lettered.
const UNKNOWN_ORDERS: usize = 3;
/// `orders.placed` whose payload does not decode: rejected, dead-lettered.
const POISON: usize = 2;
/// Each route of the example runs this many messages at once.
const CONCURRENCY: f64 = 8.0;

/// How long the lock on `orders` is held, at least, after the last order
/// was published.
const HELD: Duration = Duration::from_secs(1);

/// Generous: the gauges are polled every 5 s, and CI shares two cores.
const SETTLE: Duration = Duration::from_secs(90);

/// A service process, with its log in a temp file; killed on drop.
struct Service {
    name: &'static str,
    child: Child,
    log: tempfile::NamedTempFile,
    metrics: SocketAddr,
}

impl Service {
    fn start(env: &TestEnv, name: &'static str) -> Service {
        let metrics = free_addr();
        let log = tempfile::NamedTempFile::new().expect("a temp log file");
        let out = File::options().append(true).open(log.path()).expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_pipeline_service"))
            .arg(name)
            .env("NATS_URL", env.nats_url())
            .env("DATABASE_URL", env.database_url())
            .env("IDEM_METRICS_ADDR", metrics.to_string())
            .env("RUST_LOG", "warn,idem_runtime=info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("pipeline_service starts");
        Service {
            name,
            child,
            log,
            metrics,
        }
    }

    async fn scrape(&mut self) -> Metrics {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "the {} service exited ({status}); its log:\n{}",
                self.name,
                std::fs::read_to_string(self.log.path()).unwrap_or_default()
            );
        }
        scrape(self.metrics)
            .await
            .unwrap_or_else(|error| panic!("scraping the {} service: {error}", self.name))
    }

    /// Scrapes until `check` passes on a scrape, then returns that scrape;
    /// panics with the last scrape's mismatch after `SETTLE`.
    async fn scrape_until(&mut self, check: impl Fn(&Metrics) -> Result<(), String>) -> Metrics {
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let metrics = self.scrape().await;
            match check(&metrics) {
                Ok(()) => return metrics,
                Err(mismatch) if tokio::time::Instant::now() > deadline => {
                    panic!("the {} service's /metrics: {mismatch}", self.name)
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback address with a port free now (the service binds it a moment
/// later).
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
}

/// `Ok` if `metric` with `labels` reads `expected`.
fn expect(
    metrics: &Metrics,
    metric: &str,
    labels: &[(&str, &str)],
    expected: f64,
) -> Result<(), String> {
    match metrics.value(metric, labels) {
        Some(value) if value == expected => Ok(()),
        other => Err(format!(
            "{metric}{labels:?} is {other:?}, expected {expected}"
        )),
    }
}

/// `Ok` if histogram `metric` of `route` holds `expected` observations, in
/// its `_count` and in its `+Inf` bucket.
fn expect_observations(
    metrics: &Metrics,
    metric: &str,
    route: &str,
    expected: f64,
) -> Result<(), String> {
    expect(
        metrics,
        &format!("{metric}_count"),
        &[("route", route)],
        expected,
    )?;
    let buckets = metrics.buckets(metric, &[("route", route)]);
    match buckets.last() {
        Some(&(le, count)) if le.is_infinite() && count == expected => Ok(()),
        other => Err(format!(
            "{metric}{{route={route}}}'s last bucket is {other:?}, expected +Inf with {expected}"
        )),
    }
}

async fn publish(js: &jetstream::Context, subject: &str, id: &str, payload: Vec<u8>) {
    let mut headers = HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    js.publish_with_headers(subject.to_owned(), headers, payload.into())
        .await
        .expect("publish")
        .await
        .expect("PubAck");
}

/// Waits until every consumer of the pipeline has nothing pending or unacked.
async fn wait_idle(env: &TestEnv) {
    wait_until(SETTLE, async || {
        for (stream, durable) in [
            (ORDERS_STREAM, "orders-place"),
            (ORDERS_STREAM, "orders-mark-paid"),
            (PAYMENTS_STREAM, "payments-charge"),
        ] {
            let info = env.consumer_info(stream, durable).await;
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                return false;
            }
        }
        true
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_metrics_count_what_happened() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    let js = env.jetstream().await;
    let mut orders = Service::start(&env, "orders");
    let mut payments = Service::start(&env, "payments");
    wait_for_streams(&js, SETTLE)
        .await
        .expect("the services create their streams");
    // Each route registers its metrics when it starts.
    for (service, route) in [
        (&mut orders, "orders-place"),
        (&mut payments, "payments-charge"),
    ] {
        service
            .scrape_until(|m| expect(m, "idem_messages_received_total", &[("route", route)], 0.0))
            .await;
    }

    // The outbox gauges: a row no stream stores the subject of stays
    // pending (the relays' publishes of it fail, and it is counted as
    // failing), and ages.
    let mut conn = pool.acquire().await.unwrap();
    idem_runtime::outbox::enqueue(
        &mut conn,
        "stuck-1",
        "nowhere.stored",
        b"{}",
        &HeaderMap::new(),
    )
    .await
    .unwrap();
    drop(conn);
    let stuck = orders
        .scrape_until(|m| {
            expect(m, "idem_outbox_pending_rows", &[], 1.0)?;
            // Its failure is recorded on it: NATS answers, no stream does.
            expect(m, "idem_outbox_failing_rows", &[], 1.0)?;
            match m.value("idem_outbox_oldest_age_seconds", &[]) {
                Some(age) if age >= 1.0 => Ok(()),
                other => Err(format!("oldest outbox row {other:?} s old, expected >= 1")),
            }
        })
        .await;
    assert!(
        stuck
            .value("idem_outbox_publish_failures_total", &[])
            .unwrap_or(0.0)
            + payments
                .scrape()
                .await
                .value("idem_outbox_publish_failures_total", &[])
                .unwrap_or(0.0)
            > 0.0,
        "the relays counted their failed publishes of the stuck row"
    );
    sqlx::query("DELETE FROM idem_outbox WHERE msg_id = 'stuck-1'")
        .execute(&pool)
        .await
        .unwrap();

    // In flight and consumer lag: hold every INSERT into `orders`, so the
    // orders-place handlers wait inside their transactions while the rest
    // of the orders wait in the consumer.
    let mut hold = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN SHARE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        * 1000;
    let placed: Vec<OrderPlaced> = (0..ORDERS as i64)
        .map(|i| OrderPlaced {
            order: base + i,
            amount: 10 + i,
        })
        .collect();
    for order in &placed {
        let id = format!("order-{}", order.order);
        publish(
            &js,
            "orders.placed",
            &id,
            serde_json::to_vec(order).unwrap(),
        )
        .await;
    }
    let all_published = tokio::time::Instant::now();
    let held = orders
        .scrape_until(|m| {
            let route = [("route", "orders-place")];
            expect(m, "idem_messages_in_flight", &route, CONCURRENCY)?;
            let pending = m.value("idem_consumer_pending_messages", &route);
            let ack_pending = m.value("idem_consumer_ack_pending_messages", &route);
            match (pending, ack_pending) {
                (Some(p), Some(a)) if a >= CONCURRENCY && p + a == ORDERS as f64 => Ok(()),
                other => Err(format!(
                    "orders-place lag (pending, ack pending) {other:?}, expected ack pending >= {CONCURRENCY} and {ORDERS} in all"
                )),
            }
        })
        .await;
    // The gauges are the server's figures, which hold still while the lock does.
    let info = env.consumer_info(ORDERS_STREAM, "orders-place").await;
    let route = [("route", "orders-place")];
    assert_eq!(
        held.value("idem_consumer_pending_messages", &route),
        Some(info.num_pending as f64)
    );
    assert_eq!(
        held.value("idem_consumer_ack_pending_messages", &route),
        Some(info.num_ack_pending as f64)
    );
    assert!(
        info.num_pending > 0,
        "the lock kept orders in the consumer: {info:?}"
    );
    expect(&held, "idem_messages_processed_total", &route, 0.0).unwrap();
    // Held for at least a second after the last publish, so each held call
    // (each started before it) takes over a second.
    tokio::time::sleep_until(all_published + HELD).await;
    hold.commit().await.unwrap();

    // Everything flows: each order written, charged and marked paid once.
    wait_until(SETTLE, async || {
        let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE times_paid = 1")
            .fetch_one(&pool)
            .await
            .unwrap();
        paid == ORDERS as i64
    })
    .await;
    wait_idle(&env).await;

    // Duplicates, dead letters and rejections.
    for (i, order) in placed.iter().take(DUPLICATES).enumerate() {
        let request = PaymentRequested {
            order: order.order,
            amount: order.amount,
        };
        let id = format!("retried-request-{i}");
        publish(
            &js,
            "payments.requested",
            &id,
            serde_json::to_vec(&request).unwrap(),
        )
        .await;
    }
    for i in 0..UNKNOWN_ORDERS as i64 {
        let paid = OrderPaid {
            order: -1 - i,
            charge: 1,
        };
        let id = format!("unknown-order-{i}");
        publish(&js, "orders.paid", &id, serde_json::to_vec(&paid).unwrap()).await;
    }
    for i in 0..POISON {
        publish(
            &js,
            "orders.placed",
            &format!("poison-{i}"),
            b"not json".to_vec(),
        )
        .await;
    }
    wait_idle(&env).await;
    let mut dead_letters = js.get_stream("IDEM_DEAD_LETTERS").await.unwrap();
    assert_eq!(
        dead_letters.info().await.unwrap().state.messages,
        (UNKNOWN_ORDERS + POISON) as u64,
        "the dead letters are stored"
    );
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        charges, ORDERS as i64,
        "the retried requests charged nothing"
    );

    // What the counters must say, per route.
    let n = ORDERS as f64;
    let orders_metrics = orders
        .scrape_until(|m| {
            let place = [("route", "orders-place")];
            let paid = [("route", "orders-mark-paid")];
            expect(m, "idem_messages_received_total", &place, n + POISON as f64)?;
            expect(m, "idem_messages_processed_total", &place, n)?;
            expect(m, "idem_messages_duplicate_total", &place, 0.0)?;
            expect(m, "idem_messages_failed_total", &place, 0.0)?;
            expect(m, "idem_messages_rejected_total", &place, POISON as f64)?;
            expect(
                m,
                "idem_messages_dead_lettered_total",
                &[("route", "orders-place"), ("reason", "undecodable")],
                POISON as f64,
            )?;
            expect(
                m,
                "idem_messages_dead_lettered_total",
                &place,
                POISON as f64,
            )?;
            expect(m, "idem_commit_unknown_total", &place, 0.0)?;
            expect_observations(m, "idem_handler_duration_seconds", "orders-place", n)?;
            expect_observations(m, "idem_end_to_end_duration_seconds", "orders-place", n)?;

            expect(
                m,
                "idem_messages_received_total",
                &paid,
                n + UNKNOWN_ORDERS as f64,
            )?;
            expect(m, "idem_messages_processed_total", &paid, n)?;
            expect(
                m,
                "idem_messages_failed_total",
                &paid,
                UNKNOWN_ORDERS as f64,
            )?;
            expect(
                m,
                "idem_messages_dead_lettered_total",
                &[("route", "orders-mark-paid"), ("reason", "permanent")],
                UNKNOWN_ORDERS as f64,
            )?;
            // The failed calls are timed too.
            let calls = n + UNKNOWN_ORDERS as f64;
            expect_observations(
                m,
                "idem_handler_duration_seconds",
                "orders-mark-paid",
                calls,
            )?;
            expect_observations(m, "idem_end_to_end_duration_seconds", "orders-mark-paid", n)?;

            for route in ["orders-place", "orders-mark-paid"] {
                let route = [("route", route)];
                expect(m, "idem_messages_in_flight", &route, 0.0)?;
                expect(m, "idem_consumer_pending_messages", &route, 0.0)?;
                expect(m, "idem_consumer_ack_pending_messages", &route, 0.0)?;
            }
            expect(m, "idem_outbox_pending_rows", &[], 0.0)?;
            expect(m, "idem_outbox_oldest_age_seconds", &[], 0.0)
        })
        .await;
    let payments_metrics = payments
        .scrape_until(|m| {
            let charge = [("route", "payments-charge")];
            expect(
                m,
                "idem_messages_received_total",
                &charge,
                n + DUPLICATES as f64,
            )?;
            expect(m, "idem_messages_processed_total", &charge, n)?;
            expect(
                m,
                "idem_messages_duplicate_total",
                &charge,
                DUPLICATES as f64,
            )?;
            expect(m, "idem_messages_failed_total", &charge, 0.0)?;
            expect(m, "idem_messages_dead_lettered_total", &charge, 0.0)?;
            expect_observations(m, "idem_handler_duration_seconds", "payments-charge", n)?;
            expect_observations(m, "idem_end_to_end_duration_seconds", "payments-charge", n)?;
            expect(m, "idem_messages_in_flight", &charge, 0.0)?;
            expect(m, "idem_consumer_pending_messages", &charge, 0.0)?;
            expect(m, "idem_consumer_ack_pending_messages", &charge, 0.0)?;
            expect(m, "idem_outbox_pending_rows", &[], 0.0)
        })
        .await;

    // Each order sent one payments.requested and one orders.paid through
    // the outbox; either service's relay may have published any of them.
    let published = orders_metrics
        .value("idem_outbox_published_total", &[])
        .unwrap_or(0.0)
        + payments_metrics
            .value("idem_outbox_published_total", &[])
            .unwrap_or(0.0);
    assert_eq!(published, 2.0 * n, "outbox messages published");
    // The orders held by the lock waited in their handlers: the handler
    // latency histogram saw it.
    let slow = orders_metrics
        .buckets(
            "idem_handler_duration_seconds",
            &[("route", "orders-place")],
        )
        .into_iter()
        .find(|&(le, _)| le == 0.5)
        .map(|(_, count)| count);
    assert!(
        slow.is_some_and(|under_half_a_second| under_half_a_second <= n - CONCURRENCY),
        "the {CONCURRENCY} held calls took over {HELD:?}, so over 0.5 s: {slow:?}"
    );
    // Descriptions are exported as # HELP.
    assert!(
        orders_metrics
            .docs
            .get("idem_messages_processed_total")
            .is_some_and(|help| help.contains("committed")),
        "{:?}",
        orders_metrics.docs.get("idem_messages_processed_total")
    );
}
