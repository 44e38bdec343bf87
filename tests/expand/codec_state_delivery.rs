use bytes::Bytes;
use idem_runtime::{Delivery, State, idempotent};
use idem_tests::fixtures::Ledger;

#[idempotent(codec = raw, key = format!("{}:{}", delivery.subject(), blob.len()), state = Ledger)]
async fn archive(
    _tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(ledger): State<Ledger>,
    blob: Bytes,
) -> anyhow::Result<()> {
    let _ = (delivery.stream_sequence(), ledger.fees.0, blob.len());
    Ok(())
}

fn main() {}
