//! What a COMMIT's outcome tells the runtime, and what it must not be taken
//! for: a handler that swallowed a failed statement (PostgreSQL turns its
//! COMMIT into a rollback and reports success), a COMMIT that a deferred
//! constraint refused, and a handler that committed by itself. None is acked
//! as processed, and each message is applied once.

use std::time::Duration;

use idem_runtime::{BoxError, Delivery, Route, Router, State, Transient, idempotent};
use idem_tests::scenario::*;
use idem_tests::{Batched, Batching};

// --- A handler that swallows a failed statement -------------------------

#[idempotent(name = "swallows")]
async fn swallows(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "swallows", &d, delivery).await?;
    // The classic mistake: "insert, and ignore it if it fails". PostgreSQL
    // has now aborted the whole transaction, effect and claim included.
    let _ = sqlx::query("INSERT INTO effects (handler) VALUES (NULL)")
        .execute(&mut **tx)
        .await;
    Ok(())
}

/// A handler that ignores a failed statement and returns `Ok` has lost its
/// transaction: PostgreSQL turns the COMMIT into a rollback and reports
/// success. No such message may be acked as processed: each one is
/// dead-lettered with an error that says what happened, and nothing (no
/// effect, no claim) is half-applied.
async fn a_swallowed_sql_error_is_never_acked_as_processed(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SWALLOW", Duration::from_secs(120)).await;
    const MESSAGES: usize = 10;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("sw-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).batching(batch), swallows),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.processed(), 0, "nothing was acked as processed");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), MESSAGES, "every message is dead-lettered");
    for letter in &letters {
        assert_eq!(header(letter, "Idem-Failure"), "permanent");
        assert!(
            header(letter, "Idem-Error").contains("aborted"),
            "the error says what happened: {}",
            header(letter, "Idem-Error")
        );
        assert_eq!(header(letter, "Idem-Delivered"), "1");
    }
    assert_eq!(ledger(&pool, "swallows").await, Ledger::once_each(0));
}

#[idempotent(name = "swallows-once")]
async fn swallows_once(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(swallowed_once): State<FirstRuns>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "swallows-once", &d, delivery).await?;
    let first = swallowed_once.first(delivery);
    if first {
        let _ = sqlx::query("INSERT INTO effects (handler) VALUES (NULL)")
            .execute(&mut **tx)
            .await;
    }
    Ok(())
}

/// A swallowed error that does not come back on a retry (a lost race, say)
/// costs a retry, not the message: each message is applied once.
async fn a_swallowed_error_that_clears_is_retried_and_applied_once(batch: Batching) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SWALLOW1", Duration::from_secs(120)).await;
    const MESSAGES: usize = 10;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", 1), Some(&format!("s1-{i}"))).await;
    }
    let swallowed_once = FirstRuns::default();
    let (handle, task) = spawn(
        Router::with_state(swallowed_once.clone()).route(
            fast(Route::new(&stream, "c")).batching(batch),
            swallows_once,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let seen = swallowed_once.0.lock().unwrap().clone();
    assert_eq!(seen.len(), MESSAGES, "each message swallowed an error once");
    assert!(dead_letters(&js, &stream).await.is_empty());
    assert_eq!(
        ledger(&pool, "swallows-once").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

// --- A COMMIT that a deferred constraint refuses ------------------------

#[idempotent(name = "deferred")]
async fn deferred(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "deferred", &d, delivery).await?;
    // Checked only at COMMIT, which then fails: the server answered, so the
    // outcome is known, and nothing was committed.
    sqlx::query("INSERT INTO children (parent) VALUES (42)")
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A COMMIT that the server refused (a deferred constraint) is a failure
/// whose outcome is known: it is classed and counted like any other
/// failure, not NAKed as "unknown" until the delivery limit runs out.
#[tokio::test]
async fn a_commit_refused_by_a_deferred_constraint_is_a_known_failure() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("DEFERRED", Duration::from_secs(120)).await;
    sqlx::raw_sql(
        "CREATE TABLE parents (id int PRIMARY KEY);
         CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&pool)
    .await
    .unwrap();
    publish(&js, &subject, &deposit("a", 1), Some("orphan-child-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")).max_deliver(2), deferred),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.commit_failed(), 0, "not an unknown outcome");
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert_eq!(header(&letters[0], "Idem-Delivered"), "1");
    assert!(header(&letters[0], "Idem-Error").contains("23503"));
    assert_eq!(ledger(&pool, "deferred").await, Ledger::once_each(0));
}

idem_tests::in_every_mode!(batch = 8; a_swallowed_sql_error_is_never_acked_as_processed, a_swallowed_error_that_clears_is_retried_and_applied_once);

// ---------------------------------------------------------------------------
// A handler that commits by itself: half its work is acked as done.
// ---------------------------------------------------------------------------

/// "Commit in chunks": a handler that ends the transaction with a raw
/// `COMMIT` (and opens another), then fails before its second chunk.
#[idempotent(name = "chunked")]
async fn chunked(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), BoxError> {
    record_effect(tx, "chunked-1", &d, delivery).await?;
    sqlx::raw_sql("COMMIT; BEGIN").execute(&mut **tx).await?;
    if delivery.delivered() == 1 {
        match d.account.as_str() {
            "panics" => panic!("the second chunk panicked"),
            // Past the route's handler timeout.
            "hangs" => tokio::time::sleep(Duration::from_secs(3)).await,
            _ => {}
        }
        return Err(Transient::new("the second chunk failed").into());
    }
    record_effect(tx, "chunked-2", &d, delivery).await?;
    Ok(())
}

/// A handler that ends the transaction itself (a raw COMMIT) has committed
/// its claim with half its work. When it then fails, its redelivery would
/// find the claim and be acked as a duplicate: the second half never done,
/// nothing dead-lettered. The runtime must catch it (`HandlerError::ClaimLost`,
/// a dead letter), whether the handler returns an error, panics or outlives
/// its timeout: the message is completed or dead-lettered, never acked half
/// done.
#[tokio::test]
async fn a_handler_that_commits_by_itself_is_not_acked_half_done() {
    a_handler_commits_by_itself_then("returns an error").await;
}

/// As above, when the handler panics after its raw COMMIT: its connection
/// is closed unasked, so the runtime looks for the claim on another.
#[tokio::test]
async fn a_handler_that_commits_by_itself_then_panics_is_not_acked_half_done() {
    a_handler_commits_by_itself_then("panics").await;
}

/// As above, when the handler outlives its timeout after its raw COMMIT.
#[tokio::test]
async fn a_handler_that_commits_by_itself_then_hangs_is_not_acked_half_done() {
    a_handler_commits_by_itself_then("hangs").await;
}

/// A handler commits its first chunk by itself, then fails as `failure`
/// says on its first delivery.
async fn a_handler_commits_by_itself_then(failure: &str) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("CHUNKED", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit(failure, 1), Some("chunk-1")).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).handler_timeout(Duration::from_secs(1)),
            chunked,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.failed() >= 1,
        "the first delivery failed after its raw COMMIT"
    );
    let first = ledger(&pool, "chunked-1").await.effects;
    let second = ledger(&pool, "chunked-2").await.effects;
    let letters = dead_letters(&js, &stream).await.len();
    assert!(
        second == 1 || letters == 1,
        "acked half done: first chunk applied {first}, second chunk {second}, dead letters \
         {letters}, acked as a duplicate {} time(s)",
        stats.duplicates()
    );
}

/// The second message of each batch commits by itself (a raw COMMIT), then
/// fails: that COMMIT made every claim of the batch permanent, the handled
/// and the not yet handled alike.
#[idempotent(name = "chunked-in-batch")]
async fn chunked_in_batch(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), BoxError> {
    if let Some(failure) = d.account.strip_prefix("chunky-") {
        sqlx::raw_sql("COMMIT; BEGIN").execute(&mut **tx).await?;
        match failure {
            "panics" => panic!("panicked after its raw COMMIT"),
            // Past the route's handler timeout.
            "hangs" => tokio::time::sleep(Duration::from_secs(3)).await,
            _ => {}
        }
        return Err(Transient::new("failed after its raw COMMIT").into());
    }
    record_effect(tx, "chunked-in-batch", &d, delivery).await?;
    Ok(())
}

/// In a batch, a handler's raw COMMIT commits the claims of its batch
/// neighbours too, those whose handlers have not run yet. Retried, they
/// would find their claims and be acked without ever running. None may be:
/// every message is applied or dead-lettered, never acked undone.
#[tokio::test]
async fn a_raw_commit_in_a_batch_never_acks_its_neighbours_undone() {
    a_raw_commit_then("returns an error").await;
}

/// As above, when the handler panics after its raw COMMIT: the batch's
/// connection is closed rather than asked, so the runtime asks another
/// connection whether the batch's transaction committed.
#[tokio::test]
async fn a_raw_commit_then_a_panic_in_a_batch_never_acks_its_neighbours_undone() {
    a_raw_commit_then("panics").await;
}

/// As above, when the handler outlives its timeout after its raw COMMIT.
#[tokio::test]
async fn a_raw_commit_then_a_timeout_in_a_batch_never_acks_its_neighbours_undone() {
    a_raw_commit_then("hangs").await;
}

/// The second message of a batch of four ends the transaction with a raw
/// COMMIT, then fails as `failure` says.
async fn a_raw_commit_then(failure: &str) {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("CHUNKBATCH", Duration::from_secs(120)).await;
    const MESSAGES: usize = 4;
    for i in 0..MESSAGES {
        let account = if i == 1 {
            format!("chunky-{failure}")
        } else {
            "a".to_owned()
        };
        publish(
            &js,
            &subject,
            &deposit(&account, i as i64),
            Some(&format!("cb-{i}")),
        )
        .await;
    }
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .batch(MESSAGES)
                .concurrency(1)
                .handler_timeout(Duration::from_secs(1)),
            chunked_in_batch,
        ),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(
        stats.failed() >= 1,
        "the raw COMMIT's handler failed: {stats:?}"
    );
    let applied: std::collections::BTreeSet<String> =
        sqlx::query_scalar("SELECT message_id FROM effects WHERE handler = 'chunked-in-batch'")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let letters: std::collections::BTreeSet<String> = dead_letters(&js, &stream)
        .await
        .iter()
        .map(|letter| header(letter, "Idem-Message-Id"))
        .collect();
    for i in 0..MESSAGES {
        let id = format!("cb-{i}");
        assert!(
            applied.contains(&id) || letters.contains(&id),
            "{id} was acked without being applied or dead-lettered: applied {applied:?}, dead letters {letters:?}, {stats:?}"
        );
    }
}
