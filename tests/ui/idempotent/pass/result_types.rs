use idem_runtime::idempotent;
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

/// An alias under another name than `Result`.
type Fallible = std::result::Result<(), MyError>;

#[derive(Deserialize)]
struct Msg {}

#[idempotent]
async fn alias(_tx: &mut sqlx::PgTransaction<'_>, _msg: Msg) -> Result<()> {
    Ok(())
}

#[idempotent]
async fn with_anyhow(_tx: &mut sqlx::PgTransaction<'_>, _msg: Msg) -> anyhow::Result<()> {
    Err(anyhow::anyhow!("anyhow errors convert"))
}

#[idempotent]
async fn boxed(
    _tx: &mut sqlx::PgTransaction<'_>,
    _msg: Msg,
) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
    Err("boxed errors convert".into())
}

#[idempotent]
async fn other_alias(_tx: &mut sqlx::PgTransaction<'_>, _msg: Msg) -> Fallible {
    Ok(())
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
    assert_eq!(alias::NAME, "alias");
    assert_eq!(with_anyhow::NAME, "with_anyhow");
    assert_eq!(boxed::NAME, "boxed");
    assert_eq!(other_alias::NAME, "other_alias");
    assert_eq!(full_path::NAME, "full_path");
    assert_eq!(string_error::NAME, "string_error");
    assert_eq!(connection::NAME, "connection");
}
