//! A router on PostgreSQL refuses a handler whose transaction is SQLite's:
//! a route's handler runs on its router's database.
use idem_runtime::{Route, Router, idempotent};

#[idempotent]
async fn note(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _text: String,
) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let _ = Router::new().route(Route::new("NOTES", "note"), note);
}
