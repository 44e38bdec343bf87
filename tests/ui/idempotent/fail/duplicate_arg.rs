use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent(name = "credit-v1", key = cmd.account, name = "credit-v2")]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd.account;
    Ok(())
}

fn main() {}
