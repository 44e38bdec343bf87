use idem_runtime::{Handler, Route, Router, idempotent};
use serde::Deserialize;

/// A `pub` handler needs a payload type at least as visible.
#[derive(Deserialize)]
pub struct Credit {
    transfer_id: u64,
    account: i64,
    amount: i64,
}

#[derive(Debug)]
pub struct LedgerError(sqlx::Error);

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the ledger update failed: {}", self.0)
    }
}

impl std::error::Error for LedgerError {}

/// Credits an account once per transfer.
#[idempotent(name = "credit-v1", key = cmd.transfer_id)]
pub async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), LedgerError> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await
        .map_err(LedgerError)?;
    Ok(())
}

#[derive(Deserialize)]
struct PlaceOrder {
    customer: String,
    number: u32,
}

// Any expression works as a key; it borrows the payload rather than moving it.
#[idempotent(key = format!("{}/{}", order.customer, order.number), name = "place-order-v2",)]
async fn place_order(
    _tx: &mut sqlx::PgTransaction<'_>,
    order: PlaceOrder,
) -> Result<(), sqlx::Error> {
    drop(order);
    Ok(())
}

fn main() {
    let delivery = idem_runtime::Delivery::for_test("subject", "STREAM", 1);
    assert_eq!(credit::NAME, "credit-v1");
    assert_eq!(Handler::<()>::name(&credit()), "credit-v1");
    let cmd = Credit {
        transfer_id: 42,
        account: 7,
        amount: 100,
    };
    assert_eq!(Handler::<()>::message_key(&credit(), &cmd, &delivery).as_deref(), Some("42"));

    let order = PlaceOrder {
        customer: "acme".to_owned(),
        number: 9,
    };
    assert_eq!(place_order::NAME, "place-order-v2");
    assert_eq!(Handler::<()>::message_key(&place_order(), &order, &delivery).as_deref(), Some("acme/9"));

    let _router = Router::new()
        .route(Route::new("LEDGER", "credit"), credit)
        .route(Route::new("ORDERS", "place-order"), place_order);
}
