use idem_runtime::idempotent;

#[idempotent]
async fn store(_tx: &mut sqlx::PgTransaction<'_>, blob: Vec<u8>) -> Result<(), sqlx::Error> {
    let _ = blob;
    Ok(())
}

fn main() {}
