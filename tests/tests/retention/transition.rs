//! What a generation's transition waits for, against real servers.
//!
//! While a rotation is in transition every claim goes into two
//! generations; it ends once no transaction can still insert a claim with
//! a view of the state from before the rotation. Transactions that cannot
//! (in another database; idle, holding no snapshot, with no claim) must not
//! hold it: these tests fail if they do. Transactions that can (an
//! uncommitted claim, a snapshot from before the rotation, a batch claim
//! that read the state before it and has not inserted yet) must hold it:
//! these tests show each of them writing into the older generation after
//! the rotation, which is what makes the wait necessary. Whatever holds a
//! transition must show: a warning naming it, the purge's report and
//! `status::expiry`.

use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::RETENTION;
use crate::flowing;
use idem_runtime::Router;
use idem_runtime::expiry::{self, Holds, Step, Transition};
use idem_tests::claims::*;
use idem_tests::scenario::*;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};

/// A connection to a database of the same server other than the test's.
async fn connect_elsewhere(env: &idem_tests::TestEnv, pool: &PgPool) -> PgConnection {
    let name = idem_tests::unique_name("elsewhere");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(pool)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(env.database_url())
        .unwrap()
        .database(&name);
    PgConnection::connect_with(&options).await.unwrap()
}

/// What the purges did while a transition was open.
#[derive(Debug)]
struct Waited {
    ended_after: Option<Duration>,
    runs: usize,
    claims: i64,
    rows: i64,
}

/// Claims a fresh key and runs the purge, every 100 ms, until the
/// transition to generation `rotated` has ended or `limit` passes. Prints
/// the figures.
async fn purge_while_claiming(
    pool: &PgPool,
    handler: i32,
    rotated: i32,
    limit: Duration,
) -> Waited {
    let started = Instant::now();
    let mut waited = Waited {
        ended_after: None,
        runs: 0,
        claims: 0,
        rows: 0,
    };
    let mut n = 1_000_000;
    while started.elapsed() < limit {
        n += 1;
        assert!(claim_once(pool, handler, &key(n)).await);
        if state(pool).await != (rotated, true) {
            waited.ended_after = Some(started.elapsed());
            break;
        }
        expiry::purge(pool).await.unwrap();
        waited.runs += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (waited.claims, waited.rows) = sqlx::query_as(
        "SELECT count(DISTINCT key), count(*) FROM idem_claims WHERE key >= $1::uuid",
    )
    .bind(key(1_000_000))
    .fetch_one(pool)
    .await
    .unwrap();
    println!("{waited:?}");
    waited
}

/// `BEGIN; SELECT txid_current();` in another database of the server,
/// left open: no transaction there can claim, so the transition ends.
#[tokio::test]
async fn a_transaction_open_in_another_database_does_not_hold_the_transition() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "quiet", RETENTION).await;
    let mut foreign = connect_elsewhere(&env, &pool).await;
    let foreign_pid = backend_pid(&mut foreign).await;
    sqlx::raw_sql("BEGIN; SELECT txid_current()")
        .execute(&mut foreign)
        .await
        .unwrap();
    let rotated = rotate_now(&pool).await;

    let waited = purge_while_claiming(&pool, handler, rotated, Duration::from_secs(10)).await;
    assert!(
        waited.ended_after.is_some(),
        "the transition ended while the foreign transaction stayed open: {waited:?}"
    );
    assert_open_in_transaction(&pool, foreign_pid).await;
    sqlx::raw_sql("COMMIT").execute(&mut foreign).await.unwrap();
}

/// An idle READ COMMITTED transaction in the same database that touched
/// nothing of idem's (it wrote a table of its own, so it has a transaction
/// id and locks): it holds no snapshot and no claim, so the transition
/// ends.
#[tokio::test]
async fn an_idle_read_committed_transaction_without_claims_does_not_hold_the_transition() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "quiet", RETENTION).await;
    let mut idle = PgConnection::connect(env.database_url()).await.unwrap();
    let idle_pid = backend_pid(&mut idle).await;
    sqlx::raw_sql(
        "BEGIN; CREATE TEMP TABLE scratch (x int); INSERT INTO scratch VALUES (1); SELECT count(*) FROM effects",
    )
    .execute(&mut idle)
    .await
    .unwrap();
    let rotated = rotate_now(&pool).await;

    let waited = purge_while_claiming(&pool, handler, rotated, Duration::from_secs(10)).await;
    assert!(
        waited.ended_after.is_some(),
        "the transition ended while the idle transaction stayed open: {waited:?}"
    );
    assert_open_in_transaction(&pool, idle_pid).await;
    sqlx::raw_sql("COMMIT").execute(&mut idle).await.unwrap();
}

/// Backend `pid` is still idle in a transaction with an id: the fault the
/// test injected was in place all along.
async fn assert_open_in_transaction(pool: &PgPool, pid: i32) {
    let (state, has_xid): (String, bool) = sqlx::query_as(
        "SELECT state, backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid = $1",
    )
    .bind(pid)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), has_xid), ("idle in transaction", true));
}

/// A REPEATABLE READ transaction in the same database whose snapshot was
/// taken before the rotation: a claim it makes later sees the state from
/// before the rotation and goes into the older generation alone, so the
/// transition must wait for it, and says so: a warning names the backend.
/// Once it commits, the transition ends, and a claim of the same key finds
/// its claim in the sealed generation.
#[tokio::test]
async fn a_snapshot_from_before_the_rotation_holds_the_transition_and_is_named() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "straggler", RETENTION).await;
    let logs = LogCapture::start();
    let mut reader = PgConnection::connect(env.database_url()).await.unwrap();
    let reader_pid = backend_pid(&mut reader).await;
    sqlx::raw_sql(
        "SET application_name = 'nightly-report'; \
         BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM effects",
    )
    .execute(&mut reader)
    .await
    .unwrap();
    let rotated = rotate_now(&pool).await;

    // Held, past the time after which it is warned about.
    let waited = purge_while_claiming(&pool, handler, rotated, Duration::from_secs(3)).await;
    assert_eq!(waited.ended_after, None, "{waited:?}");
    let pid = format!("pid {reader_pid}");
    let warned = logs.lines_with(&["WARN", &pid, "nightly-report", "idle in transaction"]);
    assert!(
        !warned.is_empty(),
        "a warning names the backend that holds the transition"
    );
    // The purge's report and the status name it too.
    let report = expiry::purge(&pool).await.unwrap();
    let transition = report.transition.expect("the transition is still open");
    assert_eq!(transition.generation, rotated);
    assert!(
        transition.waited >= Duration::from_secs(1),
        "{transition:?}"
    );
    assert_blocked_by(&transition, reader_pid, Holds::Snapshot);
    let status = idem_runtime::status::expiry(&pool).await.unwrap();
    let transition = status.transition.expect("the status shows the transition");
    assert_blocked_by(&transition, reader_pid, Holds::Snapshot);

    // The straggler claims: into the older generation only.
    const STRAGGLER: &str = "00000000-0000-0000-0000-00000000abcd";
    sqlx::raw_sql(claim_sql(handler, STRAGGLER))
        .execute(&mut reader)
        .await
        .unwrap();
    assert_eq!(
        generations_of_uncommitted(&mut reader, STRAGGLER).await,
        vec![rotated - 1]
    );
    let report = expiry::purge(&pool).await.unwrap();
    assert_eq!(report.transition_ended, None, "{report:?}");
    assert_blocked_by(&report.transition.unwrap(), reader_pid, Holds::Claims);
    // A copy of the same message claimed now goes into both open
    // generations, so it waits for the straggler's claim and then finds it.
    // (Had the transition ended, it would go into the newer one alone,
    // probe the older without seeing the uncommitted claim, and commit: the
    // message applied twice.)
    let copy = tokio::spawn({
        let pool = pool.clone();
        async move { claim_once(&pool, handler, STRAGGLER).await }
    });
    eventually_or_done(&pool, &copy, "the copy's claim waits for the straggler's").await;
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    assert!(
        !copy.await.unwrap(),
        "the copy's claim conflicts with the straggler's: applied once"
    );

    purge_until(&pool, "the transition ends", |r| {
        r.transition_ended.is_some()
    })
    .await;
    assert!(
        !claim_once(&pool, handler, STRAGGLER).await,
        "found in the sealed generation"
    );
}

/// Waits until a claim of this test's (the only claim statement running
/// besides the test's own held ones) waits on a lock, or `task` has
/// finished (which the caller's next assertion then judges).
async fn eventually_or_done<T>(pool: &PgPool, task: &tokio::task::JoinHandle<T>, what: &str) {
    eventually(what, Duration::from_secs(10), || async {
        task.is_finished()
            || sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO idem_claims%'",
            )
            .fetch_one(pool)
            .await
            .unwrap()
                > 0
    })
    .await;
}

/// `transition` waits for backend `pid` alone, for `why`, and names it.
fn assert_blocked_by(transition: &Transition, pid: i32, why: Holds) {
    assert_eq!(transition.waiting_for, 1, "{transition:?}");
    let [blocker] = transition.blockers.as_slice() else {
        panic!("one blocker: {transition:?}");
    };
    assert_eq!(
        (
            blocker.pid,
            blocker.application_name.as_deref(),
            blocker.state.as_deref(),
            blocker.holds
        ),
        (
            Some(pid),
            Some("nightly-report"),
            Some("idle in transaction"),
            why
        )
    );
    assert!(blocker.transaction_age.is_some() && blocker.query_age.is_some());
}

/// The generations holding `key` as the transaction on `conn` sees them.
async fn generations_of_uncommitted(conn: &mut PgConnection, key: &str) -> Vec<i32> {
    sqlx::query_scalar("SELECT gen FROM idem_claims WHERE key = $1::uuid ORDER BY gen")
        .bind(key)
        .fetch_all(conn)
        .await
        .unwrap()
}

/// A batch claim (`idem_claim_many`) that read the generation state before
/// the rotation and has not inserted yet (its insert waits for a lock
/// another session holds on the claims table) is waited for: once it goes
/// on, it inserts into the older generation alone. A copy of the same
/// message claimed then, before the batch commits, reads the state in
/// transition and goes into both generations, so it waits for the batch's
/// claim and conflicts with it: the message is claimed once. (Had the
/// transition ended, the copy would go into the newer generation alone,
/// probe the older without seeing the uncommitted claim, and commit: the
/// message applied twice.) A claim after the transition finds it in the
/// sealed generation.
#[tokio::test]
async fn a_batch_claim_racing_the_rotation_holds_the_transition() {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let handler = register(&pool, "racing", RETENTION).await;
    // The next generation is attached (a rotation cut short after its
    // attach; the next purge goes on from there), so that rotating needs
    // no lock on the claims table.
    sqlx::query("UPDATE idem_generations SET opened_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    expiry::purge_ending_session_at(&pool, Step::Attached)
        .await
        .expect_err("the purge rotates, and its session ends after the attach");
    assert_eq!(state(&pool).await, (1, false));

    let mut locker = PgConnection::connect(env.database_url()).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE idem_claims IN SHARE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    const RACER: &str = "00000000-0000-0000-0000-0000000000ee";
    let mut batch = PgConnection::connect(env.database_url()).await.unwrap();
    let batch_pid = backend_pid(&mut batch).await;
    let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel();
    let (commit_tx, commit_rx) = tokio::sync::oneshot::channel::<()>();
    let claiming = tokio::spawn(async move {
        let mut tx = batch.begin().await.unwrap();
        let claimed: Vec<String> =
            sqlx::query_scalar("SELECT idem_claim_many($1, ARRAY[$2::uuid])::text[]")
                .bind(handler)
                .bind(RACER)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        let _ = claimed_tx.send(claimed);
        let _ = commit_rx.await;
        tx.commit().await.unwrap();
    });
    eventually(
        "the batch claim waits to insert",
        Duration::from_secs(10),
        || waiting_on_a_lock(&pool, batch_pid),
    )
    .await;

    let report = expiry::purge(&pool).await.unwrap();
    assert_eq!(report.rotated_to, Some(2), "{report:?}");
    for _ in 0..5 {
        expiry::purge(&pool).await.unwrap();
        assert_eq!(state(&pool).await, (2, true), "the transition holds");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    assert_eq!(claimed_rx.await.unwrap(), vec![RACER.to_owned()]);
    let copy = tokio::spawn({
        let pool = pool.clone();
        async move { claim_once(&pool, handler, RACER).await }
    });
    eventually_or_done(&pool, &copy, "the copy's claim waits for the batch's").await;
    let _ = commit_tx.send(());
    claiming.await.unwrap();
    assert!(
        !copy.await.unwrap(),
        "the copy's claim conflicts with the batch's: claimed once"
    );
    assert_eq!(
        generations_of(&pool, RACER).await,
        vec![1],
        "the batch claim went into the older generation alone, after the rotation"
    );

    purge_until(&pool, "the transition ends", |r| {
        r.transition_ended.is_some()
    })
    .await;
    assert!(
        !claim_once(&pool, handler, RACER).await,
        "found in the sealed generation"
    );
}

/// A router's purge reports a transition that waits in its metrics: how
/// long it has lasted, and how many transactions it waits for; both are 0
/// again once the transaction it waited for has ended.
#[tokio::test]
async fn a_waiting_transition_shows_in_the_routers_metrics() {
    const ROUTE_RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("TRANSMETRICS", Duration::from_millis(100)).await;
    register(&pool, "flowing", ROUTE_RETENTION).await;
    let mut reader = PgConnection::connect(env.database_url()).await.unwrap();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM effects")
        .execute(&mut reader)
        .await
        .unwrap();
    rotate_now(&pool).await;

    let metrics = MetricsCapture::start();
    let route = short_retention_route(&stream, Duration::ZERO, ROUTE_RETENTION);
    let (handle, task) = spawn(Router::new().route(route, flowing), nats, pool.clone());
    eventually(
        "the metrics show the waiting transition",
        Duration::from_secs(20),
        || async {
            metrics.value("idem_expiry_transition_blocking_transactions") == Some(1.0)
                && metrics
                    .value("idem_expiry_transition_seconds")
                    .is_some_and(|s| s >= 1.0)
        },
    )
    .await;
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    eventually(
        "the metrics show it ended",
        Duration::from_secs(20),
        || async {
            metrics.value("idem_expiry_transition_blocking_transactions") == Some(0.0)
                && metrics.value("idem_expiry_transition_seconds") == Some(0.0)
        },
    )
    .await;
    assert!(
        metrics
            .value("idem_purge_last_success_timestamp_seconds")
            .unwrap_or(0.0)
            > 1.7e9
    );
    assert_eq!(state(&pool).await, (2, false));
    stop(handle, task).await;
}
