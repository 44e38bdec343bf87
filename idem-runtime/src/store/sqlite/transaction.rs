//! A message's transaction on SQLite: `BEGIN IMMEDIATE`, the claim and a
//! savepoint in one string, and a COMMIT that first releases the savepoint.
//!
//! **The claim's race.** `BEGIN IMMEDIATE` takes the database's one write
//! lock before the claim, so a second attempt at the same message waits
//! for the first (up to the pool's `busy_timeout`), then finds its claim
//! committed (a primary-key violation on `idem_claims.key`, extended code
//! 1555: the message was processed) or rolled back (it claims).
//!
//! **The check before COMMIT.** SQLite has no transaction id to compare,
//! and no aborted state. A savepoint, `idem_claim`, is opened right after
//! the claim (never before it: a handler's `ROLLBACK TO idem_claim` must not
//! undo the claim and let its writes commit unclaimed); COMMIT is sent only
//! after `RELEASE idem_claim` succeeded. A handler that
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
use std::time::{Duration, Instant};

use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use crate::error::HandlerError;
use crate::store::connections::Leased;
use crate::store::transaction::{Claim, Ended};

/// What a router found out about SQLite's settings at start-up: nothing
/// that changes how a route begins (the warnings are given at start-up).
#[derive(Debug, Clone, Copy)]
pub struct Session;

/// How a route begins and commits on SQLite. SQLite has no server-side
/// bound, and cannot cancel a statement from outside: a statement a handler
/// left running past its timeout would keep the write lock, and so stop
/// every route, start-up and the purge, until it ended. So each transaction
/// of a route with a handler timeout runs under a progress handler that
/// interrupts any statement once the transaction has run longer than it can
/// (`transaction::longest`); the transaction is then rolled back. Waits for
/// the lock end at the pool's `busy_timeout`.
#[derive(Debug, Clone)]
pub struct Begin {
    /// How long a transaction may run before its statements are interrupted.
    pub(crate) at_most: Option<Duration>,
}

/// SQLite's virtual-machine steps between two looks at the deadline.
const STEPS_PER_LOOK: i32 = 10_000;

/// What begins every transaction: the write lock. The claim follows, then
/// [`SAVEPOINT`].
const BEGIN: &str = "BEGIN IMMEDIATE";

/// Opened after the claim; its [`RELEASE`] fails once a handler has ended
/// the transaction itself.
const SAVEPOINT: &str = "SAVEPOINT idem_claim";

/// Sent before COMMIT (see [`SAVEPOINT`]).
const RELEASE: &str = "RELEASE idem_claim";

/// Begins a transaction on `connection`, taking the write lock, and makes
/// `claim` in it if given: one call.
pub(crate) async fn begin<'c>(
    connection: &'c mut Leased<'_, Sqlite>,
    begin: &Begin,
    claim: Option<Claim<'_>>,
) -> Result<Transaction<'c, Sqlite>, sqlx::Error> {
    bound(connection, begin).await?;
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
    statement.push_str("; ");
    statement.push_str(SAVEPOINT);
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Begins a batch's transaction, taking the write lock; [`claim_many`]
/// claims and opens the savepoint.
pub(crate) async fn begin_batch<'c>(
    connection: &'c mut Leased<'_, Sqlite>,
    begin: &Begin,
) -> Result<Transaction<'c, Sqlite>, sqlx::Error> {
    bound(connection, begin).await?;
    sqlx::Connection::begin_with(&mut **connection, BEGIN).await
}

/// Removes the bound [`bound`] set, before the connection is kept: it may
/// go back to the pool, to statements of the application's own.
async fn unbound(connection: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    connection.lock_handle().await?.remove_progress_handler();
    Ok(())
}

/// Interrupts every statement on `connection` once the transaction about
/// to begin has run longer than `begin` allows (see [`Begin`]); without a
/// bound, removes an earlier route's. Set before BEGIN, never around it.
async fn bound(connection: &mut SqliteConnection, begin: &Begin) -> Result<(), sqlx::Error> {
    let mut handle = connection.lock_handle().await?;
    match begin.at_most {
        Some(at_most) => {
            let deadline = Instant::now() + at_most;
            // `false` interrupts the statement (SQLITE_INTERRUPT).
            handle.set_progress_handler(STEPS_PER_LOOK, move || Instant::now() < deadline);
        }
        None => handle.remove_progress_handler(),
    }
    Ok(())
}

/// Ends the transaction a failed claim left open (sqlx never counted it as
/// begun).
pub(crate) async fn end_failed_claim(connection: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    unbound(connection).await?;
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
    sqlx::raw_sql(SAVEPOINT).execute(&mut **tx).await?;
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
        Err(error) if crate::error::class::is_lock_timeout(&error) => return Ok(None),
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

/// Whether `tx` is still the transaction that claimed `keys`, asked on the
/// way to its rollback after a handler failed. It is while the claim's
/// savepoint is there (released here, which changes nothing the rollback
/// keeps). Without it, the transaction ended: a claim found committed means
/// the handler committed it itself (`false`: claim lost); none found means
/// SQLite rolled the transaction back on its own (a trigger's
/// `RAISE(ROLLBACK)`, an `ON CONFLICT ROLLBACK` column, a full disk), and
/// the handler's error stands.
pub(crate) async fn claims_still_pending(tx: &mut Transaction<'_, Sqlite>, keys: &[&str]) -> bool {
    match sqlx::raw_sql(RELEASE).execute(&mut **tx).await {
        Ok(_) => true,
        Err(error) if no_savepoint(&error) => {
            let Ok(keys_json) = serde_json::to_string(keys) else {
                return false;
            };
            // Read where the transaction ended: outside any, or inside one
            // the handler began after its COMMIT.
            let committed = sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM idem_claims WHERE key IN (SELECT value FROM json_each(?)))",
            )
            .bind(keys_json)
            .fetch_one(&mut **tx)
            .await;
            // Unreadable: taken as lost, so that the message is dead-lettered
            // rather than acked as a duplicate later.
            !committed.unwrap_or(true)
        }
        Err(_) => true,
    }
}

/// Releases the claim's savepoint, then commits; or rolls back what is
/// left. Also says whether the connection ended in a known, clean state.
pub(crate) async fn finish(mut tx: Transaction<'_, Sqlite>) -> (Ended, bool) {
    if let Err(error) = unbound(&mut tx).await {
        return (
            Ended::NotCommitted(HandlerError::CommitRefused(error)),
            false,
        );
    }
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
pub(crate) async fn rollback(mut tx: Transaction<'_, Sqlite>) -> bool {
    if unbound(&mut tx).await.is_err() {
        return false;
    }
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

fn database_message(error: &sqlx::Error) -> Option<&str> {
    match error {
        sqlx::Error::Database(db) => Some(db.message()),
        _ => None,
    }
}
