//! The relay: cycles that publish committed outbox rows and delete those
//! JetStream acknowledged, run in two lanes so that no row, and no outage,
//! stops the others. A cycle's steps are in `cycle.rs`, how the fresh lane
//! overlaps its cycles in `drain.rs`, the messages they send PostgreSQL in
//! `store/outbox.rs`.
//!
//! # The lanes
//!
//! [`Relay::run_until`] runs both at once, each with its own transactions
//! (a relay holds up to four connections: two while the fresh lane is busy,
//! given back once a poll finds nothing, one for the retry lane, and the
//! LISTEN one while the NOTIFY trigger is enabled).
//!
//! - **Fresh rows**, woken by this process's commits, notifications or the
//!   poll (see `wake.rs`), drained (see `drain.rs`) while cycles take all
//!   they can or something announced rows during them. A wake-up by the
//!   poll first looks whether a fresh row is there at all (one cheap
//!   query, outside a transaction), so that an idle relay costs one such
//!   look per poll.
//! - **Failing rows**, once due: the lane looks for the first due row about
//!   once a second, and runs one cycle at a time. A retry that waits out a
//!   PubAck timeout holds up only other failing rows, and after a retry
//!   cycle that sent nothing the lane waits a second, so rows that can
//!   never go out cost at most a cycle a second.
//!
//! Either lane backs off, from 100 ms doubling up to `max_backoff`, while
//! NATS is away or the database fails, and the fresh lane reads (and
//! discards) its notifications meanwhile.

use std::future::Future;
use std::pin::{Pin, pin};
#[cfg(feature = "fault-injection")]
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::FutureExt;
use sqlx::Pool;
use tokio::sync::watch;

use super::cycle::{Cycles, FIRST_ROW_BACKOFF, LostConnections, RelayError};
use super::drain::{Sessions, Signals, drain};
use super::lag::lag_and_notify;
#[cfg(feature = "fault-injection")]
use super::stats::Published;
use super::stats::{Cycle, Drain, RelayStats};
use super::wake::{Bell, Poll, Wakeup, Woken};
use crate::store::outbox::{Lane, OutboxStore};

/// Publishes committed outbox rows to JetStream; see the [module
/// docs](super).
///
/// ```no_run
/// # async fn start(nats: async_nats::Client, pool: sqlx::PgPool) -> Result<(), idem_runtime::outbox::RelayError> {
/// use idem_runtime::outbox::Relay;
///
/// let relay = Relay::new().batch_size(500);
/// tokio::spawn(relay.run_until(nats, pool, std::future::pending()));
/// # Ok(())
/// # }
/// ```
///
/// Each cycle, in one transaction: take up to `batch_size` rows in id order
/// with `FOR UPDATE SKIP LOCKED` (so relays never take the same row), at
/// most `max_cycle_bytes` of them, publish them all without waiting, then
/// await every PubAck, delete the rows that were acknowledged, record the
/// failures of the others, and COMMIT. While one cycle's PubAcks are out,
/// the cycle before it commits and the one after it takes its rows, on a
/// second connection; a cycle publishes only once the one before it has
/// its PubAcks, so one relay keeps the order rows were queued in. While
/// NATS is away the rows stay as they are and the relay backs off (from
/// 100 ms, doubling, up to `max_backoff`). A row that fails while NATS
/// answers (no stream stores its subject, it is too big, the relay may not
/// publish to its subject) waits out a back-off of its own (from 1 s,
/// doubling, up to `max_row_backoff`) and is retried apart from the fresh
/// rows, which go on meanwhile. A relay that dies between the PubAck and
/// its COMMIT leaves the rows pending, and the next cycle publishes them
/// again with the same ids: JetStream drops them within its duplicate
/// window, downstream dedup after it.
///
/// It wakes when a handler of its process has committed a transaction that
/// queued messages in its database (see
/// [`wake_local_relays`](super::wake_local_relays)), and polls: every
/// `min_poll_interval` (10 ms) while polls find rows, doubling while they
/// find none, up to `poll_interval` (1 s). The poll is what a relay in
/// another process than the handlers runs on, and what finds rows whose
/// wake-up was lost. Where the NOTIFY trigger is enabled again (opt-in, see
/// the guide), each notification wakes it too.
#[derive(Clone)]
pub struct Relay {
    cycles: Cycles,
    min_poll_interval: Duration,
    poll_interval: Duration,
    max_backoff: Duration,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.cycles.batch_size)
            .field("max_cycle_bytes", &self.cycles.max_cycle_bytes)
            .field("min_poll_interval", &self.min_poll_interval)
            .field("poll_interval", &self.poll_interval)
            .field("max_backoff", &self.max_backoff)
            .field("max_row_backoff", &self.cycles.max_row_backoff)
            .finish_non_exhaustive()
    }
}

impl Default for Relay {
    fn default() -> Self {
        Self::new()
    }
}

/// The first wait of a lane's back-off.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// How often the retry lane looks for a failing row that is due.
const RETRY_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The shortest time between two readings of the outbox's lag by a relay (a
/// `count(*)` of the outbox), however short its poll interval; the relay
/// reads whether the NOTIFY trigger is enabled with it.
const LAG_READ_EVERY: Duration = Duration::from_secs(1);

/// How long a drain runs before the relay asks whether its statements wait
/// for a lock, and how often it asks again.
const BLOCKED_CHECK: Duration = Duration::from_secs(2);

/// The most cycles a relay runs after it is told to stop (see
/// [`Relay::run_until`]): a stop is not held up by a long backlog.
pub const FINAL_CYCLES: usize = 8;

/// Why the fresh lane stops in the middle of a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopping {
    /// The relay was told to stop: its final cycles follow.
    Shutdown,
    /// The retry lane ended (a cycle of it died).
    OtherLane,
}

/// A lane's back-off: none, or the current wait.
#[derive(Debug, Default)]
struct Backoff(Option<Duration>);

impl Backoff {
    fn next(&mut self, max: Duration) -> Duration {
        let next = self.0.map_or(FIRST_BACKOFF, |b| (b * 2).min(max));
        self.0 = Some(next);
        next
    }

    fn current(&self) -> Option<Duration> {
        self.0
    }

    fn reset(&mut self) {
        self.0 = None;
    }
}

impl Relay {
    /// A relay with the defaults: batches of 1024 rows and at most 8 MiB,
    /// a poll from every 10 ms (while rows keep coming) to every second
    /// (idle), back-off up to 5 s while NATS is away, and up to 60 s for a
    /// row that keeps failing.
    pub fn new() -> Self {
        Self {
            cycles: Cycles {
                batch_size: 1024,
                max_cycle_bytes: 8 * 1024 * 1024,
                max_row_backoff: Duration::from_secs(60),
                stats: RelayStats::default(),
                #[cfg(feature = "fault-injection")]
                after_pubacks: None,
            },
            min_poll_interval: Duration::from_millis(10),
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(5),
        }
    }

    /// Rows per cycle (default 1024, at least 1): all published before the
    /// first PubAck is awaited, and held locked until the cycle commits.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.cycles.batch_size = rows.max(1);
        self
    }

    /// The most payload and header bytes a cycle takes (default 8 MiB),
    /// which bounds the relay's memory: a cycle takes rows while they fit,
    /// and always at least one, however big. Two cycles may be in memory at
    /// once (one publishing, the next taken).
    pub fn max_cycle_bytes(mut self, bytes: usize) -> Self {
        self.cycles.max_cycle_bytes = bytes.max(1);
        self
    }

    /// The longest the relay goes without looking for rows when nothing
    /// wakes it (default 1 s): the poll's ceiling, reached while polls find
    /// nothing. A row whose wake-up was lost, or queued by another process
    /// while no poll is fast, waits about this long.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The poll's floor (default 10 ms): how soon after a cycle that found
    /// rows the relay looks again unwoken, so that a relay in another
    /// process than the handlers keeps up while rows keep coming. Each poll
    /// that finds nothing doubles the wait, up to
    /// [`poll_interval`](Self::poll_interval).
    pub fn min_poll_interval(mut self, interval: Duration) -> Self {
        self.min_poll_interval = interval;
        self
    }

    /// The longest wait between cycles while NATS is away or the database
    /// fails (default 5 s): about how long after NATS returns the rows go
    /// out.
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff.max(FIRST_BACKOFF);
        self
    }

    /// The longest a failing row waits between two attempts (default 60 s;
    /// from 1 s, doubling with each failure): about how long after its cause
    /// is fixed it goes out, unless it is retried at once
    /// ([`retry_failing`](super::retry_failing)).
    pub fn max_row_backoff(mut self, backoff: Duration) -> Self {
        self.cycles.max_row_backoff = backoff.max(FIRST_ROW_BACKOFF);
        self
    }

    /// This relay's counters (shared with its clones).
    pub fn stats(&self) -> RelayStats {
        self.cycles.stats.clone()
    }

    /// Calls `hook` with each cycle's acknowledged messages, before the
    /// DELETE: [`AfterPubAcks::Crash`](crate::fault::AfterPubAcks::Crash)
    /// ends the relay as if its process died there.
    #[cfg(feature = "fault-injection")]
    pub fn fault_after_pubacks(
        mut self,
        hook: impl Fn(&[Published]) -> crate::fault::AfterPubAcks + Send + Sync + 'static,
    ) -> Self {
        self.cycles.after_pubacks = Some(Arc::new(hook));
        self
    }

    /// Runs both lanes until `shutdown` completes (acted on between cycles
    /// and while waiting, never during a cycle), or a cycle dies. Database
    /// errors are logged and retried after a back-off.
    ///
    /// When `shutdown` completes, the relay first publishes what is pending
    /// then, in up to [`FINAL_CYCLES`] more cycles of fresh rows, and stops
    /// early at the first cycle that is not full or finds NATS away: those
    /// rows stay for the next relay. The retry lane ends its cycle and
    /// stops.
    pub async fn run_until<DB: OutboxStore>(
        self,
        nats: async_nats::Client,
        pool: Pool<DB>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RelayError> {
        let js = jetstream::new(nats);
        crate::observe::metrics::outbox_nats_unreachable(false);
        // Whichever lane ends first stops the other.
        let (stop, stopped) = watch::channel(false);
        let away = LaneAway::default();
        let fresh = async {
            let ended = self
                .run_fresh(&js, &pool, shutdown, stopped.clone(), &away)
                .await;
            stop.send_replace(true);
            ended
        };
        let retries = async {
            let ended = self.run_retries(&js, &pool, stopped.clone(), &away).await;
            stop.send_replace(true);
            ended
        };
        let (fresh, retries) = tokio::join!(fresh, retries);
        fresh.and(retries)
    }

    /// The fresh lane: a wake-up, then drains while they take all they can
    /// or something announces rows, then a wait; a back-off instead while
    /// NATS is away.
    async fn run_fresh<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
        shutdown: impl Future<Output = ()>,
        mut stopped: watch::Receiver<bool>,
        away: &LaneAway,
    ) -> Result<(), RelayError> {
        let mut shutdown = pin!(shutdown);
        let mut wakeup = Wakeup::new(self.cycles.stats.clone(), &Bell::of(pool));
        let mut backoff = Backoff::default();
        let mut lost = LostConnections::default();
        let mut poll = Poll::new(self.min_poll_interval, self.poll_interval);
        let mut sessions = Sessions::default();
        let mut lag_read: Option<Instant> = None;
        let mut trigger = false;
        // The first pass drains at once; after a wait that the poll ended,
        // the lane first looks whether there is a fresh row at all.
        let mut look_first = false;
        loop {
            // About once per poll interval, whether woken by signals or by
            // the poll: a relay kept busy by signals still reports how far
            // behind it is, and finds the trigger enabled or disabled.
            if lag_read.is_none_or(|at| at.elapsed() >= self.poll_interval.max(LAG_READ_EVERY)) {
                trigger = self.read_lag(pool).await.unwrap_or(trigger);
                lag_read = Some(Instant::now());
            }
            wakeup.listen(pool, trigger).await;
            if look_first && !self.any_fresh(pool).await {
                poll.after(false);
                self.cycles.stats.empty_cycle();
                // Idle: its connections go back to the pool.
                sessions.release();
            } else {
                loop {
                    if shutdown.as_mut().now_or_never().is_some() {
                        return self.final_cycles(js, pool, &mut sessions, &mut lost).await;
                    }
                    if *stopped.borrow() {
                        return Ok(());
                    }
                    let signals = Signals::default();
                    let (drained, stopping) = self
                        .drain_until_stopped(
                            pool,
                            &mut wakeup,
                            &signals,
                            drain(
                                &self.cycles,
                                js,
                                pool,
                                &mut sessions,
                                &mut lost,
                                &signals,
                                usize::MAX,
                            ),
                            shutdown.as_mut(),
                            &mut stopped,
                        )
                        .await;
                    match drained {
                        Ok(drained) => {
                            poll.after(drained.taken > 0);
                            let again = drained.more || signals.announced.load(Ordering::Relaxed);
                            let backs_off = self.settle(&drained, &mut backoff, away, Lane::Fresh);
                            match stopping {
                                Some(Stopping::Shutdown) if !backs_off => {
                                    return self
                                        .final_cycles(js, pool, &mut sessions, &mut lost)
                                        .await;
                                }
                                Some(_) => return Ok(()),
                                None if backs_off || !again => break,
                                None => {}
                            }
                        }
                        Err(RelayError::Database(error)) => {
                            sessions.release();
                            if stopping.is_some() {
                                tracing::warn!(%error, "outbox relay cycle failed while stopping; its rows stay pending for the next relay");
                                return Ok(());
                            }
                            let wait = backoff.next(self.max_backoff);
                            tracing::warn!(%error, backoff_ms = wait.as_millis() as u64, "outbox relay cycle failed; backing off");
                            break;
                        }
                        Err(error) => return Err(error),
                    }
                }
            }
            // A back-off reads and discards notifications; otherwise the
            // first one ends the wait (see `wake.rs`).
            let (wait, early) = match backoff.current() {
                Some(wait) => {
                    sessions.release();
                    (wait, false)
                }
                None => (poll.wait(), true),
            };
            let woken = tokio::select! {
                () = &mut shutdown => return self.final_cycles(js, pool, &mut sessions, &mut lost).await,
                _ = stopped.changed() => return Ok(()),
                woken = wakeup.wait(wait, early) => woken,
            };
            // A back-off's end always tries again: it is how the lane finds
            // NATS back.
            look_first = woken == Woken::Poll && backoff.current().is_none();
        }
    }

    /// Runs `drained` (a drain) beside the reads of `wakeup` (see
    /// [`Wakeup::during`]) to its end, never cancelled; if `shutdown`
    /// completes or the other lane stops meanwhile, tells the drain through
    /// `signals`, so that it ends after the cycle publishing now. Returns
    /// its output, and why the lane is stopping, if it is.
    ///
    /// The drain is [`watched`](Self::watched) for locks it waits for.
    async fn drain_until_stopped<DB: OutboxStore, F: Future>(
        &self,
        pool: &Pool<DB>,
        wakeup: &mut Wakeup,
        signals: &Signals,
        drained: F,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
        stopped: &mut watch::Receiver<bool>,
    ) -> (F::Output, Option<Stopping>) {
        let work = self.watched(pool, wakeup.during(&signals.announced, drained));
        let mut work = pin!(work);
        let mut stopping = None;
        loop {
            tokio::select! {
                biased;
                output = &mut work => return (output, stopping),
                () = shutdown.as_mut(), if stopping.is_none() => {
                    stopping = Some(Stopping::Shutdown);
                    signals.stopping.store(true, Ordering::Relaxed);
                }
                _ = stopped.changed(), if stopping.is_none() => {
                    stopping = Some(Stopping::OtherLane);
                    signals.stopping.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    /// Runs `work` (a step that reads or writes `idem_outbox`) to its end,
    /// never cancelled, and while it runs past [`BLOCKED_CHECK`], asks
    /// every `BLOCKED_CHECK`, from another connection, whether relay
    /// statements wait for a lock (see [`Lag::blocked`](super::Lag::blocked)):
    /// a session left open after `LOCK TABLE`, `ALTER TABLE` or `VACUUM
    /// FULL` of the table stops every relay. Each session that holds such a
    /// lock is warned of once; the waits show in [`RelayStats::blocked`] and
    /// `idem_outbox_relays_blocked` until they end. The step is not given
    /// up: a finish waiting to DELETE rows it published must not leave
    /// them to be published again, perhaps past the stream's duplicate
    /// window.
    async fn watched<DB: OutboxStore, T>(
        &self,
        pool: &Pool<DB>,
        work: impl Future<Output = T>,
    ) -> T {
        let mut work = pin!(work);
        let watch = self.watch_locks(pool);
        let mut watch = pin!(watch);
        tokio::select! {
            biased;
            output = &mut work => {
                if !self.cycles.stats.blocked().is_empty() {
                    tracing::info!("outbox relay no longer waits for a lock");
                    self.cycles.stats.record_blocked(Vec::new());
                }
                output
            }
            () = &mut watch => unreachable!("the watch never ends"),
        }
    }

    /// The watch of [`watched`](Self::watched): never ends. Each look is
    /// bounded, so that a pool with no connection to spare does not hold it
    /// up (the step goes on meanwhile).
    async fn watch_locks<DB: OutboxStore>(&self, pool: &Pool<DB>) {
        let mut warned: Vec<i32> = Vec::new();
        loop {
            tokio::time::sleep(BLOCKED_CHECK).await;
            let blocked = match tokio::time::timeout(BLOCKED_CHECK, DB::relay_blocked(pool)).await {
                Ok(Ok(blocked)) => blocked,
                Ok(Err(error)) => {
                    tracing::debug!(%error, "could not ask whether the outbox relay waits for a lock");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(
                        "could not ask in time whether the outbox relay waits for a lock"
                    );
                    continue;
                }
            };
            for wait in blocked
                .iter()
                .filter(|wait| !warned.contains(&wait.holder_pid))
            {
                tracing::warn!(
                    holder_pid = wait.holder_pid,
                    "outbox relay statement {wait}: the relays publish nothing until it ends; end that transaction (or the session: pg_terminate_backend({}))",
                    wait.holder_pid
                );
            }
            warned = blocked.iter().map(|wait| wait.holder_pid).collect();
            self.cycles.stats.record_blocked(blocked);
        }
    }

    /// Whether a fresh row is pending: a look before a drain that only the
    /// poll called for. An error says yes (the drain then meets it, and
    /// backs off).
    async fn any_fresh<DB: OutboxStore>(&self, pool: &Pool<DB>) -> bool {
        self.watched(pool, DB::any_fresh(pool))
            .await
            .unwrap_or_else(|error| {
                tracing::debug!(%error, "outbox relay's look for rows failed; running a cycle");
                true
            })
    }

    /// The retry lane: a cycle whenever a failing row is due (looked for
    /// about once a second), a back-off while NATS is away.
    async fn run_retries<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
        mut stopped: watch::Receiver<bool>,
        away: &LaneAway,
    ) -> Result<(), RelayError> {
        let mut backoff = Backoff::default();
        let mut lost = LostConnections::default();
        // After a cycle that sent nothing (its rows failed again), wait
        // before the next even if more are due: rows that can never go out
        // cost at most a cycle a second, however many there are.
        let mut pause = false;
        loop {
            let wait = match backoff.current() {
                Some(wait) => wait,
                None => match DB::next_due(pool).await {
                    Ok(due) => {
                        let due = due.unwrap_or(RETRY_CHECK_EVERY).min(RETRY_CHECK_EVERY);
                        if std::mem::take(&mut pause) {
                            due.max(RETRY_CHECK_EVERY)
                        } else {
                            due
                        }
                    }
                    Err(error) => {
                        let wait = backoff.next(self.max_backoff);
                        tracing::warn!(%error, backoff_ms = wait.as_millis() as u64, "outbox relay's retry lane failed to read its rows; backing off");
                        wait
                    }
                },
            };
            if !wait.is_zero() {
                tokio::select! {
                    _ = stopped.changed() => return Ok(()),
                    () = tokio::time::sleep(wait) => {}
                }
                // A plain wait: look again for a row due.
                if backoff.current().is_none() {
                    continue;
                }
            }
            if *stopped.borrow() {
                return Ok(());
            }
            match self.cycles.one(js, pool, Lane::Retry, lost.alone()).await {
                Ok(cycle) => {
                    lost.count(&cycle);
                    self.settle(&Drain::of(&cycle), &mut backoff, away, Lane::Retry);
                    // Also after a cycle that took nothing: the rows due are
                    // another relay's, and would be looked for at once again.
                    pause = cycle.published.is_empty();
                }
                Err(RelayError::Database(error)) => {
                    let wait = backoff.next(self.max_backoff);
                    tracing::warn!(%error, backoff_ms = wait.as_millis() as u64, "outbox relay's retry cycle failed; backing off");
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// What a lane does after its cycles: back off (and say why) if the
    /// last found NATS away, else end any back-off. Returns whether it
    /// backs off.
    fn settle(&self, drained: &Drain, backoff: &mut Backoff, away: &LaneAway, lane: Lane) -> bool {
        match &drained.nats_away {
            Some(cause) => {
                let wait = backoff.next(self.max_backoff);
                tracing::warn!(
                    cause = cause.as_str(),
                    lane = lane.name(),
                    failed = drained.failed,
                    backoff_ms = wait.as_millis() as u64,
                    "outbox publishes failed and NATS seems away; the rows stay as they are (their failures are not recorded on them) and the relay backs off, reading its notifications meanwhile"
                );
                away.set(lane, true);
                true
            }
            None => {
                if backoff.current().is_some() {
                    tracing::info!(lane = lane.name(), "outbox relay resumes");
                }
                backoff.reset();
                away.set(lane, false);
                false
            }
        }
    }

    /// The cycles a stopping relay runs, so that a router's relay publishes
    /// what its last handlers queued (see [`Relay::run_until`]).
    async fn final_cycles<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
        sessions: &mut Sessions<DB::Relay>,
        lost: &mut LostConnections,
    ) -> Result<(), RelayError> {
        let signals = Signals::default();
        let drained = drain(
            &self.cycles,
            js,
            pool,
            sessions,
            lost,
            &signals,
            FINAL_CYCLES,
        )
        .await;
        sessions.release();
        match drained {
            Ok(drained) => {
                if let Some(cause) = drained.nats_away {
                    tracing::warn!(
                        cause,
                        failed = drained.failed,
                        "outbox publishes failed while stopping and NATS seems away; the rows stay pending for the next relay"
                    );
                }
                Ok(())
            }
            Err(RelayError::Database(error)) => {
                tracing::warn!(%error, "outbox relay cycle failed while stopping; its rows stay pending for the next relay");
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Reads the outbox's lag into the stats and the metrics, and traces
    /// it: at info when a row has waited longer than a poll interval (the
    /// relays are behind, or cannot publish) or some rows are failing, at
    /// debug otherwise. Returns whether the NOTIFY trigger is enabled, if
    /// that could be read.
    async fn read_lag<DB: OutboxStore>(&self, pool: &Pool<DB>) -> Option<bool> {
        match self.watched(pool, lag_and_notify(pool)).await {
            Ok((lag, notify)) => {
                super::lag::record_gauges(&lag);
                let oldest_ms = lag.oldest.as_millis() as u64;
                if lag.oldest >= self.poll_interval || lag.failing > 0 {
                    tracing::info!(
                        pending = lag.pending,
                        oldest_ms,
                        failing = lag.failing,
                        "outbox lag"
                    );
                } else {
                    tracing::debug!(pending = lag.pending, oldest_ms, "outbox lag");
                }
                self.cycles.stats.record_lag(lag);
                Some(notify)
            }
            Err(error) => {
                tracing::debug!(%error, "outbox lag unreadable");
                None
            }
        }
    }

    /// One cycle of the fresh lane: takes up to `batch_size` rows that never
    /// failed, in id order (as many as fit in `max_cycle_bytes`, at least
    /// one), publishes them, and in one transaction deletes those JetStream
    /// acknowledged and records the failures NATS answered for (see the
    /// [module docs](super)).
    pub async fn relay_batch<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
    ) -> Result<Cycle, RelayError> {
        self.cycles.one(js, pool, Lane::Fresh, false).await
    }

    /// One cycle of the retry lane: as [`relay_batch`](Self::relay_batch),
    /// for failing rows that are due, the earliest due first.
    pub async fn retry_batch<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
    ) -> Result<Cycle, RelayError> {
        self.cycles.one(js, pool, Lane::Retry, false).await
    }

    /// Publishes the fresh rows pending, as the fresh lane of a running
    /// relay does: cycle after cycle, each next one taken while the one
    /// before it awaits its PubAcks (on a second connection), until a cycle
    /// is not full, finds NATS away, or leaves rows pending that failed
    /// through no fault of theirs. Returns what the cycles did.
    ///
    /// ```no_run
    /// # async fn f(js: async_nats::jetstream::Context, pool: sqlx::PgPool) -> Result<(), idem_runtime::outbox::RelayError> {
    /// let drained = idem_runtime::outbox::Relay::new().drain(&js, &pool).await?;
    /// println!("{} published in {} cycles", drained.published, drained.cycles);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn drain<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
    ) -> Result<Drain, RelayError> {
        let mut lost = LostConnections::default();
        drain(
            &self.cycles,
            js,
            pool,
            &mut Sessions::default(),
            &mut lost,
            &Signals::default(),
            usize::MAX,
        )
        .await
    }
}

/// Whether each lane last found NATS away, for the metric: it reads 1
/// while either does.
#[derive(Debug, Default)]
struct LaneAway {
    fresh: AtomicBool,
    retry: AtomicBool,
}

impl LaneAway {
    fn set(&self, lane: Lane, away: bool) {
        let flag = match lane {
            Lane::Fresh => &self.fresh,
            Lane::Retry => &self.retry,
        };
        if flag.swap(away, Ordering::Relaxed) != away {
            let either = self.fresh.load(Ordering::Relaxed) || self.retry.load(Ordering::Relaxed);
            crate::observe::metrics::outbox_nats_unreachable(either);
        }
    }
}
