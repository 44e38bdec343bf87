//! Connections that die or lose their state: kept connections the server
//! ended, and sessions that lost their prepared statements, cost a retry on
//! another connection, never a delivery or a message.

use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, State, Transient, idempotent};
use idem_tests::scenario::*;

use crate::{latest_delivery, worker_pool};

/// The connections a route keeps between messages die (the server ended
/// them). The next message must not take one dead kept connection after
/// another until it runs out of tries: no delivery is used up, and every
/// message is applied once.
#[tokio::test]
async fn dead_kept_connections_use_up_no_delivery() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEADCONN", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).concurrency(8), no_ids),
        nats,
        worker_pool(env.database_url()).await,
    );
    let stats = handle.stats("c").unwrap();
    let (mut published, mut terminated) = (0, 0);
    for _ in 0..5 {
        // A burst leaves the route keeping several connections...
        for _ in 0..16 {
            publish(
                &js,
                &subject,
                &deposit("burst", published),
                Some(&format!("d-{published}")),
            )
            .await;
            published += 1;
        }
        eventually(
            "the burst is processed",
            Duration::from_secs(30),
            || async { stats.processed() == published as u64 },
        )
        .await;
        // ...which the server ends at once, before the route gives them
        // back to the pool (after 250 ms unused).
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = 'idem-worker'
               AND state IN ('idle', 'idle in transaction')",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        terminated += killed.into_iter().filter(|&killed| killed).count();
        // One message alone meets them.
        publish(
            &js,
            &subject,
            &deposit("alone", published),
            Some(&format!("d-{published}")),
        )
        .await;
        published += 1;
        wait_all_acked(&js, &stream, "c").await;
    }
    stop(handle.clone(), task).await;
    assert!(terminated >= 10, "the worker's connections were terminated");
    assert!(
        stats.infrastructure_errors() + stats.retried_in_process() > 0,
        "the router met dead connections"
    );
    assert_eq!(stats.failed(), 0, "no delivery was used up");
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(published));
    assert_eq!(
        latest_delivery(&pool, "no-ids").await,
        1,
        "every message was applied on its first delivery"
    );
}

// --- Prepared statements the session lost ----------------------------------

/// Drops the session's prepared statements (idem's and sqlx's) on the first
/// run of each message: "commits" returns `Ok` after, which the COMMIT's
/// check then meets; "fails" returns an error, which leaves its kept
/// connection to the next message's claim.
#[idempotent(name = "deallocates")]
async fn deallocates(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(first_runs): State<FirstRuns>,
    d: Deposit,
) -> Result<(), idem_runtime::BoxError> {
    if first_runs.first(delivery) && d.account != "plain" {
        sqlx::raw_sql("DEALLOCATE ALL").execute(&mut **tx).await?;
        if d.account == "fails" {
            return Err(Transient::new("fails after dropping the prepared statements").into());
        }
        return Ok(());
    }
    record_effect(tx, "deallocates", &d, delivery).await?;
    Ok(())
}

/// The claim and the COMMIT's check are the session's prepared statements.
/// A session that lost them (a handler ran `DEALLOCATE ALL`; a pooler moved
/// the connection) costs a retry on another connection, never a message:
/// each is applied once, none is dead-lettered.
#[tokio::test]
async fn lost_prepared_statements_cost_a_retry_not_a_message() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEALLOC", Duration::from_secs(120)).await;
    // One at a time, so that the connection a message leaves is the next
    // one's.
    let accounts = [
        "commits", "plain", "fails", "plain", "commits", "plain", "fails", "plain",
    ];
    for (i, account) in accounts.iter().enumerate() {
        publish(
            &js,
            &subject,
            &deposit(account, 1),
            Some(&format!("dl-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::with_state(FirstRuns::default()).route(
            fast(Route::new(&stream, "c")).per_message().concurrency(1),
            deallocates,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    // Each "commits" meets its missing check once; each "fails" leaves its
    // connection to a claim that meets the missing statement once.
    assert!(
        stats.retried_in_process() == 4,
        "the missing statements were met and retried: {}",
        stats.retried_in_process()
    );
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "deallocates").await,
        Ledger::once_each(accounts.len() as i64)
    );
}
