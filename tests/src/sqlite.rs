//! SQLite files for the tests on SQLite (`tests/tests/sqlite/`, and the
//! compliance suite's SQLite store).

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// A pool of 8 on the file at `path` (made if missing), as the guide opens
/// one: WAL mode, `synchronous = FULL`, writers waiting up to a minute for
/// the write lock.
pub async fn pool(path: &Path) -> SqlitePool {
    pool_waiting(path, Duration::from_secs(60)).await
}

/// As [`pool`], with writers that wait `busy_timeout` for the write lock.
pub async fn pool_waiting(path: &Path, busy_timeout: Duration) -> SqlitePool {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("a SQLite url")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(busy_timeout);
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("the SQLite file opens")
}
