//! The expansion adds no rustc warning of its own, even where rustc's lints
//! are denied. trybuild runs rustc only, never clippy: that the expansion is
//! clippy-clean (`clippy::pedantic` included) is proven by
//! `tests/tests/handlers/lint_clean.rs`, which `cargo clippy --all-targets` compiles.
#![deny(
    warnings,
    unused,
    rust_2018_idioms,
    unused_qualifications,
    unreachable_pub
)]

use idem_runtime::{Delivery, Route, Router, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
    account: i64,
    amount: i64,
}

#[derive(Debug)]
struct LedgerError;

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ledger error")
    }
}

impl std::error::Error for LedgerError {}

/// Credits an account once per transfer.
#[idempotent(name = "credit-v1", key = cmd.transfer_id)]
async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    meta: &Delivery,
    cmd: Credit) -> Result<(), LedgerError> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await
        .map_err(|_| LedgerError)?;
    tracing::debug!(seq = meta.stream_sequence(), "credited");
    Ok(())
}

#[idempotent(name = "debit-v1", key = account)]
async fn debit(
    _tx: &mut sqlx::PgTransaction<'_>,
    Credit {
        account, amount, ..
    }: Credit,
) -> Result<(), sqlx::Error> {
    tracing::debug!(account, amount, "debited");
    Ok(())
}

#[idempotent(key = format!("{}:{}", cmd.account, cmd.transfer_id))]
async fn audit(
    _tx: &mut sqlx::PgTransaction<'_>,
    mut cmd: Credit,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    cmd.amount = 0;
    tracing::debug!(cmd.amount, "audited");
    Ok(())
}

#[idempotent]
async fn ignore(_tx: &mut sqlx::PgTransaction<'_>, _: Credit) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let _router = Router::new()
        .route(Route::new("LEDGER", "credit"), credit)
        .route(Route::new("LEDGER", "debit"), debit)
        .route(Route::new("LEDGER", "audit"), audit)
        .route(Route::new("LEDGER", "ignore"), ignore);
}
