//! `idem status` and `idem outbox retry` against real servers: outbox rows
//! queued for a subject no stream stores yet keep failing while the relay
//! publishes the others; `idem status` lists them with their subject and
//! why; once the stream exists, `idem outbox retry` makes them go out at
//! once rather than after their back-off, each stored once; and `idem
//! status` says whether the outbox's NOTIFY trigger is on.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::outbox::{self, Outbox, Relay};
use idem_tests::outbox::{lock_outbox, out_stream, spawn_relay, stop_relay, stored_count};
use idem_tests::{TestEnv, eventually};
use serde_json::Value;

/// Runs `idem args...` with the test's servers, and returns its exit code
/// and stdout.
async fn idem(env: &TestEnv, args: &[&str]) -> (i32, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env("NATS_URL", env.nats_url())
        .env("DATABASE_URL", env.database_url())
        .output()
        .await
        .expect("the idem binary runs");
    let stdout = String::from_utf8(output.stdout).expect("stdout is UTF-8");
    println!(
        "$ idem {}\n{stdout}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().expect("idem exits"), stdout)
}

async fn idem_json(env: &TestEnv, args: &[&str]) -> Value {
    let (code, stdout) = idem(env, args).await;
    assert_eq!(code, 0, "idem {args:?} exits 0");
    serde_json::from_str(&stdout).expect("stdout is JSON")
}

#[tokio::test]
async fn idem_status_lists_failing_outbox_rows_and_idem_outbox_retry_sends_them_now() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let suffix = idem_tests::unique_name("x");
    let (late, ok) = (format!("LATE_{suffix}"), format!("OK_{suffix}"));
    js.create_stream(stream::Config {
        name: ok.clone(),
        subjects: vec![format!("{ok}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let outbox: Outbox = Outbox::keyed("cli-outbox");
    for n in 0..3 {
        outbox
            .send(&mut tx, &format!("{late}.paid"), &n)
            .await
            .unwrap();
        outbox
            .send(&mut tx, &format!("{ok}.paid"), &n)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    // An hour between attempts: only a retry by hand sends them soon.
    let relay = Relay::new()
        .poll_interval(Duration::from_millis(100))
        .max_row_backoff(Duration::from_secs(3600));
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run_until(nats, pool.clone(), async {
        let _ = stopped.await;
    }));
    eventually(
        "the failing rows are recorded",
        Duration::from_secs(30),
        async || {
            stored_count(&js, &ok).await == 3
                && outbox::lag(&pool).await.is_ok_and(|lag| lag.failing == 3)
        },
    )
    .await;
    // Pushed out as a long back-off would have them.
    sqlx::query("UPDATE idem_outbox SET not_before = now() + interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();

    let status = idem_json(&env, &["status", "--json"]).await;
    let outbox_status = &status["outbox"];
    assert_eq!(outbox_status["pending"], 3, "{status:#}");
    assert_eq!(outbox_status["failing"], 3, "{status:#}");
    let failures = outbox_status["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{status:#}");
    assert_eq!(failures[0]["subject"], format!("{late}.paid"));
    assert_eq!(failures[0]["rows"], 3);
    assert!(
        failures[0]["error"].as_str().unwrap().contains("no stream"),
        "{status:#}"
    );
    let (code, text) = idem(&env, &["status"]).await;
    assert_eq!(code, 0);
    assert!(text.contains("3 failing"), "{text}");
    assert!(text.contains(&format!("{late}.paid")), "{text}");
    assert!(text.contains("idem outbox retry"), "{text}");

    js.create_stream(stream::Config {
        name: late.clone(),
        subjects: vec![format!("{late}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let retried = idem_json(&env, &["outbox", "retry", "--json"]).await;
    assert_eq!(retried["retried"], 3, "{retried:#}");
    eventually(
        "the retried rows are published",
        Duration::from_secs(10),
        async || {
            stored_count(&js, &late).await == 3
                && outbox::lag(&pool).await.is_ok_and(|lag| lag.pending == 0)
        },
    )
    .await;
    assert_eq!(stats.duplicates(), 0, "each stored once");
    let (code, text) = idem(&env, &["outbox", "retry"]).await;
    assert_eq!(code, 0);
    assert!(text.contains("no failing outbox rows"), "{text}");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay stops")
        .expect("the relay does not panic")
        .expect("the relay returns Ok");
}

#[tokio::test]
async fn idem_status_says_whether_the_outbox_notify_trigger_is_on() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();

    // Migration 7 leaves it off.
    let status = idem_json(&env, &["status", "--json"]).await;
    assert_eq!(status["outbox"]["notify_trigger"], false, "{status:#}");
    let (code, text) = idem(&env, &["status"]).await;
    assert_eq!(code, 0);
    assert!(text.contains("NOTIFY trigger off"), "{text}");
    assert!(!idem_runtime::status::outbox_notify(&pool).await.unwrap());

    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    let status = idem_json(&env, &["status", "--json"]).await;
    assert_eq!(status["outbox"]["notify_trigger"], true, "{status:#}");
    let (code, text) = idem(&env, &["status"]).await;
    assert_eq!(code, 0);
    assert!(text.contains("NOTIFY trigger on"), "{text}");
    assert!(idem_runtime::status::outbox_notify(&pool).await.unwrap());
}

/// A session left open with a lock on `idem_outbox` stops every relay:
/// `idem status` names it. With an EXCLUSIVE lock (plain reads still run)
/// it lists the relays' waits and the session that holds the lock; with an
/// ACCESS EXCLUSIVE one (no read runs) it says within seconds, rather than
/// hang, that the table is locked and how to find the session. Once the
/// session ends, the rows go out, each once.
#[tokio::test]
async fn idem_status_names_the_session_whose_lock_stops_the_relays() {
    let env = TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool).await.unwrap();
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OUTLOCKED").await;
    let mut tx = pool.begin().await.unwrap();
    let outbox: Outbox = Outbox::keyed("cli-locked");
    for n in 0..2 {
        outbox
            .send(&mut tx, &format!("{out}.paid"), &n)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let (mut holder, holder_pid) = lock_outbox(&pool, "EXCLUSIVE").await;

    let relay = Relay::new().poll_interval(Duration::from_millis(100));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats, pool.clone());
    eventually(
        "the relay waits for the lock",
        Duration::from_secs(20),
        async || {
            stats
                .blocked()
                .iter()
                .any(|wait| wait.holder_pid == holder_pid)
        },
    )
    .await;
    let status = idem_json(&env, &["status", "--json"]).await;
    let blocked = status["outbox"]["blocked"].as_array().unwrap();
    assert!(
        blocked.iter().any(|wait| wait["holder_pid"] == holder_pid
            && wait["holder_state"] == "idle in transaction"),
        "{status:#}"
    );
    let (code, text) = idem(&env, &["status"]).await;
    assert_eq!(code, 0);
    assert!(text.contains("relays are stopped"), "{text}");
    assert!(text.contains(&format!("pid {holder_pid}")), "{text}");

    // No read of the table runs now.
    sqlx::query("LOCK TABLE idem_outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("status")
            .env("NATS_URL", env.nats_url())
            .env("DATABASE_URL", env.database_url())
            .output(),
    )
    .await
    .expect("idem status does not hang on the lock")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_ne!(output.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("waited over 5s for a lock"), "{stderr}");
    assert_eq!(stored_count(&js, &out).await, 0, "the relay waited");

    holder.commit().await.unwrap();
    eventually(
        "the rows go out once the session ends",
        Duration::from_secs(20),
        async || {
            stored_count(&js, &out).await == 2
                && outbox::lag(&pool).await.is_ok_and(|lag| lag.pending == 0)
                && stats.blocked().is_empty()
        },
    )
    .await;
    assert_eq!(stats.duplicates(), 0, "each stored once");
    stop_relay(stop, task).await;
}
