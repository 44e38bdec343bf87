use idem_runtime::idempotent;

#[idempotent]
async fn ping(_tx: &mut sqlx::PgTransaction<'_>, _ping: String) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {}
