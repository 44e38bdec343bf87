//! Batch handlers: the fresh messages of a batch in one `Vec`, their
//! deliveries as a slice, state through `FromRef`, a key closure over one
//! message (and its delivery), and a raw codec for each message.

use bytes::Bytes;
use idem_runtime::{Delivery, FromRef, Route, Router, State, idempotent};
use serde::Deserialize;

#[derive(Clone, FromRef)]
struct App {
    fees: Fees,
}

#[derive(Clone, Copy)]
struct Fees(i64);

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
    amount: i64,
}

#[idempotent(name = "credit-many-v1", key = |cmd| cmd.transfer_id, batch)]
async fn credit_many(
    tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    deliveries: &[Delivery],
    cmds: Vec<Credit>,
) -> Result<(), sqlx::Error> {
    let amounts: Vec<i64> = cmds.iter().map(|cmd| cmd.amount - fees.0).collect();
    let subjects: Vec<&str> = deliveries.iter().map(Delivery::subject).collect();
    sqlx::query("INSERT INTO credits (amount, subject) SELECT * FROM unnest($1::int8[], $2::text[])")
        .bind(&amounts)
        .bind(&subjects)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(codec = raw, key = |blob, delivery| format!("{}:{}", delivery.subject(), blob.len()), batch)]
async fn archive_many(_tx: &mut sqlx::PgTransaction<'_>, blobs: Vec<Bytes>) -> anyhow::Result<()> {
    let _ = blobs.iter().map(Bytes::len).sum::<usize>();
    Ok(())
}

fn main() {
    let app = App { fees: Fees(1) };
    let _router = Router::with_state(app)
        .route(Route::new("LEDGER", "credit").batch(64), credit_many)
        .route(Route::new("ARCHIVE", "archive").batch(16), archive_many);
    assert_eq!(credit_many::NAME, "credit-many-v1");
}
