//! What wakes a relay now that the NOTIFY trigger is opt-in (migration 7):
//! a router's relay is woken in process after each COMMIT that queued rows,
//! well before its poll, and by a redelivery found processed (its first
//! attempt committed and never rang); a ring wakes only the relays of its
//! own database; a relay that nothing wakes (another process's) still
//! delivers within its poll ceiling; while NATS is away, rings cost no extra
//! cycles; and a relay LISTENs only while the trigger is enabled.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::outbox::{Outbox, OutboxError, Relay, wake_local_relays, wake_relays};
use idem_runtime::{Route, Router, State, idempotent};
use idem_tests::outbox::{out_stream, pending_rows, spawn_relay, stop_relay, stored_count};
use idem_tests::scenario::*;
use sqlx::PgPool;

use crate::notify_trigger_enabled;

/// Where the handler queues, and when each call was about to commit.
#[derive(Clone)]
struct Forward {
    subject: String,
    before_commit: Arc<Mutex<Vec<(i64, Instant)>>>,
}

#[idempotent(name = "outbox.wake.forward.v1")]
async fn forward(
    tx: &mut sqlx::PgTransaction<'_>,
    State(forward): State<Forward>,
    outbox: Outbox,
    d: Deposit,
) -> Result<(), OutboxError> {
    outbox.send(tx, &forward.subject, &d).await?;
    // The runtime's COMMIT follows at once.
    forward
        .before_commit
        .lock()
        .unwrap()
        .push((d.amount, Instant::now()));
    Ok(())
}

/// Queues one deposit outside any handler, committed, without ringing: as
/// another process would.
async fn queue_elsewhere(pool: &PgPool, key: &str, subject: &str, amount: i64) {
    let outbox: Outbox = Outbox::keyed(key);
    let mut tx = pool.begin().await.unwrap();
    outbox
        .send(&mut tx, subject, &deposit(key, amount))
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test]
async fn a_router_s_relay_is_woken_by_its_handlers_commits_well_before_its_poll() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("OBLOCAL", Duration::from_secs(120)).await;
    let out = out_stream(&js, "OBLOCAL_OUT").await;
    assert!(
        !notify_trigger_enabled(&pool).await,
        "migration 7 leaves the trigger disabled"
    );
    // A poll that cannot explain a delivery within the test.
    const POLL: Duration = Duration::from_secs(30);
    let relay = Relay::new().poll_interval(POLL).min_poll_interval(POLL);
    let state = Forward {
        subject: format!("{out}.paid"),
        before_commit: Arc::default(),
    };
    let router = Router::with_state(state.clone())
        .route(Route::new(&stream, "forward"), forward)
        .relay(relay);
    let mut received = nats.subscribe(format!("{out}.>")).await.unwrap();
    let (handle, task) = spawn(router, nats.clone(), pool.clone());

    const MESSAGES: i64 = 40;
    let mut latencies = Vec::new();
    for amount in 0..MESSAGES {
        publish(
            &js,
            &subject,
            &deposit("local", amount),
            Some(&format!("local-{amount}")),
        )
        .await;
        let message = tokio::time::timeout(Duration::from_secs(10), received.next())
            .await
            .expect("the outbox message is published well before the 30 s poll")
            .expect("the subscription is open");
        let at = Instant::now();
        let sent: Deposit = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(sent.amount, amount, "one at a time, in order");
        let before_commit = state
            .before_commit
            .lock()
            .unwrap()
            .iter()
            .find(|(a, _)| *a == amount)
            .map(|(_, at)| *at)
            .expect("the handler ran");
        latencies.push(at - before_commit);
    }
    latencies.sort();
    let (p50, p99, max) = (
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1],
    );
    println!("COMMIT -> published, woken in process: p50 {p50:?}, p99 {p99:?}, max {max:?}");
    // Well below the poll: the ring, not the poll, delivered each. (The
    // bound leaves a loaded machine room for a slow cycle; a row the ring
    // missed would wait for the 30 s poll.)
    assert!(
        max < Duration::from_secs(5),
        "slowest COMMIT -> published {max:?} with a {POLL:?} poll"
    );
    eventually(
        "every row deleted once acknowledged",
        Duration::from_secs(10),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    assert_eq!(stored_count(&js, &out).await, MESSAGES as u64);
    assert!(!notify_trigger_enabled(&pool).await, "still no trigger");
    stop(handle, task).await;
}

#[tokio::test]
async fn a_relay_nothing_wakes_delivers_within_its_poll_ceiling() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBPOLL").await;
    assert!(!notify_trigger_enabled(&pool).await);
    const CEILING: Duration = Duration::from_millis(400);
    let relay = Relay::new().poll_interval(CEILING);
    let stats = relay.stats();
    let mut received = nats.subscribe(format!("{out}.>")).await.unwrap();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());
    let subject = format!("{out}.paid");

    // Idle: the poll slows down to its ceiling (10, 20, .. 320, 400 ms).
    eventually(
        "the idle relay's poll reaches its ceiling",
        Duration::from_secs(30),
        || async { stats.empty_cycles() >= 8 },
    )
    .await;
    let mut idle = Vec::new();
    for n in 0..5 {
        queue_elsewhere(&pool, &format!("idle-{n}"), &subject, n).await;
        let queued = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), received.next())
            .await
            .expect("a row nothing announced goes out by the poll")
            .expect("the subscription is open");
        idle.push(queued.elapsed());
        // Idle again before the next row.
        let empty = stats.empty_cycles();
        eventually(
            "the poll slows down again",
            Duration::from_secs(30),
            || async { stats.empty_cycles() >= empty + 6 },
        )
        .await;
    }
    println!("idle relay, queued -> published: {idle:?}");
    // The typical row within the ceiling and its cycle; every row within
    // the ceiling and a second for one slow cycle on a loaded machine. A
    // poll that went on slowing down past its ceiling (640 ms, 1.3 s, 2.6 s
    // after the 14 empty cycles above) fails one or the other.
    let mut sorted = idle.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let slack = Duration::from_millis(300);
    assert!(
        median <= CEILING + slack,
        "the median row waited {median:?}, above the poll ceiling {CEILING:?} (+{slack:?} for its cycle): {idle:?}"
    );
    for latency in &idle {
        assert!(
            *latency <= CEILING + Duration::from_secs(1),
            "a row waited {latency:?}, more than a second above the poll ceiling {CEILING:?}"
        );
    }

    // Rows that keep coming keep the poll near its floor.
    let mut busy = Vec::new();
    for n in 0..100 {
        queue_elsewhere(&pool, &format!("busy-{n}"), &subject, n).await;
        let queued = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), received.next())
            .await
            .expect("published")
            .expect("the subscription is open");
        busy.push(queued.elapsed());
    }
    busy.sort();
    let p50 = percentile(&busy, 0.5);
    println!(
        "busy relay (one row after another), queued -> published: p50 {p50:?}, p99 {:?}",
        percentile(&busy, 0.99)
    );
    assert!(
        p50 < CEILING / 2,
        "while rows keep coming the poll stays fast: p50 {p50:?}, ceiling {CEILING:?}"
    );
    // Counted when its PubAck comes back, which may be a moment after a
    // subscriber sees the message.
    eventually(
        "the relay counts every row published",
        Duration::from_secs(10),
        || async { stats.published() >= 105 },
    )
    .await;
    assert_eq!(stats.published(), 105, "each published once");
    // Deleted by the cycle's COMMIT, a moment after its PubAcks.
    eventually(
        "every row deleted once acknowledged",
        Duration::from_secs(10),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    stop_relay(stop, task).await;
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn rings_while_nats_is_away_cost_no_cycles_and_lose_no_rows() {
    idem_tests::require_own_servers();
    let mut env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBAWAY").await;
    let subject = format!("{out}.paid");
    const BACKOFF: Duration = Duration::from_millis(400);
    let relay = Relay::new().max_backoff(BACKOFF);
    let stats = relay.stats();
    let (stop, task) = spawn_relay(relay, nats.clone(), pool.clone());

    env.nats_server_mut().kill();
    for n in 0..50 {
        queue_elsewhere(&pool, &format!("away-{n}"), &subject, n).await;
        wake_local_relays();
    }
    // The fault happened: the relay tried, found NATS away, and backs off.
    eventually(
        "the relay finds NATS away",
        Duration::from_secs(60),
        || async { stats.nats_away() >= 2 },
    )
    .await;
    // A measuring window, not a wait: rings as fast as a busy router's
    // commits, for 3 s.
    let cycles_before = stats.cycles() + stats.empty_cycles();
    let ringing = tokio::spawn(async {
        let until = Instant::now() + Duration::from_secs(3);
        let mut rings = 0u64;
        while Instant::now() < until {
            wake_local_relays();
            rings += 1;
            tokio::task::yield_now().await;
        }
        rings
    });
    let rings = ringing.await.unwrap();
    let cycles = stats.cycles() + stats.empty_cycles() - cycles_before;
    println!("{rings} rings in 3 s while NATS was away: {cycles} relay cycles");
    // One cycle per back-off (400 ms): about 8, whatever the rings.
    assert!(
        cycles <= 3000 / BACKOFF.as_millis() as u64 + 4,
        "{cycles} cycles in 3 s with a {BACKOFF:?} back-off and {rings} rings"
    );
    assert!(rings > 1000, "the rings really came: {rings}");
    assert_eq!(pending_rows(&pool).await, 50, "nothing is lost meanwhile");
    assert_eq!(stats.published(), 0);

    env.nats_server_mut().start_again().await;
    eventually(
        "the relay publishes once NATS is back",
        Duration::from_secs(60),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    assert_eq!(stats.published(), 50);
    stop_relay(stop, task).await;
}

/// A second database on the test's server, migrated, and a pool on it.
async fn other_database(env: &idem_tests::TestEnv, pool: &PgPool) -> PgPool {
    let name = unique_name("obother").to_lowercase();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(pool)
        .await
        .expect("a second database is created");
    let url = env.database_url();
    let base = &url[..url.rfind('/').expect("a database in the URL")];
    let other = PgPool::connect(&format!("{base}/{name}"))
        .await
        .expect("the second database connects");
    idem_runtime::schema::migrate(&other)
        .await
        .expect("idem migrations apply");
    other
}

#[tokio::test]
async fn a_commit_wakes_the_relays_of_its_own_database_only() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let other = other_database(&env, &pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBBELL").await;
    // A poll that cannot explain a look within the test.
    const POLL: Duration = Duration::from_secs(30);
    let relay = Relay::new().poll_interval(POLL).min_poll_interval(POLL);
    let stats = relay.stats();
    let (stop_sender, task) = spawn_relay(relay, nats.clone(), other.clone());
    // Its look at start-up; then only a ring wakes it.
    eventually(
        "the relay's first look",
        Duration::from_secs(30),
        || async { stats.empty_cycles() >= 1 },
    )
    .await;
    let looks = || stats.cycles() + stats.empty_cycles();
    let before = looks();

    // Commits of the first database ring its bell, not the relay's.
    for _ in 0..1000 {
        wake_relays(&pool);
        tokio::task::yield_now().await;
    }
    // A measuring window, not a wait: a ring it heard would have run a
    // cycle within milliseconds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        looks(),
        before,
        "1000 rings of another database woke the relay"
    );

    // Its own database's ring wakes it: the row goes out long before the
    // poll.
    queue_elsewhere(&other, "own-db", &format!("{out}.paid"), 1).await;
    let rung = Instant::now();
    wake_relays(&other);
    eventually(
        "the relay publishes after its own database's ring",
        Duration::from_secs(10),
        || async { stored_count(&js, &out).await == 1 },
    )
    .await;
    println!(
        "own database's ring -> stored in {:?}; {} looks before, {} after",
        rung.elapsed(),
        before,
        looks()
    );
    stop_relay(stop_sender, task).await;
}

#[tokio::test]
async fn a_redelivery_found_processed_wakes_the_relay_for_what_its_first_attempt_queued() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("OBREDELIVER", Duration::from_secs(120)).await;
    let out = out_stream(&js, "OBREDELIVER_OUT").await;
    // A poll that cannot explain a delivery within the test.
    const POLL: Duration = Duration::from_secs(30);
    let relay = Relay::new().poll_interval(POLL).min_poll_interval(POLL);
    let relay_stats = relay.stats();
    let state = Forward {
        subject: format!("{out}.paid"),
        before_commit: Arc::default(),
    };
    // The first attempt commits (its outbox row with it), then its process
    // "dies": no ring, no ack. JetStream redelivers after ack_wait.
    let faults = FaultHooks::default().after_commit(|delivery| {
        if delivery.delivered() == 1 {
            AfterCommit::DropWithoutAck
        } else {
            AfterCommit::Ack
        }
    });
    let router = Router::with_state(state)
        .route(
            Route::new(&stream, "forward").ack_wait(Duration::from_secs(1)),
            forward,
        )
        .relay(relay)
        .fault_hooks(faults);
    let mut received = nats.subscribe(format!("{out}.>")).await.unwrap();
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    let stats = handle.stats("forward").unwrap();
    eventually(
        "the relay's first look",
        Duration::from_secs(30),
        || async { relay_stats.empty_cycles() >= 1 },
    )
    .await;

    publish(
        &js,
        &subject,
        &deposit("redelivered", 7),
        Some("redelivered-7"),
    )
    .await;
    let published = Instant::now();
    let message = tokio::time::timeout(Duration::from_secs(15), received.next())
        .await
        .expect("the outbox message is published well before the 30 s poll")
        .expect("the subscription is open");
    println!(
        "published -> outbox message out in {:?}",
        published.elapsed()
    );
    let sent: Deposit = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(sent.amount, 7);
    // A duplicate is counted after it rang the relay and was acked.
    eventually(
        "the redelivery is counted as a duplicate",
        Duration::from_secs(10),
        async || stats.duplicates() == 1,
    )
    .await;
    assert_eq!(
        (stats.dropped_by_fault(), stats.duplicates()),
        (1, 1),
        "the first attempt committed and never rang; its redelivery found it processed"
    );
    eventually(
        "the row is deleted once acknowledged",
        Duration::from_secs(10),
        || async { pending_rows(&pool).await == 0 },
    )
    .await;
    assert_eq!(stored_count(&js, &out).await, 1);
    stop(handle, task).await;
}

/// The LISTEN sessions on the test's database.
async fn listening(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND query ILIKE 'LISTEN%idem_outbox%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_relay_listens_only_while_the_notify_trigger_is_enabled() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let out = out_stream(&js, "OBLISTEN").await;
    assert!(!notify_trigger_enabled(&pool).await);
    // The trigger's state is read with the lag: once per poll interval
    // (1 s here), while the relay runs.
    let relay = Relay::new();
    let stats = relay.stats();
    let (stop_sender, task) = spawn_relay(relay, nats.clone(), pool.clone());
    // Its first look comes after it decided whether to listen.
    eventually(
        "the relay's first look",
        Duration::from_secs(30),
        || async { stats.empty_cycles() >= 1 },
    )
    .await;
    assert_eq!(
        listening(&pool).await,
        0,
        "no LISTEN while the trigger is off"
    );

    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    assert!(idem_runtime::status::outbox_notify(&pool).await.unwrap());
    eventually(
        "the relay listens once the trigger is enabled",
        Duration::from_secs(20),
        || async { listening(&pool).await == 1 },
    )
    .await;
    // And reads what the trigger sends.
    queue_elsewhere(&pool, "notified", &format!("{out}.paid"), 1).await;
    eventually(
        "the relay reads the notification",
        Duration::from_secs(20),
        || async { stats.notifications() >= 1 },
    )
    .await;
    eventually("the row goes out", Duration::from_secs(20), || async {
        stored_count(&js, &out).await == 1
    })
    .await;

    sqlx::query("ALTER TABLE idem_outbox DISABLE TRIGGER idem_outbox_notify")
        .execute(&pool)
        .await
        .unwrap();
    assert!(!idem_runtime::status::outbox_notify(&pool).await.unwrap());
    eventually(
        "the relay stops listening once the trigger is disabled",
        Duration::from_secs(20),
        || async { listening(&pool).await == 0 },
    )
    .await;
    stop_relay(stop_sender, task).await;
}
