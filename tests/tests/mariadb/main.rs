//! What only MariaDB does to a handler's transaction (feature `mariadb`):
//! InnoDB rolling a deadlocked transaction back by itself, the session
//! settings a route's transactions run under, a registration blocked by a
//! transaction left open, durability settings, expiry by deletes, and an
//! ambiguous COMMIT (through a proxy that cuts the connection). What
//! holds on every database (the crash between COMMIT and ack, the racing
//! redelivery, failures, timeouts, stored results) is the compliance
//! suite's (`tests/tests/compliance/`), which runs on MariaDB too.
//!
//! Every test runs a MariaDB server of its own (idem-test's
//! `harness::Mariadb`) and a nats-server.

mod kills;
mod outbox;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::retention::Unbounded;
use idem_runtime::{BoxError, Delivery, Route, Router, RouterHandle, idempotent};
use idem_test::harness::Mariadb;
use idem_tests::fault_proxy::{Cut, Direction, FaultProxy};
use idem_tests::scenario::{
    Deposit, dead_letters, deposit, eventually, fast, publish, stop, wait_all_acked,
};
use idem_tests::{NatsServer, init_tracing, unique_name};
use sqlx::{MySql, MySqlPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

type Tx<'c> = sqlx::Transaction<'c, MySql>;

/// A MariaDB server and a nats-server, a stream on `<stream>.deposit`, and
/// the migrated database with the business table `effects` (no unique key,
/// so that a double-apply would show).
struct Bed {
    mariadb: Mariadb,
    _nats: NatsServer,
    nats: async_nats::Client,
    js: async_nats::jetstream::Context,
    pool: MySqlPool,
    stream: String,
    subject: String,
}

impl Bed {
    async fn start(prefix: &str) -> Bed {
        init_tracing();
        let (mariadb, nats_server) = tokio::join!(Mariadb::start(), NatsServer::start());
        let pool = mariadb.pool().await;
        idem_runtime::schema::migrate(&pool)
            .await
            .expect("migrations run");
        sqlx::raw_sql(
            "CREATE TABLE effects (handler TEXT NOT NULL, msg_id TEXT NOT NULL,
                                   account TEXT NOT NULL, amount BIGINT NOT NULL,
                                   delivered BIGINT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("the business table is made");
        let nats = nats_server.client().await;
        let js = async_nats::jetstream::new(nats.clone());
        let stream = unique_name(prefix);
        let subject = format!("{stream}.deposit");
        idem_tests::scenario::create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        Bed {
            mariadb,
            _nats: nats_server,
            nats,
            js,
            pool,
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
    router: Router<S, MySql>,
    nats: &async_nats::Client,
    pool: &MySqlPool,
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
    sqlx::query(
        "INSERT INTO effects (handler, msg_id, account, amount, delivered) VALUES (?, ?, ?, ?, ?)",
    )
    .bind(handler)
    .bind(delivery.message_id().as_str())
    .bind(&d.account)
    .bind(d.amount)
    .bind(delivery.delivered() as i64)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[idempotent(name = "credit")]
async fn credit(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), sqlx::Error> {
    record(tx, "credit", delivery, &d).await
}

// ---------------------------------------------------------------------------
// A transaction InnoDB rolls back by itself.

/// Set once the handler's statement was chosen as a deadlock's victim.
static VICTIM: AtomicBool = AtomicBool::new(false);
/// Set by the first attempt, which meets the deadlock; later ones (retries
/// in process keep `delivered() == 1`) only record.
static DEADLOCKED_ONCE: AtomicBool = AtomicBool::new(false);
/// The handler holds row 1 of `hot`.
static HOLDS_ROW_1: Notify = Notify::const_new();
/// The test's transaction holds row 2 and waits for row 1.
static WAITS_FOR_ROW_1: Notify = Notify::const_new();

/// On its first attempt: takes row 1 of `hot`, then row 2, which the
/// test's transaction holds while it waits for row 1: a deadlock, whose
/// error the handler swallows before it records its effect and succeeds.
#[idempotent(name = "swallows-a-deadlock")]
async fn swallows_a_deadlock(
    tx: &mut Tx<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), BoxError> {
    if !DEADLOCKED_ONCE.swap(true, Ordering::SeqCst) {
        sqlx::query("UPDATE hot SET v = v + 1 WHERE id = 1")
            .execute(&mut **tx)
            .await?;
        HOLDS_ROW_1.notify_one();
        WAITS_FOR_ROW_1.notified().await;
        if let Err(sqlx::Error::Database(error)) =
            sqlx::query("UPDATE hot SET v = v + 1 WHERE id = 2")
                .execute(&mut **tx)
                .await
        {
            // ER_LOCK_DEADLOCK: InnoDB rolled the whole transaction back.
            VICTIM.store(error.code().as_deref() == Some("40001"), Ordering::SeqCst);
        }
    }
    record(tx, "swallows-a-deadlock", delivery, &d).await?;
    Ok(())
}

/// InnoDB rolls a deadlock's victim back whole, claim included. A handler
/// that swallows the error and writes on must not commit those writes
/// unclaimed (under `autocommit = 1` each would commit by itself): its
/// later write is rolled back with the rest, the message is not acked as
/// applied, and since nothing of the attempt committed it is retried (as
/// PostgreSQL's aborted transaction is), not dead-lettered as a claim lost,
/// and applied once.
#[tokio::test]
async fn a_handler_that_swallows_a_deadlock_commits_none_of_its_later_writes() {
    let bed = Bed::start("MARIADEADLOCK").await;
    // The test's own reads, on a pool the router does not use.
    let observer = bed.mariadb.pool().await;
    sqlx::raw_sql(
        "CREATE TABLE hot (id INT PRIMARY KEY, v BIGINT NOT NULL) ENGINE = InnoDB;
         INSERT INTO hot VALUES (1, 0), (2, 0);
         CREATE TABLE ballast (n INT NOT NULL) ENGINE = InnoDB;",
    )
    .execute(&bed.pool)
    .await
    .expect("the tables are made");
    let (handle, task) = spawn(
        Router::mariadb().route(
            fast(Route::new(&bed.stream, "c")).per_message(),
            swallows_a_deadlock,
        ),
        &bed.nats,
        &bed.pool,
    );
    bed.publish(["d-1".to_owned()]).await;

    // The other side: a transaction made heavier than the handler's (a
    // thousand rows), so that InnoDB picks the handler's as the victim.
    // Its pool lives as long as the connection: a dropped pool closes.
    let other_pool = bed.mariadb.pool().await;
    let mut other = other_pool.acquire().await.expect("a connection");
    sqlx::raw_sql(
        "START TRANSACTION;
         INSERT INTO ballast SELECT seq FROM seq_1_to_1000;
         UPDATE hot SET v = v + 1 WHERE id = 2;",
    )
    .execute(&mut *other)
    .await
    .expect("row 2 is taken");
    tokio::time::timeout(Duration::from_secs(30), HOLDS_ROW_1.notified())
        .await
        .expect("the handler took row 1");
    let other_id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut *other)
        .await
        .expect("the connection's id reads");
    let waiting = tokio::spawn(async move {
        let taken = sqlx::query("UPDATE hot SET v = v + 1 WHERE id = 1")
            .execute(&mut *other)
            .await;
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *other).await;
        taken
    });
    eventually(
        "the test's transaction waits for row 1",
        Duration::from_secs(30),
        || async {
            // Had its UPDATE ended, the handler's transaction no longer
            // held row 1: say so now rather than wait out the 30 s.
            assert!(
                !waiting.is_finished(),
                "the test's UPDATE of row 1 ended without waiting for the handler's transaction"
            );
            // Its UPDATE of row 1 has run for half a second. Under load
            // InnoDB's `innodb_trx` was seen to report such a wait as
            // RUNNING for 30 s, so the wait is read from the process list;
            // that it was a lock wait is proven below: the handler's
            // statement met the deadlock.
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.processlist
                  WHERE ID = ? AND INFO LIKE 'UPDATE hot%' AND TIME_MS >= 500",
            )
            .bind(other_id)
            .fetch_one(&observer)
            .await
            .expect("the process list reads")
                > 0
        },
    )
    .await;
    WAITS_FOR_ROW_1.notify_one();
    waiting
        .await
        .expect("the other side ran")
        .expect("the other side got row 1: the handler's transaction was the victim");

    let stats = handle.stats("c").unwrap();
    eventually(
        "the message is settled",
        Duration::from_secs(30),
        || async { stats.dead_lettered() + stats.processed() >= 1 },
    )
    .await;
    stop(handle.clone(), task).await;
    assert!(
        VICTIM.load(Ordering::SeqCst),
        "the handler's statement met the deadlock (error 1213)"
    );
    // Nothing of the first attempt committed, so the message was retried
    // (`Aborted`), not dead-lettered as a claim lost, and applied once by a
    // later attempt.
    assert_eq!(
        (
            stats.retried_in_process() >= 1,
            stats.processed(),
            stats.dead_lettered()
        ),
        (true, 1, 0),
        "the first attempt failed as aborted, a retry applied it"
    );
    assert_eq!(
        bed.ledger("swallows-a-deadlock").await,
        (1, 1),
        "applied once: the write after the swallowed deadlock was not committed"
    );
    assert!(dead_letters(&bed.js, &bed.stream).await.is_empty());
}

// ---------------------------------------------------------------------------
// An ambiguous COMMIT.

/// The proxy between the router and the server in
/// [`an_ambiguous_commit_is_resolved_by_the_claim_and_applied_once`].
static PROXY: std::sync::OnceLock<FaultProxy> = std::sync::OnceLock::new();
/// Set by the first attempt, which holds the server's answers back.
static PAUSED_ONCE: AtomicBool = AtomicBool::new(false);
/// The first attempt's handler has paused the server's answers.
static ANSWERS_HELD: Notify = Notify::const_new();

/// Records its effect; on its first attempt, then holds back everything the
/// server sends the router (through the proxy), so that its COMMIT runs on
/// the server and its answer never arrives.
#[idempotent(name = "ambiguous")]
async fn ambiguous(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "ambiguous", delivery, &d).await?;
    if !PAUSED_ONCE.swap(true, Ordering::SeqCst) {
        PROXY
            .get()
            .expect("the proxy runs")
            .pause(Direction::ToClient);
        ANSWERS_HELD.notify_one();
    }
    Ok(())
}

/// The connection is cut (an RST) after the server ran the message's
/// COMMIT and before its answer reached the worker: the worker cannot know
/// whether it committed. It must neither ack the message as applied on a
/// guess nor apply it again: the redelivery finds the claim, and the
/// message is applied once.
#[tokio::test]
async fn an_ambiguous_commit_is_resolved_by_the_claim_and_applied_once() {
    init_tracing();
    let (mariadb, nats_server) = tokio::join!(Mariadb::start_on_tcp(), NatsServer::start());
    let direct = mariadb.pool().await;
    idem_runtime::schema::migrate(&direct).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE effects (handler TEXT NOT NULL, msg_id TEXT NOT NULL,
                               account TEXT NOT NULL, amount BIGINT NOT NULL,
                               delivered BIGINT NOT NULL)",
    )
    .execute(&direct)
    .await
    .unwrap();
    let proxy = PROXY.get_or_init(|| FaultProxy::start("mariadb", &mariadb.tcp_url()));
    let through_proxy = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(10)
        .connect(&proxy.url_for(&mariadb.tcp_url()))
        .await
        .expect("MariaDB through the proxy");
    let nats = nats_server.client().await;
    let js = async_nats::jetstream::new(nats.clone());
    let stream = unique_name("MARIAAMBIGUOUS");
    let subject = format!("{stream}.deposit");
    idem_tests::scenario::create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
    let route = fast(Route::new(&stream, "c"))
        .per_message()
        .ack_wait(Duration::from_secs(2));
    let (handle, task) = spawn(
        Router::mariadb().route(route, ambiguous),
        &nats,
        &through_proxy,
    );
    publish(&js, &subject, &deposit("a-1", 1), Some("a-1")).await;

    tokio::time::timeout(Duration::from_secs(30), ANSWERS_HELD.notified())
        .await
        .expect("the handler held the server's answers back");
    // The COMMIT ran on the server (read without the proxy), its answer
    // held back.
    eventually(
        "the COMMIT ran on the server",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
                .fetch_one(&direct)
                .await
                .unwrap_or(0)
                == 1
        },
    )
    .await;
    let cut = proxy.cut(Cut::Reset).await;
    let paused = proxy.resume();
    assert!(cut > 0, "a live connection was reset");
    assert!(
        paused.held_to_client > 0,
        "the COMMIT's answer was held back, never delivered: {paused:?}"
    );

    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.commit_failed() >= 1,
        "the worker saw the COMMIT's outcome as unknown: {stats:?}"
    );
    assert_eq!(stats.dead_lettered(), 0, "nothing dead-lettered: {stats:?}");
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT msg_id) FROM effects")
            .fetch_one(&direct)
            .await
            .unwrap();
    assert_eq!((effects, distinct), (1, 1), "applied once");
}

// ---------------------------------------------------------------------------
// The session a route's transactions run under.

#[idempotent(name = "fails-first")]
async fn fails_first(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    record(tx, "fails-first", delivery, &d).await?;
    if delivery.delivered() == 1 {
        return Err("refused on the first delivery".into());
    }
    Ok(())
}

/// The application's own session settings, set on each connection as it
/// opens: none is a server default, so that a connection put back to the
/// defaults would show.
const OWN_SETTINGS: &str = "SET SESSION max_statement_time = 42, innodb_lock_wait_timeout = 7,
    idle_transaction_timeout = 3600";

/// Connections the test's pool opened (its `after_connect` ran).
static OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A route's transactions run under `autocommit = 0` and its bounds
/// (`max_statement_time`, `innodb_lock_wait_timeout`,
/// `idle_transaction_timeout`), session settings that would outlive them:
/// every connection goes back to the application's pool with the settings
/// the application gave it, after commits, rollbacks and duplicates alike.
/// The pool's two connections are the same throughout (none was closed and
/// replaced, which would hide settings left behind).
#[tokio::test]
async fn connections_go_back_to_the_pool_with_the_applications_settings() {
    const MESSAGES: usize = 20;
    let bed = Bed::start("MARIASESSION").await;
    // Two connections, so that every message's transaction uses one of them.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|connection, _| {
            Box::pin(async move {
                OPENED.fetch_add(1, Ordering::SeqCst);
                sqlx::raw_sql(OWN_SETTINGS).execute(connection).await?;
                Ok(())
            })
        })
        .connect_with(bed.mariadb.options())
        .await
        .unwrap();
    let own: (i64, f64, i64, i64) = (1, 42.0, 7, 3600);
    bed.publish((0..MESSAGES).map(|i| format!("s-{i}"))).await;
    let route = fast(Route::new(&bed.stream, "c"))
        .handler_timeout(Duration::from_secs(5))
        .ack_wait(Duration::from_secs(1));
    // Each message's first commit is never acked: its redelivery is a
    // duplicate, whose claim fails and is rolled back.
    let router = Router::mariadb().route(route, fails_first).fault_hooks(
        FaultHooks::default().after_commit(|delivery| {
            if delivery.delivered() <= 2 {
                AfterCommit::DropWithoutAck
            } else {
                AfterCommit::Ack
            }
        }),
    );
    let (handle, task) = spawn(router, &bed.nats, &pool);
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.failed() >= 1 && stats.processed() >= 1 && stats.duplicates() >= 1,
        "rollbacks, commits and duplicates all ran: {stats:?}"
    );
    assert_eq!(
        bed.ledger("fails-first").await,
        (MESSAGES as i64, MESSAGES as i64),
        "each message applied once"
    );
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut connection = pool.acquire().await.expect("a connection");
        let session: (i64, f64, i64, i64) = sqlx::query_as(
            "SELECT CAST(@@session.autocommit AS SIGNED), @@session.max_statement_time,
                    CAST(@@session.innodb_lock_wait_timeout AS SIGNED),
                    CAST(@@session.idle_transaction_timeout AS SIGNED)",
        )
        .fetch_one(&mut *connection)
        .await
        .unwrap();
        assert_eq!(session, own, "the session's settings are the application's");
        held.push(connection);
    }
    assert_eq!(
        OPENED.load(Ordering::SeqCst),
        2,
        "the pool's two connections were kept, never closed and replaced"
    );
}

/// The connection the last [`locks`] call ran on.
static LOCKING_CONNECTION: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Takes a named lock (`GET_LOCK`), which outlives transactions, and on
/// message `t-lock` locks a table (`LOCK TABLES`, which also commits the
/// transaction, claim included).
#[idempotent(name = "locks")]
async fn locks(tx: &mut Tx<'_>, delivery: &Delivery, d: Deposit) -> Result<(), BoxError> {
    sqlx::query("SELECT GET_LOCK('idem-test-named', 0)")
        .execute(&mut **tx)
        .await?;
    let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut **tx)
        .await?;
    LOCKING_CONNECTION.store(id, Ordering::SeqCst);
    if delivery.message_id().as_str().contains("t-lock") {
        sqlx::raw_sql("LOCK TABLES hot WRITE")
            .execute(&mut **tx)
            .await?;
    }
    record(tx, "locks", delivery, &d).await?;
    Ok(())
}

/// Locks a handler takes that outlive its transaction (a named lock, a
/// table lock) do not go back to the pool with its connection: another
/// session can take both at once afterwards. The table lock committed the
/// claim: that message is dead-lettered, never acked as applied.
#[tokio::test]
async fn a_handlers_named_and_table_locks_do_not_outlive_it() {
    let bed = Bed::start("MARIALOCKS").await;
    sqlx::raw_sql(
        "CREATE TABLE hot (id INT PRIMARY KEY, v BIGINT NOT NULL) ENGINE = InnoDB;
         INSERT INTO hot VALUES (1, 0);",
    )
    .execute(&bed.pool)
    .await
    .unwrap();
    // One connection: every message's transaction runs on it, and it stays
    // in the pool afterwards.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(bed.mariadb.options())
        .await
        .unwrap();
    bed.publish(["t-named".to_owned(), "t-lock".to_owned()])
        .await;
    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")).per_message(), locks),
        &bed.nats,
        &pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.processed(), stats.dead_lettered()),
        (1, 1),
        "t-named applied; t-lock, whose LOCK TABLES committed its claim, dead-lettered"
    );
    let kept: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        kept,
        LOCKING_CONNECTION.load(Ordering::SeqCst),
        "the handlers' connection is still the pool's (kept, not closed: closing would free its locks)"
    );
    let mut other = bed.pool.acquire().await.unwrap();
    let named: i64 = sqlx::query_scalar("SELECT GET_LOCK('idem-test-named', 1)")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert_eq!(named, 1, "the named lock is free");
    sqlx::raw_sql("SET STATEMENT lock_wait_timeout = 2 FOR UPDATE hot SET v = v + 1")
        .execute(&mut *other)
        .await
        .expect("the table is not locked");
}

// ---------------------------------------------------------------------------
// Start-up.

/// A registration that waits for a lock a transaction left open holds
/// (past the 10 s it allows) does not fail start-up: start-up says what
/// holds it back, naming the open transaction, and tries again; the router
/// runs once the transaction ends.
#[tokio::test]
async fn start_up_names_a_transaction_left_open_on_the_handlers_table() {
    let logs = idem_tests::capture_logs();
    let bed = Bed::start("MARIALOCKED").await;
    // Registered once, so that the row exists to be locked.
    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &bed.pool,
    );
    stop(handle, task).await;
    // Its pool lives as long as the connection: a dropped pool closes.
    let holder_pool = bed.mariadb.pool().await;
    let mut holder = holder_pool.acquire().await.unwrap();
    sqlx::raw_sql("START TRANSACTION; UPDATE idem_handlers SET retention_ms = NULL")
        .execute(&mut *holder)
        .await
        .expect("the rows are locked");
    bed.publish(["l-1".to_owned()]).await;
    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &bed.pool,
    );
    eventually(
        "start-up names the transaction that holds it back",
        Duration::from_secs(60),
        || async {
            !logs
                .matching(&["WARN", "idem_handlers", "in a transaction since"])
                .is_empty()
        },
    )
    .await;
    assert!(!task.is_finished(), "start-up did not give up");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .unwrap();
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;
    assert_eq!(bed.ledger("credit").await, (1, 1), "applied once, after");
}

/// A MariaDB server that cannot be reached at start-up (nothing listens
/// where the application's lazy pool points) is named in the warning, as
/// MariaDB, not PostgreSQL; the router takes no message, keeps trying, and
/// returns `Ok` when shut down. A router on the real server then applies
/// the waiting message once.
#[tokio::test]
async fn start_up_names_mariadb_when_it_cannot_be_reached() {
    let logs = idem_tests::capture_logs();
    let bed = Bed::start("MARIADOWN").await;
    bed.publish(["d-1".to_owned()]).await;
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let nowhere = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&format!("mysql://root@127.0.0.1:{closed_port}/idem"))
        .expect("the URL parses");
    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &nowhere,
    );
    eventually(
        "two start-up attempts warn that MariaDB cannot be reached",
        Duration::from_secs(30),
        || async {
            logs.matching(&["WARN", "MariaDB cannot be reached", "start-up"])
                .len()
                >= 2
        },
    )
    .await;
    assert!(!task.is_finished(), "start-up did not give up");
    assert!(
        logs.matching(&["PostgreSQL cannot be reached"]).is_empty(),
        "no warning names PostgreSQL: {:#?}",
        logs.lines()
    );
    stop(handle, task).await;
    assert_eq!(
        bed.ledger("credit").await,
        (0, 0),
        "nothing applied meanwhile"
    );

    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;
    assert_eq!(bed.ledger("credit").await, (1, 1), "applied once, after");
}

/// A server that may lose acknowledged commits
/// (`innodb_flush_log_at_trx_commit = 2`) is warned about at start-up,
/// naming the setting; the router still runs.
#[tokio::test]
async fn start_up_warns_about_commits_a_server_crash_can_lose() {
    let logs = idem_tests::capture_logs();
    let bed = Bed::start("MARIAFLUSH").await;
    sqlx::raw_sql("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
        .execute(&bed.pool)
        .await
        .unwrap();
    bed.publish(["f-1".to_owned()]).await;
    let (handle, task) = spawn(
        Router::mariadb().route(fast(Route::new(&bed.stream, "c")), credit),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;
    assert_eq!(
        logs.matching(&["WARN", "innodb_flush_log_at_trx_commit is 2"])
            .len(),
        1,
        "one warning, naming the setting"
    );
    assert_eq!(bed.ledger("credit").await, (1, 1), "the router ran");
}

// ---------------------------------------------------------------------------
// Expiry and what operators read.

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
    let bed = Bed::start("MARIAPURGE").await;
    bed.publish((0..MESSAGES).map(|i| format!("p-{i}"))).await;
    let route = fast(Route::new(&bed.stream, "c"))
        .retention(Duration::from_secs(3600))
        .publisher_retry_horizon(Duration::ZERO)
        .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
    let (handle, task) = spawn(
        Router::mariadb().route(route, kept_an_hour),
        &bed.nats,
        &bed.pool,
    );
    wait_all_acked(&bed.js, &bed.stream, "c").await;
    stop(handle, task).await;

    let claims = |pool: MySqlPool| async move {
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
        "UPDATE idem_claims SET claimed_at = claimed_at - 7200 ORDER BY claim_key LIMIT ?",
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
