//! Expiry of claims: the claims table's generations, their rotation, and
//! the purge that drops the ones older than the retention.
//!
//! Claims live in `idem_claims`, partitioned by generation (see the
//! migration `0002_claims_by_generation.sql` for the claim's side of it).
//! [`purge`] runs beside every router that has a route with a retention
//! (`Route::retention`), and can be run on demand, from a cron job say.
//! Each run, under a session advisory lock so that concurrent purgers do no
//! work twice:
//!
//! 1. **Ends a transition** once every transaction that was running when it
//!    began has ended (their virtual transaction ids, from `pg_locks`, are
//!    gone). Until then claims go into both open generations; after it the
//!    older one is *sealed*: no claim can still be writing into it.
//! 2. **Rotates** when the current generation is older than the generation
//!    length (half the retention): a new partition is created and attached
//!    (`ATTACH PARTITION` takes `SHARE UPDATE EXCLUSIVE` on the parent, which
//!    claims never wait for), and becomes current, in transition.
//! 3. **Expires** each generation sealed longer than the retention ago: the
//!    claims in it of handlers that keep theirs forever are copied into the
//!    kept partition, then it is detached with `DETACH PARTITION ...
//!    CONCURRENTLY` and dropped. No row is deleted one by one, so nothing
//!    needs vacuuming and no index bloats.
//!
//! The retention applied is the longest any registered handler asks for:
//! retention is a minimum. A claim lives at least that long after it was
//! made, and at most about one generation length more.
//!
//! No step takes a lock a claim waits for: DDL on the parent takes `SHARE
//! UPDATE EXCLUSIVE` (claims take `ROW EXCLUSIVE` and `ACCESS SHARE`), new
//! and detached partitions are not in any claim's way, and every statement
//! runs under a `lock_timeout`, so a purge that meets another's DDL fails
//! and tries again at its next run rather than queue.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::Error;

/// The key of the session advisory lock a purge holds.
const PURGE_LOCK: i64 = 0x6964_656d_5f65_7870; // "idem_exp"

/// How long a purge statement may wait for a lock before giving up for
/// this run.
const LOCK_TIMEOUT: &str = "5s";

/// What one [`purge`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Another purge held the lock: this one did nothing.
    pub skipped: bool,
    /// The longest retention a handler asks for; `None`: no handler lets
    /// its claims expire, so nothing rotates or expires.
    pub retention: Option<Duration>,
    /// The generation whose transition ended (and which is current, its
    /// predecessor sealed).
    pub transition_ended: Option<i32>,
    /// The generation rotated to.
    pub rotated_to: Option<i32>,
    /// The generations detached and dropped.
    pub expired: Vec<i32>,
    /// Claims copied into the kept partition (handlers without retention).
    pub kept: u64,
    /// Bytes of the dropped partitions, indexes included.
    pub freed_bytes: u64,
}

/// How long a generation is current: half the retention, so that a claim
/// lives between the retention and one and a half times it (and at least a
/// second, so that tests with tiny retentions still rotate sanely).
pub fn generation_length(retention: Duration) -> Duration {
    (retention / 2).max(Duration::from_secs(1))
}

/// How often a router's background purge runs for `retention`.
pub(crate) fn purge_interval(retention: Duration) -> Duration {
    (generation_length(retention) / 4).clamp(Duration::from_millis(250), Duration::from_secs(60))
}

/// Runs the expiry once: ends a transition that can end, rotates if the
/// current generation is due, and expires what is past the retention (see
/// the module docs). Safe to run from any number of processes at once: all
/// but one skip.
pub async fn purge(pool: &PgPool) -> Result<PurgeReport, Error> {
    // A session of its own, so that its advisory lock ends with it, and a
    // run cut short (a cancelled task) never hands a pooled connection back
    // halfway through DDL.
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(PURGE_LOCK)
        .fetch_one(&mut conn)
        .await?;
    if !locked {
        let _ = conn.close().await;
        return Ok(PurgeReport {
            skipped: true,
            ..PurgeReport::default()
        });
    }
    let report = purge_locked(&mut conn).await;
    // Closing ends the session, and the lock with it.
    let _ = conn.close().await;
    report
}

async fn purge_locked(conn: &mut PgConnection) -> Result<PurgeReport, Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET lock_timeout = '{LOCK_TIMEOUT}'"
    )))
    .execute(&mut *conn)
    .await?;
    let mut report = PurgeReport {
        retention: retention(conn).await?,
        ..PurgeReport::default()
    };
    finish_detaches(conn, &mut report).await?;
    report.transition_ended = end_transition(conn).await?;
    let Some(retention) = report.retention else {
        return Ok(report);
    };
    report.rotated_to = rotate_if_due(conn, generation_length(retention)).await?;
    let due: Vec<i32> = sqlx::query_scalar(
        "SELECT gen FROM idem_generations
          WHERE sealed_at <= now() - $1::bigint * interval '1 millisecond'
          ORDER BY gen",
    )
    .bind(millis(retention))
    .fetch_all(&mut *conn)
    .await?;
    for generation in due {
        expire(conn, generation, &mut report).await?;
    }
    Ok(report)
}

/// The longest retention a registered handler asks for.
async fn retention(conn: &mut PgConnection) -> Result<Option<Duration>, sqlx::Error> {
    let millis: Option<i64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM max(retention)) * 1000)::bigint FROM idem_handlers",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(millis.map(|millis| Duration::from_millis(millis.max(0).unsigned_abs())))
}

/// Ends the transition if every transaction that was running when it
/// began has ended; records those transactions first if a crash left them
/// unrecorded. Returns the generation whose transition ended.
async fn end_transition(conn: &mut PgConnection) -> Result<Option<i32>, sqlx::Error> {
    let (current, transition, recorded): (i32, bool, bool) = sqlx::query_as(
        "SELECT current_gen, transition, waiting_for IS NOT NULL FROM idem_dedup_state",
    )
    .fetch_one(&mut *conn)
    .await?;
    if !transition {
        return Ok(None);
    }
    if !recorded {
        record_running_transactions(conn).await?;
        return Ok(None);
    }
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l, idem_dedup_state s
          WHERE l.locktype = 'virtualxid' AND l.virtualxid = ANY (s.waiting_for)",
    )
    .fetch_one(&mut *conn)
    .await?;
    if running > 0 {
        tracing::debug!(
            running,
            "a generation's transition waits for transactions older than it"
        );
        return Ok(None);
    }
    let mut tx = conn.begin().await?;
    sqlx::query("UPDATE idem_dedup_state SET transition = false, waiting_for = NULL")
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE idem_generations SET sealed_at = now() WHERE gen = $1 - 1")
        .bind(current)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(
        generation = current,
        "claims generation transition ended; the previous one is sealed"
    );
    Ok(Some(current))
}

/// Records the transactions running now, which the transition waits for.
/// Taken after the rotation committed: a claim that saw the old generation
/// started before that, so it is among them unless it has ended.
async fn record_running_transactions(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE idem_dedup_state
            SET waiting_for = (SELECT coalesce(array_agg(virtualxid), '{}')
                                 FROM pg_locks
                                WHERE locktype = 'virtualxid' AND pid <> pg_backend_pid())
          WHERE transition AND waiting_for IS NULL",
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Opens the next generation if the current one has been current for
/// `length` and is not in transition.
async fn rotate_if_due(conn: &mut PgConnection, length: Duration) -> Result<Option<i32>, Error> {
    let due: Option<i32> = sqlx::query_scalar(
        "SELECT s.current_gen + 1 FROM idem_dedup_state s
           JOIN idem_generations g ON g.gen = s.current_gen
          WHERE NOT s.transition AND g.opened_at <= now() - $1::bigint * interval '1 millisecond'",
    )
    .bind(millis(length))
    .fetch_optional(&mut *conn)
    .await?;
    let Some(next) = due else {
        return Ok(None);
    };
    let partition = partition_name(next);
    // Attached before it becomes current, as a table of its own first:
    // CREATE TABLE ... PARTITION OF would lock the parent ACCESS EXCLUSIVE.
    // A run that crashed after attaching finds it attached and goes on.
    let attached: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_inherits
                         WHERE inhparent = 'idem_claims'::regclass
                           AND inhrelid = to_regclass($1))",
    )
    .bind(&partition)
    .fetch_one(&mut *conn)
    .await?;
    if !attached {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {partition};
             CREATE TABLE {partition} (LIKE idem_claims INCLUDING DEFAULTS,
                                       CHECK (gen = {next}));
             ALTER TABLE idem_claims ATTACH PARTITION {partition} FOR VALUES IN ({next});"
        )))
        .execute(&mut *conn)
        .await?;
    }
    let mut tx = conn.begin().await?;
    sqlx::query("INSERT INTO idem_generations (gen) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(next)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE idem_dedup_state SET current_gen = $1, transition = true, waiting_for = NULL",
    )
    .bind(next)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    record_running_transactions(conn).await?;
    tracing::info!(generation = next, "claims generation rotated");
    Ok(Some(next))
}

/// Moves the claims of handlers without retention out of generation
/// `generation`
/// into the kept partition, then detaches and drops it.
async fn expire(
    conn: &mut PgConnection,
    generation: i32,
    report: &mut PurgeReport,
) -> Result<(), Error> {
    let partition = partition_name(generation);
    let kept = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO idem_claims (key, gen, handler_id, claimed_at, result)
         SELECT key, 0, handler_id, claimed_at, result FROM {partition}
          WHERE handler_id IN (SELECT id FROM idem_handlers WHERE retention IS NULL)
         ON CONFLICT DO NOTHING"
    )))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    report.kept += kept;
    // Not in a transaction: DETACH ... CONCURRENTLY commits in two steps,
    // waiting in between for transactions that may still read it.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE idem_claims DETACH PARTITION {partition} CONCURRENTLY"
    )))
    .execute(&mut *conn)
    .await?;
    drop_detached(conn, generation, report).await
}

/// Drops generation `generation`'s partition, detached, and forgets it.
async fn drop_detached(
    conn: &mut PgConnection,
    generation: i32,
    report: &mut PurgeReport,
) -> Result<(), Error> {
    let partition = partition_name(generation);
    let bytes: Option<i64> = sqlx::query_scalar("SELECT pg_total_relation_size(to_regclass($1))")
        .bind(&partition)
        .fetch_one(&mut *conn)
        .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {partition}"
    )))
    .execute(&mut *conn)
    .await?;
    sqlx::query("DELETE FROM idem_generations WHERE gen = $1")
        .bind(generation)
        .execute(&mut *conn)
        .await?;
    report.expired.push(generation);
    report.freed_bytes += bytes.unwrap_or(0).max(0).unsigned_abs();
    tracing::info!(generation, bytes, "claims generation expired");
    Ok(())
}

/// Completes detaches that an earlier run began but did not finish (its
/// session ended between the two steps of `DETACH ... CONCURRENTLY`).
async fn finish_detaches(conn: &mut PgConnection, report: &mut PurgeReport) -> Result<(), Error> {
    let pending: Vec<String> = sqlx::query_scalar(
        "SELECT inhrelid::regclass::text FROM pg_inherits
          WHERE inhparent = 'idem_claims'::regclass AND inhdetachpending",
    )
    .fetch_all(&mut *conn)
    .await?;
    for partition in pending {
        let Some(generation) = partition
            .strip_prefix("idem_claims_g")
            .and_then(|number| number.parse::<i32>().ok())
        else {
            continue;
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE idem_claims DETACH PARTITION {} FINALIZE",
            partition_name(generation)
        )))
        .execute(&mut *conn)
        .await?;
        drop_detached(conn, generation, report).await?;
    }
    Ok(())
}

/// The partition of generation `generation` (a number: nothing to quote).
fn partition_name(generation: i32) -> String {
    format!("idem_claims_g{generation}")
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Runs [`purge`] every `interval` until the task is dropped; a failed run
/// is logged and the next one tries again.
pub(crate) async fn run_in_background(pool: PgPool, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match purge(&pool).await {
            Ok(report) if report.skipped => {}
            Ok(report) => tracing::debug!(?report, "claims purge ran"),
            Err(error) => {
                tracing::warn!(%error, "claims purge failed; trying again at its next run")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_is_half_the_retention() {
        assert_eq!(
            generation_length(Duration::from_secs(7 * 86_400)),
            Duration::from_secs(302_400)
        );
        assert_eq!(
            generation_length(Duration::from_millis(10)),
            Duration::from_secs(1)
        );
        assert_eq!(
            purge_interval(Duration::from_secs(7 * 86_400)),
            Duration::from_secs(60)
        );
        assert_eq!(
            purge_interval(Duration::from_secs(2)),
            Duration::from_millis(250)
        );
    }
}
