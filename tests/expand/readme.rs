use idem_runtime::{State, idempotent};
use idem_tests::fixtures::{Credit, Fees, LedgerError};

/// Credits an account once per transfer, less the fee.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
pub async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), LedgerError> {
    let updated = sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount - fees.0)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(LedgerError::UnknownAccount(cmd.account));
    }
    Ok(())
}

fn main() {}
