use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    retries: u32,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, retries);
    Ok(())
}

fn main() {}
