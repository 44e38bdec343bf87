//! Per-route counters, readable while the router runs.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of what one route did with its messages.
#[derive(Debug, Default)]
pub struct Stats {
    pub(crate) received: AtomicU64,
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) commit_failed: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) dropped_by_fault: AtomicU64,
}

impl Stats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
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
    /// Messages whose handler (or BEGIN) failed: rolled back and NAKed.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
    /// Messages whose COMMIT failed or had an unknown outcome: NAKed, never acked.
    pub fn commit_failed(&self) -> u64 {
        self.commit_failed.load(Ordering::Relaxed)
    }
    /// Messages that can never succeed (undecodable payload, unusable id): TERMed.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// Messages a fault-injection hook dropped after commit without acking.
    pub fn dropped_by_fault(&self) -> u64 {
        self.dropped_by_fault.load(Ordering::Relaxed)
    }
}
