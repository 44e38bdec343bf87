//! The first parameter's type says which database a handler runs on: each
//! way of writing a PostgreSQL transaction, or the connection it derefs to,
//! gives a `Handler<S, sqlx::Postgres>`, in every form of handler.
use idem_runtime::handler::Handler;
use idem_runtime::{Delivery, Route, Router, idempotent};
use sqlx::{PgConnection, Postgres, Transaction};

#[idempotent]
async fn by_alias(_tx: &mut sqlx::PgTransaction<'_>, _: String) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent]
async fn by_database(tx: &mut Transaction<'_, Postgres>, _: String) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(())
}

#[idempotent]
async fn by_connection(conn: &mut PgConnection, _: String) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(conn).await?;
    Ok(())
}

#[idempotent(batch)]
async fn batch(
    _conn: &mut sqlx::postgres::PgConnection,
    _: &[Delivery],
    _: Vec<String>,
) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(state = u32)]
async fn stored(_tx: &mut Transaction<'_, Postgres>, _: String) -> Result<u32, sqlx::Error> {
    Ok(1)
}

fn on_postgres<S, H: Handler<S, Postgres>>(_: H) {}

fn main() {
    on_postgres::<(), _>(by_alias());
    on_postgres::<(), _>(by_database());
    on_postgres::<(), _>(by_connection());
    on_postgres::<(), _>(batch());
    on_postgres::<u32, _>(stored());
    let _router = Router::new()
        .route(Route::new("S", "alias"), by_alias)
        .route(Route::new("S", "database"), by_database)
        .route(Route::new("S", "connection"), by_connection)
        .route(Route::new("S", "batch").batch(8), batch);
    let _router = Router::with_state(7_u32).route(Route::new("S", "stored"), stored);
}
