//! The outbox on SQLite: the same table as PostgreSQL's, and a relay whose
//! rows are held by a **lease** rather than a row lock.
//!
//! SQLite has one writer at a time and no row locks. A relay that held a
//! transaction open while it published would hold the write lock, and
//! every handler, for as long as its PubAcks took. So a cycle's take is a
//! short write transaction of its own (`BEGIN IMMEDIATE`): it reads the
//! rows no live lease holds, and leases those it takes for
//! [`LEASE_SECONDS`] under a random lease number. Other cycles, of this
//! relay or of another process, skip leased rows, as PostgreSQL's `SKIP
//! LOCKED` skips locked ones. The finish is a second short transaction:
//! it records the failures, deletes the rows JetStream acknowledged and
//! clears the lease on the rest. Between the two, no connection is held.
//! The take holds the write lock for ids and sizes only: the rows' payloads
//! are read after its COMMIT, by lease, and only those of the rows that fit
//! in the cycle's bytes.
//!
//! A finish that meets the write lock held past `busy_timeout` is tried
//! again (twice), since it is idempotent: deletes by id, marks and the
//! lease's end by lease number. A session dropped while it holds a lease
//! (a finish that still failed) gives it back in a task of its own, so
//! that its rows are not kept for the lease's length.
//!
//! A cycle whose process died keeps its rows leased until the lease ends:
//! they are published [`LEASE_SECONDS`] later, where PostgreSQL's come
//! back at once (a lost connection rolls back). A cycle that outlives its
//! lease (a frozen process) may see another take its rows and publish
//! them too: the copies carry the same `Nats-Msg-Id`, which JetStream's
//! duplicate window drops. Ids are `AUTOINCREMENT`, never reused, so such
//! a late finish can only delete rows it published.

use std::time::Duration;

use sqlx::{AssertSqlSafe, FromRow, Pool, Sqlite, SqlitePool};

use crate::error::class::is_lock_timeout;

use crate::store::outbox::{
    Advanced, FailingRow, Lane, Listener, Marks, OutboxStore, RelaySession, Row, Take,
};

/// How long a take's lease holds its rows: as PostgreSQL's relay bounds
/// its transactions (`store/outbox.rs`), far above a cycle's longest pause.
pub(crate) const LEASE_SECONDS: f64 = 60.0;

/// The outbox table (migration 3).
pub(crate) const MIGRATION: &str = "\
CREATE TABLE idem_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    msg_id TEXT NOT NULL UNIQUE,
    subject TEXT NOT NULL,
    payload BLOB NOT NULL,
    headers TEXT,
    created_at REAL NOT NULL DEFAULT (unixepoch('subsec')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    failed_at REAL,
    not_before REAL,
    lease INTEGER,
    leased_until REAL
);
CREATE INDEX idem_outbox_due ON idem_outbox (not_before) WHERE not_before IS NOT NULL;";

/// Rows no live lease holds.
const UNLEASED: &str = "(leased_until IS NULL OR leased_until < unixepoch('subsec'))";

impl OutboxStore for Sqlite {
    type Relay = Session;

    // A session holds no connection between its statements, but the fresh
    // lane finishes one cycle while it takes the next, and the retry lane
    // runs beside it.
    const RELAY_CONNECTIONS: usize = 3;

    async fn queue(
        connection: &mut Self::Connection,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        headers: Option<String>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO idem_outbox (msg_id, subject, payload, headers) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (msg_id) DO NOTHING",
        )
        .bind(msg_id)
        .bind(subject)
        .bind(payload)
        .bind(headers)
        .execute(connection)
        .await?;
        Ok(())
    }

    async fn lag(pool: &Pool<Self>) -> Result<(i64, Option<f64>, i64, bool), sqlx::Error> {
        let (pending, oldest, failing): (i64, Option<f64>, i64) = sqlx::query_as(
            "SELECT count(*), unixepoch('subsec') - min(created_at),
                    count(*) FILTER (WHERE not_before IS NOT NULL)
               FROM idem_outbox",
        )
        .fetch_one(pool)
        .await?;
        Ok((pending, oldest, failing, false))
    }

    async fn failing(pool: &Pool<Self>, most: usize) -> Result<Vec<FailingRow>, sqlx::Error> {
        sqlx::query_as(
            "SELECT subject, last_error, count(*),
                    unixepoch('subsec') - min(created_at),
                    max(attempts),
                    min(not_before) - unixepoch('subsec')
               FROM idem_outbox WHERE not_before IS NOT NULL
              GROUP BY subject, last_error
              ORDER BY count(*) DESC, subject
              LIMIT ?1",
        )
        .bind(i64::try_from(most).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await
    }

    async fn retry_failing(pool: &Pool<Self>, subject: Option<&str>) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE idem_outbox SET not_before = unixepoch('subsec'), attempts = 0
              WHERE not_before IS NOT NULL AND (?1 IS NULL OR subject = ?1)",
        )
        .bind(subject)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn next_due(pool: &Pool<Self>) -> Result<Option<Duration>, sqlx::Error> {
        // Leased rows are another cycle's: not due for this one.
        let due: Option<f64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT min(not_before) - unixepoch('subsec') FROM idem_outbox
              WHERE not_before IS NOT NULL AND {UNLEASED}"
        )))
        .fetch_one(pool)
        .await?;
        Ok(due
            .map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)))
    }

    async fn any_fresh(pool: &Pool<Self>) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM idem_outbox WHERE not_before IS NULL)")
            .fetch_one(pool)
            .await
    }

    async fn listen(_: &Pool<Self>, _: &str) -> Result<Listener, sqlx::Error> {
        Err(sqlx::Error::Protocol(
            "SQLite has no notifications: its relays are woken in process, and poll".into(),
        ))
    }
}

/// A relay's session on SQLite: the pool, and the lease of the rows its
/// open cycle holds, if any.
pub struct Session {
    pool: SqlitePool,
    lease: Option<i64>,
}

/// How often a finish that met the write lock held past `busy_timeout`
/// is sent in all.
const FINISH_TRIES: u32 = 3;

impl Drop for Session {
    fn drop(&mut self) {
        let (Some(lease), Ok(runtime)) = (self.lease, tokio::runtime::Handle::try_current()) else {
            return;
        };
        let pool = self.pool.clone();
        runtime.spawn(async move {
            if let Err(error) = end_lease(&pool, lease).await {
                tracing::debug!(%error, "an outbox lease could not be given back; its rows wait for it to end");
            }
        });
    }
}

/// Gives lease `lease`'s rows back to the other cycles.
async fn end_lease(pool: &SqlitePool, lease: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE idem_outbox SET lease = NULL, leased_until = NULL WHERE lease = ?1")
        .bind(lease)
        .execute(pool)
        .await?;
    Ok(())
}

impl RelaySession<Sqlite> for Session {
    async fn acquire(pool: &SqlitePool) -> Result<Self, sqlx::Error> {
        Ok(Session {
            pool: pool.clone(),
            lease: None,
        })
    }

    async fn advance(&mut self, finish: Option<(&[i64], &Marks)>, next: Option<Take>) -> Advanced {
        let mut committed = false;
        if let Some((acknowledged, marks)) = finish {
            let mut tries = 0;
            let finished = loop {
                tries += 1;
                match self.finish(acknowledged, marks).await {
                    Err(error) if is_lock_timeout(&error) && tries < FINISH_TRIES => {
                        tracing::debug!(%error, "an outbox cycle's finish met the write lock; trying again");
                    }
                    finished => break finished,
                }
            };
            match finished {
                Ok(()) => committed = true,
                Err(error) => {
                    return Advanced {
                        committed,
                        taken: Err(error),
                    };
                }
            }
        }
        let taken = match next {
            Some(take) => self.lease(take).await,
            None => Ok(Vec::new()),
        };
        Advanced { committed, taken }
    }

    async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        if let Some(lease) = self.lease {
            end_lease(&self.pool, lease).await?;
            self.lease = None;
        }
        Ok(())
    }
}

impl Session {
    /// Takes and leases a cycle's rows, in a write transaction of its own
    /// that reads ids and sizes only; then reads the rows it leased.
    async fn lease(&mut self, take: Take) -> Result<Vec<Row>, sqlx::Error> {
        let limit = i64::try_from(take.limit).unwrap_or(i64::MAX);
        let (filter, order) = match take.lane {
            Lane::Fresh => ("not_before IS NULL", "id"),
            Lane::Retry => ("not_before <= unixepoch('subsec')", "not_before, id"),
        };
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let candidates: Vec<(i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, length(payload) + coalesce(length(headers), 0)
               FROM idem_outbox WHERE {filter} AND {UNLEASED}
              ORDER BY {order} LIMIT ?1"
        )))
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let chosen = take.fitting(&candidates);
        if chosen.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let lease: i64 = rand::random();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE idem_outbox SET lease = ?1, leased_until = unixepoch('subsec') + {LEASE_SECONDS}
              WHERE id IN ({})",
            ids(chosen.iter().copied())
        )))
        .bind(lease)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.lease = Some(lease);
        let locked = candidates.len() as i64;
        sqlx::query(
            "SELECT id, msg_id, subject, payload, headers, attempts, ?2
               FROM idem_outbox WHERE lease = ?1 ORDER BY id",
        )
        .bind(lease)
        .bind(locked)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(Row::from_row)
        .collect()
    }

    /// Ends the open cycle in a write transaction: records `marks` on the
    /// rows this lease still holds, deletes `acknowledged`, and clears the
    /// lease on the rest.
    async fn finish(&mut self, acknowledged: &[i64], marks: &Marks) -> Result<(), sqlx::Error> {
        let Some(lease) = self.lease else {
            return Ok(());
        };
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for ((id, error), backoff) in marks.ids.iter().zip(&marks.errors).zip(&marks.backoffs) {
            sqlx::query(
                "UPDATE idem_outbox
                    SET attempts = attempts + 1, last_error = ?1, failed_at = unixepoch('subsec'),
                        not_before = unixepoch('subsec') + ?2, lease = NULL, leased_until = NULL
                  WHERE id = ?3 AND lease = ?4",
            )
            .bind(error)
            .bind(backoff)
            .bind(id)
            .bind(lease)
            .execute(&mut *tx)
            .await?;
        }
        if !acknowledged.is_empty() {
            sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM idem_outbox WHERE id IN ({})",
                ids(acknowledged.iter().copied())
            )))
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("UPDATE idem_outbox SET lease = NULL, leased_until = NULL WHERE lease = ?1")
            .bind(lease)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.lease = None;
        Ok(())
    }
}

/// Row ids as an SQL list: numbers only, so written into the statement.
fn ids(ids: impl Iterator<Item = i64>) -> String {
    ids.map(|id| id.to_string()).collect::<Vec<_>>().join(",")
}
