//! Expiry of claims against real servers: claims by generation, the
//! conflict of a claim across generations (the partitioned table's own
//! unique keys only see one partition each), the purge beside live traffic,
//! two purgers at once, and the upgrade from the schema of version 1.

use std::time::{Duration, Instant};

use crate::flowing;
use idem_runtime::__private::CLAIM_SQL;
use idem_runtime::expiry;
use idem_runtime::retention::Unbounded;
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::claims::*;
use idem_tests::scenario::*;
use sqlx::{Connection, PgConnection, PgPool};

const KEY: &str = "8707f5fa-2bfe-0af8-7913-c57c557603d3";

/// A claim still in progress in the previous generation when the table
/// rotates: a claim of the same key in the new generation waits for it, and
/// conflicts once it commits. The transition does not end while the old
/// claim runs; once it has, a claim of the key finds it in the sealed
/// generation. Without the transition, the second claim would have gone
/// into the new partition alone and both would have committed.
#[tokio::test]
async fn a_claim_in_progress_across_a_rotation_still_conflicts() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "across", Duration::from_secs(2)).await;

    let mut first = claim_held(env.database_url(), handler, KEY).await;
    let first_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut first)
        .await
        .unwrap();
    let report = purge_until(&pool, "the table rotates", |r| r.rotated_to.is_some()).await;
    assert_eq!(report.rotated_to, Some(2));
    assert_eq!(state(&pool).await, (2, true));

    // The second claim goes into the new generation and the old one: it
    // must wait for the first.
    let second = tokio::spawn({
        let pool = pool.clone();
        async move { claim_once(&pool, handler, KEY).await }
    });
    eventually(
        "the second claim waits",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
              WHERE wait_event_type = 'Lock' AND pid <> $1 AND query LIKE '%idem_claim%'",
            )
            .bind(first_pid)
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == 1
        },
    )
    .await;
    assert!(!waiting_on_a_lock(&pool, first_pid).await);
    // While the first claim's transaction runs, the transition holds.
    for _ in 0..3 {
        let report = expiry::purge(&pool).await.unwrap();
        assert_eq!(report.transition_ended, None, "{report:?}");
    }
    sqlx::raw_sql("COMMIT").execute(&mut first).await.unwrap();
    assert!(!second.await.unwrap(), "the second claim conflicts");

    let report = purge_until(&pool, "the transition ends", |r| {
        r.transition_ended.is_some()
    })
    .await;
    assert_eq!(report.transition_ended, Some(2));
    assert_eq!(state(&pool).await, (2, false));
    // Sealed in generation 1, found there.
    assert!(!claim_once(&pool, handler, KEY).await);
    let rows: Vec<i32> = sqlx::query_scalar("SELECT gen FROM idem_claims WHERE key = $1::uuid")
        .bind(KEY)
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![1], "the claim is in the old generation only");
}

/// The same, when the claim in progress rolls back: the waiting claim then
/// proceeds, in both open generations.
#[tokio::test]
async fn a_claim_rolled_back_across_a_rotation_lets_the_waiting_one_proceed() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "across-rollback", Duration::from_secs(2)).await;

    let mut first = claim_held(env.database_url(), handler, KEY).await;
    purge_until(&pool, "the table rotates", |r| r.rotated_to.is_some()).await;
    let second = tokio::spawn({
        let pool = pool.clone();
        async move { claim_once(&pool, handler, KEY).await }
    });
    eventually(
        "the second claim waits",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
              WHERE wait_event_type = 'Lock' AND query LIKE '%idem_claim%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == 1
        },
    )
    .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut first).await.unwrap();
    assert!(second.await.unwrap(), "the second claim proceeds");
    let mut rows: Vec<i32> = sqlx::query_scalar("SELECT gen FROM idem_claims WHERE key = $1::uuid")
        .bind(KEY)
        .fetch_all(&pool)
        .await
        .unwrap();
    rows.sort_unstable();
    assert_eq!(rows, vec![1, 2], "claimed in both open generations");
}

/// Claims conflict across every live generation, however many rotations
/// lie between them, until their generation expires; the claims of a
/// handler without retention are kept when it does.
#[tokio::test]
async fn claims_conflict_across_generations_until_they_expire() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let expiring = register(&pool, "expiring", Duration::from_secs(2)).await;
    let forever = register_forever(&pool, "forever").await;
    const OTHER: &str = "00000000-0000-0000-0000-000000000001";
    assert!(claim_once(&pool, expiring, KEY).await);
    assert!(claim_once(&pool, forever, OTHER).await);

    // Two rotations later the claims sit in a sealed generation, two back.
    let mut seen = Vec::new();
    while state(&pool).await != (3, false) {
        let report = purge_until(&pool, "the table moves on", |r| {
            r.rotated_to.is_some() || r.transition_ended.is_some()
        })
        .await;
        assert!(report.expired.is_empty(), "nothing expired yet: {report:?}");
        seen.push(report);
        assert!(!claim_once(&pool, expiring, KEY).await, "still a duplicate");
        assert!(
            !claim_once(&pool, forever, OTHER).await,
            "still a duplicate"
        );
    }

    // Generation 1 expires once sealed for the retention.
    let report = purge_until(&pool, "generation 1 expires", |r| r.expired.contains(&1)).await;
    assert_eq!(report.kept, 1, "the claim without retention is kept");
    assert!(report.freed_bytes > 0);
    let partitions: Vec<String> = sqlx::query_scalar(
        "SELECT inhrelid::regclass::text FROM pg_inherits
          WHERE inhparent = 'idem_claims'::regclass ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        !partitions.contains(&"idem_claims_g1".to_owned()),
        "{partitions:?}"
    );
    assert!(
        claim_once(&pool, expiring, KEY).await,
        "expired: claimed again"
    );
    assert!(
        !claim_once(&pool, forever, OTHER).await,
        "kept: still a duplicate"
    );
}

/// Claims `key` for `handler` with `$3` = `since` (Unix seconds, or NULL)
/// through the runtime's prepared claim, in a transaction on `conn` that it
/// then rolls back: whether the claim was fresh, and whether it probed
/// generation 1 and the kept generation (from the claim's EXPLAIN ANALYZE:
/// a partition PostgreSQL pruned as the claim ran shows as never executed).
async fn claim_probes(
    conn: &mut PgConnection,
    handler: i32,
    key: &str,
    since: &str,
) -> (bool, bool, bool) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DEALLOCATE ALL; PREPARE claim(integer, uuid, bigint) AS {CLAIM_SQL}"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    let plan: Result<Vec<String>, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) \
         EXECUTE claim({handler}, '{key}', {since})"
    )))
    .fetch_all(&mut *conn)
    .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
    let plan = match plan {
        Ok(plan) => plan,
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505") => {
            return (false, true, true);
        }
        Err(other) => panic!("the claim failed: {other}"),
    };
    let probed = |index: &str| {
        let line = plan
            .iter()
            .find(|line| line.contains(index))
            .unwrap_or_else(|| panic!("{index} is in the plan: {plan:#?}"));
        !line.contains("never executed")
    };
    (
        true,
        probed("idem_claims_g1_pkey"),
        probed("idem_claims_kept_pkey"),
    )
}

/// A claim that knows when its message was stored (the runtime passes it
/// where the route declares its publisher-retry horizon) probes only the
/// generations sealed after that, and the kept one: PostgreSQL prunes the
/// others when the claim runs, so a fresh message does not pay a probe for
/// every sealed generation. A message stored before a generation was sealed still finds
/// its claim there; and the bound is trusted: a copy stored later than the
/// route declared it could be is not looked for in the older generations.
#[tokio::test]
async fn a_claim_probes_only_the_generations_its_message_can_have_been_claimed_in() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "bounded", Duration::from_secs(2)).await;
    assert!(claim_once(&pool, handler, KEY).await);
    let stored: i64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::bigint - 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    // Generation 1 opened an hour ago (so the purge rotates at once).
    sqlx::query("UPDATE idem_generations SET opened_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    while state(&pool).await != (2, false) {
        purge_until(&pool, "generation 1 is sealed", |r| {
            r.rotated_to.is_some() || r.transition_ended.is_some()
        })
        .await;
    }
    let sealed: i64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM sealed_at)::bigint FROM idem_generations WHERE gen = 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    let mut conn = PgConnection::connect(env.database_url()).await.unwrap();
    const FRESH: &str = "00000000-0000-0000-0000-00000000000f";
    // Stored an hour after generation 1 was sealed: it is not probed (the
    // kept generation always is).
    let later = (sealed + 3600).to_string();
    assert_eq!(
        claim_probes(&mut conn, handler, FRESH, &later).await,
        (true, false, true)
    );
    // Unknown: every sealed generation is probed.
    assert_eq!(
        claim_probes(&mut conn, handler, FRESH, "NULL").await,
        (true, true, true)
    );
    // Stored before the seal: generation 1 is probed.
    assert_eq!(
        claim_probes(&mut conn, handler, FRESH, &(sealed - 1).to_string()).await,
        (true, true, true)
    );
    // The message of the claim in generation 1, stored before the seal:
    // found there.
    assert!(
        !claim_probes(&mut conn, handler, KEY, &stored.to_string())
            .await
            .0,
        "a duplicate"
    );
    // The same key, as a copy said to be stored an hour after the seal:
    // generation 1 is not probed, and the claim is taken again.
    assert_eq!(
        claim_probes(&mut conn, handler, KEY, &later).await,
        (true, false, true)
    );
}

/// Several purgers at once (every worker runs one): one does the work, the
/// others skip, and nothing is done twice or left half-done.
#[tokio::test]
async fn two_purgers_at_once_do_no_work_twice() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    register(&pool, "purged", Duration::from_secs(2)).await;

    let started = Instant::now();
    let (mut rotations, mut expirations, mut skipped) = (Vec::new(), Vec::new(), 0);
    while started.elapsed() < Duration::from_secs(8) {
        let (a, b) = tokio::join!(expiry::purge(&pool), expiry::purge(&pool));
        for report in [a.unwrap(), b.unwrap()] {
            skipped += usize::from(report.skipped);
            rotations.extend(report.rotated_to);
            expirations.extend(report.expired);
        }
    }
    assert!(skipped > 0, "the purgers met");
    assert!(rotations.len() >= 3, "{rotations:?}");
    let mut unique = rotations.clone();
    unique.dedup();
    assert_eq!(unique, rotations, "each rotation once");
    assert!(!expirations.is_empty(), "generations expired");
    let mut unique = expirations.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        expirations.len(),
        "each expiry once: {expirations:?}"
    );
    let attached: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'idem_claims'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let known: i64 = sqlx::query_scalar("SELECT count(*) + 1 FROM idem_generations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        attached, known,
        "every attached partition is a known generation, plus the kept one"
    );
}

/// Messages flow, and every message comes back once more while its claim is
/// well inside the retention, while the router's own purge rotates and
/// expires generations under them: no duplicate is applied.
///
/// The route's retention, 10 s, covers its retention floor (which the
/// router checks at start-up): a 1 s handler timeout (3 s for the claiming
/// transaction), ack_wait 1 s for each of the 5 deliveries JetStream can
/// still make (max_deliver 3), NAK delays of 100 and 200 ms (+20 % jitter),
/// and 1 s of publisher copies (the test's copies come about half a second
/// after their message, past the 100 ms duplicate window): 9.36 s. The
/// stream keeps messages forever; the test replays none, so the route
/// accepts that term. With generations of 5 s, the fourth opens after about
/// 15 s, and generation 1, sealed after about 6 s, expires about 10 s
/// later: the traffic lasts longer (at least 50 ms a message, 24 s).
#[tokio::test]
async fn a_purge_beside_live_traffic_removes_no_claim_inside_retention() {
    const RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FLOW", Duration::from_millis(100)).await;
    let route = short_retention_route(&stream, Duration::from_secs(1), RETENTION);
    let stream_config = js
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    let floor = route.retention_floor(&stream_config);
    assert!(
        floor.value().is_some_and(|floor| floor <= RETENTION),
        "{floor}"
    );
    let (handle, task) = spawn(Router::new().route(route, flowing), nats, pool.clone());
    const MESSAGES: i64 = 480;
    let publisher = {
        let (js, subject) = (js.clone(), subject.clone());
        tokio::spawn(async move {
            for i in 0..MESSAGES {
                let id = format!("flow-{i}");
                publish(
                    &js,
                    &subject,
                    &Deposit {
                        account: "a".into(),
                        amount: i,
                    },
                    Some(&id),
                )
                .await;
                // The copy of the message ten steps back, half a second
                // later: after the stream's duplicate window, well inside
                // the retention.
                if i >= 10 {
                    let old = format!("flow-{}", i - 10);
                    let copy = Deposit {
                        account: "a".into(),
                        amount: i - 10,
                    };
                    publish(&js, &subject, &copy, Some(&old)).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    publisher.await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let generation: (i32,) = sqlx::query_as("SELECT current_gen FROM idem_dedup_state")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        generation.0 >= 4,
        "the purge rotated under the traffic: {generation:?}"
    );
    let oldest: i32 = sqlx::query_scalar("SELECT min(gen) FROM idem_generations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(oldest > 1, "generations expired under the traffic");
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        stats.duplicates(),
        (MESSAGES - 10) as u64,
        "every copy was skipped"
    );
    let ledger = ledger(&pool, "flowing").await;
    assert_eq!(
        (ledger.effects, ledger.distinct_messages),
        (MESSAGES, MESSAGES),
        "no duplicate applied"
    );
}

/// The age of the claim of `message_id` for handler `flowing`, as the
/// database sees it, or `None` once it is purged.
async fn claim_age(pool: &PgPool, message_id: &str) -> Option<Duration> {
    let age: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - claimed_at)::float8 FROM idem_processed
          WHERE handler = 'flowing' AND key = idem_key('flowing', $1)",
    )
    .bind(message_id)
    .fetch_optional(pool)
    .await
    .unwrap();
    age.map(Duration::from_secs_f64)
}

/// The edges of the retention, with the router's own purge running: a copy
/// that arrives just inside the retention is skipped; once the purge has
/// expired the claim (never before the retention has passed: its generation
/// is sealed after the claim, and expires the retention after that; and
/// within a generation and three purge intervals of a quarter generation
/// after it), a copy is processed again.
/// That second effect is the documented behaviour of a duplicate that
/// arrives after the retention, which the retention floor exists to rule
/// out.
#[tokio::test]
async fn a_copy_just_inside_retention_is_skipped_and_one_after_expiry_is_processed_again() {
    const RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("EDGE", Duration::from_millis(100)).await;
    let route = short_retention_route(&stream, Duration::ZERO, RETENTION);
    let (handle, task) = spawn(Router::new().route(route, flowing), nats, pool.clone());
    let deposit = Deposit {
        account: "edge".into(),
        amount: 5,
    };
    let processed = |n: u64| {
        let handle = handle.clone();
        move || {
            let handle = handle.clone();
            async move { handle.stats("c").is_some_and(|s| s.processed() == n) }
        }
    };
    let skipped = |n: u64| {
        let handle = handle.clone();
        move || {
            let handle = handle.clone();
            async move { handle.stats("c").is_some_and(|s| s.duplicates() == n) }
        }
    };

    publish(&js, &subject, &deposit, Some("edge-1")).await;
    eventually(
        "the first copy is processed",
        Duration::from_secs(10),
        processed(1),
    )
    .await;

    // Just inside: a copy published when the claim is 2 s short of the
    // retention, past the stream's duplicate window. The claim's age read
    // once the copy is stored is at least its age when the copy arrived.
    let age = claim_age(&pool, "edge-1").await.expect("the claim exists");
    tokio::time::sleep((RETENTION - Duration::from_secs(2)).saturating_sub(age)).await;
    publish(&js, &subject, &deposit, Some("edge-1")).await;
    let age = claim_age(&pool, "edge-1")
        .await
        .expect("the claim is still there");
    assert!(
        age < RETENTION,
        "the copy came inside the retention: {age:?}"
    );
    eventually(
        "the copy inside the retention is handled",
        Duration::from_secs(10),
        skipped(1),
    )
    .await;
    assert!(
        age >= RETENTION - Duration::from_secs(3),
        "the copy came near the edge: {age:?}"
    );
    assert_eq!(
        handle.stats("c").unwrap().processed(),
        1,
        "the copy was skipped"
    );

    // Outside: wait for the purge to expire the claim, and note how old it
    // was when it went.
    let mut last_seen = Duration::ZERO;
    let deadline = Instant::now() + 3 * RETENTION;
    while let Some(age) = claim_age(&pool, "edge-1").await {
        last_seen = age;
        assert!(Instant::now() < deadline, "the claim was never purged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        last_seen >= RETENTION - Duration::from_millis(200),
        "the claim lived out its retention: last seen at {last_seen:?}"
    );
    let generation = expiry::generation_length(RETENTION);
    assert!(
        last_seen <= RETENTION + 2 * generation,
        "the claim went within two generations of its retention: last seen at {last_seen:?}"
    );
    publish(&js, &subject, &deposit, Some("edge-1")).await;
    eventually(
        "the copy after expiry is processed",
        Duration::from_secs(5),
        processed(2),
    )
    .await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let ledger = ledger(&pool, "flowing").await;
    assert_eq!(
        (ledger.effects, ledger.distinct_messages),
        (2, 1),
        "one effect inside the retention, a second after it: the documented behaviour"
    );
}

/// A message delivered again long after its first delivery (its consumer
/// created anew, which delivers the stream from the start) carries the time
/// it was first stored: its claim, now in a sealed generation, is still
/// probed and found, on a route whose declared publisher-retry horizon lets
/// a fresh message skip the sealed generations (`idem_claim_v5`, with the
/// earliest claim time).
#[tokio::test]
async fn an_old_message_delivered_again_after_its_generation_is_sealed_is_skipped() {
    delivered_again_after_its_generation_is_sealed(|stream, retention| {
        short_retention_route(stream, Duration::ZERO, retention)
    })
    .await;
}

/// The same on a route that declares no publisher-retry horizon: its
/// messages' earliest claim time is not known, so they are claimed by
/// `idem_claim_unbounded_v1`, which probes every sealed generation.
#[tokio::test]
async fn an_old_message_without_a_claim_time_bound_is_skipped_after_its_generation_is_sealed() {
    delivered_again_after_its_generation_is_sealed(|stream, retention| {
        Route::new(stream, "c")
            .ack_wait(Duration::from_secs(1))
            .handler_timeout(Duration::from_secs(1))
            .max_deliver(3)
            .backoff(Duration::from_millis(100), Duration::from_millis(200))
            .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
            .accept_duplicates_after_retention(Unbounded::PublisherRetryHorizon)
            .retention(retention)
    })
    .await;
}

/// Processes one message on `route(stream, retention)`, waits until its
/// claim's generation is sealed, creates the consumer anew so that the
/// message is delivered again, and checks that it is skipped.
async fn delivered_again_after_its_generation_is_sealed(route: fn(&str, Duration) -> Route) {
    const RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("AGAIN", Duration::from_millis(100)).await;
    let route = || route(&stream, RETENTION);
    let deposit = Deposit {
        account: "again".into(),
        amount: 3,
    };
    let (handle, task) = spawn(
        Router::new().route(route(), flowing),
        nats.clone(),
        pool.clone(),
    );
    publish(&js, &subject, &deposit, Some("again-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(handle.stats("c").unwrap().processed(), 1);

    // Wait until the claim's generation is sealed (the purge runs beside
    // the router; run it by hand now that the router is stopped).
    let generation: i32 = sqlx::query_scalar(
        "SELECT min(gen) FROM idem_claims WHERE key = idem_key('flowing', 'again-1')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    purge_until(&pool, "the claim's generation is sealed", |_| true).await;
    let deadline = Instant::now() + 3 * RETENTION;
    loop {
        let sealed: Option<bool> =
            sqlx::query_scalar("SELECT sealed_at IS NOT NULL FROM idem_generations WHERE gen = $1")
                .bind(generation)
                .fetch_optional(&pool)
                .await
                .unwrap();
        if sealed == Some(true) {
            break;
        }
        assert!(sealed.is_some(), "sealed before it expired");
        assert!(Instant::now() < deadline, "the generation was never sealed");
        expiry::purge(&pool).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let current: i32 = sqlx::query_scalar("SELECT current_gen FROM idem_dedup_state")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(current > generation, "new claims go elsewhere now");

    // The consumer created anew delivers the stored message again.
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer("c")
        .await
        .unwrap();
    let (handle, task) = spawn(Router::new().route(route(), flowing), nats, pool.clone());
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.processed(), stats.duplicates()),
        (0, 1),
        "delivered again and skipped"
    );
    let ledger = ledger(&pool, "flowing").await;
    assert_eq!((ledger.effects, ledger.distinct_messages), (1, 1));
}

#[idempotent(name = "upgraded")]
async fn upgraded(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "upgraded", &d, delivery).await
}

/// A database on the schema of version 1, with claims in it, upgraded: the
/// messages claimed before the upgrade are still duplicates after it.
#[tokio::test]
async fn claims_made_before_the_upgrade_still_deduplicate() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate_to(&pool, 1).await.unwrap();
    sqlx::query(
        "INSERT INTO idem_processed_messages (handler, message_id)
         VALUES ('upgraded', 'before-1'), ('upgraded', 'before-2'), ('other', 'before-1')",
    )
    .execute(&pool)
    .await
    .unwrap();
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = async_nats::jetstream::new(nats.clone());
    let stream = unique_name("UPGRADE");
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    for id in ["before-1", "before-2", "after-1"] {
        publish(
            &js,
            &subject,
            &Deposit {
                account: id.into(),
                amount: 1,
            },
            Some(id),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), upgraded),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 2));
    let applied: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(applied, vec!["after-1".to_owned()]);
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_processed")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claims, 4, "the three old claims and the new one");
}
