//! A router's start and end, against real servers.
//!
//! - Started while PostgreSQL, or nats-server, is down, the router waits for
//!   it with a growing pause and a warning naming it, and once the server is
//!   up it processes the waiting message exactly once.
//! - A configuration error (a missing stream or schema, a consumer
//!   conflict) still fails at once, with its own message.
//! - Dropped, its `run` future leaves nothing running: no task keeps the
//!   router's state, no purge rotates, no gauge is updated, the relay's
//!   LISTEN connection is closed.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream;
use common::*;
use idem_runtime::outbox::Relay;
use idem_runtime::{Delivery, Route, Router, Unbounded, idempotent};
use sqlx::postgres::PgPoolOptions;

#[idempotent(name = "lifecycle.deposit.v1")]
async fn deposit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "lifecycle.deposit.v1", &d, delivery).await
}

fn one() -> Deposit {
    Deposit {
        account: "a".into(),
        amount: 1,
    }
}

/// Waits until the captured logs hold a warning with every one of `parts`,
/// failing at once, with the router's result, if it stopped meanwhile.
async fn wait_for_warning(
    logs: &idem_tests::Logs,
    parts: &[&str],
    count: usize,
    task: &mut tokio::task::JoinHandle<Result<(), idem_runtime::Error>>,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if logs.matching(parts).len() >= count {
            return;
        }
        if task.is_finished() {
            panic!(
                "the router stopped instead of waiting for the server: {:?}",
                task.await
            );
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not {count} warnings with {parts:?} within 30 s: {:#?}",
            logs.lines()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// PostgreSQL is down when the router starts (the application made its pool
/// with `connect_lazy`): the router warns that PostgreSQL is unreachable and
/// keeps trying; once the server is up it processes the waiting message,
/// once. A second router shut down while it waits returns `Ok`.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test stops its servers"
)]
async fn a_router_started_while_postgres_is_down_waits_for_it_and_processes_once() {
    let logs = idem_tests::capture_logs();
    idem_tests::require_own_servers();
    let Scenario {
        mut env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PGDOWN", Duration::from_secs(120)).await;
    publish(&js, &subject, &one(), Some("waiting-1")).await;
    drop(pool);
    env.postgres_mut().stop_immediate().await;

    let lazy = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(env.database_url())
        .expect("the URL parses");
    let (handle, mut task) = spawn(
        Router::new().route(Route::new(&stream, "c"), deposit),
        nats,
        lazy.clone(),
    );
    // It keeps waiting: a second attempt fails the same way.
    wait_for_warning(&logs, &["WARN", "PostgreSQL", "start-up"], 2, &mut task).await;
    // A router shut down while it waits returns Ok, once its attempt ends
    // (the pool's 2 s acquire timeout).
    let (waiting, mut waiting_task) = spawn(
        Router::new().route(Route::new(&stream, "other"), deposit),
        env.nats().await,
        lazy.clone(),
    );
    wait_for_warning(
        &logs,
        &["WARN", "PostgreSQL", "start-up"],
        3,
        &mut waiting_task,
    )
    .await;
    stop(waiting, waiting_task).await;

    env.postgres_mut().start_again().await;
    wait_all_acked(&js, &stream, "c").await;
    publish(&js, &subject, &one(), Some("after-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        ledger(&lazy, "lifecycle.deposit.v1").await,
        Ledger::once_each(2)
    );
    assert_eq!(handle.stats("c").unwrap().processed(), 2);
}

/// nats-server is down when the router starts (the application connected
/// with `retry_on_initial_connect`): the router warns that NATS does not
/// answer and keeps trying; once the server is back (on its store, with the
/// message stored before), the message is processed once.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test stops its servers"
)]
async fn a_router_started_while_nats_is_down_waits_for_it_and_processes_once() {
    let logs = idem_tests::capture_logs();
    idem_tests::require_own_servers();
    let Scenario {
        mut env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NATSDOWN", Duration::from_secs(120)).await;
    publish(&js, &subject, &one(), Some("waiting-1")).await;
    drop((nats, js));
    env.nats_server_mut().kill();

    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(env.nats_url())
        .await
        .expect("with retry_on_initial_connect the client is made at once");
    let (handle, mut task) = spawn(
        Router::new().route(Route::new(&stream, "c"), deposit),
        client,
        pool.clone(),
    );
    wait_for_warning(&logs, &["WARN", "NATS", "start-up"], 1, &mut task).await;

    env.nats_server_mut().start_again().await;
    let js = env.jetstream().await;
    wait_all_acked(&js, &stream, "c").await;
    publish(&js, &subject, &one(), Some("after-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        ledger(&pool, "lifecycle.deposit.v1").await,
        Ledger::once_each(2)
    );
    assert_eq!(handle.stats("c").unwrap().processed(), 2);
}

/// A session left open after an `UPDATE idem_handlers ...` (a psql session
/// someone forgot) holds the row the router registers its handler in: the
/// router does not hang on it. Each start-up attempt gives up after its lock
/// timeout with a warning that names the session holding the lock, the
/// router takes no message meanwhile, a router shut down while it waits
/// returns, and once the session commits the waiting message is processed
/// once.
#[tokio::test]
async fn a_router_started_while_a_session_holds_its_handler_row_names_it_and_processes_once() {
    let logs = idem_tests::capture_logs();
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("HANDLERLOCK", Duration::from_secs(120)).await;
    sqlx::query("INSERT INTO idem_handlers (name) VALUES ('lifecycle.deposit.v1')")
        .execute(&pool)
        .await
        .unwrap();
    let options: sqlx::postgres::PgConnectOptions = env.database_url().parse().unwrap();
    let mut forgotten = <sqlx::PgConnection as sqlx::Connection>::connect_with(
        &options.application_name("forgotten-psql"),
    )
    .await
    .unwrap();
    sqlx::raw_sql(
        "BEGIN; UPDATE idem_handlers SET updated_at = now() WHERE name = 'lifecycle.deposit.v1'",
    )
    .execute(&mut forgotten)
    .await
    .unwrap();
    publish(&js, &subject, &one(), Some("waiting-1")).await;

    let (handle, mut task) = spawn(
        Router::new().route(Route::new(&stream, "c"), deposit),
        nats,
        pool.clone(),
    );
    let parts = ["WARN", "idem_handlers", "forgotten-psql", "start-up"];
    // It keeps trying: a second attempt is held the same way.
    wait_for_warning(&logs, &parts, 2, &mut task).await;
    assert_eq!(
        ledger(&pool, "lifecycle.deposit.v1").await,
        Ledger::once_each(0),
        "no message is taken while the handlers cannot be registered"
    );
    // A router shut down while it waits returns Ok, once its attempt has
    // given up (5 s lock timeout).
    let (waiting, mut waiting_task) = spawn(
        Router::new().route(Route::new(&stream, "other"), deposit),
        env.nats().await,
        pool.clone(),
    );
    wait_for_warning(&logs, &parts, 3, &mut waiting_task).await;
    let asked = tokio::time::Instant::now();
    stop(waiting, waiting_task).await;
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "shut down within a lock timeout and a pause: {:?}",
        asked.elapsed()
    );

    sqlx::raw_sql("COMMIT")
        .execute(&mut forgotten)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        ledger(&pool, "lifecycle.deposit.v1").await,
        Ledger::once_each(1)
    );
    assert_eq!(handle.stats("c").unwrap().processed(), 1);
}

/// With both servers up, what retrying cannot fix fails at once, with its
/// own message: a missing stream, a missing schema, a consumer conflict.
#[tokio::test]
async fn a_configuration_error_still_fails_at_once() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject: _,
    } = scenario("CONFIG", Duration::from_secs(120)).await;
    let at_once = Duration::from_secs(10);
    let run = |router: Router, pool| {
        tokio::time::timeout(
            at_once,
            router.run_until(nats.clone(), pool, std::future::pending()),
        )
    };

    let error = run(
        Router::new().route(Route::new("NO_SUCH_STREAM", "c"), deposit),
        pool.clone(),
    )
    .await
    .expect("a missing stream fails at once")
    .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::StreamMissing { .. }),
        "{error}"
    );

    js.create_consumer_on_stream(
        jetstream::consumer::pull::Config {
            durable_name: Some("taken".into()),
            ack_wait: Duration::from_secs(7),
            ..Default::default()
        },
        stream.as_str(),
    )
    .await
    .unwrap();
    let error = run(
        Router::new().route(Route::new(&stream, "taken"), deposit),
        pool.clone(),
    )
    .await
    .expect("a consumer conflict fails at once")
    .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::ConsumerConflict { .. }),
        "{error}"
    );

    let empty = {
        let admin = env.pool().await;
        sqlx::query("CREATE DATABASE empty")
            .execute(&admin)
            .await
            .unwrap();
        PgPoolOptions::new()
            .connect(&format!(
                "{}/empty",
                env.database_url().rsplit_once('/').unwrap().0
            ))
            .await
            .unwrap()
    };
    let error = run(
        Router::new().route(Route::new(&stream, "c"), deposit),
        empty,
    )
    .await
    .expect("a missing schema fails at once")
    .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::SchemaMissing { .. }),
        "{error}"
    );
}

/// Counts the updates of every gauge, by name and labels.
#[derive(Default)]
struct GaugeUpdates(Mutex<HashMap<String, Arc<Updates>>>);

#[derive(Default)]
struct Updates(AtomicU64);

impl metrics::GaugeFn for Updates {
    fn increment(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn decrement(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn set(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl metrics::Recorder for GaugeUpdates {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let mut gauges = self.0.lock().unwrap();
        metrics::Gauge::from_arc(gauges.entry(name).or_default().clone())
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

fn gauges() -> &'static GaugeUpdates {
    static GAUGES: OnceLock<&'static GaugeUpdates> = OnceLock::new();
    GAUGES.get_or_init(|| {
        let recorder: &'static GaugeUpdates = Box::leak(Box::default());
        metrics::set_global_recorder(recorder).expect("no other recorder in this test process");
        recorder
    })
}

fn updates_of(name: &str) -> u64 {
    gauges()
        .0
        .lock()
        .unwrap()
        .get(name)
        .map_or(0, |updates| updates.0.load(Ordering::SeqCst))
}

/// The application state of the teardown test: the test keeps a `Weak` of
/// its token, which lives as long as anything of the router holds the state.
struct App {
    _alive: Arc<()>,
}

/// A router whose `run` future is dropped (its task aborted) while its
/// handle lives on, as an application's does: within a few seconds nothing
/// it started runs any more. Its state is dropped (no task keeps a route's
/// pipeline), the relay's LISTEN connection is closed, and, over three poll
/// intervals, no consumer gauge is updated and the purge rotates no
/// generation (it would every 5 s).
#[tokio::test]
async fn nothing_the_router_started_outlives_its_dropped_run_future() {
    let gauges = gauges();
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("TEARDOWN", Duration::from_millis(100)).await;
    let alive = Arc::new(());
    let watch = Arc::downgrade(&alive);
    // A 10 s retention: generations of 5 s, a purge every 1.25 s.
    let route = Route::new(&stream, "c")
        .ack_wait(Duration::from_secs(1))
        .handler_timeout(Duration::from_secs(1))
        .max_deliver(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(200))
        .publisher_retry_horizon(Duration::from_millis(100))
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
        .retention(Duration::from_secs(10));
    let router = Router::with_state(App { _alive: alive })
        .route(route, deposit)
        .relay(Relay::new());
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool.clone(), std::future::pending()));
    publish(&js, &subject, &one(), Some("m-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    let pending_gauge = "idem_consumer_pending_messages{route=c}";
    let listening = async || -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%idem_outbox%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    idem_tests::wait_until(Duration::from_secs(30), async || {
        updates_of(pending_gauge) > 0 && listening().await > 0
    })
    .await;
    // Running: the purge rotates every generation (5 s).
    let generations = async || -> i32 {
        sqlx::query_scalar("SELECT max(gen) FROM idem_generations")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = generations().await;
    idem_tests::wait_until(Duration::from_secs(30), async || {
        generations().await > before
    })
    .await;

    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while (watch.upgrade().is_some() || listening().await > 0)
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state_kept = watch.upgrade().is_some();
    let still_listening = listening().await;
    // Three poll intervals: a poll left running would update the gauges
    // three times, a purge rotate at least twice.
    let (updates, generation) = (updates_of(pending_gauge), generations().await);
    tokio::time::sleep(3 * idem_runtime::metrics::POLL_INTERVAL).await;
    let updated = updates_of(pending_gauge) - updates;
    let rotated = generations().await - generation;
    eprintln!(
        "10 s after the drop the state was {}kept and {still_listening} LISTEN connection(s) open; \
         in the 15 s after: {updated} consumer gauge update(s), {rotated} rotation(s)",
        if state_kept { "" } else { "not " }
    );
    assert!(
        !state_kept,
        "a task still holds the router's state (a route's pipeline)"
    );
    assert_eq!(
        still_listening, 0,
        "the relay's LISTEN connection is closed"
    );
    assert_eq!(
        updated, 0,
        "the consumer gauges were updated after the run future was dropped"
    );
    assert_eq!(
        rotated, 0,
        "the purge rotated after the run future was dropped"
    );
    drop((handle, gauges));
}
