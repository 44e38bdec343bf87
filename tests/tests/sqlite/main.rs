//! What only SQLite does to a handler's transaction (feature `sqlite`):
//! a handler's `ROLLBACK TO` idem's savepoint, a trigger's
//! `RAISE(ROLLBACK)`, the write lock held elsewhere at start-up, and expiry
//! by deletes. What holds on every database (the crash between COMMIT and
//! ack, the racing redelivery, failures, timeouts, stored results) is the
//! compliance suite's (`tests/tests/compliance/`), which runs on SQLite too.
//!
//! Every test opens its own database file in a temporary directory, in WAL
//! mode with `synchronous = FULL`, as the guide asks.

mod kills;
mod outbox;

use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::retention::Unbounded;
use idem_runtime::{BoxError, Delivery, Route, Router, RouterHandle, idempotent};
use idem_tests::scenario::{
    Deposit, dead_letters, deposit, eventually, fast, publish, stop, wait_all_acked, wait_pulling,
};
use idem_tests::{NatsServer, init_tracing, unique_name};
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
    nats_server: NatsServer,
    nats: async_nats::Client,
    js: async_nats::jetstream::Context,
    pool: SqlitePool,
    /// Another pool on the same file: a second worker.
    second_pool: SqlitePool,
    stream: String,
    subject: String,
}

impl Bed {
    async fn start(prefix: &str) -> Bed {
        init_tracing();
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("idem.db");
        let pool = idem_tests::sqlite::pool(&path).await;
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
        let second_pool = idem_tests::sqlite::pool(&path).await;
        let nats_server = NatsServer::start().await;
        let nats = nats_server.client().await;
        let js = async_nats::jetstream::new(nats.clone());
        let stream = unique_name(prefix);
        let subject = format!("{stream}.deposit");
        idem_tests::scenario::create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        Bed {
            _dir: dir,
            path,
            nats_server,
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
// Expiry and what operators read (PostgreSQL: retention/, the status
// tests).

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
    let impatient = idem_tests::sqlite::pool_waiting(&bed.path, Duration::from_millis(300)).await;
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

/// A message whose BEGIN cannot take SQLite's write lock within the pool's
/// `busy_timeout` (another connection holds it: a transaction left open in
/// a shell) is held for the database, not failed: its attempts use up no
/// delivery (the route allows two, and it is held at least three times),
/// nothing is dead-lettered, and it is applied once the lock is free.
#[tokio::test]
async fn a_message_whose_begin_cannot_take_the_write_lock_is_held_not_failed() {
    let bed = Bed::start("SQLITEBUSY").await;
    let impatient = idem_tests::sqlite::pool_waiting(&bed.path, Duration::from_millis(200)).await;
    let route = fast(Route::new(&bed.stream, "c"))
        .per_message()
        .max_deliver(2);
    let (handle, task) = spawn(Router::sqlite().route(route, credit), &bed.nats, &impatient);
    let stats = handle.stats("c").unwrap();
    wait_pulling(&bed.js, &bed.stream, "c", 1).await;
    let mut holder = bed.second_pool.acquire().await.expect("a connection");
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .expect("the lock is taken");
    bed.publish(["b-1".to_owned()]).await;
    eventually(
        "the message is held three times for the database",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 3 },
    )
    .await;
    assert_eq!(
        (stats.processed(), stats.failed()),
        (0, 0),
        "held, neither applied nor failed, while the lock is taken"
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .expect("the lock is freed");
    drop(holder);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    assert!(
        dead_letters(&bed.js, &bed.stream).await.is_empty(),
        "nothing dead-lettered: the held attempts used up no delivery"
    );
    assert_eq!(
        bed.ledger("credit").await,
        (1, 1),
        "applied once, after the lock was freed"
    );
}

/// What `tracing` wrote while a guard of [`capture_here`] was alive, on this
/// thread only.
#[derive(Clone, Default)]
struct Here(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Here {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Here {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Captures this thread's logs at INFO and above, whatever the process's
/// subscriber, until the guard drops.
fn capture_here() -> (Here, tracing::subscriber::DefaultGuard) {
    let here = Here::default();
    let writer = here.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    (here, tracing::subscriber::set_default(subscriber))
}

/// Workers starting together on one new file all migrate it, and each
/// migration is applied once. sqlx takes no lock on SQLite, so two workers
/// can both find a migration missing and both apply it; the one that loses
/// must find it applied, not fail (it once failed with "table
/// idem_handlers already exists"). The race is nearly always on the first
/// migration; a lost race on the second (its `ALTER TABLE`s fail with
/// "duplicate column name") takes the same path, but is not forced here. Eight workers race on a fresh file,
/// round after round, until a round has lost a race (the log says so: a
/// round without one would prove nothing), at most 20 rounds.
#[tokio::test]
async fn workers_migrating_one_new_file_at_once_all_succeed() {
    let (logs, _guard) = capture_here();
    let mut rounds = 0;
    while !logs
        .text()
        .contains("another worker applied idem's migration ")
    {
        rounds += 1;
        assert!(
            rounds <= 20,
            "no worker lost a race in 20 rounds: nothing was proved"
        );
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("new.db");
        // Made and put in WAL mode once: SQLite refuses that switch at once
        // to a second connection doing the same (the guide says so).
        let first = idem_tests::sqlite::pool(&path).await;
        let mut workers = Vec::new();
        for _ in 0..8 {
            workers.push(idem_tests::sqlite::pool(&path).await);
        }
        let migrated =
            futures_util::future::join_all(workers.iter().map(idem_runtime::schema::migrate)).await;
        for (worker, result) in migrated.into_iter().enumerate() {
            if let Err(error) = result {
                panic!("worker {worker}'s migration failed in round {rounds}: {error}");
            }
        }
        idem_runtime::schema::verify(&first)
            .await
            .expect("the schema is current");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _idem_migrations")
            .fetch_one(&first)
            .await
            .expect("the history reads");
        // The version is the history's key: this checks that each ran once.
        assert_eq!(applied, 3, "the three migrations were recorded once each");
    }
}
