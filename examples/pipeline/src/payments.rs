//! The payments service: charges each order once and says so.

use idem_runtime::outbox::{Outbox, OutboxError};
use idem_runtime::{Route, Router, idempotent};

use crate::{OrderPaid, PAYMENTS_STREAM, PaymentRequested, stream_config, tuned};

/// Charges the order and queues its `orders.paid`, in one transaction with
/// the claim. The dedup key is the order, not the message: however many
/// requests arrive for an order, it is charged once.
#[idempotent(name = "payments.charge.v1", key = request.order)]
pub async fn charge(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    request: PaymentRequested,
) -> Result<(), OutboxError> {
    let charge: i64 =
        sqlx::query_scalar("INSERT INTO charges (order_id, amount) VALUES ($1, $2) RETURNING id")
            .bind(request.order)
            .bind(request.amount)
            .fetch_one(&mut **tx)
            .await?;
    let paid = OrderPaid {
        order: request.order,
        charge,
    };
    outbox.send(tx, "orders.paid", &paid).await?;
    Ok(())
}

/// The service's route; it creates the `PAYMENTS` stream if it is missing.
pub fn router() -> Router {
    Router::new().route(
        tuned(
            Route::new(PAYMENTS_STREAM, "payments-charge")
                .filter_subject("payments.requested")
                .create_stream(stream_config(PAYMENTS_STREAM, "payments.>"))
                .concurrency(8),
        ),
        charge,
    )
}

/// Installs the idem schema and the service's table. `charges` has no
/// unique key on the order, so that a double charge would show.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), idem_runtime::Error> {
    idem_runtime::schema::migrate(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
             id bigserial PRIMARY KEY,
             order_id bigint NOT NULL,
             amount bigint NOT NULL,
             charged_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    Ok(())
}
