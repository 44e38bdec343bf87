use idem_runtime::{Route, Router};

// A plain async fn, without `#[idempotent]`.
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, _amount: i64) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let _router = Router::new().route(Route::new("LEDGER", "credit"), credit);
}
