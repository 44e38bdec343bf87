//! The ack follows a durable COMMIT, whatever PostgreSQL's `synchronous_commit`
//! says, on real servers.
//!
//! - A PostgreSQL server running `synchronous_commit = off` with a 10 s
//!   `wal_writer_delay` (so that recent commits really sit unwritten in WAL
//!   buffers) crashes (immediate shutdown) right after every message was
//!   acked: every acked message's effect must be there after recovery, per
//!   message, in batches, and when the handler lowers the setting itself.
//! - Inside a handler (per message, batch fallback, request/reply) the
//!   transaction runs with at least `on`; a stronger server setting
//!   (`remote_apply`) is kept.
//! - With a synchronous standby, the ack waits until the standby has the
//!   commit, also past the handler timeout, and the router warns at start-up
//!   about what can lose acked commits: an asynchronous standby, a server
//!   default of `off`.

use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use idem_runtime::{Delivery, ReplyRoute, Route, Router, Transient, idempotent};
use idem_tests::scenario::*;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The settings of a server that loses recent commits in a crash.
const UNSAFE_SERVER: &[&str] = &["synchronous_commit=off", "wal_writer_delay=10s"];

/// One row per applied effect (no unique key, so a double-apply would
/// show), with the `synchronous_commit` its transaction ran with and the
/// transaction's id.
async fn prepare(pool: &PgPool) {
    idem_runtime::schema::migrate(pool)
        .await
        .expect("idem migrations apply");
    sqlx::raw_sql(
        "CREATE TABLE durable_effects (
             message_id         text   NOT NULL,
             synchronous_commit text   NOT NULL,
             xact               bigint NOT NULL
         )",
    )
    .execute(pool)
    .await
    .expect("the effects table is created");
}

async fn record(tx: &mut sqlx::PgTransaction<'_>, delivery: &Delivery) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO durable_effects (message_id, synchronous_commit, xact)
         VALUES ($1, current_setting('synchronous_commit'), txid_current())",
    )
    .bind(delivery.message_id().as_str())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[idempotent(name = "durable.record.v1")]
async fn durable(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    _d: Deposit,
) -> Result<(), sqlx::Error> {
    record(tx, delivery).await
}

/// A handler that lowers the setting for its own transaction: the runtime
/// must still commit it durably before the ack.
#[idempotent(name = "durable.lowers.v1")]
async fn lowers(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    _d: Deposit,
) -> Result<(), sqlx::Error> {
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut **tx)
        .await?;
    record(tx, delivery).await
}

/// Fails the first delivery of the message for account `fails`, so that its
/// batch falls back to one transaction per message.
#[idempotent(name = "durable.fallback.v1")]
async fn fails_once(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if d.account == "fails" && delivery.delivered() == 1 {
        return Err(Transient::new("fails on its first delivery").into());
    }
    record(tx, delivery).await?;
    Ok(())
}

fn deposit(account: &str) -> Deposit {
    Deposit {
        account: account.to_owned(),
        amount: 1,
    }
}

/// `(rows, distinct message ids)` of the effects table.
async fn effects(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM durable_effects")
        .fetch_one(pool)
        .await
        .expect("the effects are counted")
}

/// The `synchronous_commit` values the effects were committed under.
async fn settings_seen(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT DISTINCT synchronous_commit FROM durable_effects ORDER BY 1")
        .fetch_all(pool)
        .await
        .expect("the settings are read")
}

async fn show(pool: &PgPool, setting: &str) -> String {
    sqlx::query_scalar("SELECT current_setting($1)")
        .bind(setting)
        .fetch_one(pool)
        .await
        .expect("the setting is read")
}

/// How the crash test runs its route.
#[derive(Debug, Clone, Copy)]
enum Mode {
    PerMessage,
    Batch,
    /// Per message, with a handler that sets `synchronous_commit = off`.
    HandlerLowersIt,
}

/// N messages, all acked, then PostgreSQL crashes (immediate shutdown, which
/// drops the WAL buffers) and recovers: every acked message's effect is
/// there, once.
async fn acked_effects_survive_a_crash(mode: Mode) {
    idem_tests::require_own_servers();
    let mut env = idem_tests::TestEnv::start_with_postgres(UNSAFE_SERVER).await;
    let pool = env.pool().await;
    prepare(&pool).await;
    assert_eq!(
        show(&pool, "synchronous_commit").await,
        "off",
        "the server runs with synchronous_commit = off"
    );
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("DURABLE");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    const MESSAGES: usize = 300;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a"), Some(&format!("m-{i:04}"))).await;
    }

    let route = Route::new(&stream, "durable").concurrency(4);
    let router = match mode {
        Mode::PerMessage => Router::new().route(route, durable),
        Mode::Batch => Router::new().route(route.batch(16), durable),
        Mode::HandlerLowersIt => Router::new().route(route, lowers),
    };
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    wait_all_acked(&js, &stream, "durable").await;
    let stats = handle.stats("durable").unwrap();
    let acked = stats.processed() + stats.duplicates();

    // A plain commit of the server's own kind, right before the crash: WAL
    // that is not yet written is what an immediate shutdown drops.
    sqlx::query("INSERT INTO durable_effects VALUES ('control', 'plain', 0)")
        .execute(&pool)
        .await
        .unwrap();
    let unwritten: i64 =
        sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - pg_current_wal_lsn())::bigint")
            .fetch_one(&pool)
            .await
            .unwrap();
    env.postgres_mut().stop_immediate().await;
    env.postgres_mut().start_again().await;
    task.abort();
    let _ = task.await;
    drop(pool);

    let pool = env.pool().await;
    let control: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durable_effects WHERE message_id = 'control'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT message_id) FROM durable_effects
         WHERE message_id <> 'control'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    eprintln!(
        "{mode:?}: {acked} acked, {rows} effects after the crash ({} lost); \
         {unwritten} bytes of WAL unwritten at the crash; the plain control commit {}",
        acked as i64 - distinct,
        if control == 0 { "was lost" } else { "survived" }
    );
    assert!(
        unwritten > 0,
        "the crash must find WAL not yet written (the fault is real)"
    );
    assert_eq!(acked, MESSAGES as u64, "every message was acked");
    assert_eq!(
        (rows, distinct),
        (MESSAGES as i64, MESSAGES as i64),
        "every acked message's effect survives the crash, once"
    );
    let seen: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT synchronous_commit FROM durable_effects
         WHERE message_id <> 'control' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected = match mode {
        // The handler's own SET LOCAL is what it sees; the runtime raises it
        // again for COMMIT.
        Mode::HandlerLowersIt => "off",
        _ => "on",
    };
    assert_eq!(seen, [expected], "the settings the handlers ran with");
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn acked_effects_survive_a_postgres_crash_with_synchronous_commit_off() {
    acked_effects_survive_a_crash(Mode::PerMessage).await;
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn acked_batches_survive_a_postgres_crash_with_synchronous_commit_off() {
    acked_effects_survive_a_crash(Mode::Batch).await;
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn a_handler_that_lowers_synchronous_commit_still_commits_durably() {
    acked_effects_survive_a_crash(Mode::HandlerLowersIt).await;
}

/// `on` inside the handler on a server whose default is `off`: per message,
/// in a batch's fallback to one transaction per message, and on a
/// request/reply route.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test needs a server with its own settings"
)]
async fn every_transaction_runs_with_synchronous_commit_on_when_the_server_has_it_off() {
    idem_tests::require_own_servers();
    let env = idem_tests::TestEnv::start_with_postgres(&["synchronous_commit=off"]).await;
    let pool = env.pool().await;
    prepare(&pool).await;
    assert_eq!(show(&pool, "synchronous_commit").await, "off");
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("DURABLE");
    create_stream(
        &js,
        &stream,
        &format!("{stream}.>"),
        Duration::from_secs(120),
    )
    .await;
    let request_subject = unique_name("durable").replace('_', ".");

    let router = Router::new()
        .route(
            Route::new(&stream, "per-message").filter_subject(format!("{stream}.one")),
            durable,
        )
        .route(
            Route::new(&stream, "fallback")
                .filter_subject(format!("{stream}.many"))
                .batch(8)
                .backoff(Duration::from_millis(50), Duration::from_millis(200)),
            fails_once,
        )
        .reply_route(ReplyRoute::new(&request_subject), answer);
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    for i in 0..4 {
        let id = format!("one-{i}");
        publish(&js, &format!("{stream}.one"), &deposit("a"), Some(&id)).await;
    }
    for (i, account) in ["a", "fails", "b", "c"].into_iter().enumerate() {
        let id = format!("many-{i}");
        publish(&js, &format!("{stream}.many"), &deposit(account), Some(&id)).await;
    }
    // Answered once the route is subscribed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let setting = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reply within 30 s"
        );
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, "request-1");
        let asked =
            nats.request_with_headers(request_subject.clone(), headers, Bytes::from_static(b"{}"));
        if let Ok(Ok(reply)) = tokio::time::timeout(Duration::from_secs(2), asked).await {
            break String::from_utf8_lossy(&reply.payload).into_owned();
        }
    };
    wait_consumer_settled(&js, &stream, "per-message", 4).await;
    wait_consumer_settled(&js, &stream, "fallback", 4).await;
    stop(handle.clone(), task).await;

    assert!(
        handle.stats("fallback").unwrap().batch_fallbacks() >= 1,
        "the batch fell back to one transaction per message"
    );
    assert_eq!(effects(&pool).await, (8, 8));
    assert_eq!(settings_seen(&pool).await, ["on"], "JetStream routes");
    assert_eq!(setting, "\"on\"", "the request/reply route");
}

#[derive(serde::Deserialize)]
struct Ask {}

#[idempotent(name = "durable.answer.v1")]
async fn answer(tx: &mut sqlx::PgTransaction<'_>, _ask: Ask) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(&mut **tx)
        .await
}

/// A server whose default is stronger than `on` keeps it.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test needs a server with its own settings"
)]
async fn a_stronger_server_setting_is_kept() {
    idem_tests::require_own_servers();
    let env = idem_tests::TestEnv::start_with_postgres(&["synchronous_commit=remote_apply"]).await;
    let pool = env.pool().await;
    prepare(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("DURABLE");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    for i in 0..3 {
        publish(&js, &subject, &deposit("a"), Some(&format!("m-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "durable"), durable),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "durable").await;
    stop(handle, task).await;
    assert_eq!(effects(&pool).await, (3, 3));
    assert_eq!(settings_seen(&pool).await, ["remote_apply"]);
}

/// Waits until the primary sees standby `name` streaming, in `sync_state`.
async fn wait_for_standby(pool: &PgPool, name: &str, sync_state: &str) {
    eventually(
        &format!("standby {name} streaming as {sync_state}"),
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_replication
                 WHERE application_name = $1 AND state = 'streaming' AND sync_state = $2",
            )
            .bind(name)
            .bind(sync_state)
            .fetch_one(pool)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
}

async fn set_synchronous_standby_names(pool: &PgPool, names: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(pool)
        .await
        .unwrap();
    eventually(
        "the new standby names in effect",
        Duration::from_secs(10),
        || async { show(pool, "synchronous_standby_names").await == names },
    )
    .await;
}

/// On a server tuned not to wait for its standbys (`synchronous_commit =
/// local`) with a synchronous standby: a message is acked only once the
/// standby has its commit. With the standby stopped, the COMMIT waits (seen
/// in `pg_stat_activity` as `SyncRep`), past three handler timeouts, and
/// nothing is acked, also once the watchdog has stopped waiting for it
/// (`Stats::abandoned_transactions`); once the standby is back, the message
/// is acked, its effect applied once and on the standby too.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test stops its servers"
)]
async fn with_a_synchronous_standby_the_ack_waits_until_the_standby_has_the_commit() {
    idem_tests::require_own_servers();
    let env = idem_tests::TestEnv::start_with_postgres(&["synchronous_commit=local"]).await;
    let pool = env.pool().await;
    prepare(&pool).await;
    let mut standby = env.postgres().start_standby("s1").await;
    set_synchronous_standby_names(&pool, "s1").await;
    wait_for_standby(&pool, "s1", "sync").await;
    let standby_pool = standby.pool().await;

    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("DURABLE");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    const HANDLER_TIMEOUT: Duration = Duration::from_secs(1);
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "durable").handler_timeout(HANDLER_TIMEOUT),
            durable,
        ),
        nats,
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a"), Some("first")).await;
    wait_all_acked(&js, &stream, "durable").await;

    standby.stop_immediate().await;
    drop(standby_pool);
    publish(&js, &subject, &deposit("a"), Some("second")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let info = consumer_info(&js, &stream, "durable").await;
        assert_eq!(
            info.ack_floor.stream_sequence, 1,
            "the second message was acked while the synchronous standby was away"
        );
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event = 'SyncRep' AND now() - query_start > $1 * interval '1 ms'",
        )
        .bind(3 * HANDLER_TIMEOUT.as_millis() as i64)
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no COMMIT waited for the standby for 3 handler timeouts"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let info = consumer_info(&js, &stream, "durable").await;
    assert_eq!(
        info.ack_floor.stream_sequence, 1,
        "not acked while it waits"
    );
    assert_eq!(
        effects(&pool).await,
        (1, 1),
        "its effect is not visible yet"
    );
    // Past the transaction's bounds the watchdog stops waiting for it (the
    // message settled as of unknown outcome, never acked); the redeliveries
    // wait on its claim.
    let stats = handle.stats("durable").unwrap();
    eventually(
        "the watchdog gives up waiting for the COMMIT",
        Duration::from_secs(60),
        || async { stats.abandoned_transactions() >= 1 },
    )
    .await;
    let info = consumer_info(&js, &stream, "durable").await;
    assert_eq!(info.ack_floor.stream_sequence, 1, "still not acked");
    assert_eq!(effects(&pool).await, (1, 1), "still not visible");

    standby.start_again().await;
    wait_all_acked(&js, &stream, "durable").await;
    stop(handle, task).await;
    assert_eq!(effects(&pool).await, (2, 2), "applied once");
    let standby_pool = standby.pool().await;
    eventually(
        "the standby has both effects",
        Duration::from_secs(30),
        || async { effects(&standby_pool).await == (2, 2) },
    )
    .await;
}

/// At start-up the router says what can lose commits it acks after: a
/// server default of `off`, a standby that replicates asynchronously, and
/// synchronous standby names that no connected standby matches (every
/// COMMIT then waits).
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test needs servers of its own"
)]
async fn start_up_warns_about_what_can_lose_acked_commits() {
    let logs = idem_tests::capture_logs();
    idem_tests::require_own_servers();
    let env = idem_tests::TestEnv::start_with_postgres(&["synchronous_commit=off"]).await;
    let pool = env.pool().await;
    prepare(&pool).await;
    let _standby = env.postgres().start_standby("replica_a").await;
    wait_for_standby(&pool, "replica_a", "async").await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = unique_name("DURABLE");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;

    let run = async |id: &str| {
        let (handle, task) = spawn(
            Router::new().route(Route::new(&stream, "durable"), durable),
            nats.clone(),
            pool.clone(),
        );
        publish(&js, &subject, &deposit("a"), Some(id)).await;
        wait_all_acked(&js, &stream, "durable").await;
        stop(handle, task).await;
    };
    run("first").await;
    let off = logs.matching(&["WARN", "synchronous_commit", "off"]);
    assert_eq!(
        off.len(),
        1,
        "a warning about the server's default: {:#?}",
        logs.lines()
    );
    let asynchronous = logs.matching(&["WARN", "asynchronous", "replica_a"]);
    assert_eq!(
        asynchronous.len(),
        1,
        "a warning naming the asynchronous standby: {:#?}",
        logs.lines()
    );

    // Names no connected standby has: idem's COMMITs would wait for ever.
    set_synchronous_standby_names(&pool, "nobody").await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "durable"), durable),
        nats.clone(),
        pool.clone(),
    );
    eventually(
        "the router warns that no synchronous standby is connected",
        Duration::from_secs(30),
        || async {
            !logs
                .matching(&["WARN", "synchronous_standby_names", "nobody"])
                .is_empty()
        },
    )
    .await;
    handle.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(30), task).await;

    // What `idem status` shows: the same, as a standing condition.
    let status = idem_runtime::status::durability(&pool).await.unwrap();
    assert_eq!(
        (
            status.synchronous_commit.as_str(),
            status.idem_commits_with.as_str()
        ),
        ("off", "on")
    );
    assert_eq!(
        status.standbys,
        [("replica_a".to_owned(), Some("async".to_owned()))]
    );
    for expected in ["is off", "asynchronously to standby replica_a", "'nobody'"] {
        assert!(
            status
                .warnings
                .iter()
                .any(|warning| warning.contains(expected)),
            "{expected}: {:#?}",
            status.warnings
        );
    }
}

/// A measurement, not a check: what committing with `synchronous_commit` at
/// least `on` costs. Each transaction has idem's shape (BEGIN with its
/// settings in one message, one INSERT, the check and COMMIT in one
/// message), with the two transaction-local `set_config`s of
/// `idem-runtime/src/durability.rs` or without, the two kinds alternating
/// transaction by transaction, at 1 and 8 connections, on a server with the default
/// `synchronous_commit` and on one with `off`. Put the servers on disk, or
/// a flush costs nothing:
///
/// ```text
/// IDEM_TEST_TMPDIR=/var/tmp cargo test -p idem-tests --test durability -- \
///     --ignored --nocapture cost_of_durable_commits
/// ```
///
/// (`IDEM_DURABILITY_TRANSACTIONS`, default 4,000 per kind and run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run by hand"]
async fn cost_of_durable_commits() {
    let transactions: usize = std::env::var("IDEM_DURABILITY_TRANSACTIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(4_000);
    for (server, settings) in [
        ("default (on)", &[][..]),
        ("off", &["synchronous_commit=off"][..]),
    ] {
        let pg = idem_tests::Postgres::start_with(settings).await;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(pg.url())
            .await
            .unwrap();
        sqlx::raw_sql("CREATE TABLE t (id bigserial PRIMARY KEY, v text NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        for connections in [1usize, 8] {
            let mut elapsed = [Duration::ZERO; 2];
            let per_task = transactions / connections;
            let tasks: Vec<_> = (0..connections)
                .map(|_| {
                    let url = pg.url().to_owned();
                    tokio::spawn(async move {
                        let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
                            .await
                            .unwrap();
                        sqlx::raw_sql(
                            "PREPARE d(text) AS SELECT set_config('synchronous_commit', \
                             CASE WHEN current_setting('synchronous_commit') = 'remote_apply' \
                             THEN 'remote_apply' ELSE $1 END, true); \
                             PREPARE c(text) AS SELECT 1, set_config('synchronous_commit', \
                             CASE WHEN current_setting('synchronous_commit') = 'remote_apply' \
                             THEN 'remote_apply' ELSE $1 END, true); \
                             PREPARE c0 AS SELECT 1; \
                             PREPARE b(text, text) AS SELECT set_config('statement_timeout', $1, true), \
                             set_config('idle_in_transaction_session_timeout', $2, true)",
                        )
                        .execute(&mut connection)
                        .await
                        .unwrap();
                        let mut spent = [Duration::ZERO; 2];
                        for i in 0..per_task {
                            let durable = i % 2;
                            let (begin, commit) = if durable == 1 {
                                (
                                    "BEGIN; EXECUTE b('30000', '31000'); EXECUTE d('on')",
                                    "EXECUTE c('on'); COMMIT",
                                )
                            } else {
                                ("BEGIN; EXECUTE b('30000', '31000')", "EXECUTE c0; COMMIT")
                            };
                            let started = std::time::Instant::now();
                            sqlx::raw_sql(begin).execute(&mut connection).await.unwrap();
                            sqlx::query("INSERT INTO t (v) VALUES ($1)")
                                .bind("effect")
                                .execute(&mut connection)
                                .await
                                .unwrap();
                            sqlx::raw_sql(commit).execute(&mut connection).await.unwrap();
                            spent[durable] += started.elapsed();
                        }
                        spent
                    })
                })
                .collect();
            for task in tasks {
                let spent = task.await.unwrap();
                elapsed[0] += spent[0];
                elapsed[1] += spent[1];
            }
            // Per transaction, as one connection sees it.
            let per = |spent: Duration| {
                spent.as_secs_f64() * 1e6 / (per_task as f64 / 2.0 * connections as f64)
            };
            eprintln!(
                "server {server}, {connections} connection(s): without {:.0} µs, with {:.0} µs per transaction: {:.2}x",
                per(elapsed[0]),
                per(elapsed[1]),
                elapsed[1].as_secs_f64() / elapsed[0].as_secs_f64()
            );
        }
    }
}
