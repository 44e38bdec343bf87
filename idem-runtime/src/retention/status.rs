//! How far along expiry is: the generations, the transition, and how the
//! latest purge runs went. What `idem status` shows under "expiry"
//! ([`status::expiry`](crate::status::expiry)), and the expiry gauges.

use std::time::Duration;

use sqlx::{PgPool, Pool};
use time::OffsetDateTime;

use crate::store::backend::Backend;

/// Where expiry stands: generations, the transition, and how the latest
/// purge runs went (any process's: they record it in the database). What
/// `idem status` shows under "expiry", and the expiry metrics.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ExpiryStatus {
    /// The retention the purge applies (the longest any handler asks for);
    /// `None`: nothing expires.
    pub retention: Option<Duration>,
    /// The generation new claims go into.
    pub current_generation: i32,
    /// The generations still in the table, besides the kept one.
    pub generations: u64,
    /// Generations sealed longer than the retention ago and still there:
    /// due to be dropped.
    pub due: u64,
    /// How long ago the oldest of those was sealed.
    pub oldest_due_sealed: Option<Duration>,
    /// How long past its expiry that generation is (zero when none is due).
    pub overdue: Duration,
    /// The rotation in transition, if one is, with what it waits for.
    pub transition: Option<crate::retention::expiry::Transition>,
    /// When a purge run last succeeded.
    pub last_success: Option<OffsetDateTime>,
    /// How long ago, by the database's clock.
    pub last_success_age: Option<Duration>,
    /// Purge runs failed in a row since then.
    pub failures: u64,
    /// What the last of them said, while runs keep failing.
    pub last_error: Option<String>,
    /// How long ago it failed.
    pub last_failure_age: Option<Duration>,
    /// How long the current generation has been open.
    pub current_generation_age: Option<Duration>,
}

impl ExpiryStatus {
    /// Whether expiry is behind, so the purge is failing, blocked, or not
    /// running: a generation is past its expiry, or the current generation
    /// is past its rotation (with no transition under way), by more than two
    /// runs of a router's purge (plus a second). The second catches a purge
    /// that stopped altogether: then nothing rotates, and nothing is ever
    /// sealed to come due.
    pub fn behind(&self) -> bool {
        let Some(retention) = self.retention else {
            return false;
        };
        let slack = 2 * crate::store::purge::purge_interval(retention) + Duration::from_secs(1);
        (self.due > 0 && self.overdue > slack) || self.rotation_overdue() > slack
    }

    /// How long past its rotation the current generation is (zero when not
    /// yet due, or while a transition is under way: that is shown by
    /// itself).
    pub fn rotation_overdue(&self) -> Duration {
        match (
            self.retention,
            self.current_generation_age,
            &self.transition,
        ) {
            (Some(retention), Some(age), None) => {
                age.saturating_sub(crate::retention::expiry::generation_length(retention))
            }
            _ => Duration::ZERO,
        }
    }
}

/// Where expiry stands, with what a transition waits for as the database
/// shows it now (which reads `pg_locks` and `pg_stat_activity`).
pub async fn expiry(pool: &PgPool) -> Result<ExpiryStatus, sqlx::Error> {
    let mut status = expiry_figures(pool).await?;
    if let Some(transition) = &mut status.transition {
        let mut conn = pool.acquire().await?;
        let still = crate::store::purge::still_blocking(&mut conn).await?;
        transition.waiting_for = still.len();
        transition.blockers = crate::store::purge::describe_blockers(&mut conn, &still).await?;
    }
    Ok(status)
}

/// [`expiry`] without reading what a transition waits for (its count is
/// the one the last purge run recorded): one cheap query, for the metrics.
pub(crate) async fn expiry_figures<DB: Backend>(
    pool: &Pool<DB>,
) -> Result<ExpiryStatus, sqlx::Error> {
    let row = DB::expiry_figures(pool).await?;
    let (
        retention,
        current_generation,
        transition,
        waiting_for,
        transition_age,
        generations,
        due,
        oldest_due,
        overdue,
        last_success,
        last_success_age,
        failures,
        last_error,
        last_failure_age,
    ) = row;
    Ok(ExpiryStatus {
        retention: retention.map(|millis| Duration::from_millis(millis.max(0).unsigned_abs())),
        current_generation,
        generations: generations.max(0).unsigned_abs(),
        due: due.max(0).unsigned_abs(),
        oldest_due_sealed: oldest_due.map(seconds),
        overdue: overdue.map_or(Duration::ZERO, seconds),
        transition: transition.then(|| crate::retention::expiry::Transition {
            generation: current_generation,
            waited: transition_age.map_or(Duration::ZERO, seconds),
            waiting_for: waiting_for.unwrap_or(0).max(0).unsigned_abs() as usize,
            blockers: Vec::new(),
        }),
        last_success: last_success.and_then(timestamp),
        last_success_age: last_success_age.map(seconds),
        failures: failures.max(0).unsigned_abs(),
        last_error,
        last_failure_age: last_failure_age.map(seconds),
        current_generation_age: transition_age.map(seconds),
    })
}

/// Where expiry stands, into its gauges.
pub(crate) fn record_gauges(status: &ExpiryStatus) {
    use crate::observe::metrics::{
        EXPIRY_DUE, EXPIRY_OVERDUE, EXPIRY_ROTATION_OVERDUE, PURGE_LAST_SUCCESS,
        TRANSITION_BLOCKERS, TRANSITION_SECONDS,
    };
    if let Some(at) = status.last_success {
        metrics::gauge!(PURGE_LAST_SUCCESS).set((at.unix_timestamp_nanos() as f64) / 1e9);
    }
    metrics::gauge!(EXPIRY_DUE).set(status.due as f64);
    metrics::gauge!(EXPIRY_OVERDUE).set(status.overdue.as_secs_f64());
    metrics::gauge!(EXPIRY_ROTATION_OVERDUE).set(status.rotation_overdue().as_secs_f64());
    let (waited, blocking) = status.transition.as_ref().map_or((0.0, 0.0), |t| {
        (t.waited.as_secs_f64(), t.waiting_for as f64)
    });
    metrics::gauge!(TRANSITION_SECONDS).set(waited);
    metrics::gauge!(TRANSITION_BLOCKERS).set(blocking);
}

/// Seconds the database computed, as a duration (a negative one as zero).
pub(crate) fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// A Unix time the database computed.
pub(crate) fn timestamp(epoch: f64) -> Option<OffsetDateTime> {
    OffsetDateTime::from_unix_timestamp_nanos((epoch * 1e9) as i128).ok()
}
