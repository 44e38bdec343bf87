//! idem's tables on SQLite: their migrations, registering handlers, what
//! operators read, stored results and the purge.
//!
//! There are no generations: a claim is keyed by its key alone
//! (`idem_claims`, `WITHOUT ROWID`), and expiry deletes a handler's claims
//! older than its retention, in chunks, each chunk a transaction of its own
//! so that the write lock is held for moments only.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use sqlx::migrate::MigrateError;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Sqlite, SqlitePool, Transaction};

use crate::error::{Error, HandlerError};
use crate::store::migrations::{HISTORY_TABLE, migrator_of};
use crate::store::purge::{Figures, PurgeReport};
use crate::store::reads::HandlerRow;

/// (version, description, SQL) of every SQLite migration, oldest first.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "claims",
        "CREATE TABLE idem_handlers (
         id INTEGER PRIMARY KEY,
         name TEXT NOT NULL UNIQUE,
         retention_ms INTEGER,
         updated_at TEXT NOT NULL DEFAULT (datetime('now'))
     );
     CREATE TABLE idem_claims (
         key TEXT PRIMARY KEY,
         handler_id INTEGER NOT NULL,
         claimed_at REAL NOT NULL DEFAULT (unixepoch('subsec')),
         result BLOB
     ) WITHOUT ROWID;
     CREATE INDEX idem_claims_by_age ON idem_claims (handler_id, claimed_at);",
    ),
    (
        2,
        "the settings of the router that registered each handler",
        // `synchronous` is each connection's own: only a router knows
        // its own, so it records it when it registers its handlers, for
        // `idem status` to read.
        "ALTER TABLE idem_handlers ADD COLUMN router_journal_mode TEXT;
         ALTER TABLE idem_handlers ADD COLUMN router_synchronous INTEGER;",
    ),
    (3, "the outbox", super::outbox::MIGRATION),
];

/// Claims deleted per transaction by the purge.
const PURGE_CHUNK: i64 = 1_000;

/// How often a worker that lost a race to apply a migration tries again.
const MIGRATION_RACES: u32 = 20;

/// How often a migration that met the write lock held past the busy timeout
/// is tried again.
const MIGRATION_LOCK_WAITS: u32 = 3;

/// Applies the migrations. Several workers may run this at once on one file:
/// sqlx takes no lock on SQLite, so two can both find a migration missing
/// and both apply it. A migration and its history row commit together, and
/// SQLite's DDL is transactional, so the second apply fails whole and
/// changes nothing; that worker finds the migration recorded in the history
/// and reads it again. Any other failure is returned at once, but for the
/// write lock held past the busy timeout (by a transaction left open in a
/// `sqlite3` shell, say), which is waited out a few times, with a warning.
pub(crate) async fn migrate(pool: &SqlitePool) -> Result<(), Error> {
    let migrator = migrator_of(MIGRATIONS);
    let (mut races, mut lock_waits) = (0, 0);
    loop {
        let error = match migrator.run(pool).await {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        if let MigrateError::ExecuteMigration(_, version) = &error
            && races < MIGRATION_RACES
            && recorded(pool, *version).await
        {
            races += 1;
            tracing::info!(
                version,
                "another worker applied idem's migration {version} first; reading the history again"
            );
            tokio::time::sleep(Duration::from_millis(10 * u64::from(races))).await;
            continue;
        }
        if lock_waits < MIGRATION_LOCK_WAITS && write_lock_held(&error) {
            lock_waits += 1;
            tracing::warn!(
                %error,
                "idem's migrations wait for SQLite's write lock, which another connection has held                  past the busy timeout (a transaction left open in a sqlite3 shell?); trying again"
            );
            continue;
        }
        return Err(error.into());
    }
}

/// Whether migration `version` is in the history, applied.
async fn recorded(pool: &SqlitePool, version: i64) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT EXISTS (SELECT 1 FROM _idem_migrations WHERE version = ? AND success)",
    )
    .bind(version)
    .fetch_one(pool)
    .await
    .unwrap_or(false)
}

/// Whether a migration failed on SQLite's write lock (BUSY or LOCKED).
fn write_lock_held(error: &MigrateError) -> bool {
    match error {
        MigrateError::Execute(error) | MigrateError::ExecuteMigration(error, _) => {
            crate::error::class::is_lock_timeout(error)
        }
        _ => false,
    }
}

/// The newest migration applied to the file, from idem's history table;
/// `None` before the first.
pub(crate) async fn schema_version(pool: &SqlitePool) -> Result<Option<i64>, sqlx::Error> {
    let history: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?)",
    )
    .bind(HISTORY_TABLE)
    .fetch_one(pool)
    .await?;
    if !history {
        return Ok(None);
    }
    sqlx::query_scalar("SELECT max(version) FROM _idem_migrations WHERE success")
        .fetch_one(pool)
        .await
}

/// Checks that every migration ran.
pub(crate) async fn verify(pool: &SqlitePool) -> Result<(), Error> {
    let found = schema_version(pool).await?;
    let expected = MIGRATIONS.last().map_or(0, |&(version, _, _)| version);
    match found {
        Some(version) if version >= expected => Ok(()),
        _ => Err(Error::SchemaMissing { expected, found }),
    }
}

/// Registers `handlers` (the last retention given for a name wins) in one
/// transaction that takes the write lock first, in name order, with the
/// registering router's `journal_mode` and `synchronous`.
pub(crate) async fn register(
    pool: &SqlitePool,
    handlers: &[(&str, Option<Duration>)],
) -> Result<HashMap<String, i32>, sqlx::Error> {
    let unique: BTreeMap<&str, Option<Duration>> = handlers.iter().copied().collect();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let journal_mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *tx)
        .await?;
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&mut *tx)
        .await?;
    let mut ids = HashMap::new();
    for (name, retention) in unique {
        let millis = retention.map(crate::store::purge::millis);
        let id: i32 = sqlx::query_scalar(
            "INSERT INTO idem_handlers (name, retention_ms, router_journal_mode, router_synchronous)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (name) DO UPDATE
                SET retention_ms = excluded.retention_ms, updated_at = datetime('now'),
                    router_journal_mode = excluded.router_journal_mode,
                    router_synchronous = excluded.router_synchronous
             RETURNING id",
        )
        .bind(name)
        .bind(millis)
        .bind(journal_mode.to_ascii_lowercase())
        .bind(synchronous)
        .fetch_one(&mut *tx)
        .await?;
        ids.insert(name.to_owned(), id);
    }
    tx.commit().await?;
    Ok(ids)
}

/// Every handler with its claims (see `store::reads::handlers`).
pub(crate) async fn handlers(pool: &SqlitePool) -> Result<Vec<HandlerRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT h.name, h.retention_ms / 1000.0, count(c.key), min(c.claimed_at),
                unixepoch('subsec') - min(c.claimed_at)
           FROM idem_handlers h LEFT JOIN idem_claims c ON c.handler_id = h.id
          GROUP BY h.id ORDER BY h.name",
    )
    .fetch_all(pool)
    .await
}

/// The committed claim on `key`: made at (Unix seconds), its age, its
/// generation (always 0 here), whether a result is stored.
pub(crate) async fn claim(
    pool: &SqlitePool,
    key: &str,
) -> Result<Option<(f64, f64, i32, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT claimed_at, unixepoch('subsec') - claimed_at, 0, result IS NOT NULL
           FROM idem_claims WHERE key = ?",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
}

/// Each handler's name, with the `journal_mode` and `synchronous` of the
/// router that registered it last (none if it registered before migration
/// 2), by name; nothing on a file still at migration 1.
pub(crate) async fn router_settings(
    connection: &mut SqliteConnection,
) -> Result<Vec<(String, Option<String>, Option<i64>)>, sqlx::Error> {
    let recorded: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pragma_table_info('idem_handlers')
                         WHERE name = 'router_synchronous')",
    )
    .fetch_one(&mut *connection)
    .await?;
    if !recorded {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "SELECT name, router_journal_mode, router_synchronous FROM idem_handlers ORDER BY name",
    )
    .fetch_all(connection)
    .await
}

/// The handlers' names, sorted.
pub(crate) async fn handler_names(pool: &SqlitePool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM idem_handlers ORDER BY name")
        .fetch_all(pool)
        .await
}

/// When `name` was last registered (UTC).
pub(crate) async fn registered_at(
    pool: &SqlitePool,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT updated_at || ' UTC' FROM idem_handlers WHERE name = ?")
        .bind(name)
        .fetch_optional(pool)
        .await
}

/// What the committed claim on `key` stored.
pub(crate) async fn read_result(
    connection: &mut SqliteConnection,
    key: &str,
) -> Result<Option<Option<Bytes>>, sqlx::Error> {
    let row: Option<Option<Vec<u8>>> =
        sqlx::query_scalar("SELECT result FROM idem_claims WHERE key = ?")
            .bind(key)
            .fetch_optional(connection)
            .await?;
    Ok(row.map(|result| result.map(Bytes::from)))
}

/// Stores `result` with the claim on `key`, which `tx` made.
pub(crate) async fn store_result(
    tx: &mut Transaction<'_, Sqlite>,
    key: &str,
    result: &[u8],
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE idem_claims SET result = ?2 WHERE key = ?1")
        .bind(key)
        .bind(result)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Deletes, for every handler with a retention, its claims older than
/// that, a chunk per transaction. Safe from several processes at once:
/// each chunk is a statement of its own under the write lock.
pub(crate) async fn purge(pool: &SqlitePool) -> Result<PurgeReport, Error> {
    let handlers: Vec<(i32, i64)> =
        sqlx::query_as("SELECT id, retention_ms FROM idem_handlers WHERE retention_ms IS NOT NULL")
            .fetch_all(pool)
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
                "DELETE FROM idem_claims WHERE key IN (
                     SELECT key FROM idem_claims
                      WHERE handler_id = ?1 AND claimed_at < unixepoch('subsec') - ?2 / 1000.0
                      LIMIT ?3)",
            )
            .bind(id)
            .bind(millis)
            .bind(PURGE_CHUNK)
            .execute(pool)
            .await?
            .rows_affected();
            report.deleted += deleted;
            if deleted < PURGE_CHUNK as u64 {
                break;
            }
        }
    }
    Ok(report)
}

/// Where expiry stands: only the longest retention means anything here
/// (no generations, no purge record).
pub(crate) async fn figures(pool: &SqlitePool) -> Result<Figures, sqlx::Error> {
    let retention: Option<i64> = sqlx::query_scalar("SELECT max(retention_ms) FROM idem_handlers")
        .fetch_one(pool)
        .await?;
    Ok((
        retention, 0, false, None, None, 0, 0, None, None, None, None, 0, None, None,
    ))
}
