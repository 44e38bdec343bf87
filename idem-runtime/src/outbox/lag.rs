//! What an operator reads of the outbox, and the one thing they may do to
//! it: how far the relays are behind ([`lag`]), which rows keep failing and
//! why ([`Lag::failures`]), and retrying those now ([`retry_failing`]) once
//! the cause is fixed. `idem status` and `idem outbox retry` call these; the
//! relays read the lag themselves about once a second, into their stats and
//! the metrics.

use std::time::Duration;

use sqlx::{PgPool, Pool};

use crate::store::outbox::OutboxStore;
pub use crate::store::outbox::{BLOCKED_AFTER, Blocked};

/// How far the relays are behind: what [`lag`] reports.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Lag {
    /// Committed rows not yet published and deleted (failing ones
    /// included).
    pub pending: i64,
    /// How long ago the oldest of them was queued (its transaction's start);
    /// zero when none is pending.
    pub oldest: Duration,
    /// Of the pending rows, those whose last publish failed while NATS
    /// answered: each waits out its own back-off before it is tried again
    /// (see [`Relay`](super::Relay)), and the rows after it go on.
    pub failing: i64,
    /// The failing rows by subject and error, the most rows first, at most
    /// [`MOST_FAILURES`] of them.
    pub failures: Vec<Failing>,
    /// Relay statements (of any process) that have waited for a lock for
    /// longer than [`BLOCKED_AFTER`], each with the session that holds it:
    /// a session left open after `LOCK TABLE idem_outbox`, an `ALTER
    /// TABLE` or a `VACUUM FULL` of it. Relays skip rows other relays hold,
    /// so nothing else makes them wait. PostgreSQL only (empty elsewhere).
    pub blocked: Vec<Blocked>,
}

/// How many groups of failing rows [`Lag::failures`] lists.
pub const MOST_FAILURES: usize = 10;

/// Failing outbox rows of one subject that failed with one error.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Failing {
    /// Their subject.
    pub subject: String,
    /// Their last publish's error, with what it usually means.
    pub error: String,
    /// How many rows.
    pub rows: i64,
    /// How long ago the oldest of them was queued.
    pub oldest: Duration,
    /// The most failed publishes of any of them.
    pub attempts: i32,
    /// When the first of them is tried again; zero if it is due.
    pub next_attempt: Duration,
}

/// The outbox's lag: rows pending, the age of the oldest, and those that
/// keep failing, with why.
///
/// ```no_run
/// # async fn report(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let lag = idem_runtime::outbox::lag(&pool).await?;
/// println!("{} pending, the oldest {:?} old", lag.pending, lag.oldest);
/// for failing in &lag.failures {
///     println!("{} rows of {} fail: {}", failing.rows, failing.subject, failing.error);
/// }
/// # Ok(())
/// # }
/// ```
pub async fn lag<DB: OutboxStore>(pool: &Pool<DB>) -> Result<Lag, sqlx::Error> {
    Ok(lag_and_notify(pool).await?.0)
}

/// The [`lag`], and whether the NOTIFY trigger is enabled (see
/// [`notify_trigger_enabled`]): what a relay reads about once a second, in
/// one query (two while rows are failing).
pub(crate) async fn lag_and_notify<DB: OutboxStore>(
    pool: &Pool<DB>,
) -> Result<(Lag, bool), sqlx::Error> {
    let (pending, oldest, failing, notify) = DB::lag(pool).await?;
    let failures = if failing > 0 {
        failures(pool).await?
    } else {
        Vec::new()
    };
    let lag = Lag {
        pending,
        oldest: seconds(oldest),
        failing,
        failures,
        // Best effort: the lag is worth reading without it.
        blocked: DB::relay_blocked(pool).await.unwrap_or_else(|error| {
            tracing::debug!(%error, "could not ask whether outbox relays wait for a lock");
            Vec::new()
        }),
    };
    Ok((lag, notify))
}

/// Whether the outbox's NOTIFY trigger is enabled (migration 7 disables
/// it): `false` also where there is no trigger or no outbox table.
pub(crate) async fn notify_trigger_enabled(pool: &PgPool) -> Result<bool, sqlx::Error> {
    crate::store::outbox::notify_trigger_enabled(pool).await
}

async fn failures<DB: OutboxStore>(pool: &Pool<DB>) -> Result<Vec<Failing>, sqlx::Error> {
    let rows = DB::failing(pool, MOST_FAILURES).await?;
    Ok(rows
        .into_iter()
        .map(|(subject, error, rows, oldest, attempts, next)| Failing {
            subject,
            // Set with every failure; only a hand-made row lacks it.
            error: error.unwrap_or_default(),
            rows,
            oldest: seconds(oldest),
            attempts,
            next_attempt: seconds(next),
        })
        .collect())
}

fn seconds(value: Option<f64>) -> Duration {
    Duration::try_from_secs_f64(value.unwrap_or(0.0).max(0.0)).unwrap_or(Duration::MAX)
}

/// Makes the failing rows due now, those of `subject` only if given, and
/// restarts their back-off: what to do once the cause of their failures
/// is fixed (the stream created, the permission granted, the stream's
/// `max_msg_size` raised). A running relay retries them within about a
/// second. Returns how many rows it made due.
///
/// ```no_run
/// # async fn fixed(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// // The stream for `payments.requested` exists now:
/// let due = idem_runtime::outbox::retry_failing(&pool, Some("payments.requested")).await?;
/// println!("{due} rows retried");
/// # Ok(())
/// # }
/// ```
///
/// The same, in SQL:
///
/// ```sql
/// UPDATE idem_outbox SET not_before = now(), attempts = 0
///  WHERE not_before IS NOT NULL;
/// ```
///
/// A row that can never be published as it is (above the server's
/// `max_payload`) fails again; to drop one for good, `DELETE FROM
/// idem_outbox WHERE msg_id = '...'`: its message is then never sent.
pub async fn retry_failing<DB: OutboxStore>(
    pool: &Pool<DB>,
    subject: Option<&str>,
) -> Result<u64, sqlx::Error> {
    DB::retry_failing(pool, subject).await
}

/// The outbox's lag, into its gauges: from the router's poll, and from each
/// relay's own reading (about once per its poll interval), so a relay that
/// runs without a router reports it too.
pub(crate) fn record_gauges(lag: &Lag) {
    use crate::observe::metrics::{
        OUTBOX_FAILING, OUTBOX_OLDEST_AGE, OUTBOX_PENDING, OUTBOX_RELAYS_BLOCKED,
    };
    metrics::gauge!(OUTBOX_PENDING).set(lag.pending as f64);
    metrics::gauge!(OUTBOX_RELAYS_BLOCKED).set(lag.blocked.len() as f64);
    metrics::gauge!(OUTBOX_OLDEST_AGE).set(lag.oldest.as_secs_f64());
    metrics::gauge!(OUTBOX_FAILING).set(lag.failing as f64);
}
