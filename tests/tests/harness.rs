//! Self-test of the harness: the servers work, crash and recover as the
//! other integration tests assume, and parallel environments stay apart.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use idem_tests::{TestEnv, eventually, unique_name};

/// A file-backed stream on `<name>.>`, so it survives a server crash.
async fn create_stream(js: &jetstream::Context, name: &str) -> stream::Stream {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("create stream")
}

#[tokio::test]
async fn jetstream_and_postgres_work() {
    let started = Instant::now();
    let env = TestEnv::start().await;
    eprintln!("TestEnv::start took {:.2?}", started.elapsed());

    let js = env.jetstream().await;
    let name = unique_name("harness");
    create_stream(&js, &name).await;
    let ack = js
        .publish(format!("{name}.one"), "hello".into())
        .await
        .expect("publish")
        .await
        .expect("PubAck");
    assert_eq!(ack.stream, name);
    assert_eq!(ack.sequence, 1);
    assert!(!ack.duplicate);

    let pool = env.pool().await;
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .expect("SELECT 1");
    assert_eq!(one, 1);
}

/// A SIGKILLed nats-server comes back on the same port and store dir with
/// its stored messages, and an old client reconnects to it.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn kill_and_restart_keeps_stored_messages() {
    idem_tests::require_own_servers();
    let mut env = TestEnv::start().await;
    let url_before = env.nats_url().to_owned();
    let pid_before = env.nats_server().pid();
    // A client from before the crash, to check that it reconnects.
    let old_js = env.jetstream().await;
    let name = unique_name("crash");
    create_stream(&old_js, &name).await;
    old_js
        .publish(format!("{name}.a"), "kept".into())
        .await
        .unwrap()
        .await
        .expect("PubAck");

    let started = Instant::now();
    env.nats_server_mut().kill_and_restart().await;
    eprintln!("kill_and_restart took {:.2?}", started.elapsed());
    assert_eq!(env.nats_url(), url_before, "same port after restart");
    assert_ne!(env.nats_server().pid(), pid_before, "a new process");

    let js = env.jetstream().await;
    let stored = js
        .get_stream(&name)
        .await
        .expect("stream survives")
        .get_raw_message(1)
        .await
        .expect("message survives");
    assert_eq!(stored.payload, "kept".as_bytes());

    // The old client reconnects by itself and can publish again.
    eventually(
        "the old client publishes again",
        Duration::from_secs(15),
        async || match old_js.publish(format!("{name}.b"), "after".into()).await {
            Ok(ack) => ack.await.is_ok(),
            Err(_) => false,
        },
    )
    .await;
}

/// PostgreSQL after an immediate shutdown and restart keeps committed rows,
/// loses the open transaction, and an old pool recovers.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn restart_immediate_keeps_committed_rows() {
    idem_tests::require_own_servers();
    let mut env = TestEnv::start().await;
    let pool = env.pool().await;
    sqlx::query("CREATE TABLE kept (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO kept VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    // An open transaction at the crash must be lost.
    let mut open = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO kept VALUES (2)")
        .execute(&mut *open)
        .await
        .unwrap();

    let url_before = env.database_url().to_owned();
    let started = Instant::now();
    env.postgres_mut().restart_immediate().await;
    eprintln!("restart_immediate took {:.2?}", started.elapsed());
    assert_eq!(env.database_url(), url_before, "same port after restart");
    drop(open);

    let ids: Vec<i32> = sqlx::query_scalar("SELECT id FROM kept ORDER BY id")
        .fetch_all(&env.pool().await)
        .await
        .unwrap();
    assert_eq!(ids, [1], "committed row kept, open transaction lost");

    // A pool from before the crash replaces its broken connections.
    eventually(
        "the old pool answers again",
        Duration::from_secs(15),
        async || sqlx::query("SELECT 1").execute(&pool).await.is_ok(),
    )
    .await;
}

#[tokio::test]
async fn parallel_envs_get_their_own_servers() {
    let (a, b) = tokio::join!(TestEnv::start(), TestEnv::start());
    if std::env::var_os("NATS_URL").is_none() {
        assert_ne!(a.nats_url(), b.nats_url());
    }
    assert_ne!(a.database_url(), b.database_url());

    // Same table name in both: no clash, because each has its own database.
    for env in [&a, &b] {
        sqlx::query("CREATE TABLE same_name (id int)")
            .execute(&env.pool().await)
            .await
            .expect("own database");
    }
}

#[tokio::test]
async fn consumer_info_reports_pending_and_ack_pending() {
    let env = TestEnv::start().await;
    let js = env.jetstream().await;
    let name = unique_name("info");
    let stream = create_stream(&js, &name).await;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("c".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    for i in 0..3 {
        js.publish(format!("{name}.{i}"), "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let _unacked = batch.next().await.expect("a message").unwrap();

    let info = env.consumer_info(&name, "c").await;
    assert_eq!(info.num_pending, 2);
    assert_eq!(info.num_ack_pending, 1);
    assert_eq!(info.num_redelivered, 0);
}

#[tokio::test]
async fn eventually_accepts_both_closure_styles() {
    let ready = std::sync::atomic::AtomicBool::new(true);
    eventually("true", Duration::from_millis(100), || async { true }).await;
    eventually("ready", Duration::from_millis(100), async || {
        ready.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
}

#[tokio::test]
#[should_panic(expected = "condition still false after")]
async fn eventually_panics_on_timeout() {
    eventually("never", Duration::from_millis(50), async || false).await;
}
