//! A small service, as your crate would hold it: one handler that credits
//! a ledger, its router, and its migration. `tests/credits.rs` proves it
//! exactly-once with idem-test.

use async_nats::jetstream::stream;
use idem_runtime::{Route, Router, idempotent};
use serde::{Deserialize, Serialize};

/// A credit of one transfer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Credit {
    /// The transfer: the credit's dedup key.
    pub transfer_id: String,
    /// The account credited.
    pub account: i64,
    /// The amount.
    pub amount: i64,
}

/// Writes the credit to the ledger, once per transfer.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
pub async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO ledger (transfer_id, account, amount) VALUES ($1, $2, $3)")
        .bind(&cmd.transfer_id)
        .bind(cmd.account)
        .bind(cmd.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The service's router; it creates its stream if it is missing.
pub fn router() -> Router {
    Router::new().route(
        Route::new("LEDGER", "ledger-credit")
            .filter_subject("ledger.credit")
            .create_stream(stream::Config {
                name: "LEDGER".into(),
                subjects: vec!["ledger.>".into()],
                ..Default::default()
            }),
        credit,
    )
}

/// The service's table.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS ledger (
             transfer_id text NOT NULL,
             account bigint NOT NULL,
             amount bigint NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}
