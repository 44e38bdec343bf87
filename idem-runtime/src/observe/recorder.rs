//! One recorder per route: every event is counted once, through one call
//! that feeds both the route's [`Stats`] (what
//! [`RouterHandle::stats`](crate::RouterHandle::stats) reads) and its
//! [`metrics`](super::metrics), so that the two cannot drift.
//!
//! The stats' counters and the metrics' handles are private to this folder:
//! the rest of the runtime can only count through [`Recorder::record`].

use std::sync::Arc;

use super::metrics::{InFlight, RouteMetrics, Timer};
use super::stats::Stats;
use crate::error::Failure;

/// Something that happened to a message of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// Taken from the consumer (or, for a request route, received).
    Received,
    /// The claim was fresh, the handler ran and the transaction committed.
    Processed,
    /// The claim found the message processed: rolled back, acked.
    Duplicate,
    /// The handler, or what came before it, failed after the in-process
    /// retries.
    Failed,
    /// A transaction run again at once, in process.
    RetriedInProcess,
    /// Stored as a dead letter.
    DeadLettered(Failure),
    /// A dead letter that could not be stored (the message is held).
    DeadLetterFailed,
    /// A COMMIT that failed or whose outcome is unknown.
    CommitFailed,
    /// A message that can never succeed (bad payload or id).
    Rejected,
    /// The database could not be used before the handler ran.
    InfrastructureError,
    /// A batch rolled back and run again one message per transaction.
    BatchFallback,
    /// A transaction the database stopped answering, no longer waited for.
    AbandonedTransaction,
    /// A replay of another handler's dead letter, acked unrun.
    ReplaySkipped,
    /// Dropped after commit by a fault-injection hook (no metric: tests only).
    #[cfg(feature = "fault-injection")]
    DroppedByFault,
}

/// A route's counters and metric handles, recorded together.
#[derive(Clone)]
pub(crate) struct Recorder {
    stats: Arc<Stats>,
    metrics: RouteMetrics,
}

impl Recorder {
    /// The recorder of the route named `route` (its durable consumer, or a
    /// request route's subject), counting into `stats`.
    pub(crate) fn new(route: &str, stats: Arc<Stats>) -> Self {
        Recorder {
            stats,
            metrics: RouteMetrics::new(route),
        }
    }

    /// Counts `event` once, in the stats and the metrics.
    pub(crate) fn record(&self, event: Event) {
        let (stats, metrics) = (&self.stats, &self.metrics);
        match event {
            Event::Received => {
                Stats::bump(&stats.received);
                metrics.received();
            }
            Event::Processed => {
                Stats::bump(&stats.processed);
                metrics.processed();
            }
            Event::Duplicate => {
                Stats::bump(&stats.duplicates);
                metrics.duplicate();
            }
            Event::Failed => {
                Stats::bump(&stats.failed);
                metrics.failed();
            }
            Event::RetriedInProcess => {
                Stats::bump(&stats.retried_in_process);
                metrics.retried();
            }
            Event::DeadLettered(failure) => {
                Stats::bump(&stats.dead_lettered);
                metrics.dead_lettered(failure);
            }
            Event::DeadLetterFailed => {
                Stats::bump(&stats.dead_letter_failed);
                metrics.dead_letter_publish_failed();
            }
            Event::CommitFailed => {
                Stats::bump(&stats.commit_failed);
                metrics.commit_unknown();
            }
            Event::Rejected => {
                Stats::bump(&stats.rejected);
                metrics.rejected();
            }
            Event::InfrastructureError => {
                Stats::bump(&stats.infrastructure_errors);
                metrics.infrastructure_error();
            }
            Event::BatchFallback => {
                Stats::bump(&stats.batch_fallbacks);
                metrics.batch_fallback();
            }
            Event::AbandonedTransaction => {
                Stats::bump(&stats.abandoned_transactions);
                metrics.abandoned_transaction();
            }
            Event::ReplaySkipped => {
                Stats::bump(&stats.replays_skipped);
                metrics.replay_skipped();
            }
            #[cfg(feature = "fault-injection")]
            Event::DroppedByFault => Stats::bump(&stats.dropped_by_fault),
        }
    }

    /// A message (or batch) waited `waited` for its turn at the router's
    /// connections (`store/connections.rs`).
    pub(crate) fn connection_waited(&self, waited: std::time::Duration) {
        self.stats.record_connection_wait(waited);
        self.metrics.connection_waited(waited);
    }

    /// A batch of `size` messages committed in one transaction.
    pub(crate) fn batch_committed(&self, size: usize) {
        self.stats.record_batch(size);
        self.metrics.batch_committed(size);
    }

    /// A message committed and then acked, stored by JetStream at
    /// `stored_at`: its end-to-end latency.
    pub(crate) fn acked_processed(&self, stored_at: time::OffsetDateTime) {
        self.metrics.acked_processed(stored_at);
    }

    /// The route paused (`true`) or resumed, in the stats and the metrics.
    pub(crate) fn paused(&self, paused: bool) {
        self.stats
            .paused
            .store(paused, std::sync::atomic::Ordering::Relaxed);
        self.metrics.paused(paused);
    }

    /// `messages` in flight until the guard is dropped.
    pub(crate) fn in_flight(&self, messages: usize) -> InFlight {
        self.metrics.in_flight(messages)
    }

    /// Times one handler call until the guard is dropped.
    pub(crate) fn handler_call(&self) -> Timer<'_> {
        self.metrics.handler_call()
    }
}
