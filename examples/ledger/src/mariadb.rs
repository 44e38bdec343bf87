//! The ledger service on MariaDB. It shares all but the database with the
//! service on PostgreSQL (the crate root): the [`Credit`] message, the
//! [`Ledger`] state, the route, and the handler's statements (with `?`
//! placeholders). What holds on MariaDB, and what does not, is in the
//! guide's MariaDB chapter (`idem-runtime/docs/guide/mariadb.md`).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use ledger_example::{Fees, mariadb};
//!
//! let pool = mariadb::connect("mysql://ledger:secret@127.0.0.1/ledger").await?;
//! idem_runtime::schema::migrate(&pool).await?;
//! mariadb::prepare_ledger(&pool, 10).await?;
//! let fees = Fees::load_mariadb(&pool).await?;
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! mariadb::router(fees).run(nats, pool).await?;
//! # Ok(())
//! # }
//! ```

use idem_runtime::{Router, State, idempotent};
use sqlx::MySqlPool;
use sqlx::mysql::MySqlPoolOptions;

use crate::{Credit, Fees, Ledger, LedgerError, credit_body, credit_route};

/// Connects to the MariaDB database `url` names
/// (`mysql://USER:PASSWORD@HOST/DATABASE`, or with `?socket=PATH`): one
/// connection per message in flight (the route's 8), and two to spare.
pub async fn connect(url: &str) -> Result<MySqlPool, sqlx::Error> {
    MySqlPoolOptions::new()
        .max_connections(10)
        .connect(url)
        .await
}

/// Credits an account, less its fee, in a MariaDB transaction: the same
/// statements as [`crate::credit()`], and the same name, for a different
/// database.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
pub async fn credit(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), LedgerError> {
    credit_body!(tx, fees, cmd, ?)
}

/// The service's router on MariaDB: [`credit()`] on `ledger.credit`, on the
/// same route as [`crate::router()`].
pub fn router(fees: Fees) -> Router<Ledger, sqlx::MySql> {
    Router::mariadb_with_state(Ledger { fees }).route(credit_route(), credit)
}

/// A fresh ledger, as [`crate::prepare_ledger()`] makes one on PostgreSQL:
/// the same tables (InnoDB: every table a handler writes must be
/// transactional), accounts 1 to `accounts` from MariaDB's sequence
/// engine, the same fees. idem's schema must be installed
/// ([`idem_runtime::schema::migrate`]).
pub async fn prepare_ledger(pool: &MySqlPool, accounts: i64) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS ledger_entries, fee_schedule, accounts;
         CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)
             ENGINE = InnoDB;
         CREATE TABLE fee_schedule (
             account bigint PRIMARY KEY REFERENCES accounts (id),
             percent bigint NOT NULL CHECK (percent BETWEEN 0 AND 99)) ENGINE = InnoDB;
         CREATE TABLE ledger_entries (
             transfer_id varchar(64) NOT NULL, account bigint NOT NULL,
             amount bigint NOT NULL, fee bigint NOT NULL) ENGINE = InnoDB;
         DELETE FROM idem_claims WHERE handler_id IN
             (SELECT id FROM idem_handlers WHERE name = 'ledger.credit.v1');",
    )
    .execute(pool)
    .await?;
    // An integer, so nothing but digits reaches the SQL.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO accounts (id) SELECT seq FROM seq_1_to_{}",
        accounts.max(1)
    )))
    .execute(pool)
    .await?;
    sqlx::query(crate::SET_FEES).execute(pool).await?;
    Ok(())
}
