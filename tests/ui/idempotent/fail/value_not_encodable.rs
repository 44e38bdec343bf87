use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    id: i64,
}

/// Not `Serialize`: the JSON codec cannot store it.
struct Receipt {
    order: i64,
}

#[idempotent]
async fn place(_tx: &mut sqlx::PgTransaction<'_>, order: Order) -> Result<Receipt, sqlx::Error> {
    Ok(Receipt { order: order.id })
}

fn main() {}
