use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    cmd: Credit,
    _delivery: &idem_runtime::Delivery,
    retries: u32,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, retries);
    Ok(())
}

fn main() {}
