use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Option<()> {
    let _ = cmd.account;
    None
}

fn main() {}
