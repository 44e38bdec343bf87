//! Codecs: raw bytes, text, protobuf, and a codec of one's own.

use bytes::Bytes;
use idem_runtime::codec::{Decode, DecodeError};
use idem_runtime::{Route, Router, idempotent};

#[idempotent(codec = raw)]
async fn blob(_tx: &mut sqlx::PgTransaction<'_>, bytes: Bytes) -> Result<(), sqlx::Error> {
    let _ = bytes.len();
    Ok(())
}

#[idempotent(codec = raw)]
async fn vector(_tx: &mut sqlx::PgTransaction<'_>, bytes: Vec<u8>) -> Result<(), sqlx::Error> {
    let _ = bytes.len();
    Ok(())
}

#[idempotent(codec = raw)]
async fn text(_tx: &mut sqlx::PgTransaction<'_>, text: String) -> Result<(), sqlx::Error> {
    let _ = text.len();
    Ok(())
}

#[derive(Clone, PartialEq, prost::Message)]
struct Credit {
    #[prost(int64, tag = "1")]
    account: i64,
}

#[idempotent(codec = protobuf, key = cmd.account)]
async fn proto(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd.account;
    Ok(())
}

/// Comma-separated numbers.
struct Csv;

impl Decode<Vec<i64>> for Csv {
    fn decode(payload: &Bytes) -> Result<Vec<i64>, DecodeError> {
        std::str::from_utf8(payload)
            .map_err(|error| DecodeError::new("csv", error))?
            .split(',')
            .map(|field| field.trim().parse().map_err(|error| DecodeError::new("csv", error)))
            .collect()
    }
}

#[idempotent(codec = Csv)]
async fn numbers(_tx: &mut sqlx::PgTransaction<'_>, numbers: Vec<i64>) -> Result<(), sqlx::Error> {
    let _ = numbers.len();
    Ok(())
}

fn main() {
    let _router = Router::new()
        .route(Route::new("S", "blob"), blob)
        .route(Route::new("S", "vector"), vector)
        .route(Route::new("S", "text"), text)
        .route(Route::new("S", "proto"), proto)
        .route(Route::new("S", "numbers"), numbers);
}
