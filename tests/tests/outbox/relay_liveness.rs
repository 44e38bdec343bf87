//! The outbox relay never stops, against a real nats-server and PostgreSQL:
//! rows that keep failing (no stream stores their subject, a stream's
//! `max_msg_size`, a subject the relay's NATS user may not publish to) do not
//! hold up the rows after them; one wake-up covers every pending
//! notification; a relay that cannot reach NATS keeps reading its
//! notifications, so PostgreSQL's server-wide notification queue does not
//! grow; and after NATS is away for several times the relay's back-off,
//! every row goes out once, soon after NATS returns. Each test checks that
//! the fault it injects really happened.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_runtime::outbox::{self, Outbox, OutboxError, Relay, RelayStats};
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::FaultProxy;
use idem_tests::fault_proxy::Direction;
use idem_tests::outbox::{
    lock_outbox, out_stream, pending_rows, spawn_relay, stop_relay, stored_count, stored_ids,
};
use idem_tests::scenario::*;
use sqlx::PgPool;

/// Queues `count` deposits for `subject` in one committed transaction, with
/// ids derived from `key`, each payload `pad` bytes of padding long. Returns
/// their ids in queue order.
async fn queue_padded(
    pool: &PgPool,
    key: &str,
    subject: &str,
    count: i64,
    pad: usize,
) -> Vec<String> {
    let outbox: Outbox = Outbox::keyed(key);
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for amount in 0..count {
        let deposit = Deposit {
            account: "x".repeat(pad),
            amount,
        };
        ids.push(outbox.send(&mut tx, subject, &deposit).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

async fn queue(pool: &PgPool, key: &str, subject: &str, count: i64) -> Vec<String> {
    queue_padded(pool, key, subject, count, 1).await
}

/// What a relay test reports when its condition does not come: the figures
/// of the run so far.
async fn figures(js: &jetstream::Context, pool: &PgPool, out: &str, stats: &RelayStats) -> String {
    format!(
        "stored {} in {out}, pending {}, relay published {} failed {} cycles {}",
        stored_count(js, out).await,
        pending_rows(pool).await,
        stats.published(),
        stats.failed(),
        stats.cycles(),
    )
}

/// Waits up to `timeout` for `count` messages stored in `out`; panics with
/// the run's figures if they do not come.
async fn wait_stored(
    js: &jetstream::Context,
    pool: &PgPool,
    out: &str,
    count: u64,
    stats: &RelayStats,
    timeout: Duration,
) -> Duration {
    let started = Instant::now();
    while stored_count(js, out).await < count {
        if started.elapsed() > timeout {
            panic!(
                "after {timeout:?}, {count} messages are not stored: {}",
                figures(js, pool, out, stats).await
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// Waits until the relay's own lag reading shows `rows` failing rows, all
/// of `subject`, and returns their largest group (by error).
async fn wait_failing(stats: &RelayStats, subject: &str, rows: i64) -> outbox::Failing {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reading = stats.lag();
        if let Some((lag, _)) = &reading
            && lag.failing == rows
            && lag.failures.iter().all(|f| f.subject == subject)
            && lag.failures.iter().map(|f| f.rows).sum::<i64>() == rows
        {
            return lag.failures[0].clone();
        }
        assert!(
            Instant::now() < deadline,
            "the relay does not report {rows} failing rows of {subject}: {reading:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pushes every failing row's next attempt an hour out, as a long back-off
/// would: only a retry by hand makes them go out soon.
async fn push_out(pool: &PgPool) {
    sqlx::query(
        "UPDATE idem_outbox SET not_before = now() + interval '1 hour' WHERE not_before IS NOT NULL",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Retries the failing rows of `subject` as an operator would once the
/// cause is fixed, and checks that all `rows` were made due.
async fn retry_by_hand(pool: &PgPool, subject: &str, rows: u64) {
    assert_eq!(
        outbox::retry_failing(pool, Some(subject)).await.unwrap(),
        rows,
        "every failing row is made due"
    );
}

/// The blocking scenario of the issue: `batch_size(8)`, 8 rows that cannot
/// be published, then 1 that can.
const BATCH: usize = 8;

#[tokio::test]
async fn rows_no_stream_stores_do_not_block_the_rows_after_them() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBNOSTREAM").await;
    // Deployed before its stream: no stream stores this subject.
    let missing = format!("{}.paid", unique_name("OBMISSING"));
    queue(&pool, "missing", &missing, BATCH as i64).await;
    let good = queue(&pool, "good", &format!("{out}.paid"), 1).await;

    let relay = Relay::new()
        .batch_size(BATCH)
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());
    let took = wait_stored(&js, &pool, &out, 1, &stats, Duration::from_secs(20)).await;
    println!("the good row went out {took:?} after the relay started");
    // The fault happened: the 8 rows' publishes failed (recorded when their
    // cycle ends, which may be after the next cycle stored the good row).
    eventually(
        "the 8 rows' publishes failed",
        Duration::from_secs(10),
        || async { stats.failed() >= BATCH as u64 },
    )
    .await;
    assert_eq!(stored_ids(&js, &out).await, good);
    // They are reported, with their subject and why.
    let failing = wait_failing(&stats, &missing, BATCH as i64).await;
    assert!(failing.error.contains("no stream"), "{failing:?}");
    assert!(failing.attempts >= 1, "{failing:?}");
    assert_eq!(
        pending_rows(&pool).await,
        BATCH as i64,
        "the 8 rows stay, none lost"
    );

    // The stream is deployed at last; an operator retries them now.
    let late = missing.trim_end_matches(".paid").to_owned();
    push_out(&pool).await;
    create_stream(&js, &late, &missing, Duration::from_secs(120)).await;
    retry_by_hand(&pool, &missing, BATCH as u64).await;
    let took = wait_stored(
        &js,
        &pool,
        &late,
        BATCH as u64,
        &stats,
        Duration::from_secs(10),
    )
    .await;
    println!("the 8 rows went out {took:?} after they were retried by hand");
    eventually("nothing is pending", Duration::from_secs(10), || async {
        pending_rows(&pool).await == 0
    })
    .await;
    stop_relay(stop, task).await;
    assert_eq!(
        stored_count(&js, &late).await,
        BATCH as u64,
        "each stored once"
    );
}

#[tokio::test]
async fn rows_above_the_stream_s_max_msg_size_do_not_block_the_rows_after_them() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = unique_name("OBMSGSIZE");
    js.create_stream(stream::Config {
        name: out.clone(),
        subjects: vec![format!("{out}.>")],
        max_message_size: 1024,
        ..Default::default()
    })
    .await
    .expect("stream is created");
    // 2 KiB each: under the server's max_payload, above the stream's limit.
    queue_padded(&pool, "big", &format!("{out}.big"), BATCH as i64, 2048).await;
    let good = queue(&pool, "small", &format!("{out}.paid"), 1).await;

    let relay = Relay::new()
        .batch_size(BATCH)
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());
    let took = wait_stored(&js, &pool, &out, 1, &stats, Duration::from_secs(20)).await;
    println!("the small row went out {took:?} after the relay started");
    // The big rows' cycle records its failures when it ends, which may be
    // after the next cycle stored the small row (cycles overlap).
    eventually(
        "the big rows' publishes failed",
        Duration::from_secs(10),
        || async { stats.failed() >= BATCH as u64 },
    )
    .await;
    assert_eq!(
        stored_ids(&js, &out).await,
        good,
        "only the small row is stored"
    );
    let failing = wait_failing(&stats, &format!("{out}.big"), BATCH as i64).await;
    assert!(failing.error.contains("maximum"), "{failing:?}");

    // The stream's limit is raised; an operator retries them now.
    push_out(&pool).await;
    js.update_stream(stream::Config {
        name: out.clone(),
        subjects: vec![format!("{out}.>")],
        max_message_size: -1,
        ..Default::default()
    })
    .await
    .expect("the stream's limit is raised");
    retry_by_hand(&pool, &format!("{out}.big"), BATCH as u64).await;
    wait_stored(
        &js,
        &pool,
        &out,
        1 + BATCH as u64,
        &stats,
        Duration::from_secs(10),
    )
    .await;
    stop_relay(stop, task).await;
    assert_eq!(pending_rows(&pool).await, 0);
}

/// A nats-server of its own configuration, with JetStream and two users: `admin`, who may do
/// anything, and `relay`, who may publish to `OK.>` and JetStream's API only
/// (and receive its replies). A publish to any other subject is refused by
/// the server (`-ERR 'Permissions Violation for Publish ...'`), and the
/// JetStream publish gets no PubAck.
struct RestrictedNats {
    child: Child,
    log: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

impl RestrictedNats {
    /// Starts one, with `extra` added to its configuration.
    async fn start(extra: &str) -> RestrictedNats {
        let dir = tempfile::Builder::new()
            .prefix("idem-test-restricted-nats")
            .tempdir()
            .expect("a temp dir");
        let config = dir.path().join("nats-server.conf");
        let log = dir.path().join("nats-server.log");
        std::fs::write(
            &config,
            format!(
                "host: 127.0.0.1\nport: -1\n{extra}\n\
                 jetstream {{ store_dir: {store:?}, sync_interval: always }}\n\
                 accounts {{\n  APP {{\n    jetstream: enabled\n    users: [\n\
                 {{ user: admin, password: admin }}\n\
                 {{ user: relay, password: relay, permissions: {{\n\
                 publish: {{ allow: [\"OK.>\", \"$JS.API.>\"] }}\n\
                 subscribe: {{ allow: [\"_INBOX.>\"] }}\n  }} }}\n\
                 {{ user: noinfo, password: noinfo, permissions: {{\n\
                 publish: {{ allow: [\">\"], deny: [\"$JS.API.INFO\"] }}\n\
                 subscribe: {{ allow: [\"_INBOX.>\"] }}\n  }} }}\n    ]\n  }}\n}}\n",
                store = dir.path().join("js").display().to_string(),
            ),
        )
        .expect("the config is written");
        let bin = std::env::var_os("NATS_SERVER_BIN").unwrap_or_else(|| "nats-server".into());
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&config)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        idem_tests::die_with_test(&mut cmd);
        let child = cmd.spawn().expect("nats-server starts");
        let mut server = RestrictedNats {
            child,
            log,
            port: 0,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = server.log_text();
            if text.contains("Server is ready") {
                server.port = text
                    .lines()
                    .find_map(|l| l.split("Listening for client connections on ").nth(1))
                    .and_then(|addr| addr.trim().rsplit(':').next()?.parse().ok())
                    .expect("the log names the client port");
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not start:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn client(&self, user: &str) -> async_nats::Client {
        async_nats::ConnectOptions::with_user_and_password(user.into(), user.into())
            .connect(format!("nats://127.0.0.1:{}", self.port))
            .await
            .expect("connects")
    }
}

impl Drop for RestrictedNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn rows_the_relay_may_not_publish_do_not_block_or_slow_the_rows_after_them() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let server = RestrictedNats::start("").await;
    let admin = jetstream::new(server.client("admin").await);
    let ok = unique_name("OBPERM_OK");
    let denied = unique_name("OBPERM_DENIED");
    create_stream(&admin, &ok, &format!("OK.{ok}.>"), Duration::from_secs(120)).await;
    create_stream(
        &admin,
        &denied,
        &format!("NO.{denied}.>"),
        Duration::from_secs(120),
    )
    .await;
    queue(&pool, "denied", &format!("NO.{denied}.paid"), BATCH as i64).await;
    let first = queue(&pool, "allowed", &format!("OK.{ok}.paid"), 1).await;

    let relay = Relay::new()
        .batch_size(BATCH)
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, server.client("relay").await, pool.clone());
    let took = wait_stored(&admin, &pool, &ok, 1, &stats, Duration::from_secs(30)).await;
    println!("the allowed row went out {took:?} after the relay started");
    assert_eq!(stored_ids(&admin, &ok).await, first);

    // Then a trickle: each transaction queues a refused row before five
    // allowed ones. None of the allowed ones waits out a PubAck timeout.
    let mut slowest = Duration::ZERO;
    for n in 0..4 {
        let started = Instant::now();
        let mut tx = pool.begin().await.unwrap();
        let outbox: Outbox = Outbox::keyed(&format!("trickle-{n}"));
        let d = Deposit {
            account: "t".into(),
            amount: n,
        };
        outbox
            .send(&mut tx, &format!("NO.{denied}.paid"), &d)
            .await
            .unwrap();
        for _ in 0..5 {
            outbox
                .send(&mut tx, &format!("OK.{ok}.paid"), &d)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        let expected = 1 + 5 * (n as u64 + 1);
        wait_stored(
            &admin,
            &pool,
            &ok,
            expected,
            &stats,
            Duration::from_secs(60),
        )
        .await;
        slowest = slowest.max(started.elapsed());
    }
    println!("the slowest allowed batch after a refused row took {slowest:?}");
    assert!(
        slowest < Duration::from_secs(4),
        "an allowed row waited {slowest:?}: as long as a refused row's PubAck timeout"
    );
    // The fault happened: the server refused the relay's publishes, and
    // nothing reached the refused subject's stream.
    let log = server.log_text();
    assert!(
        log.contains("Violation"),
        "the server refused a publish; its log:\n{log}"
    );
    assert_eq!(stored_count(&admin, &denied).await, 0);
    // Reported, with why.
    let failing = wait_failing(&stats, &format!("NO.{denied}.paid"), BATCH as i64 + 4).await;
    assert!(failing.error.contains("permission"), "{failing:?}");
    stop_relay(stop, task).await;
    assert_eq!(
        pending_rows(&pool).await,
        BATCH as i64 + 4,
        "the refused rows stay"
    );
}

/// A relay whose NATS user may publish its rows but not request
/// JetStream's account info (`$JS.API.INFO`, which the relay's probe asks
/// for): when a cycle's rows all fail on their own fault (no stream), the
/// unanswered probe must not be taken for NATS being away, or the relay
/// would take the same head rows for ever. The rows are recorded as
/// failing, with why, the row after them goes out, and the relay says why
/// it could not tell.
#[tokio::test]
async fn rows_no_stream_stores_do_not_block_a_relay_that_may_not_ask_for_account_info() {
    let logs = idem_tests::capture_logs();
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let server = RestrictedNats::start("").await;
    let admin = jetstream::new(server.client("admin").await);
    let ok = unique_name("OBNOINFO_OK");
    create_stream(&admin, &ok, &format!("OK.{ok}.>"), Duration::from_secs(120)).await;
    let missing = format!("OK.{}.paid", unique_name("OBNOINFO_MISSING"));
    queue(&pool, "missing", &missing, BATCH as i64).await;
    let good = queue(&pool, "good", &format!("OK.{ok}.paid"), 1).await;

    let client = server.client("noinfo").await;
    // The fault is real: this user's account-info request goes unanswered.
    let probe = tokio::time::timeout(
        Duration::from_secs(3),
        jetstream::new(client.clone()).query_account(),
    )
    .await;
    assert!(
        !matches!(probe, Ok(Ok(_))),
        "the noinfo user must not get JetStream's account info: {probe:?}"
    );
    let relay = Relay::new()
        .batch_size(BATCH)
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, client, pool.clone());
    let took = wait_stored(&admin, &pool, &ok, 1, &stats, Duration::from_secs(30)).await;
    println!("the good row went out {took:?} after the relay started");
    assert_eq!(stored_ids(&admin, &ok).await, good);
    let failing = wait_failing(&stats, &missing, BATCH as i64).await;
    assert!(failing.error.contains("no stream"), "{failing:?}");
    assert!(
        !logs
            .matching(&["WARN", "did not answer the relay's probe", "$JS.API.INFO"])
            .is_empty(),
        "the relay says why it cannot tell NATS away from failing rows: {:#?}",
        logs.lines()
    );
    let log = server.log_text();
    assert!(
        log.contains("Violation"),
        "the server refused the probe:\n{log}"
    );
    stop_relay(stop, task).await;
    assert_eq!(
        pending_rows(&pool).await,
        BATCH as i64,
        "the 8 rows stay, none lost"
    );
}

/// A pool for the relay alone that counts how often a connection is taken
/// from it: about one per relay transaction (a cycle, a lag reading).
async fn counting_pool(url: &str) -> (PgPool, Arc<AtomicU64>) {
    let taken = Arc::new(AtomicU64::new(0));
    let (on_acquire, on_connect) = (taken.clone(), taken.clone());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .before_acquire(move |_, _| {
            on_acquire.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Ok(true) })
        })
        .after_connect(move |_, _| {
            on_connect.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Ok(()) })
        })
        .connect(url)
        .await
        .expect("the relay's pool connects");
    (pool, taken)
}

/// Commits `transactions` queuing transactions (one row each) from
/// `writers` concurrent tasks, each its own NOTIFY.
async fn queue_concurrently(pool: &PgPool, subject: &str, writers: usize, transactions: usize) {
    let tasks: Vec<_> = (0..writers)
        .map(|writer| {
            let (pool, subject) = (pool.clone(), subject.to_owned());
            tokio::spawn(async move {
                for n in (writer..transactions).step_by(writers) {
                    queue(&pool, &format!("burst-{n}"), &subject, 1).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a writer does not panic");
    }
}

#[tokio::test]
async fn one_wake_up_covers_every_pending_notification() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBWAKE").await;
    // The trigger is opt-in (migration 7): this test is about what its
    // notifications cost a relay.
    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    let (relay_pool, taken) = counting_pool(env.database_url()).await;
    let relay = Relay::new();
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats, relay_pool);

    const TRANSACTIONS: usize = 6000;
    queue_concurrently(&pool, &format!("{out}.paid"), 8, TRANSACTIONS).await;
    eventually(
        "the relay publishes every row",
        Duration::from_secs(120),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    assert_eq!(stored_count(&js, &out).await, TRANSACTIONS as u64);
    // The backlog is gone. A measuring window, not a wait: what does the
    // relay do in the 3 s after?
    let before = taken.load(Ordering::Relaxed);
    let cycles_before = stats.cycles();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let transactions = taken.load(Ordering::Relaxed) - before;
    println!(
        "relay transactions in the 3 s after the backlog was gone: {transactions} \
         (cycles with rows {}), after {TRANSACTIONS} notifying transactions; \
         {} notifications read in {} wake-ups, {} cycles in all",
        stats.cycles() - cycles_before,
        stats.notifications(),
        stats.wakeups(),
        stats.cycles() + stats.empty_cycles(),
    );
    // A poll a second and a lag reading a second: about 6. One per
    // notification would be thousands.
    assert!(
        transactions <= 20,
        "{transactions} relay transactions in 3 s with nothing to publish"
    );
    stop_relay(stop, task).await;
}

/// `pg_notification_queue_usage()`: the fraction of the server-wide
/// notification queue in use.
async fn queue_usage(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT pg_notification_queue_usage()")
        .fetch_one(pool)
        .await
        .expect("the queue usage is read")
}

#[tokio::test]
async fn a_relay_that_cannot_reach_nats_keeps_reading_its_notifications() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.jetstream().await;
    let out = out_stream(&js, "OBDEAF").await;
    // The trigger is opt-in (migration 7); where it is on, or another user
    // of the channel notifies, the relay must keep reading.
    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    let proxy = FaultProxy::start("nats", env.nats_url());
    let relay_nats = async_nats::connect(proxy.url_for(env.nats_url()))
        .await
        .expect("the relay connects through the proxy");
    let relay = Relay::new().max_backoff(Duration::from_millis(500));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, relay_nats, pool.clone());
    // Every notification counted below must reach it: it LISTENs before
    // the writers start (it does once it has read that the trigger is on).
    eventually("the relay listens", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND state = 'idle'
                    AND query ILIKE 'LISTEN%idem_outbox%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 1
    })
    .await;

    // NATS away for the relay (a partition: its connection stays open,
    // nothing comes back), while writers keep committing: one queues rows,
    // the others notify on the outbox's channel as each queuing
    // transaction's trigger does, with a payload (as another user of the
    // channel might), so that the queue fills in seconds, not minutes.
    proxy.pause(Direction::Both);
    let writing = Arc::new(AtomicBool::new(true));
    let (committed, notified) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut writers = Vec::new();
    {
        let (pool, subject) = (pool.clone(), format!("{out}.paid"));
        let (writing, committed) = (writing.clone(), committed.clone());
        writers.push(tokio::spawn(async move {
            let mut n = 0;
            while writing.load(Ordering::Relaxed) {
                queue(&pool, &format!("deaf-{n}"), &subject, 1).await;
                committed.fetch_add(1, Ordering::Relaxed);
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    for _ in 0..3 {
        let (pool, writing, notified) = (pool.clone(), writing.clone(), notified.clone());
        writers.push(tokio::spawn(async move {
            let payload = "n".repeat(500);
            while writing.load(Ordering::Relaxed) {
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(outbox::CHANNEL)
                    .bind(&payload)
                    .execute(&pool)
                    .await
                    .expect("a notifying transaction commits");
                notified.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // The fault happened: the relay's publishes fail.
    eventually(
        "the relay's publishes fail",
        Duration::from_secs(60),
        || async { stats.failed() > 0 },
    )
    .await;
    // Far more than the LISTEN socket's buffers hold: a relay that does
    // not read them holds the whole server's queue back.
    eventually(
        "writers notify 20,000 times",
        Duration::from_secs(120),
        || async { notified.load(Ordering::Relaxed) >= 20_000 },
    )
    .await;
    // While NATS is still away and writers still commit, the queue must
    // drain: the relay reads what it is sent.
    let mut samples = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let usage = queue_usage(&pool).await;
        samples.push(usage);
        if usage == 0.0 {
            break;
        }
        if Instant::now() > deadline {
            let peak = samples.iter().copied().fold(0.0, f64::max);
            panic!(
                "the notification queue stayed in use for 30 s while NATS was away: \
                 {} samples, none 0, first {:e}, peak {peak:e}, last {usage:e}; {} notifications sent",
                samples.len(),
                samples[0],
                notified.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stats.published(), 0, "NATS was away all along");
    assert!(stats.nats_away() > 0, "the relay found NATS away");
    writing.store(false, Ordering::Relaxed);
    for writer in writers {
        writer.await.expect("a writer does not panic");
    }
    let committed = committed.load(Ordering::Relaxed);
    // The relay read every one of them (those the socket still held too):
    // it was backing off, not deaf.
    let sent = notified.load(Ordering::Relaxed);
    eventually(
        "the relay reads every notification while NATS is away",
        Duration::from_secs(30),
        || async { stats.notifications() >= sent },
    )
    .await;
    assert_eq!(stats.published(), 0, "NATS was still away");
    println!(
        "queue usage samples while NATS was away: {}; {} notifications, {committed} rows",
        samples
            .iter()
            .map(|s| format!("{s:e}"))
            .collect::<Vec<_>>()
            .join(" "),
        notified.load(Ordering::Relaxed)
    );
    let pause = proxy.resume();
    assert!(pause.held_bytes() > 0, "the pause held traffic: {pause:?}");
    eventually(
        "every row goes out once NATS is back",
        Duration::from_secs(60),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    assert_eq!(stored_count(&js, &out).await, committed, "each stored once");
    stop_relay(stop, task).await;
}

/// Queues one deposit for `<account>.out`.
#[idempotent(name = "liveness.queue.v1")]
async fn queue_one(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    d: Deposit,
) -> Result<(), OutboxError> {
    outbox.send(tx, &format!("{}.out", d.account), &d).await?;
    Ok(())
}

#[idempotent(name = "liveness.downstream.v1")]
async fn downstream(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "liveness.downstream.v1", &d, delivery).await
}

#[tokio::test]
async fn after_nats_is_away_for_several_max_backoffs_every_row_goes_out_once_soon() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("OBAWAY", Duration::from_secs(120)).await;
    let out = out_stream(&js, "OBAWAY_OUT").await;
    let proxy = FaultProxy::start("nats", env.nats_url());
    let relay_nats = async_nats::connect(proxy.url_for(env.nats_url()))
        .await
        .expect("the relay connects through the proxy");
    const MAX_BACKOFF: Duration = Duration::from_millis(500);
    let relay = Relay::new().max_backoff(MAX_BACKOFF);
    let stats = relay.stats();
    let (stop_sender, relay_task) = spawn_relay(relay, relay_nats, pool.clone());
    // The handlers reach NATS; only the relay does not.
    let router = Router::new().route(Route::new(&stream, "queue"), queue_one);
    let (handle, task) = spawn(router, nats.clone(), pool.clone());

    proxy.pause(Direction::Both);
    let away = Instant::now();
    const MESSAGES: i64 = 40;
    for amount in 0..MESSAGES {
        let d = Deposit {
            account: out.clone(),
            amount,
        };
        publish(&js, &subject, &d, Some(&format!("away-{amount}"))).await;
    }
    wait_all_acked(&js, &stream, "queue").await;
    assert_eq!(
        pending_rows(&pool).await,
        MESSAGES,
        "the handlers queued every row"
    );
    // Away for 20 max back-offs, longer than a PubAck timeout too.
    eventually(
        "the relay's publishes fail",
        Duration::from_secs(60),
        || async { stats.failed() > 0 },
    )
    .await;
    tokio::time::sleep((MAX_BACKOFF * 20).saturating_sub(away.elapsed())).await;
    assert_eq!(stats.published(), 0, "nothing went out while NATS was away");
    assert_eq!(stored_count(&js, &out).await, 0);
    // The relay knew NATS was away, and blamed no row for it: none waits
    // out a back-off of its own once NATS returns.
    assert!(stats.nats_away() > 0, "the relay found NATS away");
    assert_eq!(stats.failing(), 0, "no failure was recorded on a row");
    let lag = outbox::lag(&pool).await.unwrap();
    assert_eq!((lag.pending, lag.failing), (MESSAGES, 0));

    let pause = proxy.resume();
    assert!(pause.held_bytes() > 0, "the pause held traffic: {pause:?}");
    let back = Instant::now();
    eventually(
        "every row goes out once NATS is back",
        Duration::from_secs(60),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    let recovery = back.elapsed();
    println!(
        "NATS away {:?} (max back-off {MAX_BACKOFF:?}); every row out {recovery:?} after it returned; \
         the relay's publishes failed {} times",
        pause.lasted,
        stats.failed()
    );
    // A cycle in flight when NATS returns waits out its PubAck timeout
    // (5 s), then the relay's back-off: about 6 s; generous for CI.
    assert!(
        recovery < Duration::from_secs(20),
        "rows went out {recovery:?} after NATS returned"
    );
    stop(handle, task).await;
    stop_relay(stop_sender, relay_task).await;

    // Each row once in the stream (JetStream dropped the copies the pause
    // held and delivered late), and applied once downstream.
    let ids = stored_ids(&js, &out).await;
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(
        (ids.len(), distinct.len()),
        (MESSAGES as usize, MESSAGES as usize)
    );
    let router = Router::new().route(Route::new(&out, "downstream"), downstream);
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &out, "downstream").await;
    stop(handle, task).await;
    assert_eq!(
        ledger(&pool, "liveness.downstream.v1").await,
        Ledger::once_each(MESSAGES)
    );
}

#[tokio::test]
async fn a_cycle_takes_at_most_max_cycle_bytes_and_always_one_row() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBBYTES").await;
    // Ten rows of about 3 KB, then one of 20 KB, above the cap by itself.
    let mut ids = queue_padded(&pool, "bytes", &format!("{out}.paid"), 10, 3000).await;
    ids.extend(queue_padded(&pool, "huge", &format!("{out}.paid"), 1, 20_000).await);
    let relay = Relay::new().max_cycle_bytes(10_000);
    let mut taken = Vec::new();
    loop {
        let cycle = relay.relay_batch(&js, &pool).await.unwrap();
        if cycle.taken == 0 {
            break;
        }
        assert_eq!(cycle.published.len(), cycle.taken, "{cycle:?}");
        taken.push(cycle.taken);
    }
    assert_eq!(
        taken,
        [3, 3, 3, 1, 1],
        "three 3 KB rows fit in 10,000 bytes; the big one goes alone"
    );
    assert_eq!(stored_ids(&js, &out).await, ids, "each once, in order");
}

#[tokio::test]
async fn a_row_the_nats_client_cannot_encode_is_reported_and_does_not_kill_the_relay() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBENCODE").await;
    let subject = format!("{out}.paid");
    // Rows written by hand (or by an older idem) may hold anything:
    // an id with a line feed, a header name with a space, a header value
    // with a line feed. The NATS client panics on each.
    sqlx::query(
        "INSERT INTO idem_outbox (msg_id, subject, payload, headers) VALUES
            ('bad\nid', $1, '\\x7b7d', NULL),
            ('bad-name', $1, '\\x7b7d', '[[\"a name\", \"v\"]]'),
            ('bad-value', $1, '\\x7b7d', '[[\"X-Ok\", \"line\\nfeed\"]]'),
            ('good', $1, '\\x7b7d', '[[\"X-Ok\", \"fine\"]]')",
    )
    .bind(&subject)
    .execute(&pool)
    .await
    .unwrap();
    let relay = Relay::new().poll_interval(Duration::from_millis(100));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats, pool.clone());
    wait_stored(&js, &pool, &out, 1, &stats, Duration::from_secs(20)).await;
    assert_eq!(stored_ids(&js, &out).await, ["good"]);
    let failing = wait_failing(&stats, &subject, 3).await;
    assert!(failing.error.contains("header"), "{failing:?}");
    assert!(!task.is_finished(), "the relay still runs");
    // `enqueue` refuses an id a header cannot carry.
    let mut conn = pool.acquire().await.unwrap();
    let refused = outbox::enqueue(
        &mut conn,
        "line\nfeed",
        &subject,
        b"{}",
        &Default::default(),
    )
    .await;
    assert!(
        matches!(refused, Err(OutboxError::InvalidId(_))),
        "{refused:?}"
    );
    drop(conn);
    stop_relay(stop, task).await;
}

#[tokio::test]
async fn a_subject_longer_than_the_server_takes_does_not_cut_the_relay_off() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBLONG").await;
    // nats-server reads at most 4 KiB of a protocol line (`max_control_line`)
    // and closes the connection of a client that sends a longer one: a
    // publish to this subject would cut the relay off NATS, every time.
    let long = format!("{out}.{}", "x".repeat(5000));
    let mut conn = pool.acquire().await.unwrap();
    let refused = outbox::enqueue(&mut conn, "long-0", &long, b"{}", &Default::default()).await;
    drop(conn);
    if refused.is_ok() {
        println!("enqueue took a {}-byte subject", long.len());
    } else {
        sqlx::query(
            "INSERT INTO idem_outbox (msg_id, subject, payload) VALUES ('long-0', $1, '\\x7b7d')",
        )
        .bind(&long)
        .execute(&pool)
        .await
        .unwrap();
    }
    let good = queue(&pool, "after-long", &format!("{out}.paid"), 1).await;
    let relay = Relay::new()
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());
    wait_stored(&js, &pool, &out, 1, &stats, Duration::from_secs(20)).await;
    assert_eq!(stored_ids(&js, &out).await, good);
    let failing = wait_failing(&stats, &long, 1).await;
    assert!(failing.error.contains("subject"), "{failing:?}");
    stop_relay(stop, task).await;
    assert!(
        matches!(refused, Err(OutboxError::InvalidSubject(_))),
        "enqueue refuses a subject the server cannot take: {refused:?}"
    );
}

#[tokio::test]
async fn a_row_that_makes_the_server_drop_the_connection_is_found_and_set_aside() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    // A server that reads at most 512 bytes of a protocol line: a publish to
    // a longer subject makes it close the client's connection.
    let server = RestrictedNats::start("max_control_line: 512").await;
    let js = jetstream::new(server.client("admin").await);
    let ok = unique_name("OBCUT");
    create_stream(&js, &ok, &format!("OK.{ok}.>"), Duration::from_secs(120)).await;
    let killer = format!("OK.{ok}.{}", "k".repeat(700));
    queue(&pool, "killer", &killer, 1).await;
    let good = queue(&pool, "after-killer", &format!("OK.{ok}.paid"), 3).await;
    let relay = Relay::new()
        .poll_interval(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(400));
    let stats = relay.stats();
    // A client of its own: a router's relay shares the router's, which
    // each cut would cut off too.
    let relay_nats = server.client("admin").await;
    let cuts = relay_nats.statistics();
    let (stop, task) = spawn_relay(relay, relay_nats, pool.clone());
    let took = wait_stored(&js, &pool, &ok, 3, &stats, Duration::from_secs(30)).await;
    println!(
        "the 3 rows after the connection-killing row went out after {took:?}; the relay's client connected {} times",
        cuts.connects.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(stored_ids(&js, &ok).await, good);
    // The fault happened: the server closed connections over it.
    let log = server.log_text();
    assert!(
        log.to_lowercase().contains("control line"),
        "the server refused the line; its log:\n{log}"
    );
    let failing = wait_failing(&stats, &killer, 1).await;
    assert!(failing.error.contains("connection was lost"), "{failing:?}");
    stop_relay(stop, task).await;
    assert_eq!(pending_rows(&pool).await, 1, "only the killer stays");
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn after_nats_is_killed_for_several_max_backoffs_every_row_goes_out_once_soon() {
    idem_tests::require_own_servers();
    let mut env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBKILLED").await;
    const MAX_BACKOFF: Duration = Duration::from_millis(500);
    let relay = Relay::new().max_backoff(MAX_BACKOFF);
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());

    env.nats_server_mut().kill();
    let away = Instant::now();
    // Queued while NATS is down, as an endpoint outside any handler would.
    let mut ids = Vec::new();
    for n in 0..40 {
        ids.extend(queue(&pool, &format!("killed-{n}"), &format!("{out}.paid"), 1).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eventually(
        "the relay finds NATS away",
        Duration::from_secs(60),
        || async { stats.nats_away() > 0 },
    )
    .await;
    tokio::time::sleep((MAX_BACKOFF * 20).saturating_sub(away.elapsed())).await;
    assert_eq!(stats.published(), 0);
    assert_eq!(stats.failing(), 0, "no failure was recorded on a row");
    let lag = outbox::lag(&pool).await.unwrap();
    assert_eq!((lag.pending, lag.failing), (40, 0));

    env.nats_server_mut().start_again().await;
    let back = Instant::now();
    eventually(
        "every row goes out once NATS is back",
        Duration::from_secs(60),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    let recovery = back.elapsed();
    println!(
        "NATS killed for {:?} (max back-off {MAX_BACKOFF:?}); every row out {recovery:?} after it was back; \
         {} cycles found it away",
        back - away,
        stats.nats_away()
    );
    assert!(
        recovery < Duration::from_secs(20),
        "rows went out {recovery:?} after NATS was back"
    );
    stop_relay(stop, task).await;
    let stored = stored_ids(&js, &out).await;
    assert_eq!(stored, ids, "each stored once, in order");
}

/// A session left open after `LOCK TABLE idem_outbox` stops every relay:
/// their statements wait for the lock. The wait is not silent: the relay
/// names the session that holds the lock (`RelayStats::blocked`, a warning,
/// `idem_outbox_relays_blocked`), and so does `outbox::lag`, which `idem
/// status` reads. Once the session ends, every row goes out once.
#[tokio::test]
async fn a_relay_waiting_for_a_lock_names_the_session_that_holds_it() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBLOCKED").await;
    let ids = queue(&pool, "locked", &format!("{out}.paid"), 4).await;
    // Plain reads (the lag) still run; the relay's takes wait.
    let (holder, holder_pid) = lock_outbox(&pool, "EXCLUSIVE").await;

    let relay = Relay::new().poll_interval(Duration::from_millis(100));
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());
    eventually(
        "the relay names the session that holds the lock",
        Duration::from_secs(20),
        || async {
            stats
                .blocked()
                .iter()
                .any(|wait| wait.holder_pid == holder_pid)
        },
    )
    .await;
    // The fault happened: nothing went out while the lock was held.
    assert_eq!(stored_count(&js, &out).await, 0, "the relay waited");
    let lag = outbox::lag(&pool).await.unwrap();
    assert!(
        lag.blocked.iter().any(|wait| wait.holder_pid == holder_pid
            && wait.holder_state == "idle in transaction"
            && wait.holder_query.contains("LOCK TABLE")),
        "the lag lists the relay's wait and who holds the lock: {lag:?}"
    );

    holder.commit().await.unwrap();
    wait_stored(&js, &pool, &out, 4, &stats, Duration::from_secs(20)).await;
    eventually(
        "the relay no longer says it waits",
        Duration::from_secs(10),
        || async { stats.blocked().is_empty() },
    )
    .await;
    eventually("nothing is pending", Duration::from_secs(10), || async {
        pending_rows(&pool).await == 0
    })
    .await;
    stop_relay(stop, task).await;
    assert_eq!(stored_ids(&js, &out).await, ids, "each row went out once");
    assert!(outbox::lag(&pool).await.unwrap().blocked.is_empty());
}
