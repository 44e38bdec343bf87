use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

// The order of earlier versions: the message comes last now.
#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    cmd: Credit,
    delivery: &idem_runtime::Delivery,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, delivery);
    Ok(())
}

fn main() {}
