//! The example services' `/metrics`, scraped over HTTP while real messages
//! flow: the counters must equal what happened, the histograms must have
//! one observation per processed message (per handler call), and the
//! gauges must show what the servers show.
//!
//! The services run as processes (`pipeline_service orders|payments`, the
//! same code as the example's `orders` and `payments` binaries), because the
//! metrics recorder is process-global: each process installs its exporter,
//! on a port the test chose, through `IDEM_METRICS_ADDR`.
//!
//! The failure counters are driven by real faults on routers of the test's
//! own process (a deadlock, the claims table gone, a COMMIT cut or left
//! unanswered by a proxy, a deleted dead-letter stream, a failure inside a
//! batch; on a request route, the same and refused requests), with the
//! Prometheus exporter's recorder installed in the process: each counter
//! read from what its `/metrics` serves must equal the route's `Stats`
//! counter and what the fault did.

use std::collections::HashSet;
use std::fs::File;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use bytes::Bytes;
use idem_runtime::{
    Delivery, Permanent, ReplyRoute, Route, Router, State, Stats, Transient, idempotent,
};
use idem_tests::TestEnv;
use idem_tests::pg_proxy::{PgProxy, upstream_of};
use idem_tests::scenario::{
    Deposit, create_stream, eventually, prepare_database, record_effect, spawn, stop, unique_name,
    wait_all_acked,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
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
    eventually(
        "every consumer of the pipeline is idle",
        SETTLE,
        async || {
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
        },
    )
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
    orders
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
    // A relay counts a failed publish after the commit that marks the row
    // failing, which the gauge above reads: the count may lag it a moment.
    idem_tests::eventually(
        "the relays count their failed publishes of the stuck row",
        SETTLE,
        async || {
            let failures = |m: Metrics| {
                m.value("idem_outbox_publish_failures_total", &[])
                    .unwrap_or(0.0)
            };
            failures(orders.scrape().await) + failures(payments.scrape().await) > 0.0
        },
    )
    .await;
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
            // Every slot holds a message, or a batch of them (the route
            // batches by default).
            match m.value("idem_messages_in_flight", &route) {
                Some(in_flight) if (CONCURRENCY..=ORDERS as f64).contains(&in_flight) => {}
                other => {
                    return Err(format!(
                        "orders-place in flight {other:?}, expected {CONCURRENCY} to {ORDERS}"
                    ));
                }
            }
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
    eventually("every order is paid once", SETTLE, async || {
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
            // A call in a batch the lock made wait past its lock_timeout is
            // timed too, and its message runs again alone: at least one
            // call per order.
            match m.value("idem_handler_duration_seconds_count", &place) {
                Some(calls) if calls >= n => {}
                other => {
                    return Err(format!(
                        "orders-place handler calls {other:?}, expected >= {n}"
                    ));
                }
            }
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
            // The failed calls are timed too; and in a batch that failed,
            // the calls of its other messages, which run again.
            let calls = n + UNKNOWN_ORDERS as f64;
            match m.value("idem_handler_duration_seconds_count", &paid) {
                Some(timed) if timed >= calls => {}
                other => {
                    return Err(format!(
                        "orders-mark-paid handler calls {other:?}, expected >= {calls}"
                    ));
                }
            }
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
    let buckets = orders_metrics.buckets(
        "idem_handler_duration_seconds",
        &[("route", "orders-place")],
    );
    let count_under = |limit: f64| {
        buckets
            .iter()
            .find(|&&(le, _)| le == limit)
            .map(|&(_, count)| count)
    };
    let (slow, calls) = (count_under(0.5), count_under(f64::INFINITY));
    assert!(
        matches!((slow, calls), (Some(under_half_a_second), Some(calls)) if under_half_a_second <= calls - CONCURRENCY),
        "the {CONCURRENCY} held calls took over {HELD:?}, so over 0.5 s: {slow:?} of {calls:?} under 0.5 s"
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

// ---------------------------------------------------------------------------
// The failure counters, driven by real faults in routers of this process.
// ---------------------------------------------------------------------------

/// The Prometheus exporter's recorder, installed in this process once
/// (nextest runs each test in a process of its own; `cargo test` runs them
/// all in one, and the recorder is process-global). Each route takes its
/// handles from it when it starts, so it is installed before any router.
fn exporter() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let mut builder = PrometheusBuilder::new();
        for (name, buckets) in idem_runtime::metrics::HISTOGRAM_BUCKETS {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                .expect("idem's buckets are valid");
        }
        let handle = builder
            .install_recorder()
            .expect("no other recorder is installed in this test process");
        idem_runtime::metrics::describe();
        handle
    })
}

/// What this process's `/metrics` would serve now, parsed.
fn scrape_here() -> Metrics {
    let text = exporter().render();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned())))
        .expect("the exporter's text parses");
    Metrics {
        docs: scrape.docs,
        samples: scrape.samples,
    }
}

/// Every per-route counter of each route against the route's `Stats`: the
/// two move together, so after the routes have settled they must be equal,
/// one by one. All differences of all routes are reported at once.
fn assert_counters_equal_stats(metrics: &Metrics, routes: &[(&str, Arc<Stats>)]) {
    let mut differ = Vec::new();
    for (route, stats) in routes {
        let labels = [("route", *route)];
        let read = |name: &str| metrics.value(name, &labels).unwrap_or(0.0) as u64;
        let pairs = [
            ("idem_messages_received_total", stats.received()),
            ("idem_messages_processed_total", stats.processed()),
            ("idem_messages_duplicate_total", stats.duplicates()),
            ("idem_messages_failed_total", stats.failed()),
            ("idem_messages_retried_total", stats.retried_in_process()),
            ("idem_messages_dead_lettered_total", stats.dead_lettered()),
            ("idem_messages_rejected_total", stats.rejected()),
            ("idem_commit_unknown_total", stats.commit_failed()),
            (
                "idem_dead_letter_publish_failures_total",
                stats.dead_letter_failed(),
            ),
            (
                "idem_infrastructure_errors_total",
                stats.infrastructure_errors(),
            ),
            ("idem_batch_fallbacks_total", stats.batch_fallbacks()),
            (
                "idem_abandoned_transactions_total",
                stats.abandoned_transactions(),
            ),
            ("idem_batch_size_count", stats.batches()),
        ];
        for (name, from_stats) in pairs {
            let scraped = read(name);
            if scraped != from_stats {
                differ.push((*route, name, scraped, from_stats));
            }
        }
        if metrics.value("idem_messages_in_flight", &labels) != Some(0.0) {
            differ.push((*route, "idem_messages_in_flight", u64::MAX, 0));
        }
    }
    assert!(
        differ.is_empty(),
        "scraped counters differ from Stats (route, name, scraped, Stats): {differ:#?}"
    );
}

/// The scraped value of counter `name` of `route`.
fn counter(metrics: &Metrics, name: &str, route: &str) -> u64 {
    metrics.value(name, &[("route", route)]).unwrap_or(0.0) as u64
}

/// What the fault-driving handlers share.
#[derive(Clone)]
struct Faults {
    /// The two messages of the deadlock meet here, each holding its first
    /// row lock.
    deadlock: Arc<tokio::sync::Barrier>,
    /// Message ids whose first attempt has run.
    tried: Arc<Mutex<HashSet<String>>>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            deadlock: Arc::new(tokio::sync::Barrier::new(2)),
            tried: Arc::default(),
        }
    }
}

impl Faults {
    /// Whether this is the first attempt at `delivery`'s message.
    fn first_try(&self, delivery: &Delivery) -> bool {
        self.tried
            .lock()
            .unwrap()
            .insert(delivery.message_id().as_str().to_owned())
    }
}

/// Account `a` locks row 1 then row 2, account `b` row 2 then row 1; on
/// their first attempts both take their first lock before either asks for
/// its second, so PostgreSQL finds a real deadlock and aborts one of them
/// (40P01), which the runtime runs again at once. It waits for another
/// message's transaction, so it must have its transaction to itself
/// (`per_message`): in one batch, the two would wait for each other.
#[idempotent(name = "metrics.deadlocks", per_message)]
async fn deadlocks(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(faults): State<Faults>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    let (first, second) = if d.account == "a" { (1, 2) } else { (2, 1) };
    let lock = "SELECT id FROM hot_rows WHERE id = $1 FOR UPDATE";
    sqlx::query(lock).bind(first).execute(&mut **tx).await?;
    if faults.first_try(delivery) {
        faults.deadlock.wait().await;
    }
    sqlx::query(lock).bind(second).execute(&mut **tx).await?;
    record_effect(tx, "metrics.deadlocks", &d, delivery).await
}

/// Applies the deposit for `handler`, unless its account is `refused`
/// (permanent).
async fn apply(
    tx: &mut sqlx::PgTransaction<'_>,
    handler: &str,
    delivery: &Delivery,
    d: &Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if d.account == "refused" {
        return Err(Permanent::new("this account is refused").into());
    }
    record_effect(tx, handler, d, delivery).await?;
    Ok(())
}

// One handler per route: a handler's name is its dedup scope.

#[idempotent(name = "metrics.infra")]
async fn on_infra(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    apply(tx, on_infra::NAME, delivery, &d).await
}

#[idempotent(name = "metrics.unknown")]
async fn on_unknown(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    apply(tx, on_unknown::NAME, delivery, &d).await
}

#[idempotent(name = "metrics.abandoned")]
async fn on_abandoned(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    apply(tx, on_abandoned::NAME, delivery, &d).await
}

#[idempotent(name = "metrics.dlq")]
async fn on_dlq(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    apply(tx, on_dlq::NAME, delivery, &d).await
}

#[idempotent(name = "metrics.batch")]
async fn on_batch(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    apply(tx, on_batch::NAME, delivery, &d).await
}

/// A route of the failure test: its own stream, `<prefix>.deposit`.
async fn failure_route(js: &jetstream::Context, prefix: &str) -> (String, String) {
    let stream = unique_name(prefix);
    let subject = format!("{stream}.deposit");
    create_stream(js, &stream, &subject, Duration::from_secs(120)).await;
    (stream, subject)
}

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.to_owned(),
        amount,
    }
}

/// Real faults, each on a route of its own, move the failure counters: a
/// deadlock (retried), the claims table gone (infrastructure errors), a
/// COMMIT cut after the server ran it (commit unknown), a COMMIT that never
/// gets an answer (abandoned), the dead-letter stream deleted (dead-letter
/// publish failures), and a permanent failure inside a batch (batch
/// fallback). Each scraped counter equals the route's `Stats` and what the
/// fault did, and each fault is shown to have happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_counters_count_what_happened() {
    exporter();
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    sqlx::raw_sql(
        "CREATE TABLE hot_rows (id int PRIMARY KEY); INSERT INTO hot_rows VALUES (1), (2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let (retried, retried_subject) = failure_route(&js, "M_RETRIED").await;
    let (infra, infra_subject) = failure_route(&js, "M_INFRA").await;
    let (unknown, unknown_subject) = failure_route(&js, "M_UNKNOWN").await;
    let (abandoned, abandoned_subject) = failure_route(&js, "M_ABANDONED").await;
    let (dlq, dlq_subject) = failure_route(&js, "M_DLQ").await;
    let (batch, batch_subject) = failure_route(&js, "M_BATCH").await;
    // The dead-letter route's own dead-letter stream, deleted below.
    let dead_stream = unique_name("M_DEAD");
    let dead_subject = format!("{dead_stream}.letters");
    create_stream(&js, &dead_stream, &dead_subject, Duration::from_secs(120)).await;
    let dead_config = js
        .get_stream(&dead_stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();

    // The deadlocking pair and the batch wait in their streams, so that
    // each pair and each batch is taken together.
    idem_tests::scenario::publish(&js, &retried_subject, &deposit("a", 1), Some("dl-a")).await;
    idem_tests::scenario::publish(&js, &retried_subject, &deposit("b", 1), Some("dl-b")).await;
    for (i, account) in ["ok", "refused", "ok", "ok"].iter().enumerate() {
        idem_tests::scenario::publish(
            &js,
            &batch_subject,
            &deposit(account, 1),
            Some(&format!("b-{i}")),
        )
        .await;
    }
    let deadlocks_before: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    // Every route's connections go through a proxy that can cut or
    // blackhole the next COMMIT.
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .unwrap();
    let fast = |route: Route| route.backoff(Duration::from_millis(50), Duration::from_millis(200));
    let router = Router::with_state(Faults::default())
        .route(
            fast(Route::new(&retried, "m-retried")).concurrency(2),
            deadlocks,
        )
        .route(fast(Route::new(&infra, "m-infra")), on_infra)
        .route(fast(Route::new(&unknown, "m-unknown")), on_unknown)
        .route(
            fast(Route::new(&abandoned, "m-abandoned")).handler_timeout(Duration::from_secs(1)),
            on_abandoned,
        )
        .route(
            fast(Route::new(&dlq, "m-dlq")).dead_letter_subject(&dead_subject),
            on_dlq,
        )
        .route(fast(Route::new(&batch, "m-batch")).batch(4), on_batch);
    let (handle, task) = spawn(router, nats.clone(), proxied);
    let stats = |route: &str| handle.stats(route).unwrap();
    // Started once every route's consumer exists.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for (stream, durable) in [
        (&retried, "m-retried"),
        (&infra, "m-infra"),
        (&unknown, "m-unknown"),
        (&abandoned, "m-abandoned"),
        (&dlq, "m-dlq"),
        (&batch, "m-batch"),
    ] {
        let stream = js.get_stream(stream).await.unwrap();
        while stream.consumer_info(durable).await.is_err() {
            if task.is_finished() {
                panic!("the router stopped at start-up: {:?}", task.await);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router did not start within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // Retried: the deadlock, and the batch's fallback, run first.
    wait_all_acked(&js, &retried, "m-retried").await;
    wait_all_acked(&js, &batch, "m-batch").await;
    let deadlocks_after: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        deadlocks_after - deadlocks_before,
        1,
        "PostgreSQL detected one deadlock"
    );

    // Infrastructure errors: every claim fails while the table is away.
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    idem_tests::scenario::publish(&js, &infra_subject, &deposit("infra", 1), Some("infra-1")).await;
    eventually(
        "the claim failed three times",
        Duration::from_secs(30),
        || async { stats("m-infra").infrastructure_errors() >= 3 },
    )
    .await;
    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &infra, "m-infra").await;

    // Commit unknown: the connection is cut after the server ran COMMIT.
    proxy.cut_next_commit();
    idem_tests::scenario::publish(&js, &unknown_subject, &deposit("cut", 1), Some("cut-1")).await;
    wait_all_acked(&js, &unknown, "m-unknown").await;
    assert_eq!(proxy.cuts(), 1, "the COMMIT's connection was cut");

    // Abandoned: a COMMIT that never gets an answer is no longer waited for
    // after the handler timeout's bound (1 s × 3, plus 5 s).
    proxy.blackhole_next_commit();
    idem_tests::scenario::publish(&js, &abandoned_subject, &deposit("hole", 1), Some("hole-1"))
        .await;
    eventually(
        "the blackholed COMMIT was abandoned",
        Duration::from_secs(30),
        || async { stats("m-abandoned").abandoned_transactions() == 1 },
    )
    .await;
    wait_all_acked(&js, &abandoned, "m-abandoned").await;
    assert_eq!(proxy.swallowed(), 1, "the COMMIT went into the blackhole");

    // Dead-letter publish failures: the route's dead-letter stream is gone
    // (it was there at start-up, which checks it).
    js.delete_stream(&dead_stream).await.unwrap();
    idem_tests::scenario::publish(&js, &dlq_subject, &deposit("refused", 1), Some("dlq-1")).await;
    eventually(
        "the dead-letter publish failed three times",
        Duration::from_secs(30),
        || async { stats("m-dlq").dead_letter_failed() >= 3 },
    )
    .await;
    js.create_stream(dead_config).await.unwrap();
    wait_all_acked(&js, &dlq, "m-dlq").await;
    let stored_dead_letters = js
        .get_stream(&dead_stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(
        stored_dead_letters, 1,
        "the dead letter was stored once the stream was back"
    );

    stop(handle.clone(), task).await;
    let m = scrape_here();
    let routes: Vec<(&str, Arc<Stats>)> = [
        "m-retried",
        "m-infra",
        "m-unknown",
        "m-abandoned",
        "m-dlq",
        "m-batch",
    ]
    .into_iter()
    .map(|route| (route, stats(route)))
    .collect();
    assert_counters_equal_stats(&m, &routes);
    let c = |name: &str, route: &str| counter(&m, name, route);

    // What each fault did, in the scraped counters.
    assert_eq!(
        (
            c("idem_messages_retried_total", "m-retried"),
            c("idem_messages_processed_total", "m-retried"),
            c("idem_messages_failed_total", "m-retried"),
        ),
        (1, 2, 0),
        "the deadlock's victim ran again at once, and both applied"
    );
    let infra_errors = c("idem_infrastructure_errors_total", "m-infra");
    assert!(infra_errors >= 3, "the failed claims: {infra_errors}");
    assert_eq!(
        (
            c("idem_messages_processed_total", "m-infra"),
            c("idem_messages_failed_total", "m-infra"),
        ),
        (1, 0),
        "held, not failed, while the table was away"
    );
    assert_eq!(
        (
            c("idem_commit_unknown_total", "m-unknown"),
            c("idem_messages_duplicate_total", "m-unknown"),
            c("idem_messages_processed_total", "m-unknown"),
        ),
        (1, 1, 0),
        "the cut COMMIT was of unknown outcome, and its redelivery found the claim"
    );
    assert_eq!(
        (
            c("idem_abandoned_transactions_total", "m-abandoned"),
            c("idem_commit_unknown_total", "m-abandoned"),
            c("idem_messages_processed_total", "m-abandoned"),
        ),
        (1, 1, 1),
        "the unanswered COMMIT was abandoned, settled as unknown, and its redelivery applied"
    );
    let publish_failures = c("idem_dead_letter_publish_failures_total", "m-dlq");
    assert!(
        publish_failures >= 3,
        "the failed dead-letter publishes: {publish_failures}"
    );
    assert_eq!(
        (
            c("idem_messages_failed_total", "m-dlq"),
            c("idem_messages_dead_lettered_total", "m-dlq"),
        ),
        (1, 1),
        "held until the dead letter could be stored, then dead-lettered once"
    );
    assert_eq!(
        m.value(
            "idem_messages_dead_lettered_total",
            &[("route", "m-dlq"), ("reason", "permanent")]
        ),
        Some(1.0)
    );
    assert_eq!(
        (
            c("idem_batch_fallbacks_total", "m-batch"),
            c("idem_messages_processed_total", "m-batch"),
            c("idem_messages_failed_total", "m-batch"),
            c("idem_messages_dead_lettered_total", "m-batch"),
        ),
        (1, 3, 1, 1),
        "the batch with a refused message fell back once; its three neighbours applied"
    );

    // Nothing applied twice, and the held messages used up no delivery.
    for (handler, effects) in [
        ("metrics.deadlocks", 2),
        ("metrics.infra", 1),
        ("metrics.unknown", 1),
        ("metrics.abandoned", 1),
        ("metrics.dlq", 0),
        ("metrics.batch", 3),
    ] {
        let (rows, distinct): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT message_id) FROM effects WHERE handler = $1",
        )
        .bind(handler)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (rows, distinct),
            (effects, effects),
            "{handler} applied each message once"
        );
    }
    let infra_delivered: i64 =
        sqlx::query_scalar("SELECT delivered FROM effects WHERE message_id = 'infra-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(infra_delivered, 1, "the held message used up no delivery");
}

/// Answers a request with ten times its amount, once applied. Account
/// `transient` always fails (transient); `conflict` meets a real 40001 from
/// the server on its first attempt.
#[idempotent(name = "metrics.answer")]
async fn answer(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(faults): State<Faults>,
    d: Deposit,
) -> Result<i64, idem_runtime::BoxError> {
    match d.account.as_str() {
        "transient" => return Err(Transient::new("not now").into()),
        "conflict" if faults.first_try(delivery) => {
            sqlx::query("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
                .execute(&mut **tx)
                .await?;
        }
        _ => {}
    }
    record_effect(tx, "metrics.answer", &d, delivery).await?;
    Ok(d.amount * 10)
}

/// Sends a request to `subject` (with `id` as its `Nats-Msg-Id` if given)
/// and returns the reply: its `Idem-Error` (if any) and its payload.
async fn ask(
    nats: &async_nats::Client,
    subject: &str,
    id: Option<&str>,
    payload: Vec<u8>,
) -> (Option<String>, Vec<u8>) {
    let mut headers = HeaderMap::new();
    if let Some(id) = id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    let reply = nats
        .send_request(
            subject.to_owned(),
            async_nats::Request::new()
                .headers(headers)
                .payload(payload.into())
                // Longer than an abandoned COMMIT takes to be given up on.
                .timeout(Some(Duration::from_secs(30))),
        )
        .await
        .unwrap_or_else(|error| panic!("request {id:?} got no reply: {error}"));
    let error = reply
        .headers
        .as_ref()
        .and_then(|headers| headers.get(idem_runtime::reply::ERROR_HEADER))
        .map(|value| value.as_str().to_owned());
    (error, reply.payload.to_vec())
}

fn deposit_json(account: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&deposit(account, amount)).unwrap()
}

/// Every counter of a request/reply route, driven by real faults: values,
/// retried requests answered from the stored result, requests refused
/// (no id, a payload that does not decode, no reply subject), a transient
/// error, a real 40001 retried at once, a COMMIT cut after the server ran it,
/// the claims table gone (the database cannot be used), and a COMMIT that
/// never gets an answer. Each scraped counter equals the route's `Stats`
/// and what the requests met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_route_counters_count_what_happened() {
    exporter();
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let subject = unique_name("metrics").replace('_', ".");
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .unwrap();
    let router = Router::with_state(Faults::default()).reply_route(
        ReplyRoute::new(&subject).handler_timeout(Duration::from_secs(1)),
        answer,
    );
    let (handle, task) = spawn(router, nats.clone(), proxied);
    // Serving once a request gets an answer (one without an id: refused).
    let mut probes = 0;
    eventually(
        "the request route answers",
        Duration::from_secs(30),
        async || {
            let answered = tokio::time::timeout(
                Duration::from_secs(1),
                nats.request(subject.clone(), Bytes::new()),
            )
            .await
            .is_ok_and(|reply| reply.is_ok());
            probes += u64::from(answered);
            answered
        },
    )
    .await;
    let stats = handle.stats(&subject).unwrap();
    let value = |amount: i64| (amount * 10).to_string().into_bytes();

    // Values, and a retry answered from the stored one.
    assert_eq!(
        ask(&nats, &subject, Some("r-1"), deposit_json("a", 1)).await,
        (None, value(1))
    );
    assert_eq!(
        ask(&nats, &subject, Some("r-2"), deposit_json("a", 2)).await,
        (None, value(2))
    );
    assert_eq!(
        ask(&nats, &subject, Some("r-1"), deposit_json("a", 1)).await,
        (None, value(1)),
        "the retry gets the stored reply"
    );
    // Refused: no id, a payload that does not decode, no reply subject.
    let permanent = Some("permanent".to_owned());
    assert_eq!(
        ask(&nats, &subject, None, deposit_json("a", 3)).await.0,
        permanent
    );
    assert_eq!(
        ask(&nats, &subject, Some("r-3"), b"not json".to_vec())
            .await
            .0,
        permanent
    );
    nats.publish(subject.clone(), deposit_json("a", 4).into())
        .await
        .unwrap();
    eventually(
        "the request without a reply subject is refused",
        Duration::from_secs(10),
        || async { stats.rejected() == probes + 3 },
    )
    .await;
    // A transient error, and a 40001 retried at once.
    let retry = Some("retry".to_owned());
    assert_eq!(
        ask(&nats, &subject, Some("r-4"), deposit_json("transient", 4))
            .await
            .0,
        retry
    );
    assert_eq!(
        ask(&nats, &subject, Some("r-5"), deposit_json("conflict", 5)).await,
        (None, value(5))
    );
    // A COMMIT cut after the server ran it: retry, and the retry gets the
    // stored reply.
    proxy.cut_next_commit();
    assert_eq!(
        ask(&nats, &subject, Some("r-6"), deposit_json("a", 6))
            .await
            .0,
        retry
    );
    assert_eq!(proxy.cuts(), 1, "the COMMIT's connection was cut");
    assert_eq!(
        ask(&nats, &subject, Some("r-6"), deposit_json("a", 6)).await,
        (None, value(6))
    );
    // The claims table gone: tried once more at once, then retry.
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ask(&nats, &subject, Some("r-7"), deposit_json("a", 7))
            .await
            .0,
        retry
    );
    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ask(&nats, &subject, Some("r-7"), deposit_json("a", 7)).await,
        (None, value(7))
    );
    // A COMMIT that never gets an answer: given up on after the handler
    // timeout's bound (1 s × 3, plus 5 s), answered retry; the retry runs.
    proxy.blackhole_next_commit();
    assert_eq!(
        ask(&nats, &subject, Some("r-8"), deposit_json("a", 8))
            .await
            .0,
        retry
    );
    assert_eq!(proxy.swallowed(), 1, "the COMMIT went into the blackhole");
    assert_eq!(
        ask(&nats, &subject, Some("r-8"), deposit_json("a", 8)).await,
        (None, value(8))
    );

    stop(handle.clone(), task).await;
    let m = scrape_here();
    assert_counters_equal_stats(&m, &[(subject.as_str(), stats.clone())]);
    let c = |name: &str| counter(&m, name, &subject);
    let got: Vec<(&str, u64)> = [
        "idem_messages_received_total",
        "idem_messages_processed_total",
        "idem_messages_duplicate_total",
        "idem_messages_failed_total",
        "idem_messages_rejected_total",
        "idem_messages_retried_total",
        "idem_commit_unknown_total",
        "idem_infrastructure_errors_total",
        "idem_abandoned_transactions_total",
    ]
    .into_iter()
    .map(|name| (name, c(name)))
    .collect();
    assert_eq!(
        got,
        vec![
            // The probes, and 14 requests.
            ("idem_messages_received_total", probes + 14),
            // r-1, r-2, r-5 (after its retry), r-7 and r-8 (on their
            // second requests).
            ("idem_messages_processed_total", 5),
            // r-1 and r-6 asked again.
            ("idem_messages_duplicate_total", 2),
            // r-4 (transient), r-7 (the database could not be used).
            ("idem_messages_failed_total", 2),
            // The probes, no id, not JSON, no reply subject.
            ("idem_messages_rejected_total", probes + 3),
            // r-5's 40001.
            ("idem_messages_retried_total", 1),
            // r-6 (cut) and r-8 (abandoned).
            ("idem_commit_unknown_total", 2),
            // r-7: its claim, and the one more try.
            ("idem_infrastructure_errors_total", 2),
            // r-8.
            ("idem_abandoned_transactions_total", 1),
        ],
        "the request route's counters"
    );
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT message_id) FROM effects WHERE handler = 'metrics.answer'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // r-6's cut COMMIT had committed: applied, though not counted processed.
    assert_eq!(
        (rows, distinct),
        (6, 6),
        "r-1, r-2, r-5, r-6, r-7 and r-8 applied, each once"
    );
}

/// A message JetStream gave up on (its deliveries ran out while no router
/// ran) is dead-lettered from its advisory. That event is counted through
/// the route's one recorder: once in `Stats::dead_lettered`, once in the
/// scraped `idem_messages_dead_lettered_total{reason="undeliverable"}`,
/// and every other counter of the route agrees with its `Stats` too. (The
/// metric used to be counted alone on this path, and `Stats` missed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_jetstream_gave_up_on_is_counted_once_in_stats_and_in_the_metric() {
    use idem_runtime::dead_letter;
    use idem_tests::scenario::{
        Scenario, dead_letters, eventually_get_stream, exhaust_deliveries, given_up_route, header,
        no_ids, scenario,
    };
    exporter();
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("M_GIVENUP", Duration::from_secs(120)).await;
    // A first start creates the consumer and its advisory watcher.
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats.clone(),
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    stop(handle, task).await;

    idem_tests::scenario::publish(&js, &subject, &deposit("a", 1), Some("given-up-1")).await;
    // The fault: JetStream delivers it until its limit, and gives up.
    assert_eq!(exhaust_deliveries(&nats, &stream, "c").await, 4);

    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats,
        pool.clone(),
    );
    let stats = handle.stats("c").expect("the route's stats");
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "undeliverable");
    eventually(
        "the route's Stats count the dead letter",
        Duration::from_secs(10),
        || async { stats.dead_lettered() == 1 },
    )
    .await;
    stop(handle, task).await;

    let metrics = scrape_here();
    assert_eq!(
        metrics.value(
            "idem_messages_dead_lettered_total",
            &[("route", "c"), ("reason", "undeliverable")]
        ),
        Some(1.0),
        "the scraped counter counts the dead letter once"
    );
    assert_counters_equal_stats(&metrics, &[("c", stats)]);
}
