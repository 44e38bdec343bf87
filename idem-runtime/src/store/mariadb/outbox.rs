//! The outbox on MariaDB: PostgreSQL's table and relay, with InnoDB's row
//! locks. A cycle's transaction locks its rows with `FOR UPDATE SKIP
//! LOCKED` (so relays never take the same row), holds them while it
//! publishes, and deletes those JetStream acknowledged before its COMMIT;
//! a lost connection rolls back and releases them at once.
//!
//! - **READ COMMITTED** for a cycle's transaction: under InnoDB's REPEATABLE
//!   READ, a locking read takes next-key locks on the range it scans,
//!   and a relay holding the gap past the last row would block every
//!   handler's INSERT into the outbox while it publishes. Under READ
//!   COMMITTED it locks the rows it returns and no gap.
//! - **`idle_transaction_timeout` = 60 s** while a cycle runs (the
//!   session's own value is saved and put back after its COMMIT or
//!   ROLLBACK): a relay whose process froze, or whose host vanished
//!   without a reset, must not keep its rows locked until TCP keepalive
//!   gives up. The same bound as PostgreSQL's relay. Its lock waits are
//!   bounded to 5 s too.
//! - **The fresh lane's take walks the primary key** (`FORCE INDEX`): see
//!   `Session::take_rows`.
//! - No notifications: relays in other processes find rows by their poll.

use std::time::Duration;

use sqlx::mysql::MySqlRow;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlPool, Pool, Row as _};

use crate::store::outbox::{
    Advanced, FailingRow, Lane, Listener, Marks, OutboxStore, RelaySession, Row, Take,
};

/// The outbox table (migration 2).
pub(crate) const MIGRATION: &str = "\
CREATE TABLE IF NOT EXISTS idem_outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    msg_id VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
    subject VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
    payload LONGBLOB NOT NULL,
    headers LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    created_at DOUBLE NOT NULL DEFAULT (UNIX_TIMESTAMP()),
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT CHARACTER SET utf8mb4 NULL,
    failed_at DOUBLE NULL,
    not_before DOUBLE NULL,
    UNIQUE KEY idem_outbox_by_msg_id (msg_id),
    KEY idem_outbox_due (not_before)
) ENGINE = InnoDB";

/// The time now, in Unix seconds with microseconds: the session's
/// `timestamp`, which no time zone shifts (`UNIX_TIMESTAMP(NOW(6))`
/// converts a local time back, and reads an hour off in the hour a
/// daylight-saving change repeats).
const NOW: &str = "@@timestamp";

/// A cycle's `idle_transaction_timeout`, in seconds (see the module docs).
const CYCLE_IDLE_SECONDS: u32 = 60;

/// How long a cycle's statements wait for a row lock, in seconds. A cycle
/// locks only rows no other holds (`SKIP LOCKED`), and writes only those;
/// should it ever wait (an operator's session holding a row), it fails
/// after this rather than InnoDB's 50 s, and the relay backs off.
const CYCLE_LOCK_WAIT_SECONDS: u32 = 5;

impl OutboxStore for MySql {
    type Relay = Session;

    // Its fresh lane two while its cycles overlap, its retry lane one, and
    // a look (the lag, whether a row waits) beside them.
    const RELAY_CONNECTIONS: usize = 4;

    async fn queue(
        connection: &mut Self::Connection,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        headers: Option<String>,
    ) -> Result<(), sqlx::Error> {
        // Not INSERT IGNORE: it would also turn a value that does not fit
        // into a warning, and queue a truncated row. `msg_id` compares with
        // a NO PAD collation: "a" and "a " are two messages to JetStream.
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO idem_outbox (msg_id, subject, payload, headers, created_at)
             VALUES (?, ?, ?, ?, {NOW})
             ON DUPLICATE KEY UPDATE id = id"
        )))
        .bind(msg_id)
        .bind(subject)
        .bind(payload)
        .bind(headers)
        .execute(connection)
        .await?;
        Ok(())
    }

    async fn lag(pool: &Pool<Self>) -> Result<(i64, Option<f64>, i64, bool), sqlx::Error> {
        let (pending, oldest, failing): (i64, Option<f64>, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT COUNT(*), CAST({NOW} - MIN(created_at) AS DOUBLE),
                        CAST(COALESCE(SUM(not_before IS NOT NULL), 0) AS SIGNED)
                   FROM idem_outbox"
            )))
            .fetch_one(pool)
            .await?;
        Ok((pending, oldest, failing, false))
    }

    async fn failing(pool: &Pool<Self>, most: usize) -> Result<Vec<FailingRow>, sqlx::Error> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT subject, last_error, COUNT(*),
                    CAST({NOW} - MIN(created_at) AS DOUBLE),
                    MAX(attempts),
                    CAST(MIN(not_before) - {NOW} AS DOUBLE)
               FROM idem_outbox WHERE not_before IS NOT NULL
              GROUP BY subject, last_error
              ORDER BY COUNT(*) DESC, subject
              LIMIT ?"
        )))
        .bind(i64::try_from(most).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await
    }

    async fn retry_failing(pool: &Pool<Self>, subject: Option<&str>) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(format!(
            "UPDATE idem_outbox SET not_before = {NOW}, attempts = 0
              WHERE not_before IS NOT NULL AND (? IS NULL OR subject = ?)"
        )))
        .bind(subject)
        .bind(subject)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn next_due(pool: &Pool<Self>) -> Result<Option<Duration>, sqlx::Error> {
        let due: Option<f64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(MIN(not_before) - {NOW} AS DOUBLE) FROM idem_outbox
              WHERE not_before IS NOT NULL"
        )))
        .fetch_one(pool)
        .await?;
        Ok(due
            .map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)))
    }

    async fn any_fresh(pool: &Pool<Self>) -> Result<bool, sqlx::Error> {
        let any: i64 = sqlx::query_scalar(
            "SELECT CAST(EXISTS (SELECT 1 FROM idem_outbox WHERE not_before IS NULL) AS SIGNED)",
        )
        .fetch_one(pool)
        .await?;
        Ok(any != 0)
    }

    async fn listen(_: &Pool<Self>, _: &str) -> Result<Listener, sqlx::Error> {
        Err(sqlx::Error::Protocol(
            "MariaDB has no notifications: its relays are woken in process, and poll".into(),
        ))
    }
}

/// A relay's pooled connection, whose transactions a cycle begins and ends.
pub struct Session {
    connection: PoolConnection<MySql>,
    /// A transaction may be open, or the connection's state is unknown (a
    /// statement failed midway): if dropped now, the connection is closed,
    /// not returned to the pool.
    open: bool,
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.open {
            self.connection.close_on_drop();
        }
    }
}

impl RelaySession<MySql> for Session {
    async fn acquire(pool: &MySqlPool) -> Result<Self, sqlx::Error> {
        Ok(Session {
            connection: pool.acquire().await?,
            open: false,
        })
    }

    async fn advance(&mut self, finish: Option<(&[i64], &Marks)>, next: Option<Take>) -> Advanced {
        let mut committed = false;
        if let Some((acknowledged, marks)) = finish {
            match self.finish(acknowledged, marks).await {
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
            Some(take) => self.take_rows(take).await,
            None => Ok(Vec::new()),
        };
        Advanced { committed, taken }
    }

    async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }
}

impl Session {
    /// Begins a cycle's transaction and locks its rows (their ids and
    /// sizes only); then reads the rows that fit in the cycle's bytes. A
    /// take that finds none ends its transaction at once.
    async fn take_rows(&mut self, take: Take) -> Result<Vec<Row>, sqlx::Error> {
        let limit = i64::try_from(take.limit).unwrap_or(i64::MAX);
        // The fresh lane walks the primary key: through the index on
        // `not_before`, its locking read would lock that index's entries
        // too, which a cycle deleting its rows must also lock.
        let (index, filter, order) = match take.lane {
            Lane::Fresh => (
                "FORCE INDEX (PRIMARY)",
                "not_before IS NULL".to_owned(),
                "id",
            ),
            Lane::Retry => ("", format!("not_before <= {NOW}"), "not_before, id"),
        };
        self.open = true;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET @idem_relay_idle = @@session.idle_transaction_timeout,
                 @idem_relay_lock_wait = @@session.innodb_lock_wait_timeout,
                 SESSION idle_transaction_timeout = {CYCLE_IDLE_SECONDS},
                 SESSION innodb_lock_wait_timeout = {CYCLE_LOCK_WAIT_SECONDS};
             SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
             START TRANSACTION"
        )))
        .execute(&mut *self.connection)
        .await?;
        let locked: Vec<(i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(LENGTH(payload) + COALESCE(LENGTH(headers), 0) AS SIGNED)
               FROM idem_outbox {index} WHERE {filter}
              ORDER BY {order} LIMIT ? FOR UPDATE SKIP LOCKED"
        )))
        .bind(limit)
        .fetch_all(&mut *self.connection)
        .await?;
        let chosen: Vec<String> = take.fitting(&locked).iter().map(i64::to_string).collect();
        if chosen.is_empty() {
            self.end("COMMIT").await?;
            return Ok(Vec::new());
        }
        // A plain read, of rows this transaction holds: it waits on no lock.
        let rows: Vec<MySqlRow> = sqlx::query(AssertSqlSafe(format!(
            "SELECT id, msg_id, subject, payload, headers, attempts
               FROM idem_outbox WHERE id IN ({}) ORDER BY id",
            chosen.join(",")
        )))
        .persistent(false)
        .fetch_all(&mut *self.connection)
        .await?;
        let locked = locked.len() as i64;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get(0)?,
                    row.try_get(1)?,
                    row.try_get(2)?,
                    row.try_get(3)?,
                    row.try_get(4)?,
                    row.try_get(5)?,
                    locked,
                ))
            })
            .collect()
    }

    /// Ends the open cycle: records `marks`, deletes `acknowledged` and
    /// commits (the rows it locked and kept are released).
    async fn finish(&mut self, acknowledged: &[i64], marks: &Marks) -> Result<(), sqlx::Error> {
        debug_assert!(self.open, "a finish ends an open transaction");
        for ((id, error), backoff) in marks.ids.iter().zip(&marks.errors).zip(&marks.backoffs) {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE idem_outbox
                    SET attempts = attempts + 1, last_error = ?, failed_at = {NOW},
                        not_before = {NOW} + ?
                  WHERE id = ?"
            )))
            .bind(error)
            .bind(backoff)
            .bind(id)
            .execute(&mut *self.connection)
            .await?;
        }
        if !acknowledged.is_empty() {
            // One DELETE per row, by its key, in one message. A DELETE with
            // an `IN` list may be planned as a scan of the table, which
            // waits on every row another cycle holds: two relays waited on
            // each other so until a lock wait timed out.
            let deletes: String = acknowledged
                .iter()
                .map(|id| format!("DELETE FROM idem_outbox WHERE id = {id};"))
                .collect();
            sqlx::raw_sql(AssertSqlSafe(deletes))
                .execute(&mut *self.connection)
                .await?;
        }
        self.end("COMMIT").await
    }

    /// Ends the transaction with `end` (COMMIT or ROLLBACK), then puts the
    /// session's own bounds back (the server's, if they were never saved).
    /// A restore that fails leaves the connection to be closed, not pooled;
    /// the transaction's end stands.
    async fn end(&mut self, end: &str) -> Result<(), sqlx::Error> {
        self.open = true;
        sqlx::raw_sql(AssertSqlSafe(end.to_owned()))
            .execute(&mut *self.connection)
            .await?;
        let restored = sqlx::raw_sql(
            "SET SESSION idle_transaction_timeout =
                     COALESCE(@idem_relay_idle, @@global.idle_transaction_timeout),
                 SESSION innodb_lock_wait_timeout =
                     COALESCE(@idem_relay_lock_wait, @@global.innodb_lock_wait_timeout)",
        )
        .execute(&mut *self.connection)
        .await;
        match restored {
            Ok(_) => self.open = false,
            Err(error) => {
                tracing::debug!(%error, "a relay's session bounds could not be put back; its connection is closed")
            }
        }
        Ok(())
    }
}
