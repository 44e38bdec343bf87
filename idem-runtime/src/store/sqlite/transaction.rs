//! A message's transaction on SQLite: `BEGIN IMMEDIATE`, a savepoint and
//! the claim in one string, and a COMMIT that first releases the savepoint.
//!
//! **The claim's race.** `BEGIN IMMEDIATE` takes the database's one write
//! lock before the claim, so a second attempt at the same message waits
//! for the first (up to the pool's `busy_timeout`), then finds its claim
//! committed (a primary-key violation on `idem_claims.key`, extended code
//! 1555: the message was processed) or rolled back (it claims).
//!
//! **The check before COMMIT.** SQLite has no transaction id to compare,
//! and no aborted state. The claim is made inside a savepoint, `idem_claim`;
//! COMMIT is sent only after `RELEASE idem_claim` succeeded. A handler that
//! ended the transaction itself (`COMMIT`, `ROLLBACK`, either followed by
//! `BEGIN`) took the savepoint with it, the RELEASE fails ("no such
//! savepoint"), and nothing more commits: the claim-lost case, as on
//! PostgreSQL. A handler's own savepoints nest inside it unharmed.
//!
//! **What SQLite cannot check.** A statement that fails leaves the
//! transaction open, and COMMIT commits the statements before it: a handler
//! that swallows an error commits what it did before the error (PostgreSQL
//! would refuse the COMMIT, 25P02). Return the error instead.

use std::collections::HashSet;

use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use crate::error::HandlerError;
use crate::store::connections::Leased;
use crate::store::transaction::{Claim, Ended};

/// What a router found out about SQLite's settings at start-up: nothing
/// that changes how a route begins (the warnings are given at start-up).
#[derive(Debug, Clone, Copy)]
pub struct Session;

/// How a route begins and commits on SQLite: the same for every route. The
/// handler timeout is kept by the runtime's watchdog alone: SQLite has no
/// server-side bound, and waits for the write lock end at the pool's
/// `busy_timeout`.
#[derive(Debug, Clone)]
pub struct Begin;

/// What begins every transaction: the write lock, then the savepoint whose
/// [`RELEASE`] fails once a handler has ended the transaction itself.
const BEGIN: &str = "BEGIN IMMEDIATE; SAVEPOINT idem_claim";

/// Sent before COMMIT (see [`BEGIN`]).
const RELEASE: &str = "RELEASE idem_claim";

/// Begins a transaction on `connection`, taking the write lock, and makes
/// `claim` in it if given: one call.
pub(crate) async fn begin<'c>(
    connection: &'c mut Leased<'_, Sqlite>,
    claim: Option<Claim<'_>>,
) -> Result<Transaction<'c, Sqlite>, sqlx::Error> {
    let mut statement = BEGIN.to_owned();
    if let Some(claim) = claim {
        // The key is a uuid's text and the id an integer, both made by idem:
        // nothing a message carries reaches the SQL.
        debug_assert!(
            claim
                .key
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b'-')
        );
        statement.push_str(&format!(
            "; INSERT INTO idem_claims (key, handler_id) VALUES ('{}', {})",
            claim.key, claim.handler_id
        ));
    }
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Ends the transaction a failed claim left open (sqlx never counted it as
/// begun).
pub(crate) async fn end_failed_claim(connection: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    // After a BEGIN that failed itself there is no transaction to end.
    match sqlx::raw_sql("ROLLBACK").execute(connection).await {
        Ok(_) => Ok(()),
        Err(error) if no_transaction(&error) => Ok(()),
        Err(error) => Err(error),
    }
}

/// Claims `keys` for handler `handler_id` in one statement that skips
/// those claimed before, in key order. Returns the keys this transaction
/// claimed, and the first of them as the transaction's identity, which
/// [`committed`] asks about (`""` if none was fresh: then nothing of the
/// batch runs).
pub(crate) async fn claim_many(
    tx: &mut Transaction<'_, Sqlite>,
    handler_id: i32,
    keys: &[String],
) -> Result<(HashSet<String>, String), sqlx::Error> {
    let keys_json =
        serde_json::to_string(keys).map_err(|error| sqlx::Error::Encode(error.into()))?;
    let mut fresh: Vec<String> = sqlx::query_scalar(
        "INSERT INTO idem_claims (key, handler_id)
         SELECT value, ?2 FROM json_each(?1) WHERE true ORDER BY value
         ON CONFLICT (key) DO NOTHING
         RETURNING key",
    )
    .bind(keys_json)
    .bind(handler_id)
    .fetch_all(&mut **tx)
    .await?;
    fresh.sort();
    let identity = fresh.first().cloned().unwrap_or_default();
    Ok((fresh.into_iter().collect(), identity))
}

/// What became of the batch whose identity is `id` (from [`claim_many`]),
/// asked on another connection. While that transaction runs it holds the
/// write lock, so this one cannot take it (`None`); once it can, the
/// transaction has ended, and its first fresh claim is there if and only
/// if it committed.
pub(crate) async fn committed(
    connection: &mut SqliteConnection,
    id: &str,
) -> Result<Option<bool>, sqlx::Error> {
    if id.is_empty() {
        return Ok(Some(false));
    }
    match sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await
    {
        Ok(_) => {}
        Err(error) if is_busy(&error) => return Ok(None),
        Err(error) => return Err(error),
    }
    let found =
        sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM idem_claims WHERE key = ?)")
            .bind(id)
            .fetch_one(&mut *connection)
            .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut *connection).await?;
    Ok(Some(found?))
}

/// Takes back the claims this transaction made on `keys` (the batch's own:
/// it holds the write lock, so no other transaction's claim on them can be
/// uncommitted, and the caller passes only keys it claimed fresh).
pub(crate) async fn unclaim(
    tx: &mut Transaction<'_, Sqlite>,
    keys: &[&str],
) -> Result<(), sqlx::Error> {
    let keys_json =
        serde_json::to_string(keys).map_err(|error| sqlx::Error::Encode(error.into()))?;
    sqlx::query("DELETE FROM idem_claims WHERE key IN (SELECT value FROM json_each(?))")
        .bind(keys_json)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Whether `tx` is still the transaction that claimed, asked on the way
/// to its rollback after a handler failed: the claim's savepoint is still
/// there (released here, which changes nothing that the rollback keeps).
/// `false` once the handler ended the transaction itself: what it
/// committed, its claim with it, stays committed.
pub(crate) async fn claims_still_pending(tx: &mut Transaction<'_, Sqlite>) -> bool {
    match sqlx::raw_sql(RELEASE).execute(&mut **tx).await {
        Ok(_) => true,
        Err(error) => !no_savepoint(&error),
    }
}

/// Releases the claim's savepoint, then commits; or rolls back what is
/// left. Also says whether the connection ended in a known, clean state.
pub(crate) async fn finish(mut tx: Transaction<'_, Sqlite>) -> (Ended, bool) {
    match sqlx::raw_sql(RELEASE).execute(&mut *tx).await {
        Ok(_) => {}
        Err(error) if no_savepoint(&error) => {
            // The handler ended the transaction: whatever it committed
            // stays committed, nothing after it does.
            let clean = rollback(tx).await;
            return (Ended::NotCommitted(HandlerError::ClaimLost), clean);
        }
        Err(error) => {
            let clean = rollback(tx).await;
            return (
                Ended::NotCommitted(HandlerError::CommitRefused(error)),
                clean,
            );
        }
    }
    match tx.commit().await {
        Ok(()) => (Ended::Committed, true),
        // SQLite runs in this process: a COMMIT it refused (SQLITE_BUSY,
        // a full disk) did not commit, and the transaction is left open or
        // rolled back; the connection is closed either way.
        Err(error @ sqlx::Error::Database(_)) => (
            Ended::NotCommitted(HandlerError::CommitRefused(error)),
            false,
        ),
        // The connection's worker thread is gone: nobody knows.
        Err(error) => (Ended::Unknown(error), false),
    }
}

/// Rolls back; says whether the connection is known to be clean. A
/// transaction the handler ended itself (a raw `COMMIT`) leaves nothing to
/// roll back, and sqlx's count of it wrong: the connection is closed.
pub(crate) async fn rollback(tx: Transaction<'_, Sqlite>) -> bool {
    match tx.rollback().await {
        Ok(()) => true,
        Err(error) => {
            if !no_transaction(&error) {
                tracing::warn!(%error, "ROLLBACK failed; the connection is closed");
            }
            false
        }
    }
}

/// SQLite's answer to a RELEASE of a savepoint the transaction no longer
/// has.
fn no_savepoint(error: &sqlx::Error) -> bool {
    database_message(error).is_some_and(|message| message.starts_with("no such savepoint"))
}

/// SQLite's answer to a COMMIT or ROLLBACK outside a transaction.
fn no_transaction(error: &sqlx::Error) -> bool {
    database_message(error).is_some_and(|message| message.contains("no transaction is active"))
}

/// `SQLITE_BUSY` and its extended codes: another connection holds the lock.
pub(crate) fn is_busy(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().is_some_and(|code| code.parse::<i32>().is_ok_and(|code| code & 0xff == 5)))
}

fn database_message(error: &sqlx::Error) -> Option<&str> {
    match error {
        sqlx::Error::Database(db) => Some(db.message()),
        _ => None,
    }
}
