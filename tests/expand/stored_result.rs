use idem_runtime::idempotent;

pub struct Place {
    order: i64,
}

pub struct Receipt {
    order: i64,
}

/// Places an order; the receipt is stored with the claim.
#[idempotent(name = "orders.place.v1")]
pub async fn place(_tx: &mut sqlx::PgTransaction<'_>, cmd: Place) -> Result<Receipt, sqlx::Error> {
    Ok(Receipt { order: cmd.order })
}

fn main() {}
