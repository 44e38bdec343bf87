//! The outbox's statements, as one trait: [`OutboxStore`], what the
//! outbox and its relay (`outbox/`) ask of a database, with a relay's
//! connection ([`RelaySession`]) and the shapes they share ([`Row`],
//! [`Take`], [`Marks`], [`Advanced`]). SQLite's and MariaDB's are in their
//! own modules (`store/sqlite/outbox.rs`, `store/mariadb/outbox.rs`);
//! PostgreSQL's are below.
//!
//! PostgreSQL's: the row a handler queues (in its own
//! transaction, [`queue`]), what operators read of the rows ([`lag`],
//! [`failing`], [`retry_failing`]), when the first failing row is due
//! ([`next_due`]), a relay's LISTEN connection ([`Listener`], where the
//! NOTIFY trigger is enabled), and a relay's connection and the messages it sends, each
//! step of a cycle that speaks to PostgreSQL being one round trip (the
//! cycles themselves are in `outbox/`).
//!
//! - **A take** is `BEGIN; SET LOCAL idle_in_transaction_session_timeout
//!   = '60s'; EXECUTE idem_relay_take_fresh_v1(1024, 8388608)` in one
//!   simple-query message:
//!   the settings are transaction-local, set in the same round trip as the
//!   rows are locked. The take and the DELETE are the session's prepared
//!   statements, prepared by a `DO` block in the first message on each
//!   connection that lacks them ([`prepare_sql`]).
//! - **A finish** is `DELETE ...; COMMIT` in one message, after the
//!   failures (if any) were recorded on their rows with a statement of
//!   their own (a rare step: a failure's text goes in as a bound parameter,
//!   never into the SQL).
//! - **A finish and the next take** on the same connection go together:
//!   `DELETE ...; COMMIT; BEGIN; SET LOCAL ...; <the take>`.
//!
//! A relay's COMMIT is as durable as the server makes it: it only deletes
//! rows JetStream has acknowledged (and records failures), so a relay
//! that committed without waiting for its WAL would risk rows coming back
//! after a crash, published again past JetStream's duplicate window, for an
//! fsync per cycle of up to a thousand rows: too little to measure here.
//!
//! The only values in these messages are numbers (row ids, a limit, a byte
//! count), so they are written into the SQL; the results come back in text
//! format, which sqlx decodes (a `bytea` in hex).
//!
//! A transaction never outlives the cycle that began it: a take that finds
//! nothing ends its transaction at once, so that no session sits idle in a
//! transaction between cycles (the purge's transitions wait for every
//! transaction running, see `store/purge.rs`). Begun and ended in
//! these messages, a transaction is not one sqlx knows of, so a [`Session`]
//! keeps track: dropped while its transaction may be open (a cycle's future
//! dropped, a statement failed), its connection is closed, not returned to
//! the pool, and the server rolls the transaction back and releases its
//! rows at once.

use std::future::Future;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{AssertSqlSafe, Either, FromRow, PgPool, Pool, Postgres};

use crate::error::class::is_unprepared;
use crate::store::backend::Backend;
use crate::store::transaction::prepare_missing;

/// What the outbox and its relay ask of a database (see the module docs):
/// implemented on sqlx's database types, as [`Backend`] is.
pub trait OutboxStore: Backend {
    /// A relay's connection, whose cycles take, delete and mark rows.
    type Relay: RelaySession<Self>;

    /// The pool connections a relay may hold at once.
    const RELAY_CONNECTIONS: usize;

    /// Queues a row in the transaction `connection` is in: a pending row
    /// with the same `msg_id` makes this a no-op. `headers`: a JSON array
    /// of `[name, value]` pairs, or `None`.
    fn queue(
        connection: &mut Self::Connection,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        headers: Option<String>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The outbox's rows in one query: how many are pending, the oldest
    /// one's age (seconds), how many are failing, and whether a NOTIFY
    /// trigger announces new rows (PostgreSQL's alone).
    fn lag(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(i64, Option<f64>, i64, bool), sqlx::Error>> + Send;

    /// The failing rows grouped by subject and error, the largest groups
    /// first, at most `most` groups.
    fn failing(
        pool: &Pool<Self>,
        most: usize,
    ) -> impl Future<Output = Result<Vec<FailingRow>, sqlx::Error>> + Send;

    /// Makes the failing rows (of `subject` only, if given) due now, with
    /// their back-off restarted; returns how many.
    fn retry_failing(
        pool: &Pool<Self>,
        subject: Option<&str>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// How long until the first failing row is due (zero if one is);
    /// `None` when no row is failing.
    fn next_due(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Option<Duration>, sqlx::Error>> + Send;

    /// Whether a fresh row is pending, without locking or waiting (rows
    /// another relay holds count too).
    fn any_fresh(pool: &Pool<Self>) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Relay statements waiting for a lock longer than
    /// [`BLOCKED_AFTER`], with who holds it:
    /// `(waited, pid, state, transaction age, query)`, the longest waits
    /// first. Read without taking a lock on the outbox's table. None where
    /// the database does not say (SQLite, MariaDB).
    fn relay_blocked(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<Blocked>, sqlx::Error>> + Send {
        let _ = pool;
        std::future::ready(Ok(Vec::new()))
    }

    /// A connection LISTENing on `channel`, where the database has
    /// notifications (PostgreSQL): asked for only while [`lag`](Self::lag)
    /// says a trigger announces rows.
    fn listen(
        pool: &Pool<Self>,
        channel: &str,
    ) -> impl Future<Output = Result<Listener, sqlx::Error>> + Send;
}

/// A relay's connection to its database: each cycle takes its rows with
/// [`advance`](Self::advance) (rows no other cycle holds until this one
/// ends), publishes them, then ends with the next `advance`, which deletes
/// the rows JetStream acknowledged and records the failures. Dropped in the
/// middle, the rows it held are released to the other cycles, at once or
/// after a bound the database keeps (a lease, an idle-transaction
/// timeout).
pub trait RelaySession<DB>: Send + Sized {
    /// A session on `pool`, holding nothing.
    fn acquire(pool: &Pool<DB>) -> impl Future<Output = Result<Self, sqlx::Error>> + Send
    where
        DB: sqlx::Database;

    /// Ends the open cycle, if `finish` is given: records its marks,
    /// deletes the acknowledged rows, and releases the rest; then, with
    /// `next`, takes the next cycle's rows.
    fn advance(
        &mut self,
        finish: Option<(&[i64], &Marks)>,
        next: Option<Take>,
    ) -> impl Future<Output = Advanced> + Send;

    /// Ends the open cycle without deleting or marking anything: its rows
    /// are released unpublished.
    fn rollback(&mut self) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Takes a cycle's rows on a session that holds none.
    fn take(&mut self, take: Take) -> impl Future<Output = Result<Vec<Row>, sqlx::Error>> + Send {
        async move { self.advance(None, Some(take)).await.taken }
    }
}

/// PostgreSQL: the functions and the [`Session`] below.
impl OutboxStore for Postgres {
    type Relay = Session;

    // Its fresh lane two while its cycles overlap, its retry lane one per
    // cycle, and its LISTEN connection one while the NOTIFY trigger is
    // enabled.
    const RELAY_CONNECTIONS: usize = 4;

    async fn queue(
        connection: &mut Self::Connection,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        headers: Option<String>,
    ) -> Result<(), sqlx::Error> {
        queue(connection, msg_id, subject, payload, headers).await
    }

    async fn lag(pool: &Pool<Self>) -> Result<(i64, Option<f64>, i64, bool), sqlx::Error> {
        lag(pool).await
    }

    async fn failing(pool: &Pool<Self>, most: usize) -> Result<Vec<FailingRow>, sqlx::Error> {
        failing(pool, most).await
    }

    async fn retry_failing(pool: &Pool<Self>, subject: Option<&str>) -> Result<u64, sqlx::Error> {
        retry_failing(pool, subject).await
    }

    async fn next_due(pool: &Pool<Self>) -> Result<Option<Duration>, sqlx::Error> {
        next_due(pool).await
    }

    async fn any_fresh(pool: &Pool<Self>) -> Result<bool, sqlx::Error> {
        any_fresh(pool).await
    }

    async fn relay_blocked(pool: &Pool<Self>) -> Result<Vec<Blocked>, sqlx::Error> {
        relay_blocked(pool).await
    }

    async fn listen(pool: &Pool<Self>, channel: &str) -> Result<Listener, sqlx::Error> {
        Listener::connect(pool, channel).await
    }
}

impl RelaySession<Postgres> for Session {
    async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Session::acquire(pool).await
    }

    async fn advance(&mut self, finish: Option<(&[i64], &Marks)>, next: Option<Take>) -> Advanced {
        Session::advance(self, finish, next).await
    }

    async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        Session::rollback(self).await
    }
}

const INSERT_SQL: &str = "\
INSERT INTO idem_outbox (msg_id, subject, payload, headers) VALUES ($1, $2, $3, $4::jsonb) \
ON CONFLICT (msg_id) DO NOTHING";

/// Queues a row, in the transaction `conn` belongs to: a pending row with
/// the same `msg_id` makes this a no-op. `headers`: a JSON array of
/// `[name, value]` pairs, or `None`.
pub(crate) async fn queue(
    conn: &mut sqlx::PgConnection,
    msg_id: &str,
    subject: &str,
    payload: &[u8],
    headers: Option<String>,
) -> Result<(), sqlx::Error> {
    sqlx::query(INSERT_SQL)
        .bind(msg_id)
        .bind(subject)
        .bind(payload)
        .bind(headers)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether the outbox's NOTIFY trigger is enabled (migration 7 disables
/// it): `false` also where there is no trigger or no outbox table.
const NOTIFY_ENABLED_SQL: &str = "\
SELECT coalesce(bool_or(tgenabled IN ('O', 'A')), false) FROM pg_trigger
 WHERE tgname = 'idem_outbox_notify' AND tgrelid = to_regclass('idem_outbox')";

/// Whether the outbox's NOTIFY trigger is enabled.
pub(crate) async fn notify_trigger_enabled(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(NOTIFY_ENABLED_SQL).fetch_one(pool).await
}

/// A relay's LISTEN connection (sqlx's `PgListener`), reduced to what a
/// relay asks of it: whether a notification came. A lost connection is
/// reconnected by the next read.
pub struct Listener(PgListener);

/// What a read of a [`Listener`] found.
pub enum Heard {
    /// A notification.
    Notification,
    /// The connection was lost and is connected again: notifications sent
    /// meanwhile are lost.
    Reconnected,
}

impl Listener {
    /// A connection of its own (not one of the pool's), LISTENing on
    /// `channel`.
    pub(crate) async fn connect(pool: &PgPool, channel: &str) -> Result<Self, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(channel).await?;
        Ok(Self(listener))
    }

    /// Waits for the next notification. Cancelled, it loses none: one
    /// already received stays buffered for the next read.
    pub(crate) async fn next(&mut self) -> Result<Heard, sqlx::Error> {
        Ok(match self.0.try_recv().await? {
            Some(_) => Heard::Notification,
            None => Heard::Reconnected,
        })
    }

    /// A notification the connection has already received, without
    /// waiting: `None` if there is none yet.
    pub(crate) fn next_now(&mut self) -> Option<Result<Heard, sqlx::Error>> {
        self.next().now_or_never()
    }
}

/// The outbox's rows in one query: how many are pending, the oldest one's
/// age (seconds), how many are failing, and whether the NOTIFY trigger is
/// enabled. (Named as a relay's statement, for [`RELAY_BLOCKED_SQL`]: a
/// relay reads it.)
pub(crate) async fn lag(pool: &PgPool) -> Result<(i64, Option<f64>, i64, bool), sqlx::Error> {
    sqlx::query_as(AssertSqlSafe(format!(
        "/* idem_relay_lag */ SELECT count(*), extract(epoch FROM now() - min(created_at))::float8,
                count(*) FILTER (WHERE not_before IS NOT NULL), ({NOTIFY_ENABLED_SQL})
           FROM idem_outbox"
    )))
    .fetch_one(pool)
    .await
}

/// Failing rows by subject and error: subject, error, rows, the oldest
/// one's age (seconds), the most attempts, and the seconds until the next
/// is due.
pub type FailingRow = (String, Option<String>, i64, Option<f64>, i32, Option<f64>);

/// The failing rows grouped by subject and error, the largest groups first,
/// at most `most` groups.
pub(crate) async fn failing(pool: &PgPool, most: usize) -> Result<Vec<FailingRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT subject, last_error, count(*),
                extract(epoch FROM now() - min(created_at))::float8,
                max(attempts),
                extract(epoch FROM min(not_before) - now())::float8
           FROM idem_outbox WHERE not_before IS NOT NULL
          GROUP BY subject, last_error
          ORDER BY count(*) DESC, subject
          LIMIT $1",
    )
    .bind(i64::try_from(most).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await
}

/// Makes the failing rows (of `subject` only, if given) due now, with their
/// back-off restarted; returns how many.
pub(crate) async fn retry_failing(
    pool: &PgPool,
    subject: Option<&str>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE idem_outbox SET not_before = now(), attempts = 0
          WHERE not_before IS NOT NULL AND ($1::text IS NULL OR subject = $1)",
    )
    .bind(subject)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// How long until the first failing row is due (negative: it is).
const NEXT_DUE_SQL: &str = "\
SELECT extract(epoch FROM min(not_before) - clock_timestamp())::float8
  FROM idem_outbox WHERE not_before IS NOT NULL";

/// How long until the first failing row is due (zero if one is); `None`
/// when no row is failing.
pub(crate) async fn next_due(pool: &PgPool) -> Result<Option<std::time::Duration>, sqlx::Error> {
    let due: Option<f64> = sqlx::query_scalar(NEXT_DUE_SQL).fetch_one(pool).await?;
    Ok(due.map(|seconds| {
        std::time::Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(std::time::Duration::MAX)
    }))
}

/// How long a relay statement waits for a lock before
/// [`Lag::blocked`](crate::outbox::Lag::blocked) lists it.
pub const BLOCKED_AFTER: Duration = Duration::from_secs(1);

/// A relay statement waiting for a lock, and the session that holds it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Blocked {
    /// How long the relay's statement has waited.
    pub waited: Duration,
    /// The holding session's backend pid (`pg_terminate_backend(pid)` ends
    /// it).
    pub holder_pid: i32,
    /// Its state: `idle in transaction` for a session left open.
    pub holder_state: String,
    /// How long its transaction has run, if it is in one.
    pub holder_transaction: Option<Duration>,
    /// Its last statement (200 characters at most), or why it cannot be
    /// read (another user's session, without `pg_read_all_stats`).
    pub holder_query: String,
}

impl Blocked {
    pub(crate) fn new(
        waited: Duration,
        holder_pid: i32,
        holder_state: String,
        holder_transaction: Option<Duration>,
        holder_query: String,
    ) -> Self {
        Self {
            waited,
            holder_pid,
            holder_state,
            holder_transaction,
            holder_query,
        }
    }
}

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "waited {:.0?} for a lock held by pid {} ({}",
            self.waited, self.holder_pid, self.holder_state
        )?;
        if let Some(age) = self.holder_transaction {
            write!(f, ", in a transaction for {age:.0?}")?;
        }
        write!(f, "; last statement: {})", self.holder_query)
    }
}

/// The rows a take returns: id, msg_id, subject, payload, headers (JSON
/// text), attempts, and how many rows the take locked.
pub type Row = (i64, String, String, Vec<u8>, Option<String>, i32, i64);

/// Which rows a take locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Rows that never failed, in id order.
    Fresh,
    /// Failing rows that are due, the earliest due first.
    Retry,
}

impl Lane {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Lane::Fresh => "fresh",
            Lane::Retry => "retry",
        }
    }
}

/// What a take asks for: up to `limit` rows of `lane`, of those the
/// longest prefix within `bytes` (always the first).
#[derive(Debug, Clone, Copy)]
pub struct Take {
    pub(crate) lane: Lane,
    pub(crate) limit: usize,
    pub(crate) bytes: usize,
}

/// A cycle's `idle_in_transaction_session_timeout`: far above a cycle's
/// longest pause (its PubAcks' timeout, 5 s by default, and a 2 s probe of
/// JetStream), so that only a cycle whose process or network is gone
/// reaches it; its rows are then released to the other relays, and to
/// this one's next cycle. (No statement_timeout: it would also cut a COMMIT
/// waiting for a synchronous standby.)
const CYCLE_SERVER_TIMEOUT_SETTING: &str = "60s";

/// The take of the fresh lane: rows that never failed, in id order; of
/// those, as many as fit in `$2` bytes (always the first). `locked` is how
/// many the take locked: rows whose lock is skipped (another relay's) are
/// not counted, and locked rows beyond the byte limit stay locked until the
/// transaction ends.
const TAKE_FRESH: (&str, &str, &str) = (
    "idem_relay_take_fresh_v1",
    "(int8, int8)",
    "WITH taken AS (
         SELECT id, msg_id, subject, payload, headers, attempts,
                octet_length(payload)::int8 + coalesce(pg_column_size(headers), 0)::int8 AS bytes
           FROM idem_outbox WHERE not_before IS NULL
          ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED),
     sized AS (
         SELECT *, sum(bytes) OVER (ORDER BY id) AS running,
                row_number() OVER (ORDER BY id) AS n, count(*) OVER () AS locked
           FROM taken)
     SELECT id, msg_id, subject, payload, headers::text, attempts, locked
       FROM sized WHERE n = 1 OR running <= $2
      ORDER BY id",
);

/// The take of the retry lane: failing rows that are due, the earliest due
/// first, within `$2` bytes as above; published in id order.
const TAKE_DUE: (&str, &str, &str) = (
    "idem_relay_take_due_v1",
    "(int8, int8)",
    "WITH taken AS (
         SELECT id, msg_id, subject, payload, headers, attempts, not_before,
                octet_length(payload)::int8 + coalesce(pg_column_size(headers), 0)::int8 AS bytes
           FROM idem_outbox WHERE not_before <= clock_timestamp()
          ORDER BY not_before, id LIMIT $1 FOR UPDATE SKIP LOCKED),
     sized AS (
         SELECT *, sum(bytes) OVER (ORDER BY not_before, id) AS running,
                row_number() OVER (ORDER BY not_before, id) AS n, count(*) OVER () AS locked
           FROM taken)
     SELECT id, msg_id, subject, payload, headers::text, attempts, locked
       FROM sized WHERE n = 1 OR running <= $2
      ORDER BY id",
);

/// Deletes the rows JetStream acknowledged.
const DELETE: (&str, &str, &str) = (
    "idem_relay_delete_v1",
    "(int8[])",
    "DELETE FROM idem_outbox WHERE id = ANY($1)",
);

/// A `DO` block that prepares, on the session, whichever of the relay's
/// statements it lacks (see [`prepare_missing`]): once per connection
/// rather than once per cycle.
fn prepare_sql() -> String {
    prepare_missing(&[TAKE_FRESH, TAKE_DUE, DELETE])
}

impl Take {
    /// Of `candidates` (id, size in bytes), in the take's order, the ids of
    /// the longest prefix within the take's bytes (always the first): the
    /// cut PostgreSQL's take makes on the server, for the databases whose
    /// take makes it in two steps.
    #[cfg(any(feature = "sqlite", feature = "mariadb"))]
    pub(crate) fn fitting(&self, candidates: &[(i64, i64)]) -> Vec<i64> {
        let mut chosen = Vec::with_capacity(candidates.len());
        let mut bytes = 0usize;
        for &(id, size) in candidates {
            bytes = bytes.saturating_add(usize::try_from(size).unwrap_or(usize::MAX));
            if !chosen.is_empty() && bytes > self.bytes {
                break;
            }
            chosen.push(id);
        }
        chosen
    }

    /// The statements that begin a cycle's transaction, bound it on the
    /// server (a cycle whose process froze, or whose network went away
    /// without a reset, must not keep its rows locked until TCP keepalive
    /// gives up), and lock its rows; `prepared` says whether the session
    /// holds the prepared statements.
    fn sql(&self, prepared: bool) -> String {
        let limit = i64::try_from(self.limit).unwrap_or(i64::MAX);
        let bytes = i64::try_from(self.bytes).unwrap_or(i64::MAX);
        let (name, ..) = match self.lane {
            Lane::Fresh => TAKE_FRESH,
            Lane::Retry => TAKE_DUE,
        };
        let prepare = if prepared {
            String::new()
        } else {
            format!("{}; ", prepare_sql())
        };
        format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = '{CYCLE_SERVER_TIMEOUT_SETTING}'; \
             {prepare}EXECUTE {name}({limit}, {bytes})"
        )
    }
}

/// Deletes the rows JetStream acknowledged and commits: the end of a
/// cycle's transaction, on a session that holds the prepared statements
/// (its take prepared them).
fn finish_sql(acknowledged: &[i64]) -> String {
    let mut sql = String::new();
    if !acknowledged.is_empty() {
        let ids: Vec<String> = acknowledged.iter().map(i64::to_string).collect();
        sql.push_str(&format!("EXECUTE {}('{{{}}}'); ", DELETE.0, ids.join(",")));
    }
    sql.push_str("COMMIT");
    sql
}

/// Records failures: each row's error and back-off (seconds). The comment
/// names it as a relay's statement in `pg_stat_activity` (see
/// [`RELAY_BLOCKED_SQL`]).
const MARK_SQL: &str = "\
/* idem_relay_mark */ UPDATE idem_outbox o
   SET attempts = o.attempts + 1, last_error = f.error, failed_at = clock_timestamp(),
       not_before = clock_timestamp() + f.backoff * interval '1 second'
  FROM unnest($1::int8[], $2::text[], $3::float8[]) AS f(id, error, backoff)
 WHERE o.id = f.id";

/// Whether a fresh row is pending, without locking or waiting: the look a
/// poll takes before a cycle. It counts rows another relay holds too (a
/// cycle then takes nothing).
const ANY_FRESH_SQL: &str =
    "/* idem_relay_look */ SELECT EXISTS (SELECT FROM idem_outbox WHERE not_before IS NULL)";

/// Relay statements (named `idem_relay_...`, in a comment where the
/// statement has no name) waiting for a lock longer than
/// `$1` seconds, each with a session that holds it. `pg_stat_activity`
/// and `pg_blocking_pids` take no lock on the outbox's table, so this
/// answers while a relay waits.
const RELAY_BLOCKED_SQL: &str = "\
SELECT extract(epoch FROM clock_timestamp() - w.query_start)::float8,
       h.pid,
       coalesce(h.state, 'unknown')
         || CASE WHEN h.wait_event_type = 'Lock' THEN ', itself waiting for a lock' ELSE '' END,
       extract(epoch FROM clock_timestamp() - h.xact_start)::float8,
       coalesce(left(h.query, 200), 'not visible to this user')
  FROM pg_stat_activity w
 CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS holder(pid)
  JOIN pg_stat_activity h ON h.pid = holder.pid
 WHERE w.wait_event_type = 'Lock'
   AND w.query LIKE '%idem\\_relay\\_%'
   AND w.query_start < clock_timestamp() - $1 * interval '1 second'
 ORDER BY 1 DESC
 LIMIT 10";

/// A row of [`RELAY_BLOCKED_SQL`]: how long the relay statement waited
/// (seconds), and the holder's pid, state, transaction age (seconds) and
/// last statement.
type BlockedRow = (Option<f64>, i32, String, Option<f64>, String);

/// Relay statements that wait for a lock (see [`RELAY_BLOCKED_SQL`]).
pub(crate) async fn relay_blocked(pool: &PgPool) -> Result<Vec<Blocked>, sqlx::Error> {
    let after = BLOCKED_AFTER.as_secs_f64();
    let rows: Vec<BlockedRow> = sqlx::query_as(RELAY_BLOCKED_SQL)
        .bind(after)
        .fetch_all(pool)
        .await?;
    let duration =
        |seconds: f64| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX);
    Ok(rows
        .into_iter()
        .map(|(waited, pid, state, transaction, query)| {
            Blocked::new(
                duration(waited.unwrap_or(0.0)),
                pid,
                state,
                transaction.map(duration),
                query,
            )
        })
        .collect())
}

/// Whether a fresh row is pending (see [`ANY_FRESH_SQL`]), asked of the
/// pool.
pub(crate) async fn any_fresh(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(ANY_FRESH_SQL).fetch_one(pool).await
}

/// The failures to record on their rows at the end of a cycle: each row's
/// id, error, and its next back-off in seconds.
#[derive(Debug, Default)]
pub struct Marks {
    pub(crate) ids: Vec<i64>,
    pub(crate) errors: Vec<String>,
    pub(crate) backoffs: Vec<f64>,
}

/// What a finish (with a take after it, perhaps) came to.
pub struct Advanced {
    /// Whether the finished cycle's COMMIT went through (false also when
    /// there was nothing to finish).
    pub(crate) committed: bool,
    /// The rows taken, or why the message failed. Empty when no take was
    /// asked for, or it found nothing (its transaction is then ended).
    pub(crate) taken: Result<Vec<Row>, sqlx::Error>,
}

impl Advanced {
    /// Nothing was asked.
    pub(crate) fn nothing() -> Advanced {
        Advanced {
            committed: false,
            taken: Ok(Vec::new()),
        }
    }
}

/// A pooled connection whose transactions the relay begins and ends in the
/// messages of the module docs.
pub struct Session {
    connection: PoolConnection<Postgres>,
    /// It holds the prepared statements (see [`prepare_sql`]): once a take
    /// has run on it.
    prepared: bool,
    /// A take without the `DO` block was tried on it ([`Session::first_take`]).
    tried: bool,
    /// A transaction may be open, or the connection's state is unknown
    /// (a message failed or was dropped midway): if dropped now, the
    /// connection is closed, not returned to the pool.
    open: bool,
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.open {
            self.connection.close_on_drop();
        }
    }
}

impl Session {
    /// A connection from `pool`, outside any transaction.
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Session, sqlx::Error> {
        Ok(Session {
            connection: pool.acquire().await?,
            prepared: false,
            tried: false,
            open: false,
        })
    }

    /// A take (no finish) on a session new to this relay: the pooled
    /// connection most likely holds the prepared statements from an earlier
    /// session, so it is tried without the `DO` block; if they are missing
    /// (26000), the aborted transaction is rolled back and the take sent
    /// again with it.
    async fn first_take(&mut self, take: Take) -> Advanced {
        self.prepared = true;
        let tried = self.advance(None, Some(take)).await;
        match &tried.taken {
            Err(error) if is_unprepared(error) => {}
            _ => return tried,
        }
        self.prepared = false;
        if let Err(error) = self.rollback().await {
            return Advanced {
                committed: false,
                taken: Err(error),
            };
        }
        self.advance(None, Some(take)).await
    }

    /// Ends the open transaction: records `marks` (a round trip of its own,
    /// when there are any), deletes `acknowledged` and commits, then, with
    /// `next`, begins the next transaction and takes its rows in the same
    /// message. With `finish` `None`, only the take.
    pub(crate) async fn advance(
        &mut self,
        finish: Option<(&[i64], &Marks)>,
        next: Option<Take>,
    ) -> Advanced {
        if finish.is_none()
            && let Some(take) = next
            && !self.prepared
            && !self.tried
        {
            self.tried = true;
            return Box::pin(self.first_take(take)).await;
        }
        // The statements before the take's, each answered with a
        // CommandComplete: the DELETE (if any) and the COMMIT.
        let mut sql = String::new();
        let mut before_take = 0;
        if let Some((acknowledged, marks)) = finish {
            debug_assert!(self.open, "a finish ends an open transaction");
            if !marks.ids.is_empty()
                && let Err(error) = self.mark(marks).await
            {
                return Advanced {
                    committed: false,
                    taken: Err(error),
                };
            }
            sql.push_str(&finish_sql(acknowledged));
            before_take = usize::from(!acknowledged.is_empty()) + 1;
        }
        if let Some(take) = next {
            if !sql.is_empty() {
                sql.push_str("; ");
            }
            sql.push_str(&take.sql(self.prepared));
        }
        if sql.is_empty() {
            return Advanced::nothing();
        }
        self.open = true;
        let (completed, rows) = self.run(sql).await;
        // Once a take has run, the session holds the statements; if it
        // failed, the session is not used again.
        self.prepared |= next.is_some() && rows.is_ok();
        let committed = finish.is_some() && completed >= before_take;
        let taken = match rows {
            Ok(rows) if next.is_none() => {
                self.open = false;
                Ok(rows)
            }
            Ok(rows) if rows.is_empty() => {
                // Nothing to hold: end the transaction now, not at the
                // next cycle.
                match self.run("COMMIT".to_owned()).await {
                    (_, Ok(_)) => {
                        self.open = false;
                        Ok(rows)
                    }
                    (_, Err(error)) => Err(error),
                }
            }
            Ok(rows) => Ok(rows),
            Err(error) => Err(error),
        };
        Advanced {
            committed,
            taken: taken.and_then(|rows| {
                rows.iter()
                    .map(Row::from_row)
                    .collect::<Result<Vec<Row>, sqlx::Error>>()
            }),
        }
    }

    /// Rolls back the open transaction: its rows are released unpublished.
    pub(crate) async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        self.open = true;
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut *self.connection)
            .await?;
        self.open = false;
        Ok(())
    }

    /// Records each failure on its row, in the open transaction.
    async fn mark(&mut self, marks: &Marks) -> Result<(), sqlx::Error> {
        sqlx::query(MARK_SQL)
            .bind(&marks.ids)
            .bind(&marks.errors)
            .bind(&marks.backoffs)
            .execute(&mut *self.connection)
            .await?;
        Ok(())
    }

    /// Sends `sql`, a message of statements; returns how many completed,
    /// and the rows, or the error of the statement that failed (those after
    /// it did not run).
    async fn run(&mut self, sql: String) -> (usize, Result<Vec<PgRow>, sqlx::Error>) {
        let mut completed = 0;
        let mut rows = Vec::new();
        let mut results = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_many(&mut *self.connection);
        while let Some(result) = results.next().await {
            match result {
                Ok(Either::Left(_)) => completed += 1,
                Ok(Either::Right(row)) => rows.push(row),
                Err(error) => return (completed, Err(error)),
            }
        }
        (completed, Ok(rows))
    }
}
