//! What a router refuses at start-up, before anything runs, saying why: a
//! missing dedup schema, stream or dead-letter stream, a dead-letter stream
//! that keeps nothing, a conflicting consumer (and what start-up keeps of
//! one that does not conflict), unsafe route settings, a
//! handler timeout PostgreSQL cannot take, and one handler on two routes.

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::{BoxError, Error, Permanent, Route, Router, idempotent};
use idem_tests::TestEnv;
use idem_tests::scenario::*;

// ---------------------------------------------------------------------------
// A failure before the handler that can never clear is held forever.
// ---------------------------------------------------------------------------

/// `Begin::new` puts the handler timeout into `SET LOCAL statement_timeout`
/// in milliseconds; PostgreSQL takes at most i32::MAX (about 24.8 days). A
/// longer timeout once passed `Route::validate`, then every BEGIN failed and
/// every message was held forever. Now it is refused at start-up.
#[tokio::test]
async fn a_handler_timeout_postgresql_cannot_take_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("LONGTIMEOUT", Duration::from_secs(120)).await;
    let error = Router::new()
        .route(
            fast(Route::new(&stream, "c")).handler_timeout(Duration::from_secs(25 * 24 * 3600)),
            plain,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::Config { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("about 24.8 days"), "{error}");
}

// ---------------------------------------------------------------------------
// A dead-letter stream that does not keep what it is sent.
// ---------------------------------------------------------------------------

#[idempotent(name = "always-refuses")]
async fn always_refuses(_tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> Result<(), BoxError> {
    Err(Permanent::new("this handler refuses everything").into())
}

/// `dead_letter::ensure_stream` once only checked that some stream captures
/// a route's own dead-letter subject. An interest-retention stream with no
/// consumer acknowledges the publish and keeps nothing; the runtime took the
/// PubAck for "stored" and TERMed the original: gone, with no dead letter
/// anywhere. Now such a stream is refused at start-up.
#[tokio::test]
async fn a_dead_letter_stream_that_keeps_nothing_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("INTEREST", Duration::from_secs(120)).await;
    let dead_stream = format!("{stream}_DEAD");
    js.create_stream(jetstream::stream::Config {
        name: dead_stream.clone(),
        subjects: vec![format!("{dead_stream}.>")],
        retention: jetstream::stream::RetentionPolicy::Interest,
        ..Default::default()
    })
    .await
    .unwrap();
    let error = Router::new()
        .route(
            fast(Route::new(&stream, "c")).dead_letter_subject(format!("{dead_stream}.letters")),
            always_refuses,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::DeadLetterStreamRetention { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("interest retention"), "{error}");
}

/// A durable consumer that exists with other settings is not silently
/// reused or overwritten.
#[tokio::test]
async fn conflicting_consumer_is_refused_unless_update_is_asked_for() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("CONFLICT", Duration::from_secs(120)).await;
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("c".into()),
            ack_wait: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .unwrap();
    let error = Router::new()
        .route(Route::new(&stream, "c"), plain)
        .run_until(nats.clone(), pool.clone(), std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::ConsumerConflict { .. }), "{error}");
    assert!(error.to_string().contains("ack_wait: 5s -> 30s"), "{error}");

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c").update_consumer(), plain),
        nats,
        pool,
    );
    eventually(
        "the consumer is updated",
        Duration::from_secs(30),
        || async {
            js.get_stream(&stream)
                .await
                .unwrap()
                .consumer_info("c")
                .await
                .is_ok_and(|info| info.config.ack_wait == Duration::from_secs(30))
        },
    )
    .await;
    stop(handle, task).await;
}

/// An operator pauses the route's consumer (`nats consumer pause`, for
/// maintenance, say). A worker that restarts meanwhile keeps the pause
/// (its start-up updates the consumer, leaving the pause out, and JetStream
/// keeps it), and warns that its route gets nothing until the pause ends,
/// where it used to wait without a word; `idem status` shows it. A pause
/// taken while the route runs is warned about by the router's poll. Once
/// resumed, every message is applied once.
#[tokio::test]
async fn a_restart_keeps_an_operators_pause_and_says_so() {
    let logs = idem_tests::capture_logs();
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PAUSED", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), plain),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("m-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    let handle_of_stream = js.get_stream(&stream).await.unwrap();
    let pause = || async {
        handle_of_stream
            .pause_consumer(
                "c",
                time::OffsetDateTime::now_utc() + Duration::from_secs(300),
            )
            .await
            .unwrap()
    };
    assert!(pause().await.paused);
    publish(&js, &subject, &deposit("a", 1), Some("m-2")).await;
    let paused_warnings = || logs.matching(&["WARN", "consumer is paused", "route=\"c\""]);

    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), plain),
        nats.clone(),
        pool.clone(),
    );
    eventually(
        "the restarted route warns that its consumer is paused",
        Duration::from_secs(30),
        || async { !paused_warnings().is_empty() },
    )
    .await;
    // The route pulls, and JetStream holds its request: still paused.
    eventually(
        "the route's pull request waits on the paused consumer",
        Duration::from_secs(30),
        || async { env.consumer_info(&stream, "c").await.num_waiting >= 1 },
    )
    .await;
    let info = env.consumer_info(&stream, "c").await;
    assert!(info.paused, "the restart kept the operator's pause");
    assert_eq!(info.num_pending, 1, "m-2 waits in the stream");
    assert_eq!(handle.stats("c").unwrap().received(), 0);
    let shown = idem_runtime::status::consumers(&js)
        .await
        .unwrap()
        .into_iter()
        .find(|consumer| consumer.durable == "c")
        .expect("idem status lists the consumer");
    let left = shown.paused_for.expect("idem status shows the pause");
    assert!(
        left > Duration::from_secs(200) && left <= Duration::from_secs(300),
        "{left:?}"
    );

    // Resumed, the held message is applied.
    handle_of_stream.resume_consumer("c").await.unwrap();
    wait_all_acked(&js, &stream, "c").await;

    // Paused while the route runs: the router's poll (every 5 s) warns.
    let before = paused_warnings().len();
    assert!(pause().await.paused);
    eventually(
        "the router's poll warns about a pause taken while it runs",
        Duration::from_secs(30),
        || async { paused_warnings().len() > before },
    )
    .await;
    handle_of_stream.resume_consumer("c").await.unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("m-3")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(3));
    assert!(
        logs.matching(&["max_waiting"]).is_empty(),
        "a pause is not taken for a full wait list: {:#?}",
        logs.matching(&["max_waiting"])
    );
}

/// What an operator tuned on a route's consumer and the route leaves to
/// them (`max_batch`, `max_expires`, the description, metadata of their own)
/// survives a restart of the router, and an update it asks for. Before, the
/// route created its consumer from its own settings alone at every start,
/// which reset them to JetStream's defaults.
#[tokio::test]
async fn a_restart_keeps_what_an_operator_tuned_on_the_routes_consumer() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("TUNED", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), plain),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("m-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;

    // The operator's edit (as `nats consumer edit` makes it): the whole
    // configuration, with their changes.
    let mut tuned = env.consumer_info(&stream, "c").await.config;
    assert_eq!(tuned.max_batch, 0, "JetStream's default before the edit");
    tuned.max_batch = 7;
    tuned.max_expires = Duration::from_secs(20);
    tuned.description = Some("tuned by operations".into());
    tuned.metadata.insert("team".into(), "payments".into());
    // Not kept: JetStream would delete the durable while every worker is
    // down this long.
    tuned.inactive_threshold = Duration::from_secs(3600);
    let tuned = jetstream::consumer::pull::Config {
        inactive_threshold: tuned.inactive_threshold,
        max_batch: tuned.max_batch,
        max_expires: tuned.max_expires,
        description: tuned.description,
        metadata: tuned.metadata,
        durable_name: tuned.durable_name,
        deliver_policy: tuned.deliver_policy,
        ack_policy: tuned.ack_policy,
        ack_wait: tuned.ack_wait,
        max_deliver: tuned.max_deliver,
        max_ack_pending: tuned.max_ack_pending,
        filter_subject: tuned.filter_subject,
        filter_subjects: tuned.filter_subjects,
        ..Default::default()
    };
    js.get_stream(&stream)
        .await
        .unwrap()
        .update_consumer(tuned)
        .await
        .unwrap();
    assert_eq!(env.consumer_info(&stream, "c").await.config.max_batch, 7);

    for (i, what, route) in [
        (2, "a restart", Route::new(&stream, "c")),
        (3, "an update", Route::new(&stream, "c").update_consumer()),
    ] {
        let (handle, task) = spawn(
            Router::new().route(route, plain),
            nats.clone(),
            pool.clone(),
        );
        publish(&js, &subject, &deposit("a", 1), Some(&format!("m-{i}"))).await;
        wait_all_acked(&js, &stream, "c").await;
        stop(handle, task).await;
        let config = env.consumer_info(&stream, "c").await.config;
        assert_eq!(
            (
                config.max_batch,
                config.max_expires,
                config.description.as_deref()
            ),
            (7, Duration::from_secs(20), Some("tuned by operations")),
            "after {what}"
        );
        assert_eq!(
            config.metadata.get("team").map(String::as_str),
            Some("payments"),
            "after {what}: {:?}",
            config.metadata
        );
        assert_eq!(
            config.metadata.get("idem.handler").map(String::as_str),
            Some("plain"),
            "after {what}: the route's own keys are written: {:?}",
            config.metadata
        );
        assert_eq!(
            config.inactive_threshold,
            Duration::ZERO,
            "after {what}: a route's durable is never deleted for inactivity"
        );
    }
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(3));

    // A consumer kept in memory (which loses its state when the server
    // restarts) is refused, naming the setting.
    js.get_stream(&stream)
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("in-memory".into()),
            memory_storage: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let error = Router::new()
        .route(Route::new(&stream, "in-memory"), plain)
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::ConsumerConflict { .. }), "{error}");
    assert!(
        error.to_string().contains("memory_storage: true -> false"),
        "{error}"
    );
}

/// A route that names its own dead-letter subject needs a stream that
/// stores it; without one it is refused at start-up.
#[tokio::test]
async fn missing_dead_letter_stream_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("NODLQ", Duration::from_secs(120)).await;
    let error = Router::new()
        .route(
            Route::new(&stream, "c").dead_letter_subject("nowhere.dead"),
            plain,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::DeadLetterStreamMissing { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("nowhere.dead"), "{error}");
}

/// A worker refuses to start against a database without the dedup schema,
/// and says which call creates it.
#[tokio::test]
async fn missing_dedup_schema_is_refused_at_startup() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("NOSCHEMA");
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
