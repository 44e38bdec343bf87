//! What a relay did: each cycle's report, and the counters of a relay (and
//! its clones), readable while it runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::lag::{Blocked, Lag};

/// One message a relay published and JetStream acknowledged.
#[derive(Debug, Clone)]
pub struct Published {
    /// Its `Nats-Msg-Id`.
    pub msg_id: String,
    /// Its subject.
    pub subject: String,
    /// Its sequence in the stream that stored it (the first copy's, for a
    /// duplicate).
    pub stream_sequence: u64,
    /// JetStream had it already (a republish within the duplicate window).
    pub duplicate: bool,
}

/// What one relay cycle did.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Cycle {
    /// Rows taken (and published or tried).
    pub taken: usize,
    /// Rows published, acknowledged and deleted, in id order.
    pub published: Vec<Published>,
    /// Rows whose publish failed (left pending).
    pub failed: usize,
    /// Of those, the rows whose failure was recorded on them: each waits out
    /// its own back-off, and is then retried apart from the fresh rows.
    pub failing: usize,
    /// Why NATS seemed away, if it did: nothing went out and JetStream did
    /// not answer (or the client could not queue a publish). The failures
    /// were then not recorded on the rows.
    pub nats_away: Option<String>,
    /// The take was full (or cut at `max_cycle_bytes`): more rows may be
    /// waiting.
    pub more: bool,
    /// The NATS client connected again while the cycle's publishes were
    /// out: the PubAcks that did not come back are not blamed on the rows.
    pub reconnected: bool,
}

/// What a drain did ([`Relay::drain`](super::Relay::drain), and each
/// burst of a running relay's fresh lane): its cycles summed, and how its
/// last one ended.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Drain {
    /// Cycles that took rows and committed.
    pub cycles: usize,
    /// Rows taken by its cycles (committed or not).
    pub taken: usize,
    /// Rows published, acknowledged and deleted by those that committed.
    pub published: usize,
    /// Of those, how many JetStream had already (PubAck `duplicate`).
    pub duplicates: usize,
    /// Rows whose publish failed (left pending), in cycles that committed.
    pub failed: usize,
    /// Of those, the rows whose failure was recorded on them.
    pub failing: usize,
    /// Why NATS seemed away in its last cycle, if it did: the drain stopped
    /// there, and the rows stay as they are.
    pub nats_away: Option<String>,
    /// More rows may be waiting: its last cycle was full (or cut at
    /// `max_cycle_bytes`), or a cycle taken ahead was put back.
    pub more: bool,
}

impl Drain {
    /// The drain of one cycle.
    pub(super) fn of(cycle: &Cycle) -> Drain {
        let mut drain = Drain::default();
        drain.headed(cycle);
        drain.add(cycle);
        drain
    }

    /// A cycle whose PubAcks are in: its rows, and how it ended.
    pub(super) fn headed(&mut self, cycle: &Cycle) {
        self.taken += cycle.taken;
        self.nats_away.clone_from(&cycle.nats_away);
        self.more = cycle.more;
    }

    /// A cycle that committed.
    pub(super) fn add(&mut self, cycle: &Cycle) {
        self.cycles += 1;
        self.published += cycle.published.len();
        self.duplicates += cycle.published.iter().filter(|p| p.duplicate).count();
        self.failed += cycle.failed;
        self.failing += cycle.failing;
    }
}

/// Counters of one relay (and its clones), readable while it runs.
#[derive(Debug, Clone, Default)]
pub struct RelayStats(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    failing: AtomicU64,
    cycles: AtomicU64,
    empty_cycles: AtomicU64,
    nats_away: AtomicU64,
    notifications: AtomicU64,
    wakeups: AtomicU64,
    /// The last [`lag`](fn@super::lag::lag) the relay read, and when.
    lag: Mutex<Option<(Lag, Instant)>>,
    /// Relay statements waiting for a lock, while a drain runs long.
    blocked: Mutex<Vec<Blocked>>,
}

impl RelayStats {
    /// Messages published and acknowledged by JetStream, duplicates
    /// included: counted as each cycle's PubAcks come back, before its rows
    /// are deleted, so that a message a subscriber has received is
    /// counted by the time the relay's next cycle starts. A row whose
    /// DELETE then fails (the database went away) is published again, and
    /// counted again (as a duplicate, within the stream's window).
    pub fn published(&self) -> u64 {
        self.0.published.load(Ordering::Relaxed)
    }

    /// Of those, how many JetStream had already (PubAck `duplicate`).
    pub fn duplicates(&self) -> u64 {
        self.0.duplicates.load(Ordering::Relaxed)
    }

    /// Publishes that failed (their rows stayed pending).
    pub fn failed(&self) -> u64 {
        self.0.failed.load(Ordering::Relaxed)
    }

    /// Failures recorded on their rows (NATS answered; the row waits out
    /// its own back-off): each failed attempt of a row counts once.
    pub fn failing(&self) -> u64 {
        self.0.failing.load(Ordering::Relaxed)
    }

    /// Cycles that took at least one row and committed.
    pub fn cycles(&self) -> u64 {
        self.0.cycles.load(Ordering::Relaxed)
    }

    /// Looks for fresh rows that found none: a cycle that took no row, or
    /// a poll's look (one query, before any cycle) that found none.
    pub fn empty_cycles(&self) -> u64 {
        self.0.empty_cycles.load(Ordering::Relaxed)
    }

    /// Cycles that found NATS away (nothing went out, and JetStream did not
    /// answer).
    pub fn nats_away(&self) -> u64 {
        self.0.nats_away.load(Ordering::Relaxed)
    }

    /// Notifications read from the LISTEN connection, whether they woke
    /// the relay or were discarded during a back-off.
    pub fn notifications(&self) -> u64 {
        self.0.notifications.load(Ordering::Relaxed)
    }

    /// Wake-ups by notification: each covers every notification received
    /// before it.
    pub fn wakeups(&self) -> u64 {
        self.0.wakeups.load(Ordering::Relaxed)
    }

    /// Relay statements that waited for a lock another session holds, each
    /// with that session, as the relay found them while one of its drains
    /// ran long (checked every 2 s from another connection, and warned of);
    /// empty once the drain ends. See [`Lag::blocked`].
    pub fn blocked(&self) -> Vec<Blocked> {
        self.0
            .blocked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The outbox's [`lag`](fn@super::lag::lag) as the relay last read it (about once per poll
    /// interval, at most once a second, while it runs), and how long ago;
    /// `None` before the first reading. The lag counts every relay's rows,
    /// not only this one's.
    pub fn lag(&self) -> Option<(Lag, Duration)> {
        let reading = self.0.lag.lock().unwrap_or_else(|e| e.into_inner());
        reading
            .as_ref()
            .map(|(lag, at)| (lag.clone(), at.elapsed()))
    }

    /// Counts `read` notifications, and a wake-up if they ended a wait.
    pub(super) fn notified(&self, read: usize, woke: bool) {
        self.0
            .notifications
            .fetch_add(read as u64, Ordering::Relaxed);
        if woke {
            self.0.wakeups.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl RelayStats {
    /// Relay statements waiting for a lock as the relay last found them
    /// (`idem_outbox_relays_blocked`); empty when its wait ends.
    pub(super) fn record_blocked(&self, blocked: Vec<Blocked>) {
        metrics::gauge!(crate::observe::metrics::OUTBOX_RELAYS_BLOCKED).set(blocked.len() as f64);
        *self.0.blocked.lock().unwrap_or_else(|e| e.into_inner()) = blocked;
    }

    /// The lag the relay just read.
    pub(super) fn record_lag(&self, lag: Lag) {
        *self.0.lag.lock().unwrap_or_else(|e| e.into_inner()) = Some((lag, Instant::now()));
    }

    /// The messages a cycle's PubAcks acknowledged: into these counters
    /// and the metrics, as soon as they come back.
    pub(super) fn acknowledged(&self, published: &[Published]) {
        let duplicates = published.iter().filter(|p| p.duplicate).count();
        crate::observe::metrics::outbox_published(published.len());
        let counters = &self.0;
        counters
            .published
            .fetch_add(published.len() as u64, Ordering::Relaxed);
        counters
            .duplicates
            .fetch_add(duplicates as u64, Ordering::Relaxed);
    }

    /// What one cycle that took rows did, once it committed (its PubAcks
    /// were counted by [`acknowledged`](Self::acknowledged)): into these
    /// counters and the metrics, in one place, so that the two cannot
    /// drift.
    pub(super) fn record_cycle(&self, cycle: &Cycle) {
        crate::observe::metrics::outbox_publish_failures(cycle.failed);
        let counters = &self.0;
        counters.cycles.fetch_add(1, Ordering::Relaxed);
        counters
            .failed
            .fetch_add(cycle.failed as u64, Ordering::Relaxed);
        counters
            .failing
            .fetch_add(cycle.failing as u64, Ordering::Relaxed);
        if cycle.nats_away.is_some() {
            counters.nats_away.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A cycle that found no row.
    pub(super) fn empty_cycle(&self) {
        self.0.empty_cycles.fetch_add(1, Ordering::Relaxed);
    }
}
