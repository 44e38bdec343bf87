use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent(name = "credit-v1", retries = 3)]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd.account;
    Ok(())
}

fn main() {}
