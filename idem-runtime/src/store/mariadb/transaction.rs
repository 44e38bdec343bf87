//! A message's transaction on MariaDB: the session's settings, `START
//! TRANSACTION`, the claim and a savepoint in one round trip, and a COMMIT
//! that first releases the savepoint, in another.
//!
//! **The claim's race.** The claim is the transaction's first write, an
//! INSERT on `idem_claims`' primary key. A second attempt at the same
//! message waits on that key's lock (up to `innodb_lock_wait_timeout`), then
//! finds the claim committed (error 1062, a duplicate: the message was
//! processed) or rolled back (it claims). Under either isolation level
//! InnoDB offers, the wait is on the key itself.
//!
//! **The check before COMMIT.** MariaDB has no aborted state either, and its
//! transaction ids are not comparable from the client. A savepoint,
//! `idem_claim`, is opened right after the claim; COMMIT runs only after
//! `RELEASE SAVEPOINT idem_claim` succeeded, in one multi-statement string
//! that MariaDB stops at its first error. A handler that ended the
//! transaction itself (`COMMIT`, `ROLLBACK`, a statement that commits
//! implicitly such as DDL, a deadlock that InnoDB rolled back) took the
//! savepoint with it: the RELEASE fails (error 1305), and nothing more
//! commits.
//!
//! **`autocommit = 0` while a handler runs.** After InnoDB rolls a
//! transaction back on its own (a deadlock, error 1213), a handler that
//! swallowed the error and went on writing would, under `autocommit = 1`,
//! commit each later statement on its own, unclaimed. With `autocommit =
//! 0` they open a new transaction instead, which the failed RELEASE then
//! rolls back. The session's settings are put back (`autocommit = 1`,
//! the bounds to their defaults) before the connection is kept, and a
//! connection whose settings could not be put back is closed.
//!
//! **What MariaDB cannot check.** A statement that fails otherwise leaves
//! the transaction open, and COMMIT commits the statements before it: a
//! handler that swallows an error commits what it did before the error
//! (PostgreSQL would refuse the COMMIT, 25P02). Return the error instead.

use std::collections::HashSet;
use std::time::Duration;

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql, QueryBuilder, Row, Transaction};

use crate::error::HandlerError;
use crate::store::connections::Leased;
use crate::store::transaction::{Claim, Ended};

/// What a router found out about the server at start-up: nothing that
/// changes how a route begins (the warnings are given at start-up).
#[derive(Debug, Clone, Copy)]
pub struct Session;

/// How a route begins and commits on MariaDB: the session settings each of
/// its transactions runs under. `autocommit = 0`, and with a handler
/// timeout T the bounds: `max_statement_time` T, so that the server ends a
/// statement a handler left running; `innodb_lock_wait_timeout` T (whole
/// seconds); and `idle_transaction_timeout` T + 1 s, so that the server
/// ends a transaction whose client went away (a worker's host lost), which
/// would otherwise hold its claim's lock for hours. PostgreSQL's bounds are
/// the same: `statement_timeout`, `lock_timeout`,
/// `idle_in_transaction_session_timeout`. The session's own values are
/// saved first, in user variables, and put back ([`RESTORE`]).
#[derive(Debug, Clone)]
pub struct Begin {
    /// The route's handler timeout (`None`: the server's defaults).
    pub(crate) handler_timeout: Option<Duration>,
}

impl Begin {
    /// The statements that begin a transaction whose statements wait at
    /// most `lock_wait` for a lock (the handler timeout if `None`).
    fn settings(&self, lock_wait: Option<Duration>) -> String {
        let mut set = String::from(SAVE);
        set.push_str("; SET SESSION autocommit = 0");
        if let Some(timeout) = self.handler_timeout {
            set.push_str(&format!(
                ", max_statement_time = {:.3}, idle_transaction_timeout = {}",
                timeout.as_secs_f64(),
                whole_seconds(timeout + IDLE_MARGIN)
            ));
        }
        if let Some(lock_wait) = lock_wait.or(self.handler_timeout) {
            set.push_str(&format!(
                ", innodb_lock_wait_timeout = {}",
                whole_seconds(lock_wait)
            ));
        }
        set
    }
}

/// How much longer than the handler timeout a transaction may sit idle
/// before the server ends it.
const IDLE_MARGIN: Duration = Duration::from_secs(1);

/// `duration` in whole seconds, rounded up, at least one.
fn whole_seconds(duration: Duration) -> u64 {
    (duration.as_secs() + u64::from(duration.subsec_nanos() > 0)).max(1)
}

/// Saves what [`Begin`] changes in the session, for [`RESTORE`].
const SAVE: &str = "SET @idem_autocommit = @@session.autocommit,
    @idem_max_statement_time = @@session.max_statement_time,
    @idem_lock_wait = @@session.innodb_lock_wait_timeout,
    @idem_idle = @@session.idle_transaction_timeout";

/// Puts back what [`Begin`] set, and frees the locks a handler may have
/// taken that outlive a transaction (`LOCK TABLES`, `GET_LOCK`); runs only
/// once no transaction is open (`autocommit = 1` commits an open one).
const RESTORE: &str = "UNLOCK TABLES; DO RELEASE_ALL_LOCKS();
    SET SESSION autocommit = @idem_autocommit,
        max_statement_time = @idem_max_statement_time,
        innodb_lock_wait_timeout = @idem_lock_wait,
        idle_transaction_timeout = @idem_idle";

/// Opened after the claim; its release fails once a handler has ended the
/// transaction itself.
const SAVEPOINT: &str = "SAVEPOINT idem_claim";

/// Begins a transaction on `connection` and makes `claim` in it if given:
/// one round trip.
pub(crate) async fn begin<'c>(
    connection: &'c mut Leased<'_, MySql>,
    begin: &Begin,
    claim: Option<Claim<'_>>,
) -> Result<Transaction<'c, MySql>, sqlx::Error> {
    let mut statement = format!("{}; START TRANSACTION", begin.settings(None));
    if let Some(claim) = claim {
        // The key is a uuid's text and the id an integer, both made by idem:
        // nothing a message carries reaches the SQL.
        debug_assert!(is_key(claim.key));
        statement.push_str(&format!(
            "; INSERT INTO idem_claims (claim_key, handler_id) VALUES ('{}', {})",
            claim.key, claim.handler_id
        ));
    }
    statement.push_str("; ");
    statement.push_str(SAVEPOINT);
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Begins a batch's transaction; [`claim_many`] claims and opens the
/// savepoint. With `lock_wait`, statements give up on a lock after it, so
/// that batches that would deadlock fail at once.
pub(crate) async fn begin_batch<'c>(
    connection: &'c mut Leased<'_, MySql>,
    begin: &Begin,
    lock_wait: Option<Duration>,
) -> Result<Transaction<'c, MySql>, sqlx::Error> {
    let statement = format!("{}; START TRANSACTION", begin.settings(lock_wait));
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Whether `key` is a claim key idem made (a uuid's text), safe in SQL.
fn is_key(key: &str) -> bool {
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// Ends the transaction a failed claim left open (sqlx never counted it as
/// begun), and puts the session's settings back.
pub(crate) async fn end_failed_claim(connection: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!("ROLLBACK; {RESTORE}")))
        .execute(connection)
        .await?;
    Ok(())
}

/// Claims `keys` for handler `handler_id` in one statement that skips
/// those claimed before (after waiting for any claim on them still being
/// made), in key order, so that two batches cannot deadlock on their
/// claims. Returns the keys this transaction claimed, and the first of them
/// as the transaction's identity, which [`committed`] asks about (`""` if
/// none was fresh: then nothing of the batch runs).
pub(crate) async fn claim_many(
    tx: &mut Transaction<'_, MySql>,
    handler_id: i32,
    keys: &[String],
) -> Result<(HashSet<String>, String), sqlx::Error> {
    let mut sorted: Vec<&String> = keys.iter().collect();
    sorted.sort();
    sorted.dedup();
    let mut fresh: Vec<String> = Vec::new();
    if !sorted.is_empty() {
        let mut insert =
            QueryBuilder::<MySql>::new("INSERT IGNORE INTO idem_claims (claim_key, handler_id) ");
        insert.push_values(sorted, |mut row, key| {
            row.push_bind(key.as_str()).push_bind(handler_id);
        });
        insert.push(" RETURNING claim_key");
        // Not kept prepared: each batch size is a statement of its own, and
        // sqlx's cache of them would push out the application's.
        fresh = insert
            .build_query_scalar()
            .persistent(false)
            .fetch_all(&mut **tx)
            .await?;
    }
    sqlx::raw_sql(SAVEPOINT).execute(&mut **tx).await?;
    fresh.sort();
    let identity = fresh.first().cloned().unwrap_or_default();
    Ok((fresh.into_iter().collect(), identity))
}

/// What became of the batch whose identity is `id` (from [`claim_many`]),
/// asked on another connection: a locking read of its first fresh claim
/// waits while that transaction runs (given up after a second: `None`);
/// once it ended, the claim is there if and only if it committed.
pub(crate) async fn committed(
    connection: &mut MySqlConnection,
    id: &str,
) -> Result<Option<bool>, sqlx::Error> {
    if !is_key(id) {
        return Ok(Some(false));
    }
    let read = format!(
        "SET STATEMENT innodb_lock_wait_timeout = 1 FOR
         SELECT count(*) FROM idem_claims WHERE claim_key = '{id}' LOCK IN SHARE MODE"
    );
    // A text-protocol statement: SET STATEMENT is not for prepared ones.
    match sqlx::raw_sql(AssertSqlSafe(read))
        .fetch_one(&mut *connection)
        .await
    {
        Ok(row) => Ok(Some(row.try_get::<i64, _>(0)? > 0)),
        Err(error) if crate::error::class::is_lock_timeout(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Takes back the claims this transaction made on `keys` (the caller passes
/// only keys it claimed fresh).
pub(crate) async fn unclaim(
    tx: &mut Transaction<'_, MySql>,
    keys: &[&str],
) -> Result<(), sqlx::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    let mut delete = QueryBuilder::<MySql>::new("DELETE FROM idem_claims WHERE claim_key IN (");
    let mut list = delete.separated(", ");
    for key in keys {
        list.push_bind(*key);
    }
    delete.push(")");
    delete.build().persistent(false).execute(&mut **tx).await?;
    Ok(())
}

/// Whether `tx` is still the transaction that claimed `keys`, asked on the
/// way to its rollback after a handler failed. It is while the claim's
/// savepoint is there (released here, which changes nothing the rollback
/// keeps). Without it, the transaction ended: a claim found committed means
/// the handler committed it itself (`false`: claim lost); none found means
/// InnoDB rolled the transaction back (a deadlock), and the handler's error
/// stands.
pub(crate) async fn claims_still_pending(tx: &mut Transaction<'_, MySql>, keys: &[&str]) -> bool {
    match sqlx::raw_sql("RELEASE SAVEPOINT idem_claim")
        .execute(&mut **tx)
        .await
    {
        Ok(_) => true,
        Err(error) if no_savepoint(&error) => {
            // Unreadable: taken as lost, so that the message is dead-lettered
            // rather than acked as a duplicate later.
            !any_claimed(tx, keys).await.unwrap_or(true)
        }
        Err(_) => true,
    }
}

/// Whether any of `keys` has a committed claim (or one of this session's).
async fn any_claimed(tx: &mut Transaction<'_, MySql>, keys: &[&str]) -> Result<bool, sqlx::Error> {
    if keys.is_empty() {
        return Ok(false);
    }
    let mut read =
        QueryBuilder::<MySql>::new("SELECT count(*) FROM idem_claims WHERE claim_key IN (");
    let mut list = read.separated(", ");
    for key in keys {
        list.push_bind(*key);
    }
    read.push(")");
    let found: i64 = read
        .build_query_scalar()
        .persistent(false)
        .fetch_one(&mut **tx)
        .await?;
    Ok(found > 0)
}

/// Releases the claim's savepoint and commits, in one round trip that
/// stops at the first error; then puts the session back. Or rolls back what
/// is left. Also says whether the connection ended in a known, clean state.
pub(crate) async fn finish(mut tx: Transaction<'_, MySql>, claimed: &[&str]) -> (Ended, bool) {
    let commit = format!("RELEASE SAVEPOINT idem_claim; COMMIT; {RESTORE}");
    match sqlx::raw_sql(AssertSqlSafe(commit)).execute(&mut *tx).await {
        Ok(_) => {
            // Nothing is open any more; this only tells sqlx so (its COMMIT
            // does nothing).
            let clean = tx.commit().await.is_ok();
            (Ended::Committed, clean)
        }
        Err(error) if no_savepoint(&error) => {
            // The transaction ended before COMMIT. If its claim is
            // committed, the handler ended it (whatever it committed stays
            // committed, nothing after it does); if not, InnoDB rolled it
            // back (a deadlock whose error the handler swallowed), and what
            // the handler wrote afterwards, under `autocommit = 0`, is
            // rolled back now: nothing of the attempt committed. Unreadable:
            // taken as lost, so that the message is dead-lettered rather
            // than applied again.
            let lost = any_claimed(&mut tx, claimed).await.unwrap_or(true);
            let clean = rollback(tx).await;
            let error = if lost {
                HandlerError::ClaimLost
            } else {
                HandlerError::Aborted
            };
            (Ended::NotCommitted(error), clean)
        }
        // The server answered: the RELEASE or the COMMIT was refused, and
        // nothing committed.
        Err(error @ sqlx::Error::Database(_)) => {
            let clean = rollback(tx).await;
            (
                Ended::NotCommitted(HandlerError::CommitRefused(error)),
                clean,
            )
        }
        // The connection failed with the COMMIT in flight: nobody knows.
        Err(error) => (Ended::Unknown(error), false),
    }
}

/// Rolls back, and puts the session back; says whether the connection is
/// known to be clean.
pub(crate) async fn rollback(mut tx: Transaction<'_, MySql>) -> bool {
    let rollback = format!("ROLLBACK; {RESTORE}");
    match sqlx::raw_sql(AssertSqlSafe(rollback))
        .execute(&mut *tx)
        .await
    {
        // Tells sqlx the transaction ended (its ROLLBACK does nothing).
        Ok(_) => tx.rollback().await.is_ok(),
        Err(error) => {
            tracing::warn!(%error, "ROLLBACK failed; the connection is closed");
            false
        }
    }
}

/// MariaDB's answer to a release of a savepoint the transaction no longer
/// has (ER_SP_DOES_NOT_EXIST).
fn no_savepoint(error: &sqlx::Error) -> bool {
    crate::error::class::mariadb_number(error) == Some(1305)
}
