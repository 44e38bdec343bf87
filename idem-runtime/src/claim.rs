//! The claim: the first statement of every handler's transaction.

use sqlx::PgTransaction;

use crate::message_id::MessageId;

/// What the claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub(crate) enum Claim {
    /// This transaction inserted the dedup row: run the handler body.
    Fresh,
    /// The row already existed: the message was processed before, skip it.
    Duplicate,
}

impl Claim {
    /// `true` when the message was already processed.
    pub(crate) fn is_duplicate(self) -> bool {
        self == Claim::Duplicate
    }
}

/// Inserts `(handler, message_id)` into the dedup table inside `tx`.
///
/// `ON CONFLICT DO NOTHING` rather than catching a unique violation, because in
/// PostgreSQL an error aborts the whole transaction. If another transaction
/// holds an uncommitted claim on the same key, this statement waits for it:
/// when it commits, this claim finds the row and reports [`Claim::Duplicate`];
/// when it rolls back, this claim inserts the row and proceeds.
pub(crate) async fn claim(
    tx: &mut PgTransaction<'_>,
    handler: &str,
    message_id: &MessageId,
) -> Result<Claim, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO idem_processed_messages (handler, message_id) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING",
    )
    .bind(handler)
    .bind(message_id.as_str())
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok(if inserted == 1 {
        Claim::Fresh
    } else {
        Claim::Duplicate
    })
}

/// Claims many messages in one statement, for batch mode. Returns the ids
/// this transaction inserted; the others were processed before. The ids are
/// sorted so that two batches with overlapping ids take their row locks in
/// the same order and do not deadlock.
pub(crate) async fn claim_many(
    tx: &mut PgTransaction<'_>,
    handler: &str,
    message_ids: &[&str],
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let mut sorted = message_ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let fresh: Vec<String> = sqlx::query_scalar(
        "INSERT INTO idem_processed_messages (handler, message_id) \
         SELECT $1, id FROM unnest($2::text[]) AS claim(id) ORDER BY id \
         ON CONFLICT DO NOTHING RETURNING message_id",
    )
    .bind(handler)
    .bind(&sorted)
    .fetch_all(&mut **tx)
    .await?;
    Ok(fresh.into_iter().collect())
}
