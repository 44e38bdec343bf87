//! The claim: the first statement of every message's transaction.
//!
//! A message alone is claimed by a plain INSERT sent in one round trip with
//! BEGIN (`transaction::begin`): a unique violation on the dedup
//! table means the message was processed before. A batch is claimed here, in
//! one statement that reports which of its ids were fresh.
//!
//! Either way the claim waits for a concurrent transaction that holds an
//! uncommitted claim on the same key: if that one commits, this claim finds
//! the row (a duplicate); if it rolls back, this claim proceeds. Each claim
//! records its transaction's id (`idem.claim`) for the check before COMMIT.

use sqlx::PgTransaction;

/// Claims many messages in one statement, for batch mode. Returns the ids
/// this transaction inserted; the others were processed before. The ids are
/// sorted so that two batches with overlapping ids take their row locks in
/// the same order and do not deadlock. `ON CONFLICT DO NOTHING`, because in
/// PostgreSQL an error aborts the whole transaction.
pub(crate) async fn claim_many(
    tx: &mut PgTransaction<'_>,
    handler: &str,
    message_ids: &[&str],
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let mut sorted = message_ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    // One row back, and the claim recorded once (after the insert: the
    // aggregate has taken every row), whatever the batch's size.
    let (fresh, _): (Option<Vec<String>>, String) = sqlx::query_as(
        "WITH fresh AS (
             INSERT INTO idem_processed_messages (handler, message_id)
             SELECT $1, id FROM unnest($2::text[]) AS claim(id) ORDER BY id
             ON CONFLICT DO NOTHING RETURNING message_id
         )
         SELECT array_agg(message_id),
                set_config('idem.claim',
                           coalesce(pg_current_xact_id_if_assigned()::xid::text, ''), true)
         FROM fresh",
    )
    .bind(handler)
    .bind(&sorted)
    .fetch_one(&mut **tx)
    .await?;
    Ok(fresh.unwrap_or_default().into_iter().collect())
}
