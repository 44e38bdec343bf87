//! A handler that takes a SQLite transaction is a handler on SQLite, in
//! every form: the database comes from the first parameter's type.
use idem_runtime::handler::Handler;
use idem_runtime::{Delivery, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent]
async fn note(tx: &mut Transaction<'_, Sqlite>, text: String) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO notes (text) VALUES (?)")
        .bind(text)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(batch)]
async fn notes(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _: &[Delivery],
    _: Vec<String>,
) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(state = u32)]
async fn count(_tx: &mut Transaction<'_, Sqlite>, _: String) -> Result<u32, sqlx::Error> {
    Ok(1)
}

fn on_sqlite<S, H: Handler<S, Sqlite>>(_: H) {}

fn main() {
    on_sqlite::<(), _>(note());
    on_sqlite::<(), _>(notes());
    on_sqlite::<u32, _>(count());
}
