//! The `idem` command on MariaDB: a real nats-server, a real MariaDB server
//! of the test's own, and a real MariaDB router that processes a known
//! number of messages; then the built `idem` binary runs as a process with
//! `DATABASE_URL=mysql://...?socket=...`, and its `--json` output and exit
//! codes are checked against what the run did. The outbox too: rows a real
//! relay failed to publish, as `idem status` lists them, made due by `idem
//! outbox retry`, then published.

mod common;

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::outbox::{self, Outbox, Relay, RelayStats};
use idem_runtime::retention::Unbounded;
use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::{
    Deposit, create_stream, deposit, fast, publish, stop, unique_name, wait_all_acked,
};
use idem_tests::{Mariadb, NatsServer, eventually, init_tracing};
use serde_json::{Value, json};
use sqlx::{MySql, MySqlPool};

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
        init_tracing();
        let (mariadb, nats) = tokio::join!(Mariadb::start(), NatsServer::start());
        let pool = mariadb.pool().await;
        idem_runtime::schema::migrate(&pool)
            .await
            .expect("migrations run");
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
    assert_eq!(
        status["outbox"],
        json!({
            "pending": 0,
            "oldest_age_seconds": 0.0,
            "failing": 0,
            "notify_trigger": null,
            "failures": [],
        }),
        "the router queued nothing, and MariaDB has no NOTIFY trigger: {status:#}"
    );
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

/// Rows queued for a subject no stream stores fail while the relay
/// publishes the others; `idem status` lists them with their subject and
/// why; once the stream exists, `idem outbox retry` makes them due with
/// their back-off restarted, and the relay publishes them, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_failing_outbox_rows_and_outbox_retry_makes_them_due() {
    init_tracing();
    let (mariadb, nats) = tokio::join!(Mariadb::start(), NatsServer::start());
    let pool = mariadb.pool().await;
    idem_runtime::schema::migrate(&pool)
        .await
        .expect("migrations run");
    let url = mariadb.url();
    let client = nats.client().await;
    let js = jetstream::new(client.clone());
    let (late, ok) = (unique_name("LATE"), unique_name("OK"));
    let (late_subject, ok_subject) = (format!("{late}.paid"), format!("{ok}.paid"));
    create_stream(&js, &ok, &format!("{ok}.>"), Duration::from_secs(60)).await;
    let outbox: Outbox = Outbox::keyed("mariadb-cli-outbox");
    let mut tx = pool.begin().await.expect("a transaction");
    outbox
        .send(&mut tx, &late_subject, &1)
        .await
        .expect("queued");
    outbox.send(&mut tx, &ok_subject, &1).await.expect("queued");
    tx.commit().await.expect("committed");

    let (relay, stats) = relay_on(&client, &pool);
    eventually(
        "the relay publishes one row and records the other's failure",
        Duration::from_secs(30),
        async || {
            stored(&js, &ok).await == 1
                && outbox::lag(&pool)
                    .await
                    .is_ok_and(|lag| lag.pending == 1 && lag.failing == 1)
        },
    )
    .await;
    relay.stop().await;
    // Pushed out as a long back-off would have them.
    sqlx::query("UPDATE idem_outbox SET not_before = UNIX_TIMESTAMP(NOW(6)) + 3600")
        .execute(&pool)
        .await
        .expect("the back-off is pushed out");

    let status = idem_in(None, Some(nats.url()), &url, &["status", "--json"])
        .await
        .json(0);
    let listed = &status["outbox"];
    assert_eq!(listed["pending"], 1, "{status:#}");
    assert_eq!(listed["failing"], 1, "{status:#}");
    assert_eq!(listed["notify_trigger"], Value::Null, "{status:#}");
    let failures = listed["failures"].as_array().expect("failures");
    assert_eq!(failures.len(), 1, "{status:#}");
    assert_eq!(failures[0]["subject"], late_subject.as_str(), "{status:#}");
    assert_eq!(failures[0]["rows"], 1, "{status:#}");
    assert!(
        failures[0]["attempts"].as_i64().is_some_and(|n| n >= 1),
        "{status:#}"
    );
    assert!(
        failures[0]["error"]
            .as_str()
            .is_some_and(|error| error.contains("no stream")),
        "{status:#}"
    );
    let next = failures[0]["next_attempt_seconds"]
        .as_f64()
        .expect("seconds");
    assert!((3000.0..=3600.0).contains(&next), "next attempt in {next}");
    let text = idem_in(None, Some(nats.url()), &url, &["status"]).await;
    for part in [
        "outbox: 1 pending, the oldest ",
        "(MariaDB has no notifications); 1 failing: ",
        "Fix the cause, then `idem outbox retry`.",
        late_subject.as_str(),
        "no stream",
    ] {
        assert!(text.text().contains(part), "{part}: {text:#?}");
    }

    // Another subject's rows: none failing, nothing changed.
    let other = idem_in(
        None,
        None,
        &url,
        &["outbox", "retry", "--subject", &ok_subject],
    )
    .await;
    assert_eq!(
        other.text().trim(),
        format!("no failing outbox rows of `{ok_subject}`: nothing to retry")
    );
    assert_eq!(row_state(&pool).await.0, 1, "the failing row is untouched");

    create_stream(&js, &late, &format!("{late}.>"), Duration::from_secs(60)).await;
    let retried = idem_in(None, None, &url, &["outbox", "retry", "--json"])
        .await
        .json(0);
    assert_eq!(
        retried,
        json!({ "retried": 1, "subject": null }),
        "{retried:#}"
    );
    let (attempts, due_in) = row_state(&pool).await;
    assert_eq!(attempts, 0, "its back-off restarts");
    assert!(due_in <= 0.0, "it is due now, not in {due_in}s");

    let (relay, stats_after) = relay_on(&client, &pool);
    eventually(
        "the retried row is published",
        Duration::from_secs(10),
        async || {
            stored(&js, &late).await == 1
                && outbox::lag(&pool).await.is_ok_and(|lag| lag.pending == 0)
        },
    )
    .await;
    relay.stop().await;
    assert_eq!(
        stats.duplicates() + stats_after.duplicates(),
        0,
        "each stored once"
    );
    let none = idem_in(None, None, &url, &["outbox", "retry"]).await;
    assert_eq!(
        none.text().trim(),
        "no failing outbox rows: nothing to retry"
    );
}

/// The failing row's attempts, and in how many seconds it is due.
async fn row_state(pool: &MySqlPool) -> (i32, f64) {
    sqlx::query_as(
        "SELECT attempts, CAST(not_before - UNIX_TIMESTAMP(NOW(6)) AS DOUBLE) FROM idem_outbox",
    )
    .fetch_one(pool)
    .await
    .expect("the one row left reads")
}

/// A relay running on `pool` until stopped, with an hour's back-off
/// between a row's attempts: only a retry by hand sends a failed row soon.
fn relay_on(client: &async_nats::Client, pool: &MySqlPool) -> (RunningRelay, RelayStats) {
    let relay = Relay::new()
        .poll_interval(Duration::from_millis(100))
        .max_row_backoff(Duration::from_secs(3600));
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run_until(client.clone(), pool.clone(), async {
        let _ = stopped.await;
    }));
    (RunningRelay { stop, task }, stats)
}

struct RunningRelay {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), outbox::RelayError>>,
}

impl RunningRelay {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the relay stops")
            .expect("the relay does not panic")
            .expect("the relay returns Ok");
    }
}

/// The messages `stream` holds.
async fn stored(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .expect("the stream exists")
        .info()
        .await
        .expect("its info")
        .state
        .messages
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
