//! The outbox as `idem` shows and retries it, checked once for each
//! database without NOTIFY (SQLite, MariaDB): what differs is its name and
//! its [`Dialect`].

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::outbox::{Outbox, Relay, RelayStats, Transactional};
use idem_tests::outbox::{OutboxDatabase, RelayTask, spawn_relay, stop_relay, stored_count};
use idem_tests::scenario::{create_stream, unique_name};
use idem_tests::{NatsServer, eventually};
use serde_json::{Value, json};
use sqlx::{Executor, FromRow, IntoArguments, Pool, Transaction};
use tokio::sync::oneshot;

use super::idem_in;

/// Checks that `status` (of `idem status --json`) shows an empty outbox
/// without a NOTIFY trigger, which `database` (its name) has not.
#[track_caller]
pub fn assert_empty_outbox(status: &Value, database: &str) {
    assert_eq!(
        status["outbox"],
        json!({
            "pending": 0,
            "oldest_age_seconds": 0.0,
            "failing": 0,
            "notify_trigger": null,
            "failures": [],
            "blocked": [],
        }),
        "the router queued nothing, and {database} has no NOTIFY trigger: {status:#}"
    );
}

/// What [`status_lists_failing_rows_and_retry_makes_them_due`] does its own
/// way on each database.
pub struct Dialect {
    /// The database's name, as `idem status` says it has no notifications:
    /// `SQLite`, `MariaDB`.
    pub name: &'static str,
    /// An UPDATE that pushes every outbox row's next attempt an hour out,
    /// as a long back-off would have it.
    pub push_back_off: &'static str,
    /// A SELECT of the one outbox row's attempts, and in how many seconds
    /// it is due.
    pub row_state: &'static str,
}

/// Rows queued for a subject no stream stores fail while the relay
/// publishes the others; `idem status` lists them with their subject and
/// why; once the stream exists, `idem outbox retry` makes them due with
/// their back-off restarted, and the relay publishes them, each once.
///
/// `pool` is on the migrated database `url` names, with an empty outbox.
pub async fn status_lists_failing_rows_and_retry_makes_them_due<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    url: &str,
    nats: &NatsServer,
    dialect: Dialect,
) where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    (i64, f64): for<'r> FromRow<'r, DB::Row>,
    for<'c> Transaction<'c, DB>: Transactional,
{
    let row_state = async || -> (i64, f64) {
        sqlx::query_as(dialect.row_state)
            .fetch_one(pool)
            .await
            .expect("the one row left reads")
    };
    let client = nats.client().await;
    let js = jetstream::new(client.clone());
    let (late, ok) = (unique_name("LATE"), unique_name("OK"));
    let (late_subject, ok_subject) = (format!("{late}.paid"), format!("{ok}.paid"));
    create_stream(&js, &ok, &format!("{ok}.>"), Duration::from_secs(60)).await;
    let outbox: Outbox = Outbox::keyed(&format!("{}-cli-outbox", dialect.name.to_lowercase()));
    let mut tx = pool.begin().await.expect("a transaction");
    outbox
        .send(&mut tx, &late_subject, &1)
        .await
        .expect("queued");
    outbox.send(&mut tx, &ok_subject, &1).await.expect("queued");
    tx.commit().await.expect("committed");

    let ((stop, task), stats) = relay_on(&client, pool);
    eventually(
        "the relay publishes one row and records the other's failure",
        Duration::from_secs(30),
        async || {
            stored_count(&js, &ok).await == 1
                && DB::lag(pool)
                    .await
                    .is_ok_and(|lag| lag.pending == 1 && lag.failing == 1)
        },
    )
    .await;
    stop_relay(stop, task).await;
    sqlx::query(dialect.push_back_off)
        .execute(pool)
        .await
        .expect("the back-off is pushed out");

    let status = idem_in(None, Some(nats.url()), url, &["status", "--json"])
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
    let text = idem_in(None, Some(nats.url()), url, &["status"]).await;
    let no_notifications = format!("({} has no notifications); 1 failing: ", dialect.name);
    for part in [
        "outbox: 1 pending, the oldest ",
        no_notifications.as_str(),
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
        url,
        &["outbox", "retry", "--subject", &ok_subject],
    )
    .await;
    assert_eq!(
        other.text().trim(),
        format!("no failing outbox rows of `{ok_subject}`: nothing to retry")
    );
    assert_eq!(row_state().await.0, 1, "the failing row is untouched");

    create_stream(&js, &late, &format!("{late}.>"), Duration::from_secs(60)).await;
    let retried = idem_in(None, None, url, &["outbox", "retry", "--json"])
        .await
        .json(0);
    assert_eq!(
        retried,
        json!({ "retried": 1, "subject": null }),
        "{retried:#}"
    );
    let (attempts, due_in) = row_state().await;
    assert_eq!(attempts, 0, "its back-off restarts");
    assert!(due_in <= 0.0, "it is due now, not in {due_in}s");

    let ((stop, task), stats_after) = relay_on(&client, pool);
    eventually(
        "the retried row is published",
        Duration::from_secs(10),
        async || {
            stored_count(&js, &late).await == 1
                && DB::lag(pool).await.is_ok_and(|lag| lag.pending == 0)
        },
    )
    .await;
    stop_relay(stop, task).await;
    assert_eq!(
        stats.duplicates() + stats_after.duplicates(),
        0,
        "each stored once"
    );
    let none = idem_in(None, None, url, &["outbox", "retry"]).await;
    assert_eq!(
        none.text().trim(),
        "no failing outbox rows: nothing to retry"
    );
}

/// A relay running on `pool` until stopped ([`stop_relay`]), with an hour's
/// back-off between a row's attempts: only a retry by hand sends a failed
/// row soon.
fn relay_on<DB: OutboxDatabase>(
    client: &async_nats::Client,
    pool: &Pool<DB>,
) -> ((oneshot::Sender<()>, RelayTask), RelayStats) {
    let relay = Relay::new()
        .poll_interval(Duration::from_millis(100))
        .max_row_backoff(Duration::from_secs(3600));
    let stats = relay.stats();
    (spawn_relay(relay, client.clone(), pool.clone()), stats)
}
