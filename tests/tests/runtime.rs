//! Runtime behaviour around the core promise: message ids, bad input,
//! start-up refusals and graceful shutdown, against real servers.

mod common;

use std::time::Duration;

use async_nats::jetstream;
use common::*;
use idem_runtime::{Delivery, Error, MessageIdSource, Route, Router, idempotent};
use idem_tests::TestEnv;

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.into(),
        amount,
    }
}

#[idempotent(name = "by-account", key = d.account)]
async fn by_account(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    assert_eq!(delivery.message_id().source(), MessageIdSource::Key);
    record_effect(tx, "by-account", &d, delivery).await
}

/// An explicit `key = ...` takes precedence over `Nats-Msg-Id`: messages with
/// different header ids but the same key are applied once.
#[tokio::test]
async fn explicit_key_dedups_across_different_nats_msg_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEY", Duration::from_secs(120)).await;
    for (i, account) in ["a", "b", "a", "a", "b", "c"].iter().enumerate() {
        publish(
            &js,
            &subject,
            &deposit(account, 1),
            Some(&format!("hdr-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), by_account),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (3, 3));
    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY message_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids, ["a", "b", "c"]);
}

#[idempotent(name = "ids")]
async fn ids(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "ids", &d, delivery).await
}

/// Without a key, the `Nats-Msg-Id` header is the id, and without that,
/// `<stream>:<sequence>:<stored at>`.
#[tokio::test]
async fn header_then_stream_sequence_are_the_fallback_ids() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("IDS", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("from-header")).await;
    publish(&js, &subject, &deposit("b", 1), None).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), ids),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY account")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        ids,
        vec![
            "from-header".to_owned(),
            stream_position(&js, &stream, 2).await
        ]
    );
}

#[idempotent(name = "held")]
async fn held(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    // Long enough that the test sees them all in flight, even on a loaded machine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    record_effect(tx, "held", &d, delivery).await
}

/// Shutdown while messages are in flight: they finish, commit and are acked
/// before `run` returns; messages fetched but not started are NAKed at once,
/// so a second worker takes them long before their ack_wait (2 minutes here)
/// would have run out. Every message is applied once.
#[tokio::test]
async fn shutdown_finishes_in_flight_and_hands_back_the_rest() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SHUTDOWN", Duration::from_secs(120)).await;
    const IN_FLIGHT: u64 = 4;
    const MESSAGES: u64 = 10;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("s-{i}"))).await;
    }
    let route = || {
        Route::new(&stream, "c")
            .concurrency(IN_FLIGHT as usize)
            .ack_wait(Duration::from_secs(120))
    };
    let (handle, task) = spawn(
        Router::new().route(route(), held),
        nats.clone(),
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    eventually(
        "four messages in flight",
        Duration::from_secs(30),
        || async { stats.received() >= IN_FLIGHT },
    )
    .await;
    assert_eq!(
        stats.processed(),
        0,
        "shutdown starts while they are in flight"
    );
    stop(handle.clone(), task).await;
    let taken = stats.received();
    assert_eq!(stats.processed(), taken, "every message taken was finished");
    assert!(
        taken < MESSAGES,
        "not every message was started before shutdown"
    );
    assert_eq!(ledger(&pool, "held").await.effects, taken as i64);

    // The rest go to the next worker now, not after ack_wait; the 60 s wait
    // below is shorter than the route's 120 s ack_wait.
    let (next, next_task) = spawn(Router::new().route(route(), held), nats, pool.clone());
    wait_all_acked(&js, &stream, "c").await;
    stop(next.clone(), next_task).await;
    let next_stats = next.stats("c").unwrap();
    assert_eq!(next_stats.processed(), MESSAGES - taken);
    assert_eq!(
        next_stats.duplicates(),
        0,
        "nothing the first worker finished came back"
    );
    assert_eq!(
        ledger(&pool, "held").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

/// A worker refuses to start against a database without the dedup schema,
/// and says which call creates it.
#[tokio::test]
async fn missing_dedup_schema_is_refused_at_startup() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique("NOSCHEMA");
    create_stream(
        &js,
        &stream,
        &format!("{stream}.x"),
        Duration::from_secs(120),
    )
    .await;
    let error = Router::new()
        .route(Route::new(&stream, "c"), ids)
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::SchemaMissing { found: None, .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("idem_runtime::schema::migrate"),
        "{error}"
    );
}

/// A route whose stream does not exist, and that was not asked to create it,
/// is refused at start-up with the stream's name.
#[tokio::test]
async fn missing_stream_is_refused_at_startup() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    let error = Router::new()
        .route(Route::new("NO_SUCH_STREAM", "c"), ids)
        .run_until(env.nats().await, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::StreamMissing { .. }), "{error}");
    assert!(error.to_string().contains("NO_SUCH_STREAM"), "{error}");
}

/// Settings that would stall delivery are refused before anything runs.
#[tokio::test]
async fn unsafe_route_settings_are_refused_at_startup() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    let error = Router::new()
        .route(
            Route::new("S", "c").concurrency(50).max_ack_pending(10),
            ids,
        )
        .run_until(env.nats().await, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Config { .. }), "{error}");
}

/// One handler on two routes is refused (they would share dedup rows),
/// unless the routes are the partitions of one partitioned consumer; two
/// partitioned consumers sharing a handler are refused too.
#[tokio::test]
async fn a_handler_shared_by_routes_is_refused_unless_they_are_one_consumers_partitions() {
    use idem_runtime::partition::Partitions;
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    let refusal = |router: Router| {
        let (nats, pool) = (env.nats(), pool.clone());
        async move {
            router
                .run_until(nats.await, pool, std::future::pending())
                .await
                .unwrap_err()
        }
    };
    let error = refusal(
        Router::new()
            .route(Route::new("S", "a"), ids)
            .route(Route::new("S", "b"), ids),
    )
    .await;
    assert!(
        matches!(&error, Error::Config { reason, .. } if reason.contains("also used by route")),
        "{error}"
    );
    let partitions = Partitions::new("S.in.*", 2);
    let error = refusal(
        Router::new()
            .route_partitions(partitions.routes("S", "a"), ids)
            .route_partitions(partitions.routes("S", "b"), ids),
    )
    .await;
    assert!(
        matches!(&error, Error::Config { reason, .. } if reason.contains("also used by route")),
        "{error}"
    );
    // One consumer's partitions pass the check: start-up goes on, and stops
    // at the missing stream.
    let error = refusal(Router::new().route_partitions(partitions.routes("S", "a"), ids)).await;
    assert!(matches!(error, Error::StreamMissing { .. }), "{error}");
}

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
