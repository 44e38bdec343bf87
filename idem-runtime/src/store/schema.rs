//! The dedup schema, shipped as embedded migrations.
//!
//! idem keeps its migration history in its own table, `_idem_migrations`, so
//! it never clashes with the application's `_sqlx_migrations`. Apply it once
//! at start-up (it takes an advisory lock, so many workers may call it at
//! once):
//!
//! ```no_run
//! # async fn start(pool: sqlx::PgPool) -> Result<(), idem_runtime::Error> {
//! idem_runtime::schema::migrate(&pool).await?;
//! # Ok(())
//! # }
//! ```

use sqlx::{PgPool, Pool};

use crate::error::Error;
use crate::store::backend::Backend;

/// The table that records which idem migrations ran.
pub const HISTORY_TABLE: &str = crate::store::migrations::HISTORY_TABLE;

/// The claims table (partitioned by generation; each partition's name
/// starts with this).
pub const CLAIMS_TABLE: &str = crate::error::class::CLAIMS_TABLE;

/// The transactional outbox's table (see [`crate::outbox`]).
pub const OUTBOX_TABLE: &str = "idem_outbox";

/// The newest migration this version of idem ships (PostgreSQL's).
pub fn latest_version() -> i64 {
    crate::store::migrations::latest_version()
}

/// Creates or upgrades the dedup schema. Safe to call from every worker at
/// start-up, also from several at once: on PostgreSQL sqlx takes an
/// advisory lock around the migrations; on SQLite, which has none, a worker
/// that loses the race to apply a migration finds it applied and goes on.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), Error> {
    DB::migrate(pool).await
}

/// Applies the embedded migrations up to `version` only: for tests of an
/// upgrade from an older schema.
#[doc(hidden)]
pub async fn migrate_to(pool: &PgPool, version: i64) -> Result<(), Error> {
    crate::store::migrations::migrate(pool, Some(version)).await
}

/// Checks that [`migrate`] has been applied, so that a worker refuses to start
/// (rather than NAK every message) when the dedup table is missing.
pub async fn verify<DB: Backend>(pool: &Pool<DB>) -> Result<(), Error> {
    DB::verify_schema(pool).await
}
