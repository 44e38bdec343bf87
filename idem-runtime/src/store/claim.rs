//! The claim: the first statement of every message's transaction.
//!
//! A claim is a row of `idem_claims`, keyed by [`key`]: a fixed 16 bytes
//! derived from the handler name and the message id, whatever their length.
//! The table is partitioned by generation (see the migration
//! `0002_claims_by_generation.sql` for why, and for how a claim conflicts
//! across generations). A message alone is claimed by [`CLAIM_SQL`], in the
//! same round trip as BEGIN (`transaction::begin`): a unique violation means
//! the message was processed before. A batch is claimed here, in one
//! statement that reports which of its messages were fresh.
//!
//! Either way the claim waits for a concurrent transaction that holds an
//! uncommitted claim on the same key: if that one commits, this claim finds
//! the row (a duplicate); if it rolls back, this claim proceeds. The
//! transaction's id (`idem.claim`), for the check before COMMIT, is
//! recorded by the statement that begins the transaction
//! ([`transaction`](crate::store::transaction)), and by a batch's claim.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::PgConnection;
use sqlx::{PgPool, PgTransaction};

/// The claim's statement, with `$bound` (a condition on the probed claim
/// `c`, ending in a space, or nothing) narrowing the probe of the sealed
/// generations.
macro_rules! claim_sql {
    ($bound:literal) => {
        concat!(
            "INSERT INTO idem_claims (key, gen, handler_id) \
             SELECT $2, g.gen, $1 \
               FROM idem_dedup_state AS s, \
                    LATERAL ((SELECT c.gen FROM idem_claims AS c \
                               WHERE c.key = $2 AND c.gen < s.current_gen - s.transition::integer ",
            $bound,
            "LIMIT 1) \
                             UNION ALL SELECT s.current_gen - 1 WHERE s.transition \
                             UNION ALL SELECT s.current_gen) AS g(gen)"
        )
    };
}

/// Claims key `$2` for the handler with id `$1` (an `integer` and a `uuid`),
/// or fails with a unique violation if it was claimed before. `$3`
/// (`bigint`, Unix seconds, or NULL if unknown) is the earliest time an
/// earlier claim of the same message can have been made.
///
/// One statement, which the runtime prepares once per session. It reads the
/// generation state and inserts the key into:
/// - the sealed generation that already holds the key, if one does: the
///   insert then conflicts with that committed claim, a real unique
///   violation on that partition's key, so that a duplicate found by the
///   probe looks exactly like one found by the insert;
/// - the previous generation, while a rotation is in transition;
/// - the current generation, whose unique key makes a concurrent claim wait
///   for this one and then conflict.
///
/// The probe skips the generations that cannot hold a claim made at or
/// after `$3`: a generation takes claims from its opening until it is
/// sealed, and generations are sealed in order, so it probes from the
/// oldest generation sealed at or after `$3`. The kept generation (0) is
/// always probed: the purge copies claims into it just before it detaches
/// their generation, and a claim made then must find them there, whatever
/// `idem_generations` still says. PostgreSQL prunes the skipped partitions
/// when the statement runs, so a fresh message on a table of many sealed
/// generations probes only the kept one.
///
/// The state row, the generations and the probe are read in the
/// statement's one snapshot: if it sees no transition, the transition
/// ended before it began, and so did every transaction that could still
/// write into a sealed generation.
///
/// It returns nothing: the statement before it, in the same message, records
/// the transaction's id for the check before COMMIT (see the runtime's
/// `store/transaction.rs`).
pub const CLAIM_SQL: &str = claim_sql!(
    "AND (c.gen = 0 \
          OR c.gen >= (SELECT min(gen) FILTER (WHERE $3 IS NULL OR sealed_at IS NULL \
                                                  OR sealed_at >= to_timestamp($3)) \
                         FROM idem_generations)) "
);

/// [`CLAIM_SQL`] for a message whose earliest claim time is not known
/// (`$3` NULL), with two parameters: it probes every generation older
/// than the open ones, as `CLAIM_SQL` does then, without the subquery over
/// `idem_generations` that can only bound the probe when `$3` is given.
/// Both probe the same partitions: a generation's row leaves
/// `idem_generations` only with its partition's DROP, or after it, so
/// every attached partition (one being detached too) is listed.
///
/// Measured (2026-12-07; the backend's CPU for `BEGIN; EXECUTE ..;
/// ROLLBACK`, 20,000 times in one `psql` session, generic plans, 250,000
/// claims in the table, three rounds): 158–162 µs a transaction with
/// `CLAIM_SQL` and `$3` NULL, 148–150 µs with this one, 86–92 µs with
/// `SELECT 1` in its place.
pub(crate) const CLAIM_UNBOUNDED_SQL: &str = claim_sql!("");

/// The claim key of `message_id` for the handler named `handler`: the first
/// 16 bytes of SHA-256 over the handler name, a NUL byte and the message id,
/// written as a uuid. The database's `idem_key(handler, message_id)` gives
/// the same, for looking a message up by hand.
///
/// The NUL keeps `("ab", "c")` and `("a", "bc")` apart (a handler name holds
/// no control character). A collision of 128 bits of SHA-256 is not a
/// practical concern, even for message ids an attacker chooses.
pub(crate) fn key(handler: &str, message_id: &str) -> String {
    let digest = Sha256::new()
        .chain_update(handler.as_bytes())
        .chain_update([0u8])
        .chain_update(message_id.as_bytes())
        .finalize();
    let mut key = String::with_capacity(36);
    for (i, byte) in digest[..16].iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            key.push('-');
        }
        let _ = write!(key, "{byte:02x}");
    }
    key
}

/// How long registering waits for a lock on `idem_handlers` before start-up
/// gives up the attempt (and tries again, naming the holders): a session
/// left open after `UPDATE idem_handlers ...` must not hang start-up, or a
/// shutdown during it.
pub(crate) const REGISTER_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// Registers the router's handlers, with the retention each asked for
/// (`None`: keep its claims forever), and returns the id each claim of a
/// handler stores.
///
/// One statement, in name order (two routers registering the same handlers
/// take their row locks in one order, and cannot deadlock), on a connection
/// of its own whose session has a [`REGISTER_LOCK_TIMEOUT`]: a lock held
/// elsewhere, on a row or on the table (which the statement takes before it
/// runs), fails it with `lock_not_available` (55P03) instead of waiting for
/// ever. The connection is closed after, so that the setting never reaches
/// the pool; and no COMMIT goes over the wire (the statement is its own
/// transaction).
pub(crate) async fn register(
    pool: &PgPool,
    handlers: &[(&str, Option<Duration>)],
) -> Result<HashMap<String, i32>, sqlx::Error> {
    // Once each: the partitions of one route share its handler (and a row
    // may be updated only once per statement). The last one's retention
    // wins, as it did when each was registered on its own.
    let unique: std::collections::BTreeMap<&str, Option<Duration>> =
        handlers.iter().copied().collect();
    let names: Vec<&str> = unique.keys().copied().collect();
    let millis: Vec<Option<i64>> = unique
        .values()
        .map(|retention| {
            retention.map(|period| i64::try_from(period.as_millis()).unwrap_or(i64::MAX))
        })
        .collect();
    let mut conn = pool.acquire().await?.detach();
    let registered = async {
        sqlx::query("SELECT set_config('lock_timeout', $1, false)")
            .bind(format!("{}ms", REGISTER_LOCK_TIMEOUT.as_millis()))
            .execute(&mut conn)
            .await?;
        sqlx::query_as::<_, (String, i32)>(
            "INSERT INTO idem_handlers (name, retention)
             SELECT h.name, h.millis * interval '1 millisecond'
               FROM unnest($1::text[], $2::bigint[]) AS h(name, millis)
              ORDER BY h.name
             ON CONFLICT (name) DO UPDATE
                SET retention = EXCLUDED.retention, updated_at = now()
             RETURNING name, id",
        )
        .bind(&names)
        .bind(&millis)
        .fetch_all(&mut conn)
        .await
    }
    .await;
    let _ = sqlx::Connection::close(conn).await;
    Ok(registered?.into_iter().collect())
}

/// A session holding a lock: pid, `application_name`, state, seconds its
/// transaction has run, the start of its query.
type LockHolderRow = (
    i32,
    Option<String>,
    Option<String>,
    Option<f64>,
    Option<String>,
);

/// The sessions that hold a lock on `idem_handlers`, each described (pid,
/// application name, state, how long its transaction has run, the start of
/// its query): what a [`register`] that timed out on a lock waited for,
/// most likely. Empty if none is found (the holder ended meanwhile).
pub(crate) async fn handlers_lock_holders(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let rows: Vec<LockHolderRow> = sqlx::query_as(
        "SELECT DISTINCT a.pid, a.application_name, a.state,
                    extract(epoch FROM now() - a.xact_start)::float8, left(a.query, 120)
               FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'relation' AND l.granted
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND l.relation = 'idem_handlers'::regclass
                AND l.pid <> pg_backend_pid()
              ORDER BY a.pid",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(pid, application, state, age, query)| {
            format!(
                "pid {pid} ({}, {}{}): {}",
                application
                    .filter(|name| !name.is_empty())
                    .unwrap_or_else(|| "no application_name".into()),
                state.unwrap_or_else(|| "state unknown".into()),
                age.map(|seconds| format!(", transaction open {seconds:.0}s"))
                    .unwrap_or_default(),
                query.unwrap_or_default()
            )
        })
        .collect())
}

/// Claims many keys in one statement, for batch mode. Returns the keys this
/// transaction claimed; the others were claimed before. `idem_claim_many`
/// inserts them in order, so that two batches with keys in common take
/// their locks in the same order and do not deadlock, and skips conflicts
/// (`ON CONFLICT DO NOTHING`), because in PostgreSQL an error aborts the
/// whole transaction.
///
/// Also returns the transaction's id (assigned already by the statement
/// after BEGIN, which records it for the check before COMMIT): if the
/// connection must be given up while a handler of the batch runs, that id
/// tells from another connection whether the handler committed the batch's
/// claims itself (see [`committed`]).
pub(crate) async fn claim_many(
    tx: &mut PgTransaction<'_>,
    handler_id: i32,
    keys: &[String],
) -> Result<(HashSet<String>, String), sqlx::Error> {
    let (fresh, xid): (Vec<String>, String) = sqlx::query_as(
        "SELECT idem_claim_many($1, $2::uuid[])::text[], pg_current_xact_id()::text",
    )
    .bind(handler_id)
    .bind(keys)
    .fetch_one(&mut **tx)
    .await?;
    Ok((fresh.into_iter().collect(), xid))
}

/// What became of transaction `xid` (from [`claim_many`]), asked on
/// another connection: `Some(true)` once it committed, `Some(false)` once
/// it aborted, `None` while it is still in progress.
pub(crate) async fn committed(
    connection: &mut PgConnection,
    xid: &str,
) -> Result<Option<bool>, sqlx::Error> {
    let status: Option<String> = sqlx::query_scalar("SELECT pg_xact_status($1::xid8)")
        .bind(xid)
        .fetch_one(connection)
        .await?;
    Ok(match status.as_deref() {
        Some("committed") => Some(true),
        Some("in progress") => None,
        // "aborted", or too old to tell (NULL): a transaction that claimed
        // moments ago is never too old, so it did not commit.
        _ => Some(false),
    })
}

/// Takes back the claims this transaction made on `keys` (each key's rows
/// in every generation: a claim made during a transition has two), so that
/// they commit with the rest of the batch as if never made. For the
/// messages of a batch that shutdown stopped before their handlers ran:
/// they are handed back, and their next delivery claims them afresh. Rows
/// of other transactions are never touched.
pub(crate) async fn unclaim(tx: &mut PgTransaction<'_>, keys: &[&str]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM idem_claims WHERE key = ANY($1::uuid[]) AND xmin = pg_current_xact_id()::xid",
    )
    .bind(keys)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_sixteen_bytes_of_sha256_as_a_uuid() {
        // printf 'credit-v1\0order-7' | sha256sum
        assert_eq!(
            key("credit-v1", "order-7"),
            "8707f5fa-2bfe-0af8-7913-c57c557603d3"
        );
        assert_ne!(key("ab", "c"), key("a", "bc"));
        assert_eq!(key("h", &"x".repeat(10_000)).len(), 36);
    }
}
