use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
}

#[idempotent(batch, per_message, key = |cmd| cmd.transfer_id)]
async fn credit_many(_tx: &mut sqlx::PgTransaction<'_>, cmds: Vec<Credit>) -> Result<(), sqlx::Error> {
    let _ = cmds;
    Ok(())
}

fn main() {}
