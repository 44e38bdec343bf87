//! idem's tables on MariaDB: their migrations, registering handlers, what
//! operators read, stored results and the purge.
//!
//! There are no generations: a claim is keyed by its key alone
//! (`idem_claims`, InnoDB, the key its primary key), and expiry deletes a
//! handler's claims older than its retention, in chunks, each chunk a
//! statement of its own so that its locks are held for moments only.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use sqlx::mysql::MySqlConnection;
use sqlx::{MySql, MySqlPool, Transaction};

use crate::error::{Error, HandlerError};
use crate::store::migrations::{HISTORY_TABLE, migrator_of};
use crate::store::purge::{Figures, PurgeReport};
use crate::store::reads::HandlerRow;

/// (version, description, SQL) of every MariaDB migration, oldest first.
/// sqlx's migrator takes a named lock (`GET_LOCK`) while it runs, so
/// workers starting at once apply each migration once.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "claims",
        "CREATE TABLE IF NOT EXISTS idem_handlers (
         id INT AUTO_INCREMENT PRIMARY KEY,
         name VARCHAR(255) NOT NULL,
         retention_ms BIGINT NULL,
         updated_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
         UNIQUE KEY idem_handlers_by_name (name)
     ) ENGINE = InnoDB;
     CREATE TABLE IF NOT EXISTS idem_claims (
         claim_key VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
         handler_id INT NOT NULL,
         claimed_at DOUBLE NOT NULL DEFAULT (UNIX_TIMESTAMP()),
         result LONGBLOB NULL,
         KEY idem_claims_by_age (handler_id, claimed_at)
     ) ENGINE = InnoDB;",
    ),
    (2, "the outbox", super::outbox::MIGRATION),
];

/// Claims deleted per statement by the purge.
const PURGE_CHUNK: i64 = 1_000;

/// How long registering waits for a lock on `idem_handlers` (a row's, or
/// the table's: `LOCK TABLES`, an `ALTER` waiting) before start-up fails
/// and names the sessions that may hold it.
const REGISTER_LOCK_WAIT_SECONDS: u32 = 10;

/// How long the purge's deletes wait for a lock before the purge fails
/// (and is tried again at its next run).
const PURGE_LOCK_WAIT_SECONDS: u32 = 30;

/// Bounds the session's waits for row and table locks to `seconds`, having
/// saved its own bounds for [`UNBOUND_LOCKS`].
fn bound_locks(seconds: u32) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!(
        "SET @idem_lock_wait = @@session.innodb_lock_wait_timeout,
             @idem_table_lock_wait = @@session.lock_wait_timeout;
         SET SESSION innodb_lock_wait_timeout = {seconds}, lock_wait_timeout = {seconds}"
    ))
}

/// Puts back the bounds [`bound_locks`] saved.
const UNBOUND_LOCKS: &str = "SET SESSION innodb_lock_wait_timeout = @idem_lock_wait,
    lock_wait_timeout = @idem_table_lock_wait";

/// Applies the migrations.
pub(crate) async fn migrate(pool: &MySqlPool) -> Result<(), Error> {
    migrator_of(MIGRATIONS).run(pool).await?;
    Ok(())
}

/// The newest migration applied to the database, from idem's history table;
/// `None` before the first.
pub(crate) async fn schema_version(pool: &MySqlPool) -> Result<Option<i64>, sqlx::Error> {
    let history: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
          WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(HISTORY_TABLE)
    .fetch_one(pool)
    .await?;
    if history == 0 {
        return Ok(None);
    }
    sqlx::query_scalar("SELECT max(version) FROM _idem_migrations WHERE success")
        .fetch_one(pool)
        .await
}

/// Checks that every migration ran.
pub(crate) async fn verify(pool: &MySqlPool) -> Result<(), Error> {
    let found = schema_version(pool).await?;
    let expected = MIGRATIONS.last().map_or(0, |&(version, _, _)| version);
    match found {
        Some(version) if version >= expected => Ok(()),
        _ => Err(Error::SchemaMissing { expected, found }),
    }
}

/// Registers `handlers` (the last retention given for a name wins) in one
/// transaction, in name order, waiting at most
/// [`REGISTER_LOCK_WAIT_SECONDS`] for a lock.
pub(crate) async fn register(
    pool: &MySqlPool,
    handlers: &[(&str, Option<Duration>)],
) -> Result<HashMap<String, i32>, sqlx::Error> {
    let unique: BTreeMap<&str, Option<Duration>> = handlers.iter().copied().collect();
    let mut connection = pool.acquire().await?;
    let registered = register_on(&mut connection, unique).await;
    if registered.is_err() {
        // Its session setting may not have been put back.
        connection.close_on_drop();
    }
    registered
}

async fn register_on(
    connection: &mut MySqlConnection,
    handlers: BTreeMap<&str, Option<Duration>>,
) -> Result<HashMap<String, i32>, sqlx::Error> {
    sqlx::raw_sql(bound_locks(REGISTER_LOCK_WAIT_SECONDS))
        .execute(&mut *connection)
        .await?;
    let mut tx = sqlx::Connection::begin(&mut *connection).await?;
    let mut ids = HashMap::new();
    for (name, retention) in handlers {
        let millis = retention.map(crate::store::purge::millis);
        sqlx::query(
            "INSERT INTO idem_handlers (name, retention_ms, updated_at)
             VALUES (?, ?, UTC_TIMESTAMP(6))
             ON DUPLICATE KEY UPDATE
                retention_ms = VALUES(retention_ms), updated_at = VALUES(updated_at)",
        )
        .bind(name)
        .bind(millis)
        .execute(&mut *tx)
        .await?;
        let id: i32 = sqlx::query_scalar("SELECT id FROM idem_handlers WHERE name = ?")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        ids.insert(name.to_owned(), id);
    }
    tx.commit().await?;
    sqlx::raw_sql(UNBOUND_LOCKS).execute(connection).await?;
    Ok(ids)
}

/// The transactions open for more than a few seconds, described for the
/// warning of a registration that waited for a lock: one of them holds it.
/// Empty if the server does not let this user see them.
pub(crate) async fn long_transactions(pool: &MySqlPool) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<(u64, String, Option<String>)> = match sqlx::query_as(
        "SELECT trx_mysql_thread_id, CAST(trx_started AS CHAR), trx_query
           FROM information_schema.innodb_trx
          WHERE trx_started < NOW() - INTERVAL 5 SECOND
          ORDER BY trx_started",
    )
    .fetch_all(pool)
    .await
    {
        Ok(rows) => rows,
        // No PROCESS privilege: nothing can be named.
        Err(sqlx::Error::Database(_)) => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    Ok(rows
        .into_iter()
        .map(|(thread, started, query)| match query {
            Some(query) => {
                format!("connection {thread}, in a transaction since {started}, running: {query}")
            }
            None => format!("connection {thread}, in a transaction since {started}, idle"),
        })
        .collect())
}

/// Every handler with its claims (see `store::reads::handlers`).
pub(crate) async fn handlers(pool: &MySqlPool) -> Result<Vec<HandlerRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT h.name, CAST(h.retention_ms / 1000 AS DOUBLE), count(c.claim_key),
                min(c.claimed_at),
                CAST(UNIX_TIMESTAMP() - min(c.claimed_at) AS DOUBLE)
           FROM idem_handlers h LEFT JOIN idem_claims c ON c.handler_id = h.id
          GROUP BY h.id, h.name, h.retention_ms ORDER BY h.name",
    )
    .fetch_all(pool)
    .await
}

/// The committed claim on `key`: made at (Unix seconds), its age, its
/// generation (always 0 here), whether a result is stored.
pub(crate) async fn claim(
    pool: &MySqlPool,
    key: &str,
) -> Result<Option<(f64, f64, i32, bool)>, sqlx::Error> {
    let row: Option<(f64, f64, i64)> = sqlx::query_as(
        "SELECT claimed_at, CAST(UNIX_TIMESTAMP() - claimed_at AS DOUBLE),
                CAST(result IS NOT NULL AS SIGNED)
           FROM idem_claims WHERE claim_key = ?",
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(at, age, stored)| (at, age, 0, stored != 0)))
}

/// The handlers' names, sorted.
pub(crate) async fn handler_names(pool: &MySqlPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM idem_handlers ORDER BY name")
        .fetch_all(pool)
        .await
}

/// When `name` was last registered (UTC).
pub(crate) async fn registered_at(
    pool: &MySqlPool,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT CONCAT(DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s'), ' UTC')
           FROM idem_handlers WHERE name = ?",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
}

/// What the committed claim on `key` stored.
pub(crate) async fn read_result(
    connection: &mut MySqlConnection,
    key: &str,
) -> Result<Option<Option<Bytes>>, sqlx::Error> {
    let row: Option<Option<Vec<u8>>> =
        sqlx::query_scalar("SELECT result FROM idem_claims WHERE claim_key = ?")
            .bind(key)
            .fetch_optional(connection)
            .await?;
    Ok(row.map(|result| result.map(Bytes::from)))
}

/// Stores `result` with the claim on `key`, which `tx` made.
pub(crate) async fn store_result(
    tx: &mut Transaction<'_, MySql>,
    key: &str,
    result: &[u8],
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE idem_claims SET result = ? WHERE claim_key = ?")
        .bind(result)
        .bind(key)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Deletes, for every handler with a retention, its claims older than
/// that, a chunk per statement (each its own transaction), waiting at most
/// [`PURGE_LOCK_WAIT_SECONDS`] for a lock. Safe from several processes at
/// once: their deletes of one chunk wait for each other, in the index's
/// order.
pub(crate) async fn purge(pool: &MySqlPool) -> Result<PurgeReport, Error> {
    let mut connection = pool.acquire().await?;
    let purged = purge_on(&mut connection).await;
    if purged.is_err() {
        // Its session's bounds may not have been put back.
        connection.close_on_drop();
    }
    purged
}

async fn purge_on(connection: &mut MySqlConnection) -> Result<PurgeReport, Error> {
    sqlx::raw_sql(bound_locks(PURGE_LOCK_WAIT_SECONDS))
        .execute(&mut *connection)
        .await?;
    let handlers: Vec<(i32, i64)> =
        sqlx::query_as("SELECT id, retention_ms FROM idem_handlers WHERE retention_ms IS NOT NULL")
            .fetch_all(&mut *connection)
            .await?;
    let mut report = PurgeReport {
        retention: handlers
            .iter()
            .map(|&(_, millis)| Duration::from_millis(u64::try_from(millis).unwrap_or(0)))
            .max(),
        ..PurgeReport::default()
    };
    for (id, millis) in handlers {
        loop {
            let deleted = sqlx::query(
                "DELETE FROM idem_claims
                  WHERE handler_id = ? AND claimed_at < UNIX_TIMESTAMP() - ? / 1000
                  ORDER BY claimed_at LIMIT ?",
            )
            .bind(id)
            .bind(millis)
            .bind(PURGE_CHUNK)
            .execute(&mut *connection)
            .await?
            .rows_affected();
            report.deleted += deleted;
            if deleted < PURGE_CHUNK as u64 {
                break;
            }
        }
    }
    sqlx::raw_sql(UNBOUND_LOCKS).execute(connection).await?;
    Ok(report)
}

/// Where expiry stands: only the longest retention means anything here
/// (no generations, no purge record).
pub(crate) async fn figures(pool: &MySqlPool) -> Result<Figures, sqlx::Error> {
    let retention: Option<i64> = sqlx::query_scalar("SELECT max(retention_ms) FROM idem_handlers")
        .fetch_one(pool)
        .await?;
    Ok((
        retention, 0, false, None, None, 0, 0, None, None, None, None, 0, None, None,
    ))
}
