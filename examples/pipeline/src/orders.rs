//! The orders service: takes placed orders and asks for their payment, then
//! marks them paid when the payment service says so.

use idem_runtime::error::{Classify, ErrorClass};
use idem_runtime::outbox::{Outbox, OutboxError};
use idem_runtime::{Route, Router, idempotent};

use crate::{ORDERS_STREAM, OrderPaid, OrderPlaced, PaymentRequested, stream_config, tuned};

/// Writes the order and queues its payment request, in one transaction with
/// the claim: a redelivery, or a publisher's retry after JetStream's window,
/// is skipped by the claim (its id is the `Nats-Msg-Id`), and queues nothing.
#[idempotent(name = "orders.place.v1")]
pub async fn place(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    placed: OrderPlaced,
) -> Result<(), OutboxError> {
    sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
        .bind(placed.order)
        .bind(placed.amount)
        .execute(&mut **tx)
        .await?;
    let request = PaymentRequested {
        order: placed.order,
        amount: placed.amount,
    };
    outbox.send(tx, "payments.requested", &request).await?;
    Ok(())
}

/// Why an `orders.paid` could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum OrdersError {
    #[error("order {0} does not exist")]
    UnknownOrder(i64),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A payment for an order this service never wrote will not apply on a
/// retry either: dead-letter it at once.
impl Classify for OrdersError {
    fn class(&self) -> ErrorClass {
        match self {
            OrdersError::UnknownOrder(_) => ErrorClass::Permanent,
            OrdersError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// Marks the order paid. `times_paid` counts the applications, so that a
/// double one would show (the demo and the test check it is 1).
#[idempotent(name = "orders.mark-paid.v1")]
pub async fn mark_paid(
    tx: &mut sqlx::PgTransaction<'_>,
    paid: OrderPaid,
) -> Result<(), OrdersError> {
    let updated = sqlx::query(
        "UPDATE orders SET times_paid = times_paid + 1, charge = $2, paid_at = now() WHERE id = $1",
    )
    .bind(paid.order)
    .bind(paid.charge)
    .execute(&mut **tx)
    .await?;
    if updated.rows_affected() == 0 {
        return Err(OrdersError::UnknownOrder(paid.order));
    }
    Ok(())
}

/// The service's routes; each creates the `ORDERS` stream if it is missing.
pub fn router() -> Router {
    let route = |durable: &str, subject: &str| {
        tuned(
            Route::new(ORDERS_STREAM, durable)
                .filter_subject(subject)
                .create_stream(stream_config(ORDERS_STREAM, "orders.>"))
                .concurrency(8),
        )
    };
    Router::new()
        .route(route("orders-place", "orders.placed"), place)
        .route(route("orders-mark-paid", "orders.paid"), mark_paid)
}

/// Installs the idem schema and the service's table.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), idem_runtime::Error> {
    idem_runtime::schema::migrate(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (
             id bigint PRIMARY KEY,
             amount bigint NOT NULL,
             times_paid int NOT NULL DEFAULT 0,
             charge bigint,
             placed_at timestamptz NOT NULL DEFAULT now(),
             paid_at timestamptz)",
    )
    .execute(pool)
    .await?;
    Ok(())
}
