//! A router on SQLite does not run on a PostgreSQL pool.
use idem_runtime::{Route, Router, idempotent};

#[idempotent]
async fn note(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _text: String,
) -> Result<(), sqlx::Error> {
    Ok(())
}

async fn run(nats: async_nats::Client, pool: sqlx::PgPool) {
    let _ = Router::sqlite()
        .route(Route::new("NOTES", "note"), note)
        .run(nats, pool)
        .await;
}

fn main() {
    drop(run);
}
