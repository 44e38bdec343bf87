//! The purge a router runs beside its routes: a run every interval, the
//! expiry gauges after each, and a warning naming the session that holds
//! the purge back while expiry falls behind.

use std::time::Duration;

use sqlx::Pool;

use crate::store::backend::Backend;
use crate::store::purge::{SESSION_IDLE_TIMEOUT, purge_interval};

/// Runs [`Backend::purge`] every `interval` until `shutdown` fires, and after each
/// run reads the expiry's figures into the metrics. A failed run is logged
/// and counted, and the next one tries again. Shutdown is checked between
/// runs only: a run in progress is never cut short (the router waits for it
/// within its grace period, then leaves it to finish).
pub(crate) async fn run_in_background<DB: Backend>(
    pool: Pool<DB>,
    interval: Duration,
    mut shutdown: crate::tasks::Signal,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.fired() => return,
            _ = ticks.tick() => {}
        }
        match DB::purge(&pool).await {
            Ok(report) if report.skipped => warn_if_held_back(&pool).await,
            Ok(report) => tracing::debug!(?report, "claims purge ran"),
            Err(error) => {
                crate::observe::metrics::purge_failed();
                tracing::warn!(%error, "claims purge failed; the next run resumes where it stopped");
            }
        }
        match super::status::expiry_figures(&pool).await {
            Ok(status) => super::status::record_gauges(&status),
            Err(error) => tracing::debug!(%error, "expiry figures unreadable for metrics"),
        }
    }
}

/// After a run skipped because another session holds the purge's lock:
/// that is how purges take turns, unless expiry is behind meanwhile (the
/// holder is stuck, or its process froze). Then warns, naming the holder.
async fn warn_if_held_back<DB: Backend>(pool: &Pool<DB>) {
    let Ok(status) = super::status::expiry_figures(pool).await else {
        return;
    };
    if !status.behind() {
        return;
    }
    // A holder that is working (a long DETACH, a first run after a long
    // downtime expiring many generations) is left alone: only one that
    // sends nothing, or has been in one state for longer than expiry may
    // lag, is named.
    let slack = status
        .retention
        .map_or(Duration::from_secs(1), |retention| {
            2 * purge_interval(retention) + Duration::from_secs(1)
        });
    let holder = match DB::purge_holder(pool, slack).await {
        Ok(Some(holder)) => holder,
        // Working, or ended since: nothing to point at.
        Ok(None) => return,
        Err(error) => format!("a session that could not be read ({error})"),
    };
    tracing::warn!(
        holder,
        "expiry is behind while another session holds the purge's lock, so this router's purge runs are skipped; if that session is stuck, end it (pg_terminate_backend): the server ends it by itself after {}s without a statement",
        SESSION_IDLE_TIMEOUT.as_secs()
    );
}
