use idem_runtime::{Delivery, State, idempotent};
use idem_tests::fixtures::{Credit, Fees};

/// Credits the accounts of a batch, less the fee, with one statement.
#[idempotent(name = "ledger.credit_many.v1", key = |cmd| cmd.transfer_id, batch)]
pub async fn credit_many(
    tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    deliveries: &[Delivery],
    cmds: Vec<Credit>,
) -> Result<(), sqlx::Error> {
    let accounts: Vec<i64> = cmds.iter().map(|cmd| cmd.account).collect();
    let amounts: Vec<i64> = cmds.iter().map(|cmd| cmd.amount - fees.0).collect();
    let _ = deliveries;
    sqlx::query(
        "UPDATE accounts SET balance = balance + c.amount
         FROM (SELECT account, sum(amount) AS amount
                 FROM unnest($1::int8[], $2::int8[]) AS m(account, amount) GROUP BY account) AS c
         WHERE id = c.account",
    )
    .bind(&accounts)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn main() {}
