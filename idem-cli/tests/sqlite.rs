//! The `idem` command on SQLite: a real nats-server, a real database file
//! in a temporary directory, and a real SQLite router that processes a
//! known number of messages; then the built `idem` binary runs as a
//! process with `DATABASE_URL=sqlite://...`, and its `--json` output and
//! exit codes are checked against what the run did. The outbox too: rows a
//! real relay failed to publish, as `idem status` lists them, made due by
//! `idem outbox retry`, then published. Also what the command refuses: a
//! scheme it does not support, and a file that is not there (never
//! created, except by `idem migrate` with `?mode=rwc`).

mod common;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use idem_runtime::retention::Unbounded;
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::{
    Deposit, create_stream, deposit, fast, publish, stop, unique_name, wait_all_acked, wait_pulling,
};
use idem_tests::{NatsServer, init_tracing};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use common::outbox::{self, Dialect};
use common::{Run, idem_in};

const HANDLER: &str = "sqlite.cli.credit.v1";
const DURABLE: &str = "credits";
/// The messages every run processes, each once.
const MESSAGES: usize = 8;

/// Books a deposit; no unique key, so a double apply would show.
#[idempotent(name = "sqlite.cli.credit.v1")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (msg_id, account, amount) VALUES (?, ?, ?)")
        .bind(delivery.message_id().as_str())
        .bind(&d.account)
        .bind(d.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn idem(nats_url: Option<&str>, database_url: &str, args: &[&str]) -> Run {
    idem_in(None, nats_url, database_url, args).await
}

/// A SQLite file in a temporary directory, migrated by the runtime, in
/// the journal mode given and with `synchronous = FULL`.
struct Db {
    _dir: tempfile::TempDir,
    /// `sqlite:///` and the file's absolute path.
    url: String,
    pool: SqlitePool,
}

impl Db {
    /// In WAL mode, as the guide asks.
    async fn migrated() -> Db {
        Db::migrated_in(SqliteJournalMode::Wal).await
    }

    async fn migrated_in(journal_mode: SqliteJournalMode) -> Db {
        init_tracing();
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("idem.db");
        let url = format!("sqlite://{}", path.display());
        let options = SqliteConnectOptions::from_str(&url)
            .expect("a SQLite url")
            .create_if_missing(true)
            .journal_mode(journal_mode)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(30));
        // As many as a route's messages in flight, so that none waits.
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .expect("the SQLite file opens");
        idem_runtime::schema::migrate(&pool)
            .await
            .expect("migrations run");
        Db {
            _dir: dir,
            url,
            pool,
        }
    }

    /// (claims, rows of sqlite_master): what `idem` must not change.
    async fn contents(&self) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM idem_claims), (SELECT count(*) FROM sqlite_master)",
        )
        .fetch_one(&self.pool)
        .await
        .expect("the file reads")
    }
}

/// A migrated file and a nats-server, with [`MESSAGES`] deposits processed
/// once each by a SQLite router.
struct Bed {
    db: Db,
    nats: NatsServer,
    stream: String,
}

impl Bed {
    /// Processes [`MESSAGES`] deposits (ids `c-0`, `c-1`, ...) with a
    /// router on the file whose route keeps claims for `retention` (`None`:
    /// forever), and stops it.
    async fn processed(retention: Option<Duration>) -> Bed {
        let db = Db::migrated().await;
        sqlx::raw_sql(
            "CREATE TABLE effects (msg_id TEXT NOT NULL, account TEXT NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(&db.pool)
        .await
        .expect("the business table is made");
        let nats = NatsServer::start().await;
        let client = nats.client().await;
        let js = async_nats::jetstream::new(client.clone());
        let stream = unique_name("SQLITECLI");
        let subject = format!("{stream}.deposit");
        create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        for i in 0..MESSAGES {
            let id = format!("c-{i}");
            publish(&js, &subject, &deposit("acct", 1), Some(&id)).await;
        }
        let mut route = fast(Route::new(&stream, DURABLE));
        if let Some(retention) = retention {
            // A stream without max_age, whose publishers never retry.
            route = route
                .retention(retention)
                .publisher_retry_horizon(Duration::ZERO)
                .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
        }
        let router = Router::sqlite().route(route, credit);
        let handle = router.handle();
        let task =
            tokio::spawn(router.run_until(client.clone(), db.pool.clone(), std::future::pending()));
        wait_all_acked(&js, &stream, DURABLE).await;
        stop(handle.clone(), task).await;
        let stats = handle.stats(DURABLE).expect("the route's stats");
        assert_eq!(
            stats.processed(),
            MESSAGES as u64,
            "the run did what the test expects"
        );
        let (effects, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT msg_id) FROM effects")
                .fetch_one(&db.pool)
                .await
                .expect("the effects read");
        assert_eq!((effects, distinct), (MESSAGES as i64, MESSAGES as i64));
        Bed { db, nats, stream }
    }

    async fn idem(&self, args: &[&str]) -> Run {
        idem(Some(self.nats.url()), &self.db.url, args).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_passes_and_migrate_changes_nothing_on_a_file_a_router_ran_on() {
    let bed = Bed::processed(None).await;
    let version = idem_runtime::status::sqlite::schema_version(&bed.db.pool)
        .await
        .expect("the version reads")
        .expect("a version is recorded");
    let verified = bed.idem(&["verify", "--json"]).await.json(0);
    assert_eq!(verified, json!({ "ok": true, "version": version }));
    let text = bed.idem(&["verify"]).await;
    assert!(
        text.text()
            .contains(&format!("applied and current (version {version})")),
        "{text:#?}"
    );

    let before = bed.db.contents().await;
    let migrated = bed.idem(&["migrate", "--json"]).await.json(0);
    assert_eq!(migrated, json!({ "version": version }));
    assert_eq!(bed.db.contents().await, before, "nothing was changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_one_claim_per_processed_message_and_shows_an_empty_outbox() {
    let bed = Bed::processed(None).await;
    let status = bed.idem(&["status", "--json"]).await.json(0);

    let consumers = status["consumers"].as_array().expect("consumers");
    assert_eq!(consumers.len(), 1, "only the route's consumer: {status:#}");
    let consumer = &consumers[0];
    assert_eq!(consumer["stream"], bed.stream.as_str());
    assert_eq!(consumer["durable"], DURABLE);
    assert_eq!(consumer["handler"], HANDLER);
    assert_eq!(consumer["pending"], 0);
    assert_eq!(consumer["ack_pending"], 0);
    assert_eq!(consumer["claims"], MESSAGES);
    let handlers = status["handlers"].as_array().expect("handlers");
    assert_eq!(handlers.len(), 1, "{status:#}");
    assert_eq!(handlers[0]["name"], HANDLER);
    assert_eq!(handlers[0]["claims"], MESSAGES);
    assert_eq!(handlers[0]["retention_seconds"], Value::Null);
    let oldest = handlers[0]["oldest_claim_age_seconds"]
        .as_f64()
        .expect("an age");
    assert!((0.0..600.0).contains(&oldest), "oldest claim age {oldest}");

    outbox::assert_empty_outbox(&status, "SQLite");
    assert_eq!(status["expiry"]["behind"], false, "{status:#}");
    assert_eq!(
        status["database_durability"],
        json!({
            "journal_mode": "wal",
            "command_synchronous": "full",
            "filesystem": "local",
            "routers": [{ "handler": HANDLER, "journal_mode": "wal", "synchronous": "full" }],
            "warnings": [],
        }),
        "{status:#}"
    );
    assert_eq!(
        status["write_lock"],
        json!({ "state": "free" }),
        "{status:#}"
    );

    let text = bed.idem(&["status"]).await;
    for part in [
        format!("{}/{DURABLE}", bed.stream),
        "outbox: 0 pending; relays are woken by their own process's commits, and poll (SQLite has no notifications)".to_owned(),
        "database durability: journal_mode wal, synchronous full".to_owned(),
        "write lock: free".to_owned(),
        "expiry: no handler lets its claims expire".to_owned(),
    ] {
        assert!(text.text().contains(&part), "{part}: {text:#?}");
    }
    assert!(!text.text().contains("warning"), "{text:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_check_says_processed_for_a_processed_id_and_not_for_an_unknown_one() {
    let bed = Bed::processed(None).await;
    let checked = bed
        .idem(&["dedup", "check", HANDLER, "c-3", "--json"])
        .await
        .json(0);
    assert_eq!(checked["processed"], true, "{checked:#}");
    assert!(checked["claimed_at"].is_string(), "{checked:#}");
    assert_eq!(checked["has_result"], false, "{checked:#}");
    assert_eq!(
        checked["generation"],
        Value::Null,
        "no generations on SQLite"
    );
    let text = bed.idem(&["dedup", "check", HANDLER, "c-3"]).await;
    assert!(
        text.text()
            .starts_with(&format!("processed: `{HANDLER}` claimed `c-3`")),
        "{text:#?}"
    );

    let unseen = bed
        .idem(&["dedup", "check", HANDLER, "c-404", "--json"])
        .await
        .json(0);
    assert_eq!(unseen["processed"], false, "{unseen:#}");
    assert_eq!(unseen["claimed_at"], Value::Null, "{unseen:#}");
    let text = bed.idem(&["dedup", "check", HANDLER, "c-404"]).await;
    assert!(text.text().starts_with("not processed"), "{text:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_the_claims_aged_past_their_retention_and_says_how_many() {
    const AGED: usize = 5;
    let bed = Bed::processed(Some(Duration::from_secs(3600))).await;
    // Claims aged by hand, two hours back: the purge reads nothing else.
    let aged = sqlx::query(
        "UPDATE idem_claims SET claimed_at = claimed_at - 7200
          WHERE key IN (SELECT key FROM idem_claims ORDER BY key LIMIT ?)",
    )
    .bind(AGED as i64)
    .execute(&bed.db.pool)
    .await
    .expect("claims are aged")
    .rows_affected();
    assert_eq!(aged, AGED as u64, "the ageing took");

    // No router runs: status says expiry is behind, for the handler.
    let status = bed.idem(&["status", "--json"]).await.json(0);
    assert_eq!(status["expiry"]["behind"], true, "{status:#}");
    assert_eq!(
        status["expiry"]["overdue"][0]["handler"], HANDLER,
        "{status:#}"
    );
    let text = bed.idem(&["status"]).await;
    assert!(
        text.text()
            .contains(&format!("expiry behind: `{HANDLER}`'s oldest claim is 2h")),
        "{text:#?}"
    );

    let purged = bed.idem(&["purge", "--json"]).await.json(0);
    assert_eq!(
        purged,
        json!({ "skipped": false, "retention_seconds": 3600.0, "deleted": AGED }),
        "{purged:#}"
    );
    let status = bed.idem(&["status", "--json"]).await.json(0);
    assert_eq!(
        status["handlers"][0]["claims"],
        MESSAGES - AGED,
        "{status:#}"
    );
    assert_eq!(status["expiry"]["behind"], false, "{status:#}");

    // Nothing is left to delete; the text says so, without PostgreSQL's
    // generations.
    let again = bed.idem(&["purge"]).await;
    let text = again.text();
    assert!(text.contains("claims deleted          0"), "{text}");
    assert!(text.contains("longest retention       1h"), "{text}");
    assert!(!text.contains("generation"), "{text}");
}

/// Failing outbox rows, as `idem status` lists them and `idem outbox retry`
/// makes them due, on SQLite: see
/// [`outbox::status_lists_failing_rows_and_retry_makes_them_due`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_failing_outbox_rows_and_outbox_retry_makes_them_due() {
    let db = Db::migrated().await;
    let nats = NatsServer::start().await;
    outbox::status_lists_failing_rows_and_retry_makes_them_due(
        &db.pool,
        &db.url,
        &nats,
        Dialect {
            name: "SQLite",
            push_back_off: "UPDATE idem_outbox SET not_before = unixepoch('subsec') + 3600",
            row_state: "SELECT attempts, not_before - unixepoch('subsec') FROM idem_outbox",
        },
    )
    .await;
}

#[tokio::test]
async fn an_unsupported_scheme_exits_2_and_names_the_supported_ones() {
    let secret = "s3cret-pass";
    for (url, says) in [
        (
            format!("redis://alice:{secret}@127.0.0.1:6379/0"),
            "does not start with a scheme idem supports",
        ),
        (
            "ledger.db".to_owned(),
            "does not start with a scheme idem supports",
        ),
        (
            format!("alice:{secret}@127.0.0.1/ledger"),
            "does not start with a scheme idem supports",
        ),
    ] {
        for args in [["verify"].as_slice(), &["status"], &["migrate"]] {
            let run = idem(None, &url, args).await;
            let stderr = run.failure(2);
            assert!(stderr.contains(says), "{url} {args:?}: {run:#?}");
            assert!(
                stderr.contains("postgres://")
                    && stderr.contains("sqlite:///")
                    && stderr.contains("mysql://"),
                "names the supported schemes: {run:#?}"
            );
            assert!(!stderr.contains(secret), "no secret: {run:#?}");
        }
    }
}

/// A URL that opens an in-memory database, however it is spelled, is
/// refused: `idem migrate` would otherwise migrate a database that is gone
/// when it exits, and report success. The file named stays untouched.
#[tokio::test]
async fn an_in_memory_database_is_refused_however_the_url_spells_it() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("ledger.db");
    std::fs::write(&file, b"").expect("an empty file");
    let path = file.display();
    for url in [
        "sqlite::memory:".to_owned(),
        format!("sqlite://{path}?mode=memory"),
        // What sqlx makes of these is a database in memory.
        format!("sqlite://{path}?mode=rw&mode=memory"),
        format!("sqlite://{path}?mode=memor%79"),
        format!("sqlite://{path}?vfs=memdb"),
    ] {
        for args in [["migrate"].as_slice(), &["verify"]] {
            let run = idem(None, &url, args).await;
            let stderr = run.failure(2);
            assert!(stderr.contains("names no file"), "{url} {args:?}: {run:#?}");
        }
    }
    assert_eq!(
        std::fs::metadata(&file).expect("the file is there").len(),
        0,
        "nothing was written to the file"
    );
}

#[tokio::test]
async fn a_missing_sqlite_file_fails_clearly_and_is_not_created() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let absolute: PathBuf = dir.path().join("missing.db");
    let nats = NatsServer::start().await;
    let urls = [
        (format!("sqlite://{}", absolute.display()), absolute.clone()),
        // Even when the URL asks for it, only `idem migrate` creates.
        (
            format!("sqlite://{}?mode=rwc", absolute.display()),
            absolute.clone(),
        ),
        // Relative to the directory idem runs in.
        ("sqlite://missing.db".to_owned(), "missing.db".into()),
        ("sqlite:missing.db".to_owned(), "missing.db".into()),
    ];
    for (url, path) in &urls {
        for args in [
            ["verify"].as_slice(),
            &["status"],
            &["dedup", "check", HANDLER, "c-1"],
            &["purge"],
            &["outbox", "retry"],
        ] {
            let run = idem_in(Some(dir.path()), Some(nats.url()), url, args).await;
            let stderr = run.failure(1);
            assert!(
                stderr.contains(&format!("no such database file: {}", path.display())),
                "{url} {args:?}: {run:#?}"
            );
            assert!(
                stderr.contains("`idem` never creates one"),
                "{url} {args:?}: {run:#?}"
            );
        }
    }
    // `idem migrate` creates only with ?mode=rwc.
    let run = idem_in(
        Some(dir.path()),
        None,
        &format!("sqlite://{}", absolute.display()),
        &["migrate"],
    )
    .await;
    assert!(
        run.failure(1)
            .contains("add ?mode=rwc to the end of the URL"),
        "{run:#?}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("the dir reads")
        .collect();
    assert!(left.is_empty(), "no file was created: {left:?}");
}

#[tokio::test]
async fn migrate_creates_a_missing_file_only_when_the_url_says_mode_rwc() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let url = "sqlite://ledger.db?mode=rwc";
    let migrated = idem_in(Some(dir.path()), None, url, &["migrate", "--json"])
        .await
        .json(0);
    assert!(
        dir.path().join("ledger.db").exists(),
        "the file was created"
    );
    let verified = idem_in(Some(dir.path()), None, url, &["verify", "--json"])
        .await
        .json(0);
    assert_eq!(verified["ok"], true, "{verified:#}");
    assert_eq!(verified["version"], migrated["version"], "{verified:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_warns_while_another_connection_holds_the_write_lock() {
    let db = Db::migrated().await;
    let nats = NatsServer::start().await;
    let mut holder = db.pool.acquire().await.expect("a connection");
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .expect("the lock is taken");

    let run = idem(Some(nats.url()), &db.url, &["status"]).await;
    let text = run.text();
    assert!(
        text.contains("write lock: held by another connection for the 5s this command waited"),
        "{text}"
    );
    assert!(
        text.contains("  warning: every message's transaction takes SQLite's write lock at BEGIN, so while it is held no router on this file makes progress"),
        "{text}"
    );
    let status = idem(Some(nats.url()), &db.url, &["status", "--json"])
        .await
        .json(0);
    assert_eq!(status["write_lock"]["state"], "held", "{status:#}");
    let waited = status["write_lock"]["waited_seconds"]
        .as_f64()
        .expect("seconds");
    assert!(waited >= 4.5, "waited {waited}");

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *holder)
        .await
        .expect("the lock is freed");
    let status = idem(Some(nats.url()), &db.url, &["status", "--json"])
        .await
        .json(0);
    assert_eq!(
        status["write_lock"],
        json!({ "state": "free" }),
        "{status:#}"
    );
}

/// `synchronous` is each connection's own, so `idem status` cannot read a
/// service's from its own connections: each router records its own when it
/// registers its handlers, and status shows it. A router whose connections
/// run at NORMAL (acked commits can be lost on power loss) is named with a
/// warning, while the command's own connections are at FULL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_a_router_whose_synchronous_is_below_full() {
    let bed = Bed::processed(None).await;
    let lax = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(
            SqliteConnectOptions::from_str(&bed.db.url)
                .expect("a SQLite url")
                .synchronous(SqliteSynchronous::Normal),
        )
        .await
        .expect("the file opens");
    let client = bed.nats.client().await;
    let router = Router::sqlite().route(fast(Route::new(&bed.stream, DURABLE)), credit);
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(client, lax, std::future::pending()));
    let js = async_nats::jetstream::new(bed.nats.client().await);
    wait_pulling(&js, &bed.stream, DURABLE, 1).await;
    stop(handle, task).await;

    let status = bed.idem(&["status", "--json"]).await.json(0);
    let durability = &status["database_durability"];
    assert_eq!(durability["command_synchronous"], "full", "{status:#}");
    assert_eq!(
        durability["routers"],
        json!([{ "handler": HANDLER, "journal_mode": "wal", "synchronous": "normal" }]),
        "{status:#}"
    );
    let warnings = durability["warnings"].as_array().expect("warnings");
    assert!(
        warnings.iter().any(
            |warning| warning.as_str().unwrap_or_default().contains(&format!(
                "`synchronous` is NORMAL on the router's (that registered `{HANDLER}`) connections"
            ))
        ),
        "{status:#}"
    );
    let text = bed.idem(&["status"]).await;
    assert!(
        text.text().contains(&format!(
            "the router that registered `{HANDLER}` last: journal_mode wal, synchronous normal"
        )),
        "{text:#?}"
    );
}

#[tokio::test]
async fn status_warns_when_the_file_is_not_in_wal_mode() {
    let db = Db::migrated_in(SqliteJournalMode::Delete).await;
    let nats = NatsServer::start().await;
    let status = idem(Some(nats.url()), &db.url, &["status", "--json"])
        .await
        .json(0);
    let durability = &status["database_durability"];
    assert_eq!(durability["journal_mode"], "delete", "{status:#}");
    let warnings = durability["warnings"].as_array().expect("warnings");
    assert_eq!(warnings.len(), 1, "{status:#}");
    assert!(
        warnings[0]
            .as_str()
            .unwrap_or_default()
            .contains("SQLite is not in WAL mode (journal_mode delete)"),
        "{status:#}"
    );
    let run = idem(Some(nats.url()), &db.url, &["status"]).await;
    assert!(
        run.text().contains("  warning: SQLite is not in WAL mode"),
        "{run:#?}"
    );
}

#[tokio::test]
async fn status_does_not_call_the_write_lock_free_on_a_read_only_url() {
    let db = Db::migrated().await;
    let nats = NatsServer::start().await;
    // A read-only connection's BEGIN IMMEDIATE takes no lock: it would
    // read as free even while the lock is held.
    let mut holder = db.pool.acquire().await.expect("a connection");
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *holder)
        .await
        .expect("the lock is taken");
    let read_only = format!("{}?mode=ro", db.url);
    let status = idem(Some(nats.url()), &read_only, &["status", "--json"])
        .await
        .json(0);
    assert_eq!(status["write_lock"]["state"], "not-checked", "{status:#}");
    let text = idem(Some(nats.url()), &read_only, &["status"]).await;
    assert!(
        text.text()
            .contains("write lock: not checked: this command cannot write to the file"),
        "{text:#?}"
    );
}
