use idem_runtime::idempotent;

pub struct Credit {
    pub transfer_id: String,
    pub account: i64,
    pub amount: i64,
}

// By hand rather than derived, to keep serde's expansion out of the snapshot.
impl<'de> serde::Deserialize<'de> for Credit {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (transfer_id, account, amount) = serde::Deserialize::deserialize(deserializer)?;
        Ok(Credit {
            transfer_id,
            account,
            amount,
        })
    }
}

/// Credits an account once per transfer.
#[idempotent(name = "credit-v1", key = cmd.transfer_id)]
pub async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    meta: &idem_runtime::Delivery,
    cmd: Credit) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await?;
    let _ = meta.stream_sequence();
    Ok(())
}

fn main() {}
