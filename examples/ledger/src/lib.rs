//! The ledger service: credits accounts from JetStream messages, exactly
//! once, less a fee taken from the service's state.
//!
//! The handler takes the fee schedule from the service's state
//! ([`Router::with_state`], [`State`]): loaded from the database once at
//! start-up and shared by every delivery, rather than kept in a `static`.
//! The service runs on PostgreSQL (here) or on a SQLite file ([`sqlite`]):
//! the message, the state, the route and the handler's statements are the
//! same, only the handler's transaction type differs. `src/main.rs` runs it
//! as a demo (`scripts/demo.sh`, or `scripts/demo.sh --database sqlite`);
//! `tests/` proves it exactly-once under idem-test's faults, on PostgreSQL.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream;
use idem_runtime::error::{Classify, ErrorClass};
use idem_runtime::{FromRef, Route, Router, State, idempotent};
use serde::{Deserialize, Serialize};

pub mod mariadb;
pub mod sqlite;

/// The stream that stores `ledger.>`.
pub const STREAM: &str = "LEDGER";
/// The subject credits are published to.
pub const SUBJECT: &str = "ledger.credit";
/// Short, so the demo can wait past it to show a retry JetStream cannot catch.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);

/// A credit to one account, identified by its transfer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Credit {
    /// The transfer: the credit's dedup key.
    pub transfer_id: String,
    /// The account credited.
    pub account: i64,
    /// The amount credited, before the fee.
    pub amount: i64,
}

/// Why a credit failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The account is not in the ledger; no retry can help.
    #[error("account {0} does not exist")]
    UnknownAccount(i64),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// An unknown account will not appear on a retry, so that error is
/// permanent: the credit is dead-lettered at once instead of retried.
impl Classify for LedgerError {
    fn class(&self) -> ErrorClass {
        match self {
            LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
            LedgerError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// The service's state: what its handlers need besides the message, made
/// once at start-up and shared by every delivery. A handler takes a part of
/// it with `State<T>`; more parts (a client of another service, settings)
/// would be more fields.
#[derive(Clone, FromRef)]
pub struct Ledger {
    /// The fee schedule.
    pub fees: Fees,
}

/// The fee schedule: the percentage of each credit that an account pays as
/// a fee, by account. Read from the `fee_schedule` table at start-up, so a
/// change takes effect on the next start.
#[derive(Debug, Clone)]
pub struct Fees(Arc<BTreeMap<i64, i64>>);

/// The fee schedule's rates, by account, on either database.
const FEE_SCHEDULE: &str = "SELECT account, percent FROM fee_schedule";

impl Fees {
    /// Reads the schedule from the `fee_schedule` table.
    pub async fn load(pool: &sqlx::PgPool) -> Result<Fees, sqlx::Error> {
        Ok(Fees::from_rates(
            sqlx::query_as(FEE_SCHEDULE).fetch_all(pool).await?,
        ))
    }

    /// Reads the schedule from the `fee_schedule` table of a SQLite file.
    pub async fn load_sqlite(pool: &sqlx::SqlitePool) -> Result<Fees, sqlx::Error> {
        Ok(Fees::from_rates(
            sqlx::query_as(FEE_SCHEDULE).fetch_all(pool).await?,
        ))
    }

    /// Reads the schedule from the `fee_schedule` table of a MariaDB
    /// database.
    pub async fn load_mariadb(pool: &sqlx::MySqlPool) -> Result<Fees, sqlx::Error> {
        Ok(Fees::from_rates(
            sqlx::query_as(FEE_SCHEDULE).fetch_all(pool).await?,
        ))
    }

    fn from_rates(rates: Vec<(i64, i64)>) -> Fees {
        Fees(Arc::new(rates.into_iter().collect()))
    }

    /// The fee on a credit of `amount` to `account`, in whole units rounded
    /// down: none for an account without a rate.
    pub fn on(&self, account: i64, amount: i64) -> i64 {
        amount * self.0.get(&account).copied().unwrap_or(0) / 100
    }
}

/// The statements of every `credit` handler, PostgreSQL's ([`credit()`]),
/// SQLite's ([`sqlite::credit()`]) and MariaDB's ([`mariadb::credit()`]):
/// only the transaction's type differs, and the placeholders (`$1` on
/// PostgreSQL and SQLite, `?` on MariaDB; `credit_body!(tx, fees, cmd, ?)`).
/// A macro, because a function generic over the database would need more
/// lines of sqlx bounds than it has statements, and `rows_affected` is on
/// each database's own result type.
macro_rules! credit_body {
    ($tx:ident, $fees:ident, $cmd:ident) => {
        $crate::credit_body!(
            $tx,
            $fees,
            $cmd,
            "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
            "INSERT INTO ledger_entries (transfer_id, account, amount, fee) VALUES ($1, $2, $3, $4)"
        )
    };
    ($tx:ident, $fees:ident, $cmd:ident, ?) => {
        $crate::credit_body!(
            $tx,
            $fees,
            $cmd,
            "UPDATE accounts SET balance = balance + ? WHERE id = ?",
            "INSERT INTO ledger_entries (transfer_id, account, amount, fee) VALUES (?, ?, ?, ?)"
        )
    };
    ($tx:ident, $fees:ident, $cmd:ident, $update:literal, $insert:literal) => {{
        let fee = $fees.on($cmd.account, $cmd.amount);
        let updated = ::sqlx::query($update)
            .bind($cmd.amount - fee)
            .bind($cmd.account)
            .execute(&mut **$tx)
            .await?;
        if updated.rows_affected() == 0 {
            return Err($crate::LedgerError::UnknownAccount($cmd.account));
        }
        ::sqlx::query($insert)
            .bind(&$cmd.transfer_id)
            .bind($cmd.account)
            .bind($cmd.amount)
            .bind(fee)
            .execute(&mut **$tx)
            .await?;
        Ok(())
    }};
}
pub(crate) use credit_body;

/// Credits an account, less its fee. The dedup key is the transfer id, so a
/// credit republished under any `Nats-Msg-Id` is still applied once.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
pub async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), LedgerError> {
    credit_body!(tx, fees, cmd)
}

/// The route [`credit()`] is bound to, on either database: durable consumer
/// `ledger-credit` on `ledger.credit`, creating the stream if it is missing.
fn credit_route() -> Route {
    Route::new(STREAM, "ledger-credit")
        .filter_subject(SUBJECT)
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec!["ledger.>".into()],
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .concurrency(8)
}

/// The service's router: [`credit()`] on `ledger.credit`, creating the
/// stream if it is missing.
pub fn router(fees: Fees) -> Router<Ledger> {
    Router::with_state(Ledger { fees }).route(credit_route(), credit)
}

/// `n` unique credits spread over `accounts` accounts.
pub fn credits(n: usize, accounts: i64) -> Vec<Credit> {
    (0..n)
        .map(|i| Credit {
            transfer_id: format!("transfer-{i:06}"),
            account: 1 + (i as i64 % accounts),
            amount: 1 + (i as i64 * 7) % 100,
        })
        .collect()
}

/// The ledger's tables, fresh, and no claims of its handler left from a
/// run before. Standard SQL, the same on both databases: one `DROP` per
/// table, as SQLite takes one table at a time.
const FRESH_LEDGER: &str = "
    DROP TABLE IF EXISTS ledger_entries;
    DROP TABLE IF EXISTS fee_schedule;
    DROP TABLE IF EXISTS accounts;
    CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
    CREATE TABLE fee_schedule (
        account bigint PRIMARY KEY REFERENCES accounts,
        percent bigint NOT NULL CHECK (percent BETWEEN 0 AND 99));
    CREATE TABLE ledger_entries (
        transfer_id text NOT NULL, account bigint NOT NULL,
        amount bigint NOT NULL, fee bigint NOT NULL);
    DELETE FROM idem_claims WHERE handler_id IN (SELECT id FROM idem_handlers WHERE name = 'ledger.credit.v1');";

/// Accounts 1 to `$1`, zeroed. A recursive query rather than PostgreSQL's
/// `generate_series`, which SQLite does not have.
const OPEN_ACCOUNTS: &str = "
    WITH RECURSIVE n(id) AS (SELECT CAST(1 AS bigint) UNION ALL SELECT id + 1 FROM n WHERE id < $1)
    INSERT INTO accounts (id) SELECT id FROM n";

/// Accounts pay 0, 5 or 10 % by turns.
pub(crate) const SET_FEES: &str =
    "INSERT INTO fee_schedule (account, percent) SELECT id, 5 * (id % 3) FROM accounts";

/// A fresh ledger: zeroed accounts and no entries, so each run proves
/// itself, and a fee schedule in which accounts pay 0, 5 or 10 % by turns.
/// idem's schema must be installed ([`idem_runtime::schema::migrate`]).
pub async fn prepare_ledger(pool: &sqlx::PgPool, accounts: i64) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(FRESH_LEDGER).execute(pool).await?;
    sqlx::query(OPEN_ACCOUNTS)
        .bind(accounts)
        .execute(pool)
        .await?;
    sqlx::query(SET_FEES).execute(pool).await?;
    Ok(())
}
