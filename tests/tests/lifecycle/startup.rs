//! A router's start, against real servers: started while PostgreSQL or nats-
//! server is down, or while a session holds its handler row, it waits with a
//! warning naming the cause, then processes the waiting message once; a
//! configuration error still fails at once; the migrations can be applied
//! twice and keep their own history.

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::{Route, Router};
use idem_tests::TestEnv;
use idem_tests::scenario::*;
use sqlx::postgres::PgPoolOptions;

use crate::{deposit, one};

/// Applying the migrations twice, as every worker does at start-up, is fine,
/// and they keep their history apart from the application's.
#[tokio::test]
async fn migrations_are_idempotent_and_keep_their_own_history() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    idem_runtime::schema::migrate(&pool).await.unwrap();
    idem_runtime::schema::verify(&pool).await.unwrap();
    let (idem_history, sqlx_history): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('_idem_migrations') IS NOT NULL, to_regclass('_sqlx_migrations') IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((idem_history, sqlx_history), (true, false));
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
