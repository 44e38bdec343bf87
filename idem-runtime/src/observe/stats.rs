//! Per-route counters, readable while the router runs. They are counted
//! only through the route's [`Recorder`](super::recorder::Recorder), which
//! feeds the metrics in the same call.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Counters of what one route did with its messages, read through
/// [`RouterHandle::stats`](crate::RouterHandle::stats) (which shows them
/// in use) while the router runs. Each counts from the router's start; the
/// same events are in the [`metrics`](super::metrics).
///
/// ```
/// let stats = idem_runtime::Stats::default(); // what a route starts with
/// assert_eq!((stats.received(), stats.processed(), stats.duplicates()), (0, 0, 0));
/// ```
#[derive(Debug, Default)]
pub struct Stats {
    pub(super) received: AtomicU64,
    pub(super) processed: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) commit_failed: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) retried_in_process: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) dead_letter_failed: AtomicU64,
    pub(super) dropped_by_fault: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) batch_fallbacks: AtomicU64,
    pub(super) largest_batch: AtomicU64,
    pub(super) infrastructure_errors: AtomicU64,
    pub(super) abandoned_transactions: AtomicU64,
    pub(super) replays_skipped: AtomicU64,
    /// Microseconds.
    pub(super) longest_connection_wait: AtomicU64,
    pub(super) paused: AtomicBool,
}

impl Stats {
    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a committed batch of `size` messages.
    pub(super) fn record_batch(&self, size: usize) {
        Stats::bump(&self.batches);
        self.largest_batch.fetch_max(size as u64, Ordering::Relaxed);
    }

    /// Records a wait for a turn at the router's connections.
    pub(super) fn record_connection_wait(&self, waited: std::time::Duration) {
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.longest_connection_wait
            .fetch_max(micros, Ordering::Relaxed);
    }

    /// Messages taken from the consumer.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
    /// Messages whose claim was fresh: the body ran and the transaction committed.
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }
    /// Messages whose claim found them already processed: rolled back and acked.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
    /// Deliveries that failed after the in-process retries (the handler,
    /// COMMIT, or a claim the database refused, such as one past its
    /// statement timeout): rolled back, then NAKed or dead-lettered. A BEGIN
    /// or claim that failed because the database could not be used counts
    /// under [`infrastructure_errors`](Stats::infrastructure_errors) instead.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
    /// Transactions run again at once after a serialization failure, a
    /// deadlock or a lost connection.
    pub fn retried_in_process(&self) -> u64 {
        self.retried_in_process.load(Ordering::Relaxed)
    }
    /// Messages published as dead letters and then TERMed.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }
    /// Dead-letter publishes that failed: the message is held, leased, and
    /// its dead letter tried again.
    pub fn dead_letter_failed(&self) -> u64 {
        self.dead_letter_failed.load(Ordering::Relaxed)
    }
    /// Messages whose COMMIT failed or had an unknown outcome: NAKed, never acked.
    pub fn commit_failed(&self) -> u64 {
        self.commit_failed.load(Ordering::Relaxed)
    }
    /// Messages that can never succeed (undecodable payload, unusable id):
    /// dead-lettered.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// Batches committed in one transaction (batch mode).
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }
    /// The most messages one committed batch transaction held (batch mode):
    /// above 1 shows that batching really happened.
    pub fn largest_batch(&self) -> u64 {
        self.largest_batch.load(Ordering::Relaxed)
    }
    /// Attempts that failed before the handler ran, because the database
    /// could not be used: BEGIN, the claim, or getting a connection.
    pub fn infrastructure_errors(&self) -> u64 {
        self.infrastructure_errors.load(Ordering::Relaxed)
    }
    /// Transactions the database stopped answering (a partition, a frozen
    /// host) that the runtime stopped waiting for: left to finish on their
    /// own, their messages settled as of unknown outcome.
    pub fn abandoned_transactions(&self) -> u64 {
        self.abandoned_transactions.load(Ordering::Relaxed)
    }
    /// Batches rolled back and rerun one message per transaction.
    pub fn batch_fallbacks(&self) -> u64 {
        self.batch_fallbacks.load(Ordering::Relaxed)
    }
    /// Replays of dead letters that another handler dead-lettered (their
    /// `Idem-Replay-For` names it): acked without running this handler.
    pub fn replays_skipped(&self) -> u64 {
        self.replays_skipped.load(Ordering::Relaxed)
    }
    /// The longest a message (or batch) of the route waited for its turn at
    /// the router's connections, which are handed out in the order asked
    /// for, whichever route asks (see
    /// [Sizing the pool](crate::guide::writing_handlers#sizing-the-pool)).
    /// Near zero unless the pool is smaller than the routes' concurrency.
    ///
    /// ```
    /// let stats = idem_runtime::Stats::default();
    /// assert_eq!(stats.longest_connection_wait(), std::time::Duration::ZERO);
    /// ```
    pub fn longest_connection_wait(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.longest_connection_wait.load(Ordering::Relaxed))
    }
    /// Messages a fault-injection hook dropped after commit without acking.
    pub fn dropped_by_fault(&self) -> u64 {
        self.dropped_by_fault.load(Ordering::Relaxed)
    }
    /// Whether the route is paused now: it takes no new messages, because
    /// its database cannot be used (see
    /// [failure handling](crate::guide::failure_handling)). It resumes when
    /// an attempt gets past its claim, or, with no attempt left running, when
    /// the database answers again. The gauge `idem_route_paused` says the
    /// same.
    ///
    /// ```
    /// assert!(!idem_runtime::Stats::default().paused());
    /// ```
    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }
}
