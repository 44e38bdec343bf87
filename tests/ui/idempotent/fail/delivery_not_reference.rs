use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

// The delivery is borrowed, `&Delivery`: an owned one cannot be taken.
#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    delivery: idem_runtime::Delivery,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, delivery);
    Ok(())
}

fn main() {}
