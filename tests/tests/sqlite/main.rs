//! Handlers on SQLite (feature `sqlite`): the exactly-once promise on a
//! database file, against a real nats-server. The first tests of the
//! compliance suite issue 22 asks for; PostgreSQL's versions of each are
//! named at each test.
//!
//! Every test opens its own database file in a temporary directory, in WAL
//! mode with `synchronous = FULL`, as the guide asks.

use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::retention::Unbounded;
use idem_runtime::{
    BoxError, Delivery, Route, Router, RouterHandle, State, Stats, Transient, idempotent,
};
use idem_tests::scenario::{
    Deposit, dead_letters, deposit, eventually, fast, publish, stop, wait_all_acked,
};
use idem_tests::{NatsServer, init_tracing, unique_name};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};
use tokio::task::JoinHandle;

type Tx<'c> = sqlx::Transaction<'c, Sqlite>;

/// A nats-server, a stream on `<stream>.deposit`, and a migrated SQLite
/// file with the business table `effects` (no unique key, so that a
/// double-apply would show).
struct Bed {
    _dir: tempfile::TempDir,
    /// The database file.
    path: std::path::PathBuf,
    _nats: NatsServer,
    nats: async_nats::Client,
    js: async_nats::jetstream::Context,
    pool: SqlitePool,
    /// Another pool on the same file: a second worker.
    second_pool: SqlitePool,
    stream: String,
    subject: String,
}

async fn pool(path: &std::path::Path) -> SqlitePool {
    pool_waiting(path, Duration::from_secs(60)).await
}

/// A pool on `path` whose writers wait `busy_timeout` for the write lock.
async fn pool_waiting(path: &std::path::Path, busy_timeout: Duration) -> SqlitePool {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("a SQLite url")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(busy_timeout);
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("the SQLite file opens")
}

impl Bed {
    async fn start(prefix: &str) -> Bed {
        init_tracing();
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("idem.db");
        let pool = pool(&path).await;
        idem_runtime::schema::migrate(&pool)
            .await
            .expect("migrations run");
        sqlx::raw_sql(
            "CREATE TABLE effects (handler TEXT NOT NULL, msg_id TEXT NOT NULL,
                                   account TEXT NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("the business table is made");
        let second_pool = self::pool(&path).await;
        let nats_server = NatsServer::start().await;
        let nats = nats_server.client().await;
        let js = async_nats::jetstream::new(nats.clone());
        let stream = unique_name(prefix);
        let subject = format!("{stream}.deposit");
        idem_tests::scenario::create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        Bed {
            _dir: dir,
            path,
            _nats: nats_server,
            nats,
            js,
            pool,
            second_pool,
            stream,
            subject,
        }
    }

    async fn publish(&self, ids: impl IntoIterator<Item = String>) -> usize {
        let mut published = 0;
        for id in ids {
            publish(&self.js, &self.subject, &deposit(&id, 1), Some(&id)).await;
            published += 1;
        }
        published
    }

    /// (effects, distinct messages) that `handler` applied.
    async fn ledger(&self, handler: &str) -> (i64, i64) {
        sqlx::query_as("SELECT count(*), count(DISTINCT msg_id) FROM effects WHERE handler = ?")
            .bind(handler)
            .fetch_one(&self.pool)
            .await
            .expect("the ledger reads")
    }
}

fn spawn<S: Send + Sync + 'static>(
    router: Router<S, Sqlite>,
    nats: &async_nats::Client,
    pool: &SqlitePool,
) -> (RouterHandle, JoinHandle<Result<(), idem_runtime::Error>>) {
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats.clone(), pool.clone(), std::future::pending()));
    (handle, task)
}

async fn record(
    tx: &mut Tx<'_>,
    handler: &str,
    delivery: &Delivery,
    d: &Deposit,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (handler, msg_id, account, amount) VALUES (?, ?, ?, ?)")
        .bind(handler)
        .bind(delivery.message_id().as_str())
        .bind(&d.account)
        .bind(d.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(name = "credit")]
async fn credit(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), sqlx::Error> {
    record(tx, "credit", delivery, &d).await
}

// ---------------------------------------------------------------------------
// Crash between COMMIT and ack (PostgreSQL: commit_ack/acks.rs and the
// chaos suite).

/// Every message commits and is then dropped unacked (the fault hook acts
/// after COMMIT, as a process that dies there); a second worker gets the
/// redeliveries, finds each claim and acks them as duplicates. Effects =
/// inputs, no duplicates; per message and in batches.
async fn committed_but_never_acked_is_applied_once(batch: Option<usize>) {
    const MESSAGES: usize = 20;
    let bed = Bed::start("SQLITECRASH").await;
    let route = || {
        let route = fast(Route::new(&bed.stream, "c")).ack_wait(Duration::from_secs(2));
        match batch {
            Some(size) => route.batch(size),
            None => route.per_message(),
        }
    };
    let published = bed.publish((0..MESSAGES).map(|i| format!("m-{i}"))).await;
    let first = Router::sqlite()
        .route(route(), credit)
        .fault_hooks(FaultHooks::default().after_commit(|_| AfterCommit::DropWithoutAck));
    let (handle, task) = spawn(first, &bed.nats, &bed.pool);
    let first_stats = handle.stats("c").unwrap();
    eventually(
        "every message committed and was dropped unacked",
        Duration::from_secs(30),
        || async { first_stats.dropped_by_fault() as usize == published },
    )
    .await;
    stop(handle, task).await;
    assert_eq!(
        bed.ledger("credit").await,
        (MESSAGES as i64, MESSAGES as i64),
        "committed once each before the crash"
    );

    let (handle, task) = spawn(
        Router::sqlite().route(route(), credit),
        &bed.nats,
        &bed.second_pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let second = handle.stats("c").unwrap();
    assert_eq!(
        (second.duplicates() as usize, second.processed()),
        (MESSAGES, 0),
        "every redelivery was a duplicate, none ran"
    );
    assert_eq!(
        bed.ledger("credit").await,
        (MESSAGES as i64, MESSAGES as i64),
        "effects = inputs, no duplicates"
    );
}

#[tokio::test]
async fn committed_but_never_acked_is_applied_once_per_message() {
    committed_but_never_acked_is_applied_once(None).await;
}

#[tokio::test]
async fn committed_but_never_acked_is_applied_once_in_batches() {
    committed_but_never_acked_is_applied_once(Some(8)).await;
}

// ---------------------------------------------------------------------------
// A redelivery racing the first attempt (PostgreSQL: claims/redelivery.rs,
// claims/exactly_once.rs).

/// Both workers' counters, for the first attempt to watch.
#[derive(Clone, Default)]
struct Workers(Arc<OnceLock<[Arc<Stats>; 2]>>);

/// What the attempts saw.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

#[derive(Clone, Default, idem_runtime::FromRef)]
struct RaceState {
    workers: Workers,
    seen: Seen,
}

#[idempotent(name = "racer")]
async fn racer(
    tx: &mut Tx<'_>,
    delivery: &Delivery,
    State(workers): State<Workers>,
    State(seen): State<Seen>,
    d: Deposit,
) -> Result<(), BoxError> {
    record(tx, "racer", delivery, &d).await?;
    if delivery.delivered() == 1 {
        // Hold the write lock until the redelivery (ack_wait expired,
        // heartbeats off) has been received, by the other worker (this
        // one's only slot is taken): it then waits on the lock for this
        // transaction to end.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let received = || {
            workers.0.get().map_or(0, |both| {
                both.iter().map(|stats| stats.received()).sum::<u64>()
            })
        };
        while received() < 2 {
            if tokio::time::Instant::now() > deadline {
                return Err("no redelivery reached the other worker within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen.0
            .lock()
            .unwrap()
            .push("the redelivery arrived while the first attempt held its claim".into());
    } else {
        seen.0
            .lock()
            .unwrap()
            .push(format!("delivery {} ran the body", delivery.delivered()));
    }
    Ok(())
}

/// Two workers on one durable, each with one slot. The first attempt
/// claims the message and holds its transaction open until the redelivery
/// reaches the other worker. That attempt cannot take the write lock
/// (`BEGIN IMMEDIATE`) until the first commits, then finds the claim: it
/// is acked as a duplicate, and the body ran once.
#[tokio::test]
async fn a_redelivery_during_the_first_attempt_waits_then_skips() {
    let bed = Bed::start("SQLITERACE").await;
    let route = || {
        fast(Route::new(&bed.stream, "c"))
            .per_message()
            .ack_wait(Duration::from_secs(1))
            .without_heartbeat()
            .allow_redelivery_while_running()
            .concurrency(1)
    };
    let state = RaceState::default();
    let worker = |pool| {
        spawn(
            Router::sqlite_with_state(state.clone()).route(route(), racer),
            &bed.nats,
            pool,
        )
    };
    let (first, first_task) = worker(&bed.pool);
    let (second, second_task) = worker(&bed.second_pool);
    let both = [first.stats("c").unwrap(), second.stats("c").unwrap()];
    let _ = state.workers.0.set(both.clone());
    // Both have registered (which takes the write lock) and pull, before
    // the first attempt holds the lock.
    eventually("both workers pull", Duration::from_secs(30), || async {
        let Ok(stream) = bed.js.get_stream_no_info(&bed.stream).await else {
            return false;
        };
        // The first worker to start makes the consumer.
        stream
            .consumer_info("c")
            .await
            .is_ok_and(|info| info.num_waiting >= 2)
    })
    .await;
    bed.publish(["race-1".to_owned()]).await;
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(first, first_task).await;
    stop(second, second_task).await;

    let seen = state.seen.0.lock().unwrap().clone();
    assert_eq!(
        seen,
        ["the redelivery arrived while the first attempt held its claim"],
        "the first attempt ran while its redelivery arrived, and no later attempt ran the body"
    );
    let processed: u64 = both.iter().map(|stats| stats.processed()).sum();
    let duplicates: u64 = both.iter().map(|stats| stats.duplicates()).sum();
    assert_eq!(
        (processed, duplicates),
        (1, 1),
        "the first attempt committed; the redelivery was a duplicate"
    );
    assert_eq!(bed.ledger("racer").await, (1, 1), "applied once");
}

// ---------------------------------------------------------------------------
// Failures roll back (PostgreSQL: errors/, commit_ack/commit_check.rs).

#[idempotent(name = "fails-first")]
async fn fails_first(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "fails-first", delivery, &d).await?;
    if delivery.delivered() == 1 {
        return Err(Transient::new("the first attempt fails after its write").into());
    }
    Ok(())
}

/// A handler that fails after writing: its write and its claim roll back
/// together, and the retry applies the message once.
#[tokio::test]
async fn a_failed_attempt_rolls_back_and_its_retry_applies_once() {
    const MESSAGES: usize = 5;
    let bed = Bed::start("SQLITEFAIL").await;
    bed.publish((0..MESSAGES).map(|i| format!("f-{i}"))).await;
    let (handle, task) = spawn(
        Router::sqlite().route(
            fast(Route::new(&bed.stream, "c")).per_message(),
            fails_first,
        ),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.failed() as usize, stats.processed() as usize),
        (MESSAGES, MESSAGES),
        "each failed once, then applied"
    );
    assert_eq!(
        bed.ledger("fails-first").await,
        (MESSAGES as i64, MESSAGES as i64),
        "effects = inputs, no duplicates"
    );
}

/// Commits its first chunk itself (a raw `COMMIT; BEGIN`), then fails on its
/// first delivery.
#[idempotent(name = "chunked")]
async fn chunked(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "chunked-1", delivery, &d).await?;
    sqlx::raw_sql("COMMIT; BEGIN").execute(&mut **tx).await?;
    if delivery.delivered() == 1 {
        return Err(Transient::new("the second chunk failed").into());
    }
    record(tx, "chunked-2", delivery, &d).await?;
    Ok(())
}

/// A handler that ends the transaction itself has committed its claim with
/// half its work. The claim's savepoint is gone with it, so the runtime
/// knows (`ClaimLost`): the message is dead-lettered, never acked half done
/// as a duplicate. And an attempt that succeeds after a raw COMMIT is not
/// acked as done either (its RELEASE fails).
#[tokio::test]
async fn a_handler_that_commits_by_itself_is_not_acked_half_done() {
    let bed = Bed::start("SQLITECHUNK").await;
    bed.publish(["chunk-1".to_owned()]).await;
    let (handle, task) = spawn(
        Router::sqlite().route(fast(Route::new(&bed.stream, "c")).per_message(), chunked),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    let letters = dead_letters(&bed.js, &bed.stream).await;
    assert_eq!(
        (
            stats.duplicates(),
            letters.len(),
            bed.ledger("chunked-1").await,
            bed.ledger("chunked-2").await
        ),
        (0, 1, (1, 1), (0, 0)),
        "dead-lettered after its first chunk committed, never acked as a duplicate"
    );
}

// ---------------------------------------------------------------------------
// Expiry, stored results and what operators read (PostgreSQL: retention/,
// reply/, the status tests).

#[idempotent(name = "kept-an-hour")]
async fn kept_an_hour(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), sqlx::Error> {
    record(tx, "kept-an-hour", delivery, &d).await
}

/// Claims older than their handler's retention are deleted by the purge,
/// younger ones are kept, and the handler's claims count says so. The
/// claims are aged by hand (their `claimed_at` set two hours back): the
/// purge reads nothing else.
#[tokio::test]
async fn the_purge_deletes_claims_past_their_retention_and_keeps_the_rest() {
    const MESSAGES: usize = 10;
    const AGED: i64 = 6;
    let bed = Bed::start("SQLITEPURGE").await;
    bed.publish((0..MESSAGES).map(|i| format!("p-{i}"))).await;
    // A stream without max_age, whose publishers never retry.
    let route = fast(Route::new(&bed.stream, "c"))
        .retention(Duration::from_secs(3600))
        .publisher_retry_horizon(Duration::ZERO)
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
    let (handle, task) = spawn(
        Router::sqlite().route(route, kept_an_hour),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;

    let claims = |pool: SqlitePool| async move {
        let handlers = idem_runtime::status::handlers(&pool)
            .await
            .expect("status reads");
        let handler = handlers
            .iter()
            .find(|handler| handler.name == "kept-an-hour")
            .expect("the handler is registered");
        assert_eq!(
            handler.retention,
            Some(Duration::from_secs(3600)),
            "its retention is registered"
        );
        handler.claims
    };
    assert_eq!(
        claims(bed.pool.clone()).await,
        MESSAGES as u64,
        "one claim a message"
    );
    let aged = sqlx::query(
        "UPDATE idem_claims SET claimed_at = claimed_at - 7200
          WHERE key IN (SELECT key FROM idem_claims ORDER BY key LIMIT ?)",
    )
    .bind(AGED)
    .execute(&bed.pool)
    .await
    .expect("claims are aged")
    .rows_affected();
    assert_eq!(aged, AGED as u64, "the ageing took");

    let report = idem_runtime::retention::expiry::purge(&bed.pool)
        .await
        .expect("the purge runs");
    assert_eq!(
        (report.deleted, report.retention),
        (AGED as u64, Some(Duration::from_secs(3600))),
        "the aged claims were deleted: {report:?}"
    );
    assert_eq!(
        claims(bed.pool.clone()).await,
        MESSAGES as u64 - AGED as u64,
        "the young claims are kept"
    );
    let again = idem_runtime::retention::expiry::purge(&bed.pool)
        .await
        .expect("the purge runs");
    assert_eq!(again.deleted, 0, "nothing more to delete");
    assert_eq!(
        bed.ledger("kept-an-hour").await,
        (MESSAGES as i64, MESSAGES as i64),
        "effects untouched"
    );
}

#[idempotent(name = "priced")]
async fn priced(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<i64, sqlx::Error> {
    record(tx, "priced", delivery, &d).await?;
    Ok(d.amount * 100)
}

/// A handler's value is stored with its claim, in the same transaction,
/// and read back by message id; a message never processed has none.
#[tokio::test]
async fn a_handlers_value_is_stored_with_its_claim() {
    let bed = Bed::start("SQLITERESULT").await;
    publish(&bed.js, &bed.subject, &deposit("a", 7), Some("r-1")).await;
    let (handle, task) = spawn(
        Router::sqlite().route(fast(Route::new(&bed.stream, "c")), priced),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;
    let stored = idem_runtime::results::stored(&bed.pool, "priced", "r-1")
        .await
        .expect("the result reads");
    assert_eq!(stored.as_deref(), Some(&b"700"[..]), "the value, as JSON");
    let none = idem_runtime::results::stored(&bed.pool, "priced", "never-sent")
        .await
        .expect("the result reads");
    assert_eq!(none, None, "no claim, no value");
}

// ---------------------------------------------------------------------------
// What a handler or SQLite itself does to the transaction.

/// Undoes everything back to idem's savepoint, then writes and succeeds on
/// its first delivery, whose ack the fault hook then drops.
#[idempotent(name = "rolls-back-to")]
async fn rolls_back_to(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    sqlx::raw_sql("ROLLBACK TO idem_claim")
        .execute(&mut **tx)
        .await?;
    record(tx, "rolls-back-to", delivery, &d).await?;
    Ok(())
}

/// A handler that rolls back to idem's own savepoint cannot undo its claim
/// (the savepoint is opened after the claim): the redelivery of the
/// committed but unacked message finds it and is acked as a duplicate.
#[tokio::test]
async fn a_rollback_to_idems_savepoint_keeps_the_claim() {
    let bed = Bed::start("SQLITEROLLBACKTO").await;
    bed.publish(["t-1".to_owned()]).await;
    let route = || {
        fast(Route::new(&bed.stream, "c"))
            .per_message()
            .ack_wait(Duration::from_secs(1))
    };
    let faulted = Router::sqlite().route(route(), rolls_back_to).fault_hooks(
        FaultHooks::default().after_commit(|delivery| {
            if delivery.delivered() == 1 {
                AfterCommit::DropWithoutAck
            } else {
                AfterCommit::Ack
            }
        }),
    );
    let (handle, task) = spawn(faulted, &bed.nats, &bed.pool);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.dropped_by_fault(), stats.duplicates()),
        (1, 1),
        "the first delivery committed and was dropped; the redelivery found its claim"
    );
    assert_eq!(bed.ledger("rolls-back-to").await, (1, 1), "applied once");
}

/// Writes into `guarded`, whose trigger makes SQLite roll back the whole
/// transaction (`RAISE(ROLLBACK)`) on the first delivery.
#[idempotent(name = "guarded")]
async fn guarded(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "guarded", delivery, &d).await?;
    sqlx::query("INSERT INTO guarded (delivered) VALUES (?)")
        .bind(delivery.delivered() as i64)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// SQLite rolls back a whole transaction by itself on a trigger's
/// `RAISE(ROLLBACK)` (also on an `ON CONFLICT ROLLBACK` column or a full
/// disk), taking idem's savepoint with it. Nothing committed, so it is an
/// ordinary failure: retried and applied once, not dead-lettered as a claim
/// lost.
#[tokio::test]
async fn a_transaction_sqlite_rolls_back_by_itself_is_retried_not_dead_lettered() {
    let bed = Bed::start("SQLITERAISE").await;
    sqlx::raw_sql(
        "CREATE TABLE guarded (delivered INTEGER NOT NULL);
         CREATE TRIGGER first_delivery_refused BEFORE INSERT ON guarded
         WHEN NEW.delivered = 1 BEGIN SELECT RAISE(ROLLBACK, 'refused on the first delivery'); END;",
    )
    .execute(&bed.pool)
    .await
    .expect("the guarded table is made");
    bed.publish(["g-1".to_owned()]).await;
    let (handle, task) = spawn(
        Router::sqlite().route(fast(Route::new(&bed.stream, "c")).per_message(), guarded),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (
            stats.failed(),
            stats.processed(),
            dead_letters(&bed.js, &bed.stream).await.len()
        ),
        (1, 1, 0),
        "failed once (the trigger's rollback), then applied; nothing dead-lettered"
    );
    assert_eq!(bed.ledger("guarded").await, (1, 1), "applied once");
}

/// Runs a statement that never ends on its first delivery.
#[idempotent(name = "runaway")]
async fn runaway(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "runaway", delivery, &d).await?;
    if d.account == "runaway" && delivery.delivered() == 1 {
        sqlx::query_scalar::<_, i64>(
            "WITH RECURSIVE forever(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM forever)
             SELECT max(n) FROM forever",
        )
        .fetch_one(&mut **tx)
        .await?;
    }
    Ok(())
}

/// A statement left running past the handler timeout would hold SQLite's
/// write lock for ever, and stop every message behind it. It is
/// interrupted once its transaction has run as long as one can (three
/// handler timeouts), its transaction rolls back, and the messages behind
/// it go through: each applied once.
#[tokio::test]
async fn a_statement_left_running_past_the_handler_timeout_is_interrupted() {
    let bed = Bed::start("SQLITERUNAWAY").await;
    publish(
        &bed.js,
        &bed.subject,
        &deposit("runaway", 1),
        Some("runaway"),
    )
    .await;
    for i in 0..3 {
        publish(
            &bed.js,
            &bed.subject,
            &deposit("behind", 1),
            Some(&format!("behind-{i}")),
        )
        .await;
    }
    let route = fast(Route::new(&bed.stream, "c"))
        .per_message()
        .handler_timeout(Duration::from_secs(1));
    let (handle, task) = spawn(Router::sqlite().route(route, runaway), &bed.nats, &bed.pool);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(stats.failed() >= 1, "the runaway attempt failed");
    assert_eq!(
        bed.ledger("runaway").await,
        (4, 4),
        "every message applied once, the runaway one too"
    );
}

/// A worker starting while another connection holds SQLite's write lock
/// longer than its `busy_timeout` does not fail: start-up says what holds
/// it back and tries again, and runs once the lock is free.
#[tokio::test]
async fn start_up_waits_out_a_write_lock_held_elsewhere() {
    let logs = idem_tests::capture_logs();
    let bed = Bed::start("SQLITELOCKED").await;
    bed.publish(["l-1".to_owned()]).await;
    let mut holder = bed.second_pool.acquire().await.expect("a connection");
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .expect("the lock is taken");
    let impatient = pool_waiting(&bed.path, Duration::from_millis(300)).await;
    let (handle, task) = spawn(
        Router::sqlite().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &impatient,
    );
    eventually(
        "start-up says what holds it back",
        Duration::from_secs(30),
        || async {
            !logs
                .matching(&["WARN", "SQLite's write lock", "cannot be registered"])
                .is_empty()
        },
    )
    .await;
    assert!(!task.is_finished(), "start-up did not give up");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .expect("the lock is freed");
    drop(holder);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(
        bed.ledger("credit").await,
        (1, 1),
        "applied once, after the lock was freed"
    );
}
