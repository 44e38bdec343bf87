//! Stored results: what a handler returned, kept with its claim.
//!
//! A handler may return a value (`-> Result<Receipt, E>`). The runtime
//! encodes it with the handler's codec (JSON unless it chose another) and
//! stores the bytes in the `result` column of the message's claim, in the
//! same transaction, after the body and before COMMIT:
//!
//! ```sql
//! UPDATE idem_claims SET result = $2 WHERE key = $1::uuid
//! ```
//!
//! Every row of that key is this transaction's own claim (during a
//! generation transition the claim is in two generations; a claim made by
//! anyone else would have been a duplicate), so the value commits with the
//! claim and the writes, or not at all. A handler that returns `()` stores
//! nothing and costs no statement.
//!
//! A duplicate of a processed request reads the value back and
//! gets the first reply again without running the body (see
//! [`ReplyRoute`](crate::ReplyRoute)). A stored result lives exactly as long
//! as its claim: it is in the claim's row, so the route's retention
//! (`Route::retention`, `ReplyRoute::retention`) expires both together, and
//! a claim kept forever keeps its result forever. A reply route refuses,
//! before COMMIT, a value too large to be sent as a reply (see
//! [`ReplyRoute`](crate::ReplyRoute)), so it never stores one.

use bytes::Bytes;
use sqlx::Pool;

use crate::store::backend::Backend;

/// The result stored for `message_id` by the handler named `handler`: the
/// bytes its codec encoded (for JSON, the JSON text). For a reply route,
/// whose claims are keyed under the route's name rather than its
/// handler's, pass [`ReplyRoute::dedup_name`](crate::ReplyRoute::dedup_name)
/// (`reply:` and the route's name) as `handler`.
///
/// `None` if the message was not processed (or its claim has expired), or
/// was processed by a handler that returns `()`. It reads committed claims
/// only, so a message still being processed reads as not processed.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// #[derive(serde::Deserialize)]
/// struct Receipt { order: i64 }
///
/// if let Some(bytes) = idem_runtime::handler::results::stored(&pool, "orders.place.v1", "order-7").await? {
///     let receipt: Receipt = serde_json::from_slice(&bytes)?;
///     println!("order {} was placed", receipt.order);
/// }
/// # Ok(())
/// # }
/// ```
pub async fn stored<DB: Backend>(
    pool: &Pool<DB>,
    handler: &str,
    message_id: &str,
) -> Result<Option<Bytes>, sqlx::Error> {
    let key = crate::store::claim::key(handler, message_id);
    let mut connection = pool.acquire().await?;
    Ok(DB::read_result(&mut connection, &key).await?.flatten())
}
