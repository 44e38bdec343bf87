//! A message's transaction: how it begins, and how it commits.
//!
//! Per message, the runtime pays three round trips plus the handler's own
//! statements beyond the first: BEGIN (with the claim, and ahead of it the
//! ROLLBACK of the empty transaction the last COMMIT left open, below), the
//! handler's write, and COMMIT. A hand-written at-least-once consumer on a
//! default sqlx pool pays five (BEGIN, its write, COMMIT, and the pool's
//! liveness checks on release and on acquire). Counted on the server
//! (2026-12-07, `strace` of the backends' `recvfrom` over 6,000 messages of
//! `idem-bench idem` and `naive`): 3 reads a message for idem, the ROLLBACK
//! and the next BEGIN in one read in every case but a connection's first;
//! 5 for naive.
//!
//! **BEGIN** goes out in one simple-query message with the route's bounds,
//! the commit level and the claim:
//!
//! ```sql
//! BEGIN;
//! EXECUTE idem_bounds_v3('300000', '301000', 'on');  -- and synchronous_commit, at least on,
//!                                                     -- and idem.claim
//! EXECUTE idem_claim_v5(3, '8707f5fa-2bfe-0af8-7913-c57c557603d3', 1764500000)  -- handler id, claim key,
//!                                                                              -- earliest claim time
//! ```
//!
//! A message whose earliest claim time is not known (its route declares no
//! publisher-retry horizon, or its id comes from a `key` expression, a
//! request, a source stream or an older replay; see
//! `Pipeline::first_claim_not_before`) is claimed by
//! `idem_claim_unbounded_v1(3, '8707..')`
//! instead, which skips the subquery that bounds the probe (12 µs of the
//! server's CPU a message; see [`claim`](crate::store::claim)).
//!
//! The commit level (`synchronous_commit`, transaction-local, at least `on`,
//! `remote_apply` kept): the COMMIT that precedes the ack is durable
//! whatever the server's default; see [`durability`](crate::store::durability).
//!
//! The bounds (`set_config(.., true)`, transaction-local): a statement stuck
//! on a lock is cancelled by the server at the handler timeout, and a backend
//! whose client vanished behind a partition, still holding its claim, is
//! ended soon after, so redeliveries do not wait on it until TCP keepalive
//! gives up (where the server supports it, `client_connection_check_interval`
//! also ends a statement whose client went away). The claim (`CLAIM_SQL`,
//! see [`claim`](crate::store::claim)) inserts the message's key: if another
//! transaction holds an uncommitted claim on the key, it waits; if that one
//! commits, it fails with a unique violation, which is how a duplicate is
//! told (the runtime then rolls back and acks); if that one rolls back, it
//! proceeds.
//!
//! The statement before the claim also records the transaction's id in the
//! transaction-local setting `idem.claim`, which the check before COMMIT
//! compares with the transaction that commits. (It used to be the claim's
//! `RETURNING`; that made the insert into the partitioned table build a
//! projection for the partition on every execution. The server's CPU for
//! the BEGIN message, 20,000 of them each way in one session, three pairs:
//! 180, 180 and 179 µs before; 180, 151 and 153 µs after.) A batch's
//! transaction records it the same way, and
//! [`claim_many`](crate::store::claim::claim_many) once more.
//!
//! **COMMIT** goes out in one simple-query message with a check:
//!
//! ```sql
//! EXECUTE idem_check_v2('on');  -- SELECT 1 / coalesce(current_setting('idem.claim', true)
//!                               --   = pg_current_xact_id_if_assigned()::xid::text, false)::int,
//!                               -- and synchronous_commit at least on, again
//! COMMIT;
//! BEGIN
//! ```
//!
//! The commit level is set again here because the handler may have lowered
//! it for its own transaction (see [`durability`](crate::store::durability)).
//!
//! PostgreSQL turns the COMMIT of an aborted transaction (a statement failed
//! and the handler ignored the error) into a rollback that it reports as
//! success, and sqlx does not look at the command tag. Here the check fails
//! first, with 25P02, in the same round trip, and the COMMIT never runs. If
//! the transaction is no longer the one that claimed (the handler ended it
//! with a raw `ROLLBACK` or `COMMIT`, which also clears the
//! transaction-local setting), the division by zero stops the COMMIT
//! instead. Either way nothing is acked. The trailing `BEGIN` keeps sqlx's
//! view of the connection true: its transaction is still open, so dropping
//! it queues a `ROLLBACK`. sqlx writes that ROLLBACK into the connection's
//! buffer, and the next BEGIN (`Connection::begin_with`) goes out behind it
//! in the same write: no round trip of its own, only one short statement
//! more for the server (1 µs of execution, measured 2026-12-02). A
//! connection given back to the pool instead sends it with the pool's check
//! on release. sqlx 0.9 has no way to end its transaction without sending a
//! statement of its own, and `Transaction::commit` after the checked COMMIT
//! would cost a round trip.
//!
//! **Prepared statements.** The claim, the bounds and the check are the
//! session's prepared statements (`PREPARE`), so that the server parses and
//! plans them once per connection rather than once per message: a simple
//! query cannot bind parameters, and sqlx's own prepared statements would
//! each cost a round trip. A connection the route used moments ago has them;
//! on any other (one straight from the pool), the BEGIN message first runs a
//! `DO` block that prepares whichever of them the session lacks, in the same
//! round trip. Should they vanish all the same (`DEALLOCATE ALL` in a
//! handler, a pooler that moved the session), the first `EXECUTE` fails with 26000:
//! the connection is closed, and the message is retried at once on another
//! (see `ErrorClass::of_sqlx`), which prepares them again.
//!
//! No timer or `select!` is ever held around BEGIN or COMMIT: a cancelled
//! BEGIN can hand back a pooled connection still inside a transaction
//! (sqlx#4393). (A transaction the database stops answering altogether is
//! left to finish on its own; see `Pipeline::watched`.)
//!
//! The only values in this SQL are numbers, a claim key (a uuid in hex), and
//! the statements of the `DO` block, which go in as dollar-quoted literals
//! whose tag is chosen so that it cannot occur in the value.

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, PgTransaction};

use crate::error::HandlerError;
use crate::error::class::{is_aborted_transaction, is_claim_lost};
use crate::store::claim::{CLAIM_SQL, CLAIM_UNBOUNDED_SQL};
use crate::store::connections::Leased;
use crate::store::durability::{Level, at_least};

/// Whether the transaction running it is the one that made the claims:
/// true, false, never NULL.
macro_rules! still_claiming {
    () => {
        "coalesce(current_setting('idem.claim', true) \
         = pg_current_xact_id_if_assigned()::xid::text, false)"
    };
}

/// Records the running transaction's id in `idem.claim`: the transaction
/// that claims. Part of the statement that follows `BEGIN`, so that the
/// claim itself needs no `RETURNING` (measured: a `RETURNING` list makes
/// the insert into the partitioned table build a projection for the
/// partition on every execution, about 20 µs of the server's CPU per
/// message, 2026-12-02).
macro_rules! claiming {
    () => {
        "set_config('idem.claim', pg_current_xact_id()::xid::text, true)"
    };
}

/// The prepared statements of the module docs: (name, parameters, SQL).
/// A name carries a version, so that a runtime whose statement changed
/// never executes an older one a session still holds.
const CLAIM: (&str, &str, &str) = ("idem_claim_v5", "(integer, uuid, bigint)", CLAIM_SQL);
/// The claim of a message whose earliest claim time is not known (most
/// routes': see `Pipeline::first_claim_not_before`).
const CLAIM_UNBOUNDED: (&str, &str, &str) = (
    "idem_claim_unbounded_v1",
    "(integer, uuid)",
    CLAIM_UNBOUNDED_SQL,
);
const CHECK: (&str, &str, &str) = (
    "idem_check_v2",
    "(text)",
    concat!(
        "SELECT 1 / ",
        still_claiming!(),
        "::int, set_config('synchronous_commit', ",
        at_least!(),
        ", true)"
    ),
);
const DURABLE: (&str, &str, &str) = (
    "idem_durable_v2",
    "(text)",
    concat!(
        "SELECT set_config('synchronous_commit', ",
        at_least!(),
        ", true), ",
        claiming!()
    ),
);
/// The bounds and the commit level in one statement (one statement fewer
/// per message than the bounds and [`DURABLE`] apart: each costs the server
/// a parse, a portal and an executor start-up).
const BOUNDS: (&str, &str, &str) = (
    "idem_bounds_v3",
    "(text, text, text)",
    concat!(
        "SELECT set_config('statement_timeout', $1, true), \
         set_config('idle_in_transaction_session_timeout', $2, true), \
         set_config('synchronous_commit', ",
        at_least!("$3"),
        ", true), ",
        claiming!()
    ),
);
const BOUNDS_AND_CLIENT_CHECK: (&str, &str, &str) = (
    "idem_bounds_client_check_v3",
    "(text, text, text, text)",
    concat!(
        "SELECT set_config('statement_timeout', $1, true), \
         set_config('idle_in_transaction_session_timeout', $2, true), \
         set_config('client_connection_check_interval', $3, true), \
         set_config('synchronous_commit', ",
        at_least!("$4"),
        ", true), ",
        claiming!()
    ),
);

/// What the router found out about the pool's sessions at start-up, which
/// decides how its routes begin and commit.
#[derive(Debug, Clone, Copy)]
pub struct Session {
    /// Whether the server accepts `client_connection_check_interval`.
    pub(crate) check_client_connection: bool,
    /// The `synchronous_commit` idem's transactions commit with.
    pub(crate) commit_level: Level,
}

impl Session {
    /// Asks the server (see [`server_checks_client_connection`] and
    /// [`durability::check`](crate::store::durability::check), which warns, if
    /// `warn`, about what can lose acked commits).
    pub(crate) async fn probe(pool: &sqlx::PgPool, warn: bool) -> Result<Session, sqlx::Error> {
        Ok(Session {
            check_client_connection: server_checks_client_connection(pool).await?,
            commit_level: crate::store::durability::check(pool, warn).await?,
        })
    }
}

/// How a route begins and commits its transactions.
#[derive(Debug, Clone)]
pub struct Begin {
    /// The bounds and the commit level, through the prepared statements, to
    /// follow `BEGIN`.
    bounds: String,
    /// A `DO` block that prepares the statements this route uses, where the
    /// session lacks them.
    prepare: String,
    /// The checked COMMIT message (see the module docs).
    commit: String,
}

impl Begin {
    /// `BEGIN` with the bounds derived from the handler timeout: statements
    /// end at it, and a transaction left idle longer (its client gone) is
    /// ended by the server shortly after. Without a handler timeout there are
    /// no bounds. Every transaction commits with `session.commit_level` (at
    /// least: a stronger level of its own is kept).
    pub(crate) fn new(handler_timeout: Option<Duration>, session: Session) -> Self {
        let check_client_connection = session.check_client_connection;
        let level = session.commit_level.as_str();
        let mut bounds = String::new();
        // Every route of a router prepares the same statements, whether it
        // bounds its transactions or not: its connections go to the other
        // routes' messages too (see `store/connections.rs`), and a
        // connection kept after a transaction of any route counts as
        // prepared.
        let bounds_statement = if check_client_connection {
            BOUNDS_AND_CLIENT_CHECK
        } else {
            BOUNDS
        };
        let statements = [CLAIM, CLAIM_UNBOUNDED, CHECK, DURABLE, bounds_statement];
        if let Some(timeout) = handler_timeout {
            let millis = timeout.as_millis().max(1);
            // The idle bound waits a little longer than the handler may take,
            // so that a slow handler between two statements is never cut off
            // by it: the handler timeout fires first.
            let idle = millis + IDLE_MARGIN.as_millis();
            if check_client_connection {
                let check = CLIENT_CHECK.as_millis();
                let (name, ..) = BOUNDS_AND_CLIENT_CHECK;
                bounds.push_str(&format!(
                    "; EXECUTE {name}('{millis}', '{idle}', '{check}', '{level}')"
                ));
            } else {
                let (name, ..) = BOUNDS;
                bounds.push_str(&format!(
                    "; EXECUTE {name}('{millis}', '{idle}', '{level}')"
                ));
            }
        } else {
            bounds.push_str(&format!("; EXECUTE {}('{level}')", DURABLE.0));
        }
        let commit = format!("EXECUTE {}('{level}'); COMMIT; BEGIN", CHECK.0);
        let prepare = prepare_missing(&statements);
        Self {
            bounds,
            prepare,
            commit,
        }
    }

    /// The statement that begins a transaction, and claims `key` for the
    /// handler with id `handler_id` in it if given: one round trip (see the
    /// module docs). `prepared`: whether the session holds the prepared
    /// statements.
    fn statement(&self, claim: Option<Claim<'_>>, prepared: bool) -> String {
        let mut sql = String::from("BEGIN");
        if !prepared {
            sql.push_str("; ");
            sql.push_str(&self.prepare);
        }
        sql.push_str(&self.bounds);
        if let Some(Claim {
            handler_id,
            key,
            since,
        }) = claim
        {
            // A uuid in hex and integers: nothing to quote.
            debug_assert!(key.chars().all(|c| c.is_ascii_hexdigit() || c == '-'));
            match since {
                Some(at) => {
                    let (name, ..) = CLAIM;
                    let since = at.unix_timestamp();
                    sql.push_str(&format!("; EXECUTE {name}({handler_id}, '{key}', {since})"));
                }
                None => {
                    let (name, ..) = CLAIM_UNBOUNDED;
                    sql.push_str(&format!("; EXECUTE {name}({handler_id}, '{key}')"));
                }
            }
        }
        sql
    }
}

/// A `DO` block that prepares, on the session, whichever of `statements`
/// ((name, parameters, SQL)) it lacks: sent in the first message of each
/// session, so that the server parses and plans them once per connection (a
/// simple query cannot bind parameters). A name carries a version, so that a
/// runtime whose statement changed never executes an older one a session
/// still holds.
pub(crate) fn prepare_missing(statements: &[(&str, &str, &str)]) -> String {
    let prepares: Vec<String> = statements
        .iter()
        .map(|(name, parameters, sql)| {
            format!(
                "IF NOT EXISTS (SELECT FROM pg_prepared_statements WHERE name = '{name}') \
                 THEN EXECUTE {}; END IF;",
                literal(&format!("PREPARE {name}{parameters} AS {sql}"))
            )
        })
        .collect();
    format!(
        "DO {}",
        literal(&format!("BEGIN {} END", prepares.join(" ")))
    )
}

/// What a message's transaction claims: `key` (see [`claim::key`]) for the
/// handler registered as `handler_id`.
///
/// [`claim::key`]: crate::store::claim::key
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub(crate) handler_id: i32,
    pub(crate) key: &'a str,
    /// The earliest time an earlier claim of the message can have been
    /// made, if known (see `CLAIM_SQL`).
    pub(crate) since: Option<time::OffsetDateTime>,
}

/// Begins a transaction on `connection`, and makes `claim` in it if given:
/// one round trip. The transaction, with the claim in it, or an error:
/// [`is_duplicate_claim`](crate::error::class::is_duplicate_claim) tells the error of a message processed before,
/// after which [`end_failed_claim`] makes the connection clean again.
pub(crate) async fn begin<'c>(
    connection: &'c mut Leased<'_>,
    begin: &Begin,
    claim: Option<Claim<'_>>,
) -> Result<PgTransaction<'c>, sqlx::Error> {
    // Marked before the statement runs: once it has run, the session holds
    // the statements; if it fails otherwise, the connection is not kept.
    let prepared = connection.mark_prepared();
    let statement = begin.statement(claim, prepared);
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Begins a batch's transaction on `connection` (its claim is a statement of
/// its own, [`claim_many`](crate::store::claim::claim_many)): one round
/// trip. With `lock_wait`, a statement of the transaction that waits longer
/// than that for a lock fails (`lock_timeout`, 55P03), so that a batch
/// waiting on another's row locks gives up at once instead of waiting for
/// PostgreSQL to find a deadlock (`deadlock_timeout`, 1 s by default) while
/// everything queued behind both stands still.
pub(crate) async fn begin_batch<'c>(
    connection: &'c mut Leased<'_>,
    begin: &Begin,
    lock_wait: Option<Duration>,
) -> Result<PgTransaction<'c>, sqlx::Error> {
    let prepared = connection.mark_prepared();
    let mut statement = begin.statement(None, prepared);
    if let Some(wait) = lock_wait {
        // A number of milliseconds: nothing to quote.
        statement.push_str(&format!(
            "; SET LOCAL lock_timeout = '{}ms'",
            wait.as_millis().max(1)
        ));
    }
    sqlx::Connection::begin_with(&mut **connection, AssertSqlSafe(statement)).await
}

/// Ends the transaction a failed claim left aborted, which sqlx never
/// counted as begun.
pub(crate) async fn end_failed_claim(connection: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("ROLLBACK").execute(connection).await?;
    Ok(())
}

/// The longest a transaction can run when every part of it gets its answer
/// under `handler_timeout`: the claim (which may wait on a concurrent
/// attempt, up to `statement_timeout`), the handler and the storing of what
/// it returned (up to the handler timeout together; a batch's handler calls
/// and their results share one) and COMMIT (up to `statement_timeout`), each
/// the handler timeout: `3 × handler_timeout`.
/// The retention floor counts it for the claiming transaction, and the
/// watchdog waits that long (plus a margin) before it gives up on one
/// (`Pipeline::watched`).
pub(crate) fn longest(handler_timeout: Duration) -> Duration {
    handler_timeout.saturating_mul(3)
}

/// How much longer than the handler timeout a transaction may sit idle
/// before the server ends it.
const IDLE_MARGIN: Duration = Duration::from_secs(1);

/// How often the server checks, during a statement, that its client is
/// still there.
const CLIENT_CHECK: Duration = Duration::from_secs(1);

/// Whether the server accepts `client_connection_check_interval` (PostgreSQL
/// 14 or newer, on a platform that supports it). An error other than the
/// server's refusal (the database cannot be reached) is returned.
pub(crate) async fn server_checks_client_connection(
    pool: &sqlx::PgPool,
) -> Result<bool, sqlx::Error> {
    // Transaction-local in the statement's own implicit transaction: it
    // changes nothing, and needs no BEGIN.
    match sqlx::query("SELECT set_config('client_connection_check_interval', '1000', true)")
        .execute(pool)
        .await
    {
        Ok(_) => Ok(true),
        // Unknown before 14 (42704), refused where unsupported (22023).
        Err(sqlx::Error::Database(_)) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Why a transaction did not commit.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// PostgreSQL had aborted the transaction (a failed statement whose error
    /// was ignored): nothing committed. The transaction is still open, in
    /// the aborted state; roll it back.
    Aborted,
    /// The claims were no longer all in the transaction: nothing was
    /// committed by this COMMIT. Roll back.
    ClaimLost,
    /// The server refused the COMMIT, or the statement before it: nothing
    /// was committed, and the connection's state is not worth finding out.
    Refused(sqlx::Error),
    /// The connection failed: the outcome is unknown.
    Unknown(sqlx::Error),
}

/// How a transaction whose handlers all returned `Ok` ended.
pub enum Ended {
    /// Committed, claims and all.
    Committed,
    /// Nothing was committed, for the reason given.
    NotCommitted(HandlerError),
    /// The connection failed during COMMIT: the outcome is unknown.
    Unknown(sqlx::Error),
}

/// Commits `tx` as `begin` says (see [`commit`]) or rolls back what is left
/// of it. Also says whether its connection ended in a known, clean state and
/// may be kept.
pub(crate) async fn finish(mut tx: PgTransaction<'_>, begin: &Begin) -> (Ended, bool) {
    match commit(&mut tx, begin).await {
        // Dropping `tx` queues the ROLLBACK of the empty transaction the
        // commit statement began.
        Ok(()) => (Ended::Committed, true),
        Err(CommitError::Aborted) => {
            let clean = rollback(tx).await;
            (Ended::NotCommitted(HandlerError::Aborted), clean)
        }
        Err(CommitError::ClaimLost) => {
            let clean = rollback(tx).await;
            (Ended::NotCommitted(HandlerError::ClaimLost), clean)
        }
        Err(CommitError::Refused(error)) => (
            Ended::NotCommitted(HandlerError::CommitRefused(error)),
            false,
        ),
        Err(CommitError::Unknown(error)) => (Ended::Unknown(error), false),
    }
}

/// Rolls back; says whether the connection is known to be clean.
pub(crate) async fn rollback(tx: PgTransaction<'_>) -> bool {
    match tx.rollback().await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(%error, "ROLLBACK failed; the connection is closed");
            false
        }
    }
}

/// Commits `tx` if it is still the transaction that claimed, durably (see
/// [`durability`](crate::store::durability)), in one round trip (see the module
/// docs).
///
/// On `Ok`, drop `tx`: its trailing empty transaction is rolled back with
/// the connection's next statement.
pub(crate) async fn commit(tx: &mut PgTransaction<'_>, begin: &Begin) -> Result<(), CommitError> {
    let checked_commit = AssertSqlSafe(begin.commit.as_str());
    match sqlx::raw_sql(checked_commit).execute(&mut **tx).await {
        Ok(_) => Ok(()),
        Err(error) if is_aborted_transaction(&error) => Err(CommitError::Aborted),
        Err(error) if is_claim_lost(&error) => Err(CommitError::ClaimLost),
        // The connection's own end (the server shutting down, say) can come
        // right after the COMMIT went through: as unknown as a lost
        // connection.
        Err(error) if crate::error::class::is_infrastructure(&error) => {
            Err(CommitError::Unknown(error))
        }
        Err(error @ sqlx::Error::Database(_)) => Err(CommitError::Refused(error)),
        Err(error) => Err(CommitError::Unknown(error)),
    }
}

/// Whether the claims are still this transaction's own, uncommitted: asked
/// on the way to a rollback after a handler failed, so that a handler that
/// committed its claim itself (a raw COMMIT) and then failed is not
/// redelivered and taken for processed. A transaction PostgreSQL aborted
/// (the handler's statement failed) still holds them.
pub(crate) async fn claims_still_pending(tx: &mut PgTransaction<'_>) -> bool {
    // An error is 25P02 (aborted: the claims roll back with it), or one that
    // leaves the usual path to decide.
    sqlx::query_scalar::<_, bool>(concat!("SELECT ", still_claiming!()))
        .fetch_one(&mut **tx)
        .await
        .unwrap_or(true)
}

/// `value` as a dollar-quoted SQL literal whose tag cannot end it early.
pub(crate) fn literal(value: &str) -> String {
    let mut tag = String::from("$idem$");
    let mut n = 0u32;
    // The value ends at the first occurrence of the closing tag, so the tag
    // must first occur right after the value.
    while format!("{value}{tag}").find(&tag) != Some(value.len()) {
        n += 1;
        tag = format!("$idem{n}$");
    }
    format!("{tag}{value}{tag}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_pick_a_tag_the_value_cannot_close() {
        assert_eq!(literal("order-1"), "$idem$order-1$idem$");
        assert_eq!(literal("a$idem$b"), "$idem1$a$idem$b$idem1$");
        // A value ending in a prefix of the tag would close it early.
        assert_eq!(literal("x$idem"), "$idem1$x$idem$idem1$");
        assert_eq!(
            literal("'; DROP TABLE t; --"),
            "$idem$'; DROP TABLE t; --$idem$"
        );
    }

    fn session(check_client_connection: bool) -> Session {
        Session {
            check_client_connection,
            commit_level: Level::On,
        }
    }

    #[test]
    fn begin_carries_the_bounds_of_the_handler_timeout_the_commit_level_and_the_claim() {
        const KEY: &str = "8707f5fa-2bfe-0af8-7913-c57c557603d3";
        let claim = Some(Claim {
            handler_id: 3,
            key: KEY,
            since: None,
        });
        let unbounded = Begin::new(None, session(true));
        assert_eq!(
            unbounded.statement(None, true),
            "BEGIN; EXECUTE idem_durable_v2('on')"
        );
        assert_eq!(
            unbounded.statement(claim, true),
            format!(
                "BEGIN; EXECUTE idem_durable_v2('on'); EXECUTE idem_claim_unbounded_v1(3, '{KEY}')"
            )
        );
        assert_eq!(
            unbounded.commit,
            "EXECUTE idem_check_v2('on'); COMMIT; BEGIN"
        );
        let begin = Begin::new(Some(Duration::from_secs(2)), session(false));
        assert_eq!(
            begin.statement(claim, true),
            format!(
                "BEGIN; EXECUTE idem_bounds_v3('2000', '3000', 'on'); EXECUTE idem_claim_unbounded_v1(3, '{KEY}')"
            )
        );
        assert_eq!(begin.commit, "EXECUTE idem_check_v2('on'); COMMIT; BEGIN");
        assert_eq!(
            Begin::new(Some(Duration::from_secs(2)), session(true)).statement(None, true),
            "BEGIN; EXECUTE idem_bounds_client_check_v3('2000', '3000', '1000', 'on')"
        );
        let stronger = Session {
            check_client_connection: false,
            commit_level: Level::RemoteApply,
        };
        let begin = Begin::new(None, stronger);
        assert_eq!(
            begin.statement(None, true),
            "BEGIN; EXECUTE idem_durable_v2('remote_apply')"
        );
        assert!(
            begin
                .commit
                .starts_with("EXECUTE idem_check_v2('remote_apply')")
        );
    }

    #[test]
    fn routes_with_and_without_bounds_prepare_the_same_statements() {
        for check in [false, true] {
            let bounded = Begin::new(Some(Duration::from_secs(2)), session(check));
            let unbounded = Begin::new(None, session(check));
            assert_eq!(bounded.prepare, unbounded.prepare);
        }
    }

    #[test]
    fn an_unprepared_session_prepares_what_the_route_uses_first() {
        let begin = Begin::new(Some(Duration::from_secs(2)), session(false));
        let claim = Claim {
            handler_id: 3,
            key: "8707f5fa-2bfe-0af8-7913-c57c557603d3",
            since: Some(time::OffsetDateTime::from_unix_timestamp(1_764_500_000).unwrap()),
        };
        let statement = begin.statement(Some(claim), false);
        let (prefix, rest) = statement
            .split_once("; EXECUTE idem_bounds_v3")
            .expect("the bounds follow the DO block");
        assert!(
            prefix.starts_with("BEGIN; DO $idem1$BEGIN IF NOT EXISTS"),
            "{prefix}"
        );
        for name in [
            "idem_claim_v5",
            "idem_claim_unbounded_v1",
            "idem_check_v2",
            "idem_durable_v2",
            "idem_bounds_v3",
        ] {
            assert!(
                prefix.contains(&format!(
                    "WHERE name = '{name}') THEN EXECUTE $idem$PREPARE {name}"
                )),
                "{name}: {prefix}"
            );
        }
        assert!(!prefix.contains("idem_bounds_client_check_v3"), "{prefix}");
        assert!(rest.ends_with(
            "EXECUTE idem_claim_v5(3, '8707f5fa-2bfe-0af8-7913-c57c557603d3', 1764500000)"
        ));
        assert!(begin.commit.starts_with(&format!("EXECUTE {}(", CHECK.0)));
    }
}
