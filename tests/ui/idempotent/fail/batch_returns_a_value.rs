use idem_runtime::idempotent;
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
}

#[derive(Serialize)]
struct Receipt {
    credited: usize,
}

#[idempotent(batch, key = |cmd| cmd.transfer_id)]
async fn credit_many(
    _tx: &mut sqlx::PgTransaction<'_>,
    cmds: Vec<Credit>,
) -> Result<Receipt, sqlx::Error> {
    Ok(Receipt { credited: cmds.len() })
}

fn main() {}
