use idem_runtime::idempotent;

#[idempotent(codec = yaml)]
async fn store(_tx: &mut sqlx::PgTransaction<'_>, text: String) -> Result<(), sqlx::Error> {
    let _ = text;
    Ok(())
}

fn main() {}
