//! A statement stuck on a lock is stopped at the handler timeout, in the
//! database too, and the route goes on.

use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::*;

// --- A statement stuck in the database -----------------------------------

#[idempotent(name = "locker")]
async fn locker(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if d.account == "locked" {
        sqlx::query("SELECT id FROM hot_rows WHERE id = 1 FOR UPDATE")
            .execute(&mut **tx)
            .await?;
    }
    record_effect(tx, "locker", &d, delivery).await
}

/// Backends of this database waiting on a lock, other than the caller's.
async fn backends_waiting_on_a_lock(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A handler blocked on a row lock past `handler_timeout` is stopped in the
/// database too: its statement does not go on waiting, holding the route's
/// only slot and a connection, and the next message runs while the lock is
/// still held. Once it is released the blocked message is applied once.
#[tokio::test]
async fn a_statement_stuck_on_a_lock_is_stopped_at_the_handler_timeout() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("STUCK", Duration::from_secs(120)).await;
    sqlx::raw_sql("CREATE TABLE hot_rows (id int PRIMARY KEY); INSERT INTO hot_rows VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM hot_rows WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .handler_timeout(Duration::from_secs(1))
                .concurrency(1),
            locker,
        ),
        nats,
        pool.clone(),
    );
    publish(&js, &subject, &deposit("locked", 1), Some("locked-1")).await;
    eventually(
        "the handler waits on the lock",
        Duration::from_secs(30),
        || async { backends_waiting_on_a_lock(&pool).await == 1 },
    )
    .await;
    let (stuck, stuck_since): (i32, f64) = sqlx::query_as(
        "SELECT pid, extract(epoch FROM query_start)::float8 FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND pid <> pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    publish(&js, &subject, &deposit("free", 1), Some("free-1")).await;
    let stats = handle.stats("c").unwrap();
    eventually(
        "the next message runs while the lock is held",
        Duration::from_secs(20),
        || async { ledger(&pool, "locker").await.effects == 1 },
    )
    .await;
    assert!(stats.failed() >= 1, "the locked message timed out");
    // The statement that waited is gone, while the lock is still held: the
    // server cancelled it (statement_timeout), or the watchdog ended its
    // backend (its client closed the connection). Its backend may be back
    // in the pool, and its retries may wait on the lock again, but each
    // in a statement of its own.
    eventually(
        "the stuck statement is gone",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE pid = $1 AND extract(epoch FROM query_start)::float8 = $2",
            )
            .bind(stuck)
            .bind(stuck_since)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;

    holder.rollback().await.unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "locker").await, Ledger::once_each(2));
}
