use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    id: i64,
}

/// An alias that hides the value type.
type Placed = Result<i64, sqlx::Error>;

#[idempotent]
async fn place(_tx: &mut sqlx::PgTransaction<'_>, order: Order) -> Placed {
    Ok(order.id)
}

fn main() {}
