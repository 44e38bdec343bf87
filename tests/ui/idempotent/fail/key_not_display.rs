use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[derive(Deserialize)]
struct Transfer {
    id: (u64, u64),
}

#[idempotent(key = transfer.id)]
async fn transfer(
    _tx: &mut sqlx::PgTransaction<'_>,
    transfer: Transfer,
) -> Result<(), sqlx::Error> {
    let _ = transfer.id;
    Ok(())
}

fn main() {}
