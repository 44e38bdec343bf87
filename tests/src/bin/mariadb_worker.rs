//! A worker on MariaDB that credits accounts, for the MariaDB kill run
//! (`tests/tests/mariadb/kills.rs`), which SIGKILLs and restarts it. The
//! SQLite worker's twin (`sqlite_worker.rs`, whose module docs give the
//! environment and the journal): the same handler on MariaDB, named
//! `mariadb-credit`, whose durable consumer is `mariadb-credit` by default.
//! `DATABASE_URL` is `mysql://USER@HOST/DATABASE` (or with `?socket=PATH`);
//! the database must exist.
//!
//! Several copies may start at once: `schema::migrate` takes a named lock,
//! and the business tables are made with `CREATE TABLE IF NOT EXISTS`.

use std::process::ExitCode;

use idem_runtime::{Delivery, Router, idempotent};
use idem_tests::kill_worker::{
    Credit, Settings, after_commit_hooks, journal, journal_message, listen_for_aim, pause_if_asked,
};
use serde_json::json;
use sqlx::mysql::MySqlPoolOptions;

/// Credits `cmd.amount` to `cmd.account`: a row in `ledger` and the sum in
/// `balances`, in idem's transaction.
#[idempotent(name = "mariadb-credit")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    journal_message("begin", delivery);
    pause_if_asked(delivery).await;
    sqlx::query("INSERT INTO ledger (msg_id, account, amount, pid) VALUES (?, ?, ?, ?)")
        .bind(delivery.message_id().as_str())
        .bind(cmd.account)
        .bind(cmd.amount)
        .bind(i64::from(std::process::id()))
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO balances (account, balance) VALUES (?, ?)
         ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
    )
    .bind(cmd.account)
    .bind(cmd.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Connects, and creates idem's schema and the business tables (InnoDB).
async fn open_database(settings: &Settings) -> Result<sqlx::MySqlPool, String> {
    let pool = MySqlPoolOptions::new()
        .max_connections(settings.pool_size())
        .connect(&settings.database_url)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", settings.database_url))?;
    idem_runtime::schema::migrate(&pool)
        .await
        .map_err(|e| format!("cannot create idem's dedup schema: {e}"))?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS ledger (
             msg_id VARCHAR(64) NOT NULL, account BIGINT NOT NULL,
             amount BIGINT NOT NULL, pid BIGINT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE IF NOT EXISTS balances (
             account BIGINT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE = InnoDB;",
    )
    .execute(&pool)
    .await
    .map_err(|e| format!("cannot create the business tables: {e}"))?;
    Ok(pool)
}

async fn run(settings: Settings) -> Result<(), String> {
    // Before anything else: SIGUSR1's default action would kill the process.
    let hold_next = listen_for_aim()?;
    let pool = open_database(&settings).await?;
    let nats = async_nats::connect(&settings.nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {}: {e}", settings.nats_url))?;
    let router = Router::mariadb()
        .route(settings.route(), credit)
        .fault_hooks(after_commit_hooks(hold_next));
    journal(json!({"event": "started", "pid": std::process::id()}));
    router
        .run(nats, pool.clone())
        .await
        .map_err(|e| format!("the router failed: {e}"))?;
    pool.close().await;
    journal(json!({"event": "stopped", "pid": std::process::id()}));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    idem_tests::kill_worker::main("mariadb_worker", "mariadb-credit", run).await
}
