//! An expiry cut short at any point must not stop the purges after it.
//!
//! Each test ends a purge's session between two of its steps (with
//! `pg_terminate_backend` from another session, through the
//! `fault-injection` hook, or aimed at the purge's backend while its
//! `DETACH ... CONCURRENTLY`, or the `DROP` of a generation's piece, waits
//! for a lock), checks that the catalog was left in the state that step
//! leaves, and then runs purges beside fresh claims for a
//! few seconds: every later run must succeed, the interrupted generation
//! must be finished, later generations must expire on time, a claim inside
//! the retention must still be a duplicate, and the claims of a handler
//! without retention must be kept.

use std::time::{Duration, Instant};

use crate::RETENTION;
use crate::flowing;
use idem_runtime::Router;
use idem_runtime::expiry::{self, Step};
use idem_tests::claims::*;
use idem_tests::scenario::*;
use sqlx::{Connection, PgConnection, PgPool};

struct Setup {
    env: idem_tests::TestEnv,
    pool: PgPool,
    expiring: i32,
    kept: i32,
}

/// The claim of the handler with the retention in generation 1.
const EXPIRING_KEY: u64 = 1;
/// The claim of the handler without retention in generation 1.
const KEPT_KEY: u64 = 2;

/// Two handlers, one with the retention and one that keeps its claims
/// forever, each with a claim in generation 1.
async fn setup() -> Setup {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let expiring = register(&pool, "expiring", RETENTION).await;
    let kept = register_forever(&pool, "kept").await;
    assert!(claim_once(&pool, expiring, &key(EXPIRING_KEY)).await);
    assert!(claim_once(&pool, kept, &key(KEPT_KEY)).await);
    Setup {
        env,
        pool,
        expiring,
        kept,
    }
}

/// Whether generation 1 is due to expire within `margin`.
async fn generation_1_due_within(pool: &PgPool, margin: Duration) -> bool {
    sqlx::query_scalar(
        "SELECT coalesce(bool_or(sealed_at <= now() - $1::bigint * interval '1 millisecond'), false)
           FROM idem_generations WHERE gen = 1",
    )
    .bind((RETENTION - margin).as_millis() as i64)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs purges until one runs `step` on the way to expiring generation 1,
/// and ends that one's session there. Returns the error it failed with.
async fn interrupt_expiry_of_generation_1(pool: &PgPool, step: Step) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "generation 1 never came due");
        if generation_1_due_within(pool, Duration::from_millis(300)).await {
            match expiry::purge_ending_session_at(pool, step).await {
                Err(error) => return error.to_string(),
                // Not quite due yet: nothing reached the step.
                Ok(report) => assert!(report.expired.is_empty(), "{report:?}"),
            }
        } else {
            expiry::purge(pool).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether partition `name` exists, and whether it is attached.
async fn partition(pool: &PgPool, name: &str) -> (bool, bool) {
    sqlx::query_as(
        "SELECT to_regclass($1) IS NOT NULL,
                EXISTS (SELECT FROM pg_inherits WHERE inhparent = 'idem_claims'::regclass
                                                  AND inhrelid = to_regclass($1))",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn generation_known(pool: &PgPool, generation: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM idem_generations WHERE gen = $1)")
        .bind(generation)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Asserts that an error is what a session ended under a statement gives.
fn assert_session_ended(error: &str) {
    assert!(
        ["terminat", "connection", "closed", "EOF", "broken pipe"]
            .iter()
            .any(|sign| error.contains(sign)),
        "the purge failed because its session ended: {error}"
    );
}

/// What the purges after an interruption did.
#[derive(Debug)]
struct Recovery {
    runs: usize,
    failures: usize,
    last_error: Option<String>,
    expired: Vec<i32>,
    /// The most generations seen past their expiry by more than 2 s (the
    /// purge runs about every 200 ms here).
    overdue: i64,
}

/// Runs purges for `period`, beside a fresh claim of the expiring handler
/// before each, and checks at each that a claim made about a second ago
/// (inside the retention) is still a duplicate. Prints the figures the
/// issue reported.
async fn run_purges_after(setup: &Setup, period: Duration) -> Recovery {
    let pool = &setup.pool;
    let mut recovery = Recovery {
        runs: 0,
        failures: 0,
        last_error: None,
        expired: Vec::new(),
        overdue: 0,
    };
    let started = Instant::now();
    let mut n = 1000;
    let mut made = Vec::new();
    while started.elapsed() < period {
        n += 1;
        assert!(claim_once(pool, setup.expiring, &key(n)).await, "fresh");
        made.push((n, Instant::now()));
        match expiry::purge(pool).await {
            Ok(report) => recovery.expired.extend(report.expired),
            Err(error) => {
                recovery.failures += 1;
                recovery.last_error = Some(error.to_string());
            }
        }
        recovery.runs += 1;
        let overdue: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_generations
              WHERE sealed_at <= now() - $1::bigint * interval '1 millisecond' - interval '2 seconds'",
        )
        .bind(RETENTION.as_millis() as i64)
        .fetch_one(pool)
        .await
        .unwrap();
        recovery.overdue = recovery.overdue.max(overdue);
        if let Some(&(earlier, at)) = made
            .iter()
            .rev()
            .find(|(_, at)| at.elapsed() >= Duration::from_secs(1))
        {
            let age = at.elapsed();
            let fresh = claim_once(pool, setup.expiring, &key(earlier)).await;
            assert!(
                !fresh,
                "a claim made a second ago, inside the retention, is still a duplicate: \
                 claim {earlier}, made {age:?} before this check (retention {RETENTION:?}); \
                 its generations now: {:?}",
                sqlx::query_as::<_, (i32, Option<f64>)>(
                    "SELECT gen, extract(epoch FROM now() - sealed_at)::float8 FROM idem_generations ORDER BY gen"
                )
                .fetch_all(pool)
                .await
                .unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let attached = attached_partitions(pool).await.len();
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idem_generations
          WHERE sealed_at <= now() - $1::bigint * interval '1 millisecond'",
    )
    .bind(RETENTION.as_millis() as i64)
    .fetch_one(pool)
    .await
    .unwrap();
    let oldest: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(claimed_at))::float8 FROM idem_claims WHERE gen > 0",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    println!(
        "after the interruption: {} of {} purges failed (last error: {:?}); expired {:?}; \
         {attached} attached partitions, {due} generations due; the oldest claim {oldest:.1} s old \
         against a {:?} retention",
        recovery.failures, recovery.runs, recovery.last_error, recovery.expired, RETENTION
    );
    recovery
}

/// The purges after an interruption completed it and kept expiring on
/// time; the interrupted generation is gone and the claims that had to be
/// kept are.
async fn assert_recovered(setup: &Setup, recovery: &Recovery) {
    let pool = &setup.pool;
    assert_eq!(
        (recovery.failures, &recovery.last_error),
        (0, &None),
        "every purge after the interruption succeeds"
    );
    assert_eq!(recovery.overdue, 0, "no generation stays past its expiry");
    assert!(
        recovery.expired.len() >= 3,
        "later generations expire: {:?}",
        recovery.expired
    );
    assert_eq!(partition(pool, "idem_claims_g1").await, (false, false));
    assert!(
        !generation_known(pool, 1).await,
        "generation 1 is forgotten"
    );
    assert!(
        !claim_once(pool, setup.kept, &key(KEPT_KEY)).await,
        "the claim of the handler without retention is kept"
    );
    assert!(
        claim_once(pool, setup.expiring, &key(EXPIRING_KEY)).await,
        "the expired claim is gone: claimed again"
    );
}

/// Cut short after the kept claims are copied out of the expiring
/// generation, before its detach.
#[tokio::test]
async fn a_purge_ended_after_copying_the_kept_claims_is_finished_by_the_next() {
    let setup = setup().await;
    let error = interrupt_expiry_of_generation_1(&setup.pool, Step::Copied).await;
    assert_session_ended(&error);
    assert_eq!(
        partition(&setup.pool, "idem_claims_g1").await,
        (true, true),
        "still attached"
    );
    assert_eq!(
        generations_of(&setup.pool, &key(KEPT_KEY)).await,
        vec![0, 1],
        "the kept claim is copied"
    );
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// Cut short after the expiring generation is detached, before its drop:
/// the state that stopped every later purge.
#[tokio::test]
async fn a_purge_ended_after_detaching_a_generation_is_finished_by_the_next() {
    let setup = setup().await;
    let error = interrupt_expiry_of_generation_1(&setup.pool, Step::Detached).await;
    assert_session_ended(&error);
    assert_eq!(
        partition(&setup.pool, "idem_claims_g1").await,
        (true, false),
        "detached, not dropped"
    );
    assert!(generation_known(&setup.pool, 1).await);
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// Dropped, not forgotten: what an earlier version's purge, which dropped
/// and forgot a generation in two transactions, left when cut short
/// between them.
#[tokio::test]
async fn a_generation_dropped_but_not_forgotten_is_forgotten_by_the_next_purge() {
    let setup = setup().await;
    let error = interrupt_expiry_of_generation_1(&setup.pool, Step::Detached).await;
    assert_session_ended(&error);
    sqlx::raw_sql("DROP TABLE idem_claims_g1")
        .execute(&setup.pool)
        .await
        .unwrap();
    assert_eq!(
        partition(&setup.pool, "idem_claims_g1").await,
        (false, false)
    );
    assert!(generation_known(&setup.pool, 1).await);
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// Cut short inside `DETACH ... CONCURRENTLY`, between its two
/// transactions: the purge's backend is terminated while the detach waits
/// for a transaction that read the claims table, which leaves the detach
/// pending.
#[tokio::test]
async fn a_purge_ended_inside_its_detach_is_finished_by_the_next() {
    let setup = setup().await;
    let pool = &setup.pool;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Purged until generation 1 is nearly due (no purge then can expire
    // it), then left until it is.
    while !generation_1_due_within(pool, Duration::from_millis(300)).await {
        assert!(Instant::now() < deadline, "generation 1 never came due");
        expiry::purge(pool).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually("generation 1 is due", Duration::from_secs(1), || {
        generation_1_due_within(pool, Duration::ZERO)
    })
    .await;
    // A reader the detach must wait for.
    let mut reader = PgConnection::connect(setup.env.database_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM idem_claims")
        .execute(&mut reader)
        .await
        .unwrap();
    let purging = tokio::spawn({
        let pool = pool.clone();
        async move { expiry::purge(&pool).await }
    });
    let detaching = detach_waiting(pool).await;
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
        .bind(detaching)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(ended);
    let error = purging.await.unwrap().expect_err("the purge was cut short");
    assert_session_ended(&error.to_string());
    let pending: bool = sqlx::query_scalar(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = 'idem_claims_g1'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(pending, "the detach is left pending");
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// The backend of a purge whose `DETACH ... CONCURRENTLY` waits for a lock.
async fn detach_waiting(pool: &PgPool) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    // (The purge gets there when a loaded machine lets it; once there, it
    // waits up to its 5 s lock timeout.)
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
              WHERE query LIKE 'ALTER TABLE idem_claims DETACH PARTITION%' AND wait_event_type = 'Lock'",
        )
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        assert!(Instant::now() < deadline, "no purge's detach waits");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Cut short after the next generation's partition is attached, before the
/// rotation to it commits.
#[tokio::test]
async fn a_purge_ended_after_attaching_the_next_generation_is_finished_by_the_next() {
    let setup = setup().await;
    let error = interrupt_rotation(&setup.pool, Step::Attached).await;
    assert_session_ended(&error);
    let (current, _) = state(&setup.pool).await;
    let next = format!("idem_claims_g{}", current + 1);
    assert_eq!(partition(&setup.pool, &next).await, (true, true));
    assert!(!generation_known(&setup.pool, current + 1).await);
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// Cut short after the rotation committed, before the transactions its
/// transition waits for are recorded.
#[tokio::test]
async fn a_purge_ended_after_rotating_is_finished_by_the_next() {
    let setup = setup().await;
    let error = interrupt_rotation(&setup.pool, Step::Rotated).await;
    assert_session_ended(&error);
    let recorded: (bool, bool) =
        sqlx::query_as("SELECT transition, waiting_for IS NOT NULL FROM idem_dedup_state")
            .fetch_one(&setup.pool)
            .await
            .unwrap();
    assert_eq!(recorded, (true, false), "in transition, nothing recorded");
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_recovered(&setup, &recovery).await;
}

/// The pieces of generation `generation`'s partition, by name.
async fn pieces_of(pool: &PgPool, generation: i32) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT inhrelid::regclass::text FROM pg_inherits
          WHERE inhparent = to_regclass($1) ORDER BY 1",
    )
    .bind(format!("idem_claims_g{generation}"))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The claims of each handler in generation 2, for the tests of pieces.
const EXPIRING_KEY_2: u64 = 21;
const KEPT_KEY_2: u64 = 22;

/// [`setup`], with the database's piece size set to 8 KiB, so that the
/// first rotation makes generation 2 of several pieces (by generation 1's
/// size); a claim of each handler in it. Returns its pieces.
async fn setup_with_pieces() -> (Setup, Vec<String>) {
    let setup = setup().await;
    let pool = &setup.pool;
    // For the sessions that begin from now on: each purge run's.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DO $$BEGIN EXECUTE format('ALTER DATABASE %I SET {} = 8192', current_database()); END$$",
        expiry::PIECE_BYTES_SETTING
    )))
    .execute(pool)
    .await
    .unwrap();
    let first_bytes: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('idem_claims_g1')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(rotate_and_seal(pool).await, 2);
    let pieces = pieces_of(pool, 2).await;
    assert_eq!(
        pieces.len() as u32,
        expiry::pieces_for(first_bytes.unsigned_abs(), 8192),
        "generation 2 is made of pieces, by generation 1's size ({first_bytes} bytes): {pieces:?}"
    );
    assert!(pieces.len() >= 3, "{pieces:?}");
    assert!(claim_once(pool, setup.expiring, &key(EXPIRING_KEY_2)).await);
    assert!(claim_once(pool, setup.kept, &key(KEPT_KEY_2)).await);
    assert_eq!(generations_of(pool, &key(EXPIRING_KEY_2)).await, vec![2]);
    (setup, pieces)
}

/// Runs purges (generation 1, one table, expires on the way) until
/// generation 2 is due within `margin`.
async fn purge_until_generation_2_due_within(pool: &PgPool, margin: Duration) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "generation 2 never came due");
        let due: bool = sqlx::query_scalar(
            "SELECT coalesce(bool_or(sealed_at <= now() - $1::bigint * interval '1 millisecond'), false)
               FROM idem_generations WHERE gen = 2",
        )
        .bind((RETENTION - margin).as_millis() as i64)
        .fetch_one(pool)
        .await
        .unwrap();
        if due {
            return;
        }
        let report = expiry::purge(pool).await.unwrap();
        assert!(!report.expired.contains(&2), "{report:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The purges after an interruption dropped generation 2's remaining
/// pieces and forgot it, and kept expiring on time.
async fn assert_generation_2_recovered(setup: &Setup, recovery: &Recovery) {
    let pool = &setup.pool;
    assert_eq!(
        (recovery.failures, &recovery.last_error),
        (0, &None),
        "every purge after the interruption succeeds"
    );
    assert_eq!(recovery.overdue, 0, "no generation stays past its expiry");
    assert!(
        recovery.expired.len() >= 3 && recovery.expired.contains(&2),
        "generation 2 and later ones expire: {:?}",
        recovery.expired
    );
    assert_eq!(partition(pool, "idem_claims_g2").await, (false, false));
    let left_over: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relname LIKE 'idem\\_claims\\_g2\\_%'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(left_over, 0, "no piece of generation 2 is left");
    assert!(
        !generation_known(pool, 2).await,
        "generation 2 is forgotten"
    );
    assert!(
        !claim_once(pool, setup.kept, &key(KEPT_KEY_2)).await,
        "the claim of the handler without retention is kept"
    );
    assert!(
        claim_once(pool, setup.expiring, &key(EXPIRING_KEY_2)).await,
        "the expired claim is gone: claimed again"
    );
}

/// Cut short between two pieces of an expiring generation: generation 2,
/// made of pieces, is detached, and its pieces are dropped one at a time;
/// the purge's session ends after the first. The next runs drop the rest
/// and forget it.
#[tokio::test]
async fn a_purge_ended_between_the_pieces_of_a_generation_is_finished_by_the_next() {
    let (setup, pieces) = setup_with_pieces().await;
    let pool = &setup.pool;
    purge_until_generation_2_due_within(pool, Duration::from_millis(300)).await;
    let error = loop {
        match expiry::purge_ending_session_at(pool, Step::PieceDropped).await {
            Err(error) => break error.to_string(),
            // Not quite due yet: nothing reached the step.
            Ok(report) => assert!(!report.expired.contains(&2), "{report:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_session_ended(&error);
    assert_eq!(
        partition(pool, "idem_claims_g2").await,
        (true, false),
        "detached, not dropped"
    );
    let left = pieces_of(pool, 2).await;
    assert_eq!(
        left.len(),
        pieces.len() - 1,
        "one piece dropped, the others left: {left:?} of {pieces:?}"
    );
    assert!(generation_known(pool, 2).await);
    assert!(
        !generation_known(pool, 1).await,
        "generation 1 expired before"
    );
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_generation_2_recovered(&setup, &recovery).await;
}

/// Cut short inside the `DROP` of a piece: the purge's backend is
/// terminated while its `DROP` of generation 2's last piece waits for a
/// session that reads that piece, after the pieces before it went. The
/// piece is left, with the generation detached, and the next runs finish.
/// (Generation 2 is detached by a purge ended there first.)
#[tokio::test]
async fn a_purge_ended_inside_the_drop_of_a_piece_is_finished_by_the_next() {
    let (setup, pieces) = setup_with_pieces().await;
    let pool = &setup.pool;
    purge_until_generation_2_due_within(pool, Duration::from_millis(300)).await;
    // Ended once generation 2 is detached, before any piece goes: a reader
    // of its last piece (which no claim can see now) then holds up that
    // piece's DROP, and nothing before it (the pieces go in name order).
    let error = loop {
        match expiry::purge_ending_session_at(pool, Step::Detached).await {
            Err(error) => break error.to_string(),
            Ok(report) => assert!(!report.expired.contains(&2), "{report:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_session_ended(&error);
    assert_eq!(partition(pool, "idem_claims_g2").await, (true, false));
    assert_eq!(pieces_of(pool, 2).await, pieces);
    let last = pieces.last().unwrap().clone();
    let mut reader = PgConnection::connect(setup.env.database_url())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; SELECT count(*) FROM {last}"
    )))
    .execute(&mut reader)
    .await
    .unwrap();
    let purging = tokio::spawn({
        let pool = pool.clone();
        async move { expiry::purge(&pool).await }
    });
    let dropping = statement_waiting(pool, &format!("DROP TABLE {last}")).await;
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
        .bind(dropping)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(ended);
    let error = purging.await.unwrap().expect_err("the purge was cut short");
    assert_session_ended(&error.to_string());
    assert_eq!(
        partition(pool, "idem_claims_g2").await,
        (true, false),
        "detached, not dropped"
    );
    assert_eq!(
        pieces_of(pool, 2).await,
        vec![last],
        "the pieces before the last went; the last is left"
    );
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    let recovery = run_purges_after(&setup, Duration::from_secs(7)).await;
    assert_generation_2_recovered(&setup, &recovery).await;
}

/// The backend of a purge whose `statement` waits for a lock.
async fn statement_waiting(pool: &PgPool, statement: &str) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    // (The purge gets there when a loaded machine lets it; once there, it
    // waits up to its 5 s lock timeout.)
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE query = $1 AND wait_event_type = 'Lock'",
        )
        .bind(statement)
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "no purge's `{statement}` waits for a lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs purges until one rotates, and ends its session at `step`.
async fn interrupt_rotation(pool: &PgPool, step: Step) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "no rotation came due");
        if let Err(error) = expiry::purge_ending_session_at(pool, step).await {
            return error.to_string();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A router shut down while its purge detaches a generation (the detach
/// waits for a reader of the claims table): the purge is not cut short but
/// finishes the expiry within the grace period, once the reader ends, so
/// that no half-done step is left to the next run.
#[tokio::test]
async fn a_router_shut_down_during_its_purge_lets_the_expiry_finish() {
    const ROUTE_RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("SHUTPURGE", Duration::from_millis(100)).await;
    // Generation 1, sealed an hour ago, is due: the router's first purge
    // expires it.
    register(&pool, "flowing", ROUTE_RETENTION).await;
    rotate_and_seal(&pool).await;
    sqlx::query("UPDATE idem_generations SET sealed_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    let mut reader = PgConnection::connect(env.database_url()).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM idem_claims")
        .execute(&mut reader)
        .await
        .unwrap();

    let route = short_retention_route(&stream, Duration::ZERO, ROUTE_RETENTION);
    let router = Router::new()
        .route(route, flowing)
        .shutdown_grace(Duration::from_secs(5));
    let (handle, task) = spawn(router, nats, pool.clone());
    detach_waiting(&pool).await;
    handle.shutdown();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the router shuts down")
        .unwrap()
        .unwrap();
    let pending: Option<bool> = sqlx::query_scalar(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass('idem_claims_g1')",
    )
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert_eq!(
        (partition(&pool, "idem_claims_g1").await, pending),
        ((false, false), None),
        "the expiry the router's purge was in finished: dropped"
    );
    assert!(!generation_known(&pool, 1).await, "and forgotten");
    // And nothing is left for the next purge to trip over.
    let report = expiry::purge(&pool).await.unwrap();
    assert!(report.expired.is_empty(), "{report:?}");
}

/// A purge that keeps failing says so every time. A forgotten session that
/// read the claims table (`BEGIN; SELECT count(*) FROM idem_processed;`
/// in a psql) holds the detach of a due generation past the purge's lock
/// timeout, run after run. Each of the router's purge runs fails, is logged
/// at `warn` naming that session, is counted (`idem_purge_failures_total`)
/// and recorded: `status::expiry` is behind, with the error, and the
/// rotation goes on meanwhile. Once the session ends, the next run expires
/// the generation and the status is on time again.
#[tokio::test]
async fn a_purge_that_keeps_failing_is_warned_counted_and_shown() {
    const ROUTE_RETENTION: Duration = Duration::from_secs(10);
    let Scenario {
        env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("FAILING", Duration::from_millis(100)).await;
    register(&pool, "flowing", ROUTE_RETENTION).await;
    rotate_and_seal(&pool).await;
    sqlx::query("UPDATE idem_generations SET sealed_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    let mut forgotten = PgConnection::connect(env.database_url()).await.unwrap();
    sqlx::raw_sql(
        "SET application_name = 'forgotten-psql'; BEGIN; SELECT count(*) FROM idem_processed",
    )
    .execute(&mut forgotten)
    .await
    .unwrap();

    let metrics = MetricsCapture::start();
    let logs = LogCapture::start();
    let route = short_retention_route(&stream, Duration::ZERO, ROUTE_RETENTION);
    let (handle, task) = spawn(Router::new().route(route, flowing), nats, pool.clone());
    eventually("two purge runs failed", Duration::from_secs(40), || async {
        metrics.value("idem_purge_failures_total").unwrap_or(0.0) >= 2.0
    })
    .await;

    let status = idem_runtime::status::expiry(&pool).await.unwrap();
    println!("{status:?}");
    assert!(status.behind(), "{status:?}");
    // Generation 1, and any sealed since that came due behind it.
    assert!(status.due >= 1, "{status:?}");
    assert!(status.overdue > Duration::from_secs(3000), "{status:?}");
    assert!(status.failures >= 2, "{status:?}");
    let error = status.last_error.clone().unwrap_or_default();
    for part in [
        "generation 1",
        "lock timeout",
        "forgotten-psql",
        "idle in transaction",
    ] {
        assert!(
            error.contains(part),
            "the recorded error names {part}: {error}"
        );
    }
    let warned = logs.lines_with(&["WARN", "claims purge failed", "forgotten-psql"]);
    assert!(
        warned.len() >= 2,
        "a warning at each failed run: {warned:#?}"
    );
    assert!(metrics.value("idem_expiry_due_generations").unwrap_or(0.0) >= 1.0);
    assert!(metrics.value("idem_expiry_overdue_seconds").unwrap_or(0.0) > 3000.0);
    let (current, _) = state(&pool).await;
    assert!(current >= 3, "the rotation goes on: generation {current}");

    sqlx::raw_sql("COMMIT")
        .execute(&mut forgotten)
        .await
        .unwrap();
    eventually(
        "the next run expires the generation",
        Duration::from_secs(20),
        || async {
            let status = idem_runtime::status::expiry(&pool).await.unwrap();
            status.due == 0 && status.failures == 0 && !status.behind()
        },
    )
    .await;
    assert!(!generation_known(&pool, 1).await);
    stop(handle, task).await;
}

/// A purge that stopped altogether (no router with a retention runs, a
/// cron job was removed) seals nothing, so nothing ever comes due: expiry
/// must show as behind all the same, because the current generation is past
/// its rotation. And a session that holds the purge's lock while expiry is
/// behind (a purge whose process froze) is named in a warning by the
/// routers whose purge runs it makes skip; once it is gone, they catch up.
#[tokio::test]
async fn a_stopped_purge_shows_as_behind_and_a_held_purge_lock_is_named() {
    const ROUTE_RETENTION: Duration = Duration::from_secs(10);
    /// The key of the purge's session advisory lock ("idem_exp").
    const PURGE_LOCK: i64 = 0x6964_656d_5f65_7870;
    let Scenario {
        env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("STOPPED", Duration::from_millis(100)).await;
    register(&pool, "flowing", ROUTE_RETENTION).await;
    let status = idem_runtime::status::expiry(&pool).await.unwrap();
    assert!(
        !status.behind(),
        "a fresh generation is on time: {status:?}"
    );
    // No purge has run for an hour: generation 1 should have rotated long ago.
    sqlx::query("UPDATE idem_generations SET opened_at = now() - interval '1 hour' WHERE gen = 1")
        .execute(&pool)
        .await
        .unwrap();
    let status = idem_runtime::status::expiry(&pool).await.unwrap();
    assert_eq!(status.due, 0, "nothing sealed, so nothing due: {status:?}");
    assert!(status.behind(), "{status:?}");
    assert!(
        status.rotation_overdue() > Duration::from_secs(3000),
        "{status:?}"
    );

    let mut stuck = PgConnection::connect(env.database_url()).await.unwrap();
    sqlx::raw_sql("SET application_name = 'stuck-purge'")
        .execute(&mut stuck)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(PURGE_LOCK)
        .execute(&mut stuck)
        .await
        .unwrap();
    let metrics = MetricsCapture::start();
    let logs = LogCapture::start();
    let route = short_retention_route(&stream, Duration::ZERO, ROUTE_RETENTION);
    let (handle, task) = spawn(Router::new().route(route, flowing), nats, pool.clone());
    eventually(
        "a warning naming the lock's holder",
        Duration::from_secs(30),
        || async {
            !logs
                .lines_with(&["WARN", "holds the purge's lock", "stuck-purge"])
                .is_empty()
        },
    )
    .await;
    assert_eq!(
        state(&pool).await,
        (1, false),
        "the held lock kept the purge from rotating"
    );
    // The router sets its gauges after the run that warned, with a query
    // of their own: seen the warning, the gauge may still be a moment away.
    eventually(
        "the rotation-overdue gauge above the hour the purge missed",
        Duration::from_secs(30),
        || async {
            metrics
                .value("idem_expiry_rotation_overdue_seconds")
                .unwrap_or(0.0)
                > 3000.0
        },
    )
    .await;
    assert_eq!(
        state(&pool).await,
        (1, false),
        "still held: the purge has not rotated"
    );

    stuck.close().await.unwrap();
    eventually(
        "the router's purge catches up",
        Duration::from_secs(20),
        || async {
            let status = idem_runtime::status::expiry(&pool).await.unwrap();
            !status.behind() && status.current_generation > 1
        },
    )
    .await;
    stop(handle, task).await;
}
