//! The ledger service on a SQLite file, for a small or edge service next to
//! a NATS leaf node. It shares all but the database with the service on
//! PostgreSQL (the crate root): the [`Credit`] message, the [`Ledger`]
//! state, the route, and the handler's statements and tables. What holds on
//! SQLite, and what does not, is in the guide's SQLite chapter
//! (`idem-runtime/docs/guide/sqlite.md`).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use ledger_example::{Fees, sqlite};
//!
//! let pool = sqlite::connect("sqlite:///var/lib/ledger/ledger.db").await?;
//! idem_runtime::schema::migrate(&pool).await?;
//! sqlite::prepare_ledger(&pool, 10).await?;
//! let fees = Fees::load_sqlite(&pool).await?;
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! sqlite::router(fees).run(nats, pool).await?;
//! # Ok(())
//! # }
//! ```

use std::str::FromStr;
use std::time::Duration;

use idem_runtime::{Router, State, idempotent};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use crate::{
    Credit, FRESH_LEDGER, Fees, Ledger, LedgerError, OPEN_ACCOUNTS, SET_FEES, credit_body,
    credit_route,
};

/// Opens the SQLite file that `url` names (`sqlite:///absolute/path.db`),
/// creating it if it is missing, with the settings idem asks for: WAL, so
/// that readers never wait for the writer, and `synchronous(Full)`, so that
/// a power loss keeps what was acked.
pub async fn connect(url: &str) -> Result<SqlitePool, sqlx::Error> {
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        // How long BEGIN waits for a write lock held by another connection:
        // another worker's transaction, `idem status`.
        .busy_timeout(Duration::from_secs(30));
    // A router on SQLite uses one connection at a time (two are enough);
    // the pool opens only those asked for.
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
}

/// Credits an account, less its fee, in a SQLite transaction: the same
/// statements as [`crate::credit()`], and the same name, for a different
/// database.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
pub async fn credit(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), LedgerError> {
    credit_body!(tx, fees, cmd)
}

/// The service's router on SQLite: [`credit()`] on `ledger.credit`, on the
/// same route as [`crate::router()`].
pub fn router(fees: Fees) -> Router<Ledger, sqlx::Sqlite> {
    Router::sqlite_with_state(Ledger { fees }).route(credit_route(), credit)
}

/// A fresh ledger in a SQLite file, as [`crate::prepare_ledger()`] makes
/// one on PostgreSQL, with the same statements. idem's schema must be
/// installed ([`idem_runtime::schema::migrate`]).
pub async fn prepare_ledger(pool: &SqlitePool, accounts: i64) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(FRESH_LEDGER).execute(pool).await?;
    sqlx::query(OPEN_ACCOUNTS)
        .bind(accounts)
        .execute(pool)
        .await?;
    sqlx::query(SET_FEES).execute(pool).await?;
    Ok(())
}
