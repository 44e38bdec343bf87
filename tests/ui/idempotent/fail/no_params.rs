use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit() -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {}
