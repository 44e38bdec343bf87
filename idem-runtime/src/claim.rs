//! The claim: the first statement of every message's transaction.
//!
//! A message alone is claimed by a plain INSERT sent in one round trip with
//! BEGIN (`transaction::Begin::and_claim`): a unique violation on the dedup
//! table means the message was processed before. A batch is claimed here, in
//! one statement that reports which of its ids were fresh.
//!
//! Either way the claim waits for a concurrent transaction that holds an
//! uncommitted claim on the same key: if that one commits, this claim finds
//! the row (a duplicate); if it rolls back, this claim proceeds. Each claim
//! records its transaction's id (`idem.claim`) for the check before COMMIT.

use sqlx::PgTransaction;

use crate::transaction::RECORD_CLAIM;

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
    let fresh: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO idem_processed_messages (handler, message_id) \
         SELECT $1, id FROM unnest($2::text[]) AS claim(id) ORDER BY id \
         ON CONFLICT DO NOTHING {RECORD_CLAIM}, message_id"
    )))
    .bind(handler)
    .bind(&sorted)
    .fetch_all(&mut **tx)
    .await?;
    Ok(fresh.into_iter().map(|(_, id)| id).collect())
}
