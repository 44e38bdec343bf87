use idem_runtime::{Handler, ReplyRoute, Route, Router, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Order {
    id: i64,
}

#[derive(Serialize)]
struct Receipt {
    order: i64,
}

/// A JSON value, through `anyhow::Result<T>`.
#[idempotent(name = "orders.place.v1")]
async fn place(_tx: &mut sqlx::PgTransaction<'_>, order: Order) -> anyhow::Result<Receipt> {
    Ok(Receipt { order: order.id })
}

/// Raw bytes back.
#[idempotent(codec = raw)]
async fn echo(_tx: &mut sqlx::PgTransaction<'_>, bytes: bytes::Bytes) -> Result<bytes::Bytes, String> {
    Ok(bytes)
}

/// An alias that hides `()` still works.
type Done = Result<(), sqlx::Error>;

#[idempotent]
async fn done(_tx: &mut sqlx::PgTransaction<'_>, _order: Order) -> Done {
    Ok(())
}

fn main() {
    let _router = Router::new()
        .route(Route::new("ORDERS", "place"), place)
        .reply_route(ReplyRoute::new("orders.place").queue_group("orders"), place)
        .reply_route(ReplyRoute::new("echo"), echo)
        .reply_route(ReplyRoute::new("done"), done);
    let _ = Handler::<()>::name(&place());
}
