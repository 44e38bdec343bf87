//! PostgreSQL failing under traffic: a restart, an outage while messages were
//! already fetched, the dedup table gone. The database's fault uses up no
//! delivery and dead-letters nothing; once it is back every message is applied
//! once.

use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::{Route, Router, dead_letter};
use idem_tests::scenario::*;

use crate::{latest_delivery, worker_pool};

// --- The dedup table gone -----------------------------------------------

/// The dedup table disappears (dropped, renamed, a wrong `search_path`):
/// every claim fails with 42P01. That is the database's fault, not the
/// messages': nothing is dead-lettered and no delivery is used up while it
/// lasts, and once the table is back every message is applied once.
#[tokio::test]
async fn a_missing_dedup_table_dead_letters_nothing() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NOTABLE", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(2).concurrency(2),
            no_ids,
        ),
        nats,
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    for i in 0..6 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("nt-{i}"))).await;
    }
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claims failed again and again",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 20 },
    )
    .await;
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(stats.failed(), 0, "no delivery was used up");

    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(6));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
}

/// While the database cannot be used, the route takes no new messages; the
/// ones it had fetched and not started must not lose a delivery to the
/// outage either. They were once handed back (NAKed) when the route paused:
/// each came back as its next delivery, so that on a route allowed one
/// delivery (`max_deliver(1)`) they arrived past the limit and were
/// dead-lettered as `exhausted`, never having run.
#[tokio::test]
async fn messages_fetched_during_a_database_outage_use_up_no_delivery() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FETCHED", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).max_deliver(1).concurrency(2),
            no_ids,
        ),
        nats,
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    sqlx::query("ALTER TABLE idem_claims RENAME TO idem_claims_away")
        .execute(&pool)
        .await
        .unwrap();
    for i in 0..6 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("f-{i}"))).await;
    }
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claims failed again and again",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 10 },
    )
    .await;
    assert!(
        stats.paused(),
        "the route says it is paused while its claims fail: {stats:?}"
    );
    // The fault: more messages were fetched than the two held ones.
    let fetched = consumer_info(&js, &stream, "c")
        .await
        .delivered
        .stream_sequence;
    assert!(
        fetched > 2,
        "the route fetched messages behind the held ones: {fetched}"
    );
    sqlx::query("ALTER TABLE idem_claims_away RENAME TO idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    assert!(!stats.paused(), "the route resumed: {stats:?}");
    stop(handle.clone(), task).await;
    let letters: Vec<String> = dead_letters(&js, &stream)
        .await
        .iter()
        .map(|letter| {
            format!(
                "{} ({}, delivered {})",
                header(letter, "Idem-Message-Id"),
                header(letter, "Idem-Failure"),
                header(letter, "Idem-Delivered")
            )
        })
        .collect();
    assert_eq!(letters, Vec::<String>::new(), "nothing was dead-lettered");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(6));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.delivered.consumer_sequence, info.num_redelivered),
        (6, 0),
        "JetStream delivered each message once"
    );
}

/// A PostgreSQL restart under steady traffic: the attempts that meet it are
/// retried without using up deliveries.
#[tokio::test]
async fn a_postgres_restart_under_traffic_uses_up_no_delivery() {
    let Scenario {
        mut env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PGRESTART", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).concurrency(8), no_ids),
        nats,
        worker_pool(env.database_url()).await,
    );
    let publisher = publish_steadily(&js, &subject, 300);
    let stats = handle.stats("c").unwrap();
    eventually("traffic flows", Duration::from_secs(30), || async {
        stats.processed() >= 50
    })
    .await;
    let before = stats.processed();
    env.postgres_mut().restart_immediate().await;
    publisher.await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert!(
        stats.processed() > before,
        "processing went on after the restart"
    );
    assert!(
        stats.infrastructure_errors() + stats.retried_in_process() + stats.commit_failed() > 0,
        "the router saw the restart"
    );
    assert_eq!(stats.failed(), 0, "no delivery was used up by the restart");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(300));
    // A COMMIT the restart cut has an unknown outcome: NAKed, and if it
    // had not committed, applied on its next delivery. Nothing else may
    // take a second delivery.
    let redelivered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM effects WHERE handler = 'no-ids' AND delivered > 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        redelivered as u64 <= stats.commit_failed(),
        "{redelivered} messages were applied on a later delivery, and only {} COMMITs were of unknown outcome",
        stats.commit_failed()
    );
}

/// Publishes `count` messages with distinct ids, one every 5 ms.
fn publish_steadily(
    js: &jetstream::Context,
    subject: &str,
    count: i64,
) -> tokio::task::JoinHandle<()> {
    let js = js.clone();
    let subject = subject.to_owned();
    tokio::spawn(async move {
        for i in 0..count {
            publish(
                &js,
                &subject,
                &deposit("a", i),
                Some(&format!("steady-{i}")),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}
