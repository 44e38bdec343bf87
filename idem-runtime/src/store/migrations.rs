//! PostgreSQL's migrations of idem's tables (the SQL files in
//! `idem-runtime/migrations/`), their history table, and the check that
//! they ran: what [`schema`](crate::schema) does on PostgreSQL.

use std::borrow::Cow;

use sqlx::PgPool;
use sqlx::migrate::{Migration, MigrationType, Migrator};

use crate::error::Error;

/// The table that records which idem migrations ran.
pub(crate) const HISTORY_TABLE: &str = "_idem_migrations";

/// (version, description, SQL) of every embedded migration, oldest first.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "processed messages",
        include_str!("../../migrations/0001_processed_messages.sql"),
    ),
    (
        2,
        "claims by generation",
        include_str!("../../migrations/0002_claims_by_generation.sql"),
    ),
    (
        3,
        "claim in one statement",
        include_str!("../../migrations/0003_claim_in_one_statement.sql"),
    ),
    (
        4,
        "outbox",
        include_str!("../../migrations/0004_outbox.sql"),
    ),
    (
        5,
        "outbox retries",
        include_str!("../../migrations/0005_outbox_retries.sql"),
    ),
    (
        6,
        "expiry state",
        include_str!("../../migrations/0006_expiry_state.sql"),
    ),
    (
        7,
        "outbox notify opt-in",
        include_str!("../../migrations/0007_outbox_notify_opt_in.sql"),
    ),
];

fn migrator() -> Migrator {
    migrator_of(MIGRATIONS)
}

/// A migrator of `migrations` ((version, description, SQL), oldest first)
/// that records them in [`HISTORY_TABLE`]: every database's.
pub(crate) fn migrator_of(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    let migrations = migrations
        .iter()
        .map(|&(version, description, sql)| {
            Migration::new(
                version,
                Cow::Borrowed(description),
                MigrationType::Simple,
                sqlx::SqlSafeStr::into_sql_str(sql),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(HISTORY_TABLE);
    migrator
}

/// The newest migration this version of idem ships for PostgreSQL.
pub(crate) fn latest_version() -> i64 {
    MIGRATIONS.last().map_or(0, |&(version, _, _)| version)
}

/// Applies the embedded migrations, all of them or up to `to`.
pub(crate) async fn migrate(pool: &PgPool, to: Option<i64>) -> Result<(), Error> {
    match to {
        Some(version) => migrator().run_to(version, pool).await?,
        None => migrator().run(pool).await?,
    }
    Ok(())
}

/// Checks that every embedded migration ran.
pub(crate) async fn verify(pool: &PgPool) -> Result<(), Error> {
    let history_exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(HISTORY_TABLE)
        .fetch_one(pool)
        .await?;
    let found: Option<i64> = if history_exists {
        sqlx::query_scalar("SELECT max(version) FROM _idem_migrations WHERE success")
            .fetch_one(pool)
            .await?
    } else {
        None
    };
    let expected = latest_version();
    match found {
        Some(version) if version >= expected => Ok(()),
        _ => Err(Error::SchemaMissing { expected, found }),
    }
}
