//! A message's transaction: how it begins, and how it commits.
//!
//! **BEGIN** carries the route's bounds on the server, in the same round
//! trip: `statement_timeout` (a statement stuck on a lock is cancelled by the
//! server at the handler timeout) and `idle_in_transaction_session_timeout`
//! (a backend whose client vanished behind a network partition, still
//! holding its claim, is ended soon after, so redeliveries do not wait on it
//! until TCP keepalive gives up). Where the server supports it,
//! `client_connection_check_interval` also ends a statement whose client
//! went away. No timer or `select!` is ever held around BEGIN or COMMIT: a
//! cancelled BEGIN can hand back a pooled connection still inside a
//! transaction (sqlx#4393).
//!
//! **COMMIT** is sent in one simple-query message together with a check:
//!
//! ```sql
//! SELECT 1 / ((SELECT count(*) FROM idem_processed_messages
//!              WHERE handler = $h$…$h$ AND message_id IN ($m$…$m$)
//!                AND xmin = pg_current_xact_id()::xid) = 1)::int;
//! COMMIT;
//! BEGIN
//! ```
//!
//! PostgreSQL turns the COMMIT of an aborted transaction (a statement failed
//! and the handler ignored the error) into a rollback that it reports as
//! success, and sqlx does not look at the command tag. Here the `SELECT`
//! fails first, with 25P02, in the same round trip, and the COMMIT never
//! runs. If the claims are no longer this transaction's own (the handler
//! ended it with a raw `ROLLBACK` or `COMMIT`: their `xmin` is not the
//! current transaction's id), the division by zero stops the COMMIT instead.
//! Either way nothing is acked. The trailing `BEGIN` keeps sqlx's view of the
//! connection true: its transaction is still open, so dropping it queues a
//! `ROLLBACK`, which ends that empty transaction together with the
//! connection's next statement, without a round trip of its own.
//!
//! Values go into this SQL as dollar-quoted literals, whose tag is chosen so
//! that it cannot occur in the value: safe whatever the value holds and
//! whatever `standard_conforming_strings` says. Message ids cannot hold NUL
//! (refused when the id is resolved).

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, PgTransaction};

use crate::error::HandlerError;
use crate::schema::DEDUP_TABLE;

/// The statement that begins a route's transactions.
#[derive(Debug, Clone)]
pub(crate) struct Begin {
    sql: String,
}

impl Begin {
    /// `BEGIN` with `SET LOCAL` bounds derived from the handler timeout:
    /// statements end at it, and a transaction left idle longer (its client
    /// gone) is ended by the server shortly after. Without a handler timeout
    /// there are no bounds.
    pub(crate) fn new(handler_timeout: Option<Duration>, check_client_connection: bool) -> Self {
        let mut sql = String::from("BEGIN");
        if let Some(timeout) = handler_timeout {
            let millis = timeout.as_millis().max(1);
            // The idle bound waits a little longer than the handler may take,
            // so that a slow handler between two statements is never cut off
            // by it: the handler timeout fires first.
            let idle = millis + IDLE_MARGIN.as_millis();
            sql.push_str(&format!(
                "; SET LOCAL statement_timeout = {millis}; \
                 SET LOCAL idle_in_transaction_session_timeout = {idle}"
            ));
            if check_client_connection {
                sql.push_str(&format!(
                    "; SET LOCAL client_connection_check_interval = {}",
                    CLIENT_CHECK.as_millis()
                ));
            }
        }
        Self { sql }
    }

    /// Begins a transaction on `connection`: one round trip.
    pub(crate) async fn run<'c>(
        &self,
        connection: &'c mut PgConnection,
    ) -> Result<PgTransaction<'c>, sqlx::Error> {
        sqlx::Connection::begin_with(connection, AssertSqlSafe(self.sql.clone())).await
    }
}

/// How much longer than the handler timeout a transaction may sit idle
/// before the server ends it.
const IDLE_MARGIN: Duration = Duration::from_secs(1);

/// How often the server checks, during a statement, that its client is
/// still there.
const CLIENT_CHECK: Duration = Duration::from_secs(1);

/// Whether the server accepts `client_connection_check_interval` (PostgreSQL
/// 14 or newer, on a platform that supports it).
pub(crate) async fn server_checks_client_connection(pool: &sqlx::PgPool) -> bool {
    let Ok(mut connection) = pool.acquire().await else {
        return false;
    };
    let Ok(mut tx) = sqlx::Connection::begin(&mut *connection).await else {
        return false;
    };
    let supported = sqlx::query("SET LOCAL client_connection_check_interval = 1000")
        .execute(&mut *tx)
        .await
        .is_ok();
    let _ = tx.rollback().await;
    supported
}

/// Why a transaction did not commit.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// PostgreSQL had aborted the transaction (a failed statement whose error
    /// was ignored): nothing committed. The transaction is still open, in
    /// the aborted state; roll it back.
    Aborted,
    /// The claims were no longer all in the transaction: nothing was
    /// committed by this COMMIT. Roll back.
    ClaimLost,
    /// The server refused the COMMIT, or the statement before it: nothing
    /// was committed, and the connection's state is not worth finding out.
    Refused(sqlx::Error),
    /// The connection failed: the outcome is unknown.
    Unknown(sqlx::Error),
}

/// How a transaction whose handlers all returned `Ok` ended.
pub(crate) enum Ended {
    /// Committed, claims and all.
    Committed,
    /// Nothing was committed, for the reason given.
    NotCommitted(HandlerError),
    /// The connection failed during COMMIT: the outcome is unknown.
    Unknown(sqlx::Error),
}

/// Commits `tx` (see [`commit`]) or rolls back what is left of it. Also says
/// whether its connection ended in a known, clean state and may be kept.
pub(crate) async fn finish(
    mut tx: PgTransaction<'_>,
    handler: &str,
    message_ids: &[&str],
) -> (Ended, bool) {
    match commit(&mut tx, handler, message_ids).await {
        // Dropping `tx` queues the ROLLBACK of the empty transaction the
        // commit statement began.
        Ok(()) => (Ended::Committed, true),
        Err(CommitError::Aborted) => {
            let clean = rollback(tx).await;
            (Ended::NotCommitted(HandlerError::Aborted), clean)
        }
        Err(CommitError::ClaimLost) => {
            let clean = rollback(tx).await;
            (Ended::NotCommitted(HandlerError::ClaimLost), clean)
        }
        Err(CommitError::Refused(error)) => (
            Ended::NotCommitted(HandlerError::CommitRefused(error)),
            false,
        ),
        Err(CommitError::Unknown(error)) => (Ended::Unknown(error), false),
    }
}

/// Rolls back; says whether the connection is known to be clean.
pub(crate) async fn rollback(tx: PgTransaction<'_>) -> bool {
    match tx.rollback().await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(%error, "ROLLBACK failed; the connection is closed");
            false
        }
    }
}

/// Commits `tx` if it still holds the claims of `handler` for `message_ids`,
/// in one round trip (see the module docs).
///
/// On `Ok`, drop `tx`: its trailing empty transaction is rolled back with
/// the connection's next statement.
pub(crate) async fn commit(
    tx: &mut PgTransaction<'_>,
    handler: &str,
    message_ids: &[&str],
) -> Result<(), CommitError> {
    let sql = commit_sql(handler, message_ids);
    match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut **tx).await {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("25P02") => {
            Err(CommitError::Aborted)
        }
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("22012") => {
            Err(CommitError::ClaimLost)
        }
        // The connection's own end (the server shutting down, say) can come
        // right after the COMMIT went through: as unknown as a lost
        // connection.
        Err(error) if crate::failure::is_infrastructure(&error) => Err(CommitError::Unknown(error)),
        Err(error @ sqlx::Error::Database(_)) => Err(CommitError::Refused(error)),
        Err(error) => Err(CommitError::Unknown(error)),
    }
}

fn commit_sql(handler: &str, message_ids: &[&str]) -> String {
    format!(
        "SELECT 1 / ({})::int; COMMIT; BEGIN",
        claims_are_pending(handler, message_ids)
    )
}

/// SQL that is true when every claim of `handler` for `message_ids` was
/// made by the transaction it runs in, and not committed yet: not gone (a
/// raw ROLLBACK), not committed by the handler itself (a raw COMMIT).
fn claims_are_pending(handler: &str, message_ids: &[&str]) -> String {
    let ids: Vec<String> = message_ids.iter().map(|id| literal(id)).collect();
    format!(
        "(SELECT count(*) FROM {DEDUP_TABLE} WHERE handler = {} AND message_id IN ({}) \
         AND xmin = pg_current_xact_id()::xid) = {}",
        literal(handler),
        ids.join(", "),
        message_ids.len()
    )
}

/// Whether the claims are still this transaction's own, uncommitted: asked
/// on the way to a rollback after a handler failed, so that a handler that
/// committed its claim itself (a raw COMMIT) and then failed is not
/// redelivered and taken for processed. A transaction PostgreSQL aborted
/// (the handler's statement failed) still holds them.
pub(crate) async fn claims_still_pending(
    tx: &mut PgTransaction<'_>,
    handler: &str,
    message_ids: &[&str],
) -> bool {
    let sql = format!("SELECT {}", claims_are_pending(handler, message_ids));
    // An error is 25P02 (aborted: the claims roll back with it), or one that
    // leaves the usual path to decide.
    sqlx::query_scalar::<_, bool>(AssertSqlSafe(sql))
        .fetch_one(&mut **tx)
        .await
        .unwrap_or(true)
}

/// `value` as a dollar-quoted SQL literal whose tag cannot end it early.
pub(crate) fn literal(value: &str) -> String {
    let mut tag = String::from("$idem$");
    let mut n = 0u32;
    // The value ends at the first occurrence of the closing tag, so the tag
    // must first occur right after the value.
    while format!("{value}{tag}").find(&tag) != Some(value.len()) {
        n += 1;
        tag = format!("$idem{n}$");
    }
    format!("{tag}{value}{tag}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_pick_a_tag_the_value_cannot_close() {
        assert_eq!(literal("order-1"), "$idem$order-1$idem$");
        assert_eq!(literal("a$idem$b"), "$idem1$a$idem$b$idem1$");
        // A value ending in a prefix of the tag would close it early.
        assert_eq!(literal("x$idem"), "$idem1$x$idem$idem1$");
        assert_eq!(
            literal("'; DROP TABLE t; --"),
            "$idem$'; DROP TABLE t; --$idem$"
        );
    }

    #[test]
    fn begin_carries_the_bounds_of_the_handler_timeout() {
        assert_eq!(Begin::new(None, true).sql, "BEGIN");
        assert_eq!(
            Begin::new(Some(Duration::from_secs(2)), false).sql,
            "BEGIN; SET LOCAL statement_timeout = 2000; SET LOCAL idle_in_transaction_session_timeout = 3000"
        );
        assert!(
            Begin::new(Some(Duration::from_secs(2)), true)
                .sql
                .ends_with("; SET LOCAL client_connection_check_interval = 1000")
        );
    }

    #[test]
    fn the_commit_checks_every_claim_first() {
        assert_eq!(
            commit_sql("h", &["a", "b"]),
            "SELECT 1 / ((SELECT count(*) FROM idem_processed_messages WHERE handler = $idem$h$idem$ \
             AND message_id IN ($idem$a$idem$, $idem$b$idem$) AND xmin = pg_current_xact_id()::xid) = 2)::int; \
             COMMIT; BEGIN"
        );
    }
}
