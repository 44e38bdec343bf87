//! The statements of stored results (see [`handler::results`] for what
//! they are): a value goes into the `result` column of the message's claim,
//! in the claim's transaction, after the body and before COMMIT:
//!
//! ```sql
//! UPDATE idem_claims SET result = $2 WHERE key = $1::uuid
//! ```
//!
//! [`handler::results`]: crate::handler::results

use bytes::Bytes;
use sqlx::{PgConnection, PgTransaction};

use crate::error::HandlerError;

/// What the committed claim on `key` stored: `None` if there is no claim,
/// `Some(None)` for a claim without a result.
pub(crate) async fn read(
    connection: &mut PgConnection,
    key: &str,
) -> Result<Option<Option<Bytes>>, sqlx::Error> {
    // Both rows of a claim made during a transition hold the same result.
    let row: Option<Option<Vec<u8>>> =
        sqlx::query_scalar("SELECT result FROM idem_claims WHERE key = $1::uuid LIMIT 1")
            .bind(key)
            .fetch_optional(connection)
            .await?;
    Ok(row.map(|result| result.map(Bytes::from)))
}

/// Stores `result` with the claim on `key`, which `tx` made.
pub(crate) async fn store(
    tx: &mut PgTransaction<'_>,
    key: &str,
    result: &Bytes,
) -> Result<(), HandlerError> {
    sqlx::query("UPDATE idem_claims SET result = $2 WHERE key = $1::uuid")
        .bind(key)
        .bind(result.as_ref())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Stores the results of a batch's messages with their claims, in one
/// statement.
pub(crate) async fn store_many(
    tx: &mut PgTransaction<'_>,
    keys: &[&str],
    results: &[&[u8]],
) -> Result<(), HandlerError> {
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE idem_claims SET result = r.result
           FROM unnest($1::uuid[], $2::bytea[]) AS r(key, result)
          WHERE idem_claims.key = r.key",
    )
    .bind(keys)
    .bind(results)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
