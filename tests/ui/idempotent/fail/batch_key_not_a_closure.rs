use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
}

#[idempotent(batch, key = cmds.transfer_id)]
async fn credit_many(_tx: &mut sqlx::PgTransaction<'_>, cmds: Vec<Credit>) -> Result<(), sqlx::Error> {
    let _ = cmds;
    Ok(())
}

#[idempotent(key = |cmd, delivery, extra| cmd.transfer_id)]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd;
    Ok(())
}

fn main() {}
