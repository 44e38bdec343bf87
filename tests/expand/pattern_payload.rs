use idem_runtime::idempotent;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[idempotent(name = "transfer-v1", key = transfer_id)]
async fn transfer(
    _tx: &mut sqlx::PgTransaction<'_>,
    (transfer_id, mut amount): (String, i64),
) -> Result<()> {
    amount -= 1;
    let _ = (transfer_id, amount);
    Ok(())
}

fn main() {}
