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
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("a SQLite url")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        // Longer than any test holds the write lock.
        .busy_timeout(Duration::from_secs(60));
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
