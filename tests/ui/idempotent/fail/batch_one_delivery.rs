use idem_runtime::{Delivery, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    amount: i64,
}

#[idempotent(batch)]
async fn credit_many(
    _tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    cmds: Vec<Credit>,
) -> Result<(), sqlx::Error> {
    let _ = (delivery, cmds.len());
    Ok(())
}

#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    deliveries: &[Delivery],
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (deliveries, cmd.amount);
    Ok(())
}

fn main() {}
