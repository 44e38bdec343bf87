//! The `idem` command on MariaDB: a real nats-server, a real MariaDB server
//! of the test's own, and a real MariaDB router that processes a known
//! number of messages; then the built `idem` binary runs as a process with
//! `DATABASE_URL=mysql://...?socket=...`, and its `--json` output and exit
//! codes are checked against what the run did. The outbox too: rows a real
//! relay failed to publish, as `idem status` lists them, made due by `idem
//! outbox retry`, then published.

mod common;

use std::time::Duration;

use idem_runtime::retention::Unbounded;
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::{
    Deposit, create_stream, deposit, fast, publish, stop, unique_name, wait_all_acked,
};
use idem_tests::{Mariadb, NatsServer, init_tracing};
use serde_json::json;
use sqlx::{MySql, MySqlPool};

use common::outbox::{self, Dialect};
use common::{Run, idem_in};

const HANDLER: &str = "mariadb.cli.credit.v1";
const DURABLE: &str = "credits";
/// The messages every run processes, each once.
const MESSAGES: usize = 8;

/// Books a deposit; no unique key, so a double apply would show.
#[idempotent(name = "mariadb.cli.credit.v1")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, MySql>,
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

/// A MariaDB server of the test's own, migrated by the runtime, and a
/// nats-server.
async fn migrated() -> (Mariadb, MySqlPool, NatsServer) {
    init_tracing();
    let (mariadb, nats) = tokio::join!(Mariadb::start(), NatsServer::start());
    let pool = mariadb.pool().await;
    idem_runtime::schema::migrate(&pool)
        .await
        .expect("migrations run");
    (mariadb, pool, nats)
}

/// A MariaDB server and a nats-server, with [`MESSAGES`] deposits (ids
/// `c-0`, `c-1`, ...) processed once each by a MariaDB router.
struct Bed {
    mariadb: Mariadb,
    pool: sqlx::MySqlPool,
    nats: NatsServer,
    stream: String,
}

impl Bed {
    /// The router's route keeps claims for `retention` (`None`: forever).
    async fn processed(retention: Option<Duration>) -> Bed {
        let (mariadb, pool, nats) = migrated().await;
        sqlx::raw_sql(
            "CREATE TABLE effects (msg_id TEXT NOT NULL, account TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("the business table is made");
        let client = nats.client().await;
        let js = async_nats::jetstream::new(client.clone());
        let stream = unique_name("MARIADBCLI");
        let subject = format!("{stream}.deposit");
        create_stream(&js, &stream, &subject, Duration::from_secs(60)).await;
        for i in 0..MESSAGES {
            publish(&js, &subject, &deposit("acct", 1), Some(&format!("c-{i}"))).await;
        }
        let mut route = fast(Route::new(&stream, DURABLE));
        if let Some(retention) = retention {
            // A stream without max_age, whose publishers never retry.
            route = route
                .retention(retention)
                .publisher_retry_horizon(Duration::ZERO)
                .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
        }
        let router = Router::mariadb().route(route, credit);
        let handle = router.handle();
        let task =
            tokio::spawn(router.run_until(client.clone(), pool.clone(), std::future::pending()));
        wait_all_acked(&js, &stream, DURABLE).await;
        stop(handle.clone(), task).await;
        assert_eq!(
            handle
                .stats(DURABLE)
                .expect("the route's stats")
                .processed(),
            MESSAGES as u64,
            "the run did what the test expects"
        );
        Bed {
            mariadb,
            pool,
            nats,
            stream,
        }
    }

    async fn idem(&self, args: &[&str]) -> Run {
        idem_in(None, Some(self.nats.url()), &self.mariadb.url(), args).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_passes_and_migrate_changes_nothing_on_a_database_a_router_ran_on() {
    let bed = Bed::processed(None).await;
    let version = idem_runtime::status::mariadb::schema_version(&bed.pool)
        .await
        .expect("the version reads")
        .expect("a version is recorded");
    let verified = bed.idem(&["verify", "--json"]).await.json(0);
    assert_eq!(verified, json!({ "ok": true, "version": version }));
    let migrated = bed.idem(&["migrate", "--json"]).await.json(0);
    assert_eq!(migrated, json!({ "version": version }));
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_claims")
        .fetch_one(&bed.pool)
        .await
        .unwrap();
    assert_eq!(claims, MESSAGES as i64, "nothing was changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_one_claim_per_message_shows_an_empty_outbox_and_warns_about_durability() {
    let bed = Bed::processed(None).await;
    let status = bed.idem(&["status", "--json"]).await.json(0);
    let consumer = &status["consumers"][0];
    assert_eq!(consumer["stream"], bed.stream.as_str(), "{status:#}");
    assert_eq!(consumer["handler"], HANDLER, "{status:#}");
    assert_eq!(consumer["claims"], MESSAGES, "{status:#}");
    assert_eq!(status["handlers"][0]["claims"], MESSAGES, "{status:#}");
    outbox::assert_empty_outbox(&status, "MariaDB");
    assert_eq!(status["expiry"]["behind"], false, "{status:#}");
    let durability = &status["database_durability"];
    assert_eq!(
        durability["innodb_flush_log_at_trx_commit"], 1,
        "{status:#}"
    );
    assert_eq!(durability["warnings"], json!([]), "{status:#}");
    assert!(
        durability["version"]
            .as_str()
            .is_some_and(|version| version.contains("MariaDB")),
        "{status:#}"
    );
    let text = bed.idem(&["status"]).await;
    assert!(
        text.text().contains(
            "outbox: 0 pending; relays are woken by their own process's commits, and poll (MariaDB has no notifications)"
        ),
        "{text:#?}"
    );
    assert!(!text.text().contains("warning"), "{text:#?}");

    sqlx::raw_sql("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
        .execute(&bed.pool)
        .await
        .unwrap();
    let status = bed.idem(&["status", "--json"]).await.json(0);
    let warnings = status["database_durability"]["warnings"]
        .as_array()
        .expect("warnings");
    assert!(
        warnings.len() == 1
            && warnings[0]
                .as_str()
                .is_some_and(|w| w.contains("innodb_flush_log_at_trx_commit is 2")),
        "{status:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_check_and_purge_on_mariadb() {
    const AGED: usize = 5;
    let bed = Bed::processed(Some(Duration::from_secs(3600))).await;
    let checked = bed
        .idem(&["dedup", "check", HANDLER, "c-3", "--json"])
        .await
        .json(0);
    assert_eq!(checked["processed"], true, "{checked:#}");
    let unseen = bed
        .idem(&["dedup", "check", HANDLER, "c-404", "--json"])
        .await
        .json(0);
    assert_eq!(unseen["processed"], false, "{unseen:#}");

    // Claims aged by hand, two hours back: the purge reads nothing else.
    let aged = sqlx::query(
        "UPDATE idem_claims SET claimed_at = claimed_at - 7200 ORDER BY claim_key LIMIT ?",
    )
    .bind(AGED as i64)
    .execute(&bed.pool)
    .await
    .expect("claims are aged")
    .rows_affected();
    assert_eq!(aged, AGED as u64, "the ageing took");
    let status = bed.idem(&["status", "--json"]).await.json(0);
    assert_eq!(status["expiry"]["behind"], true, "{status:#}");
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
}

/// Failing outbox rows, as `idem status` lists them and `idem outbox retry`
/// makes them due, on MariaDB: see
/// [`outbox::status_lists_failing_rows_and_retry_makes_them_due`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_failing_outbox_rows_and_outbox_retry_makes_them_due() {
    let (mariadb, pool, nats) = migrated().await;
    outbox::status_lists_failing_rows_and_retry_makes_them_due(
        &pool,
        &mariadb.url(),
        &nats,
        Dialect {
            name: "MariaDB",
            push_back_off: "UPDATE idem_outbox SET not_before = UNIX_TIMESTAMP(NOW(6)) + 3600",
            row_state: "SELECT attempts, CAST(not_before - UNIX_TIMESTAMP(NOW(6)) AS DOUBLE) FROM idem_outbox",
        },
    )
    .await;
}

#[tokio::test]
async fn an_unreachable_server_exits_1_and_never_shows_its_password() {
    let secret = "s3cret-pass";
    for url in [
        format!("mysql://alice:{secret}@127.0.0.1:9/ledger"),
        format!("mariadb://alice:{secret}@127.0.0.1:9/ledger"),
    ] {
        let run = idem_in(None, None, &url, &["verify"]).await;
        let stderr = run.failure(1);
        assert!(
            stderr.contains("cannot connect to the database at")
                && stderr.contains("alice:***@127.0.0.1:9")
                && stderr.contains("check that MariaDB runs"),
            "{run:#?}"
        );
        assert!(!stderr.contains(secret), "no secret: {run:#?}");
    }
}
