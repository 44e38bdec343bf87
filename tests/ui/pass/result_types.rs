use idem_runtime::{Handler, idempotent};
use serde::Deserialize;

#[derive(Debug)]
struct MyError;

impl std::fmt::Display for MyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("my error")
    }
}

impl std::error::Error for MyError {}

type Result<T> = std::result::Result<T, MyError>;

/// A stand-in for `anyhow`, whose `Result<T>` has the same shape.
mod anyhow {
    pub type Error = Box<dyn std::error::Error + Send + Sync>;
    pub type Result<T, E = Error> = std::result::Result<T, E>;
}

#[derive(Deserialize)]
struct Msg {}

#[idempotent]
async fn alias(_tx: &mut sqlx::PgTransaction<'_>, _msg: Msg) -> Result<()> {
    Ok(())
}

#[idempotent]
async fn anyhow_like(_tx: &mut sqlx::PgTransaction<'_>, _msg: Msg) -> anyhow::Result<()> {
    Err("boxed errors convert".into())
}

#[idempotent]
async fn full_path(
    _tx: &mut sqlx::PgTransaction<'_>,
    _msg: Msg,
) -> std::result::Result<(), MyError> {
    Err(MyError)
}

// Any error that converts into `BoxError` works, including a `String`.
#[idempotent]
async fn string_error(
    _tx: &mut sqlx::PgTransaction<'_>,
    _msg: Msg,
) -> ::core::result::Result<u32, String> {
    Ok(1)
}

// The transaction derefs to the connection, so a handler can take that instead.
#[idempotent]
async fn connection(tx: &mut sqlx::PgConnection, _msg: Msg) -> Result<()> {
    let _: &mut sqlx::PgConnection = tx;
    Ok(())
}

fn main() {
    assert_eq!(alias().name(), "alias");
    assert_eq!(anyhow_like().name(), "anyhow_like");
    assert_eq!(full_path().name(), "full_path");
    assert_eq!(string_error().name(), "string_error");
    assert_eq!(connection().name(), "connection");
}
