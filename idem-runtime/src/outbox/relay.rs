//! The relay: cycles that publish committed outbox rows and delete those
//! JetStream acknowledged, run in two lanes so that no row, and no outage,
//! stops the others.
//!
//! # A cycle, step by step
//!
//! One transaction each ([`Relay::relay_batch`], [`Relay::retry_batch`]):
//!
//! 1. **Take** up to `batch_size` rows with `FOR UPDATE SKIP LOCKED` (so
//!    relays never take the same row), and of those the longest prefix that
//!    fits in `max_cycle_bytes` (always the first row): the fresh lane takes
//!    rows that never failed in id order, the retry lane failing rows that
//!    are due, the earliest due first.
//! 2. **Publish** them all, in id order, before awaiting the first PubAck.
//!    A row the client refuses, or would panic on (above `max_payload`, an
//!    invalid subject, a header it cannot encode), fails at once; a publish
//!    the client cannot queue (it is disconnected, its buffer full) leaves
//!    it and the rest of the cycle untouched, since each further send would
//!    wait out its own timeout.
//! 3. **Await the PubAcks**, each up to the client's timeout; but once one
//!    has come back, those still missing a second later (or as long as the
//!    last took, if longer) are given up on: a publish the server refused
//!    for want of permission never gets an answer, and must not hold up the
//!    rows that went through. Once the client has connected again, those
//!    of the lost connection are given up on too.
//! 4. **Blame or not.** A row the client refused is the row's fault. For
//!    the others:
//!    - if the client could not queue a publish, or the connection was
//!      lost while they were out, what did not come back is not the rows'
//!      fault (an answer that did come, such as "no stream", still is,
//!      unless nothing went out);
//!    - else, if nothing went out, ask JetStream whether it answers at all
//!      ([`nats_answers`]); if it does not, NATS is away and nothing is
//!      recorded;
//!    - else each failed row gets `attempts + 1`, its `last_error` and its
//!      own `not_before`.
//!
//!    A lane that lost the connection in two cycles in a row publishes one
//!    row per cycle until one goes through ([`LostConnections`]): a row
//!    over which the server drops the connection then loses it alone, and
//!    is blamed if JetStream answers right after.
//! 5. **DELETE** the acknowledged rows, record the failures, COMMIT.
//!
//! # The lanes
//!
//! [`Relay::run_until`] runs both at once, each with its own transaction
//! (a relay holds up to three connections: the LISTEN one and one per
//! lane).
//!
//! - **Fresh rows**, woken by notifications or the poll (see `wake.rs`),
//!   cycle after cycle while a cycle took all it could or notifications
//!   came during it (read while it runs).
//! - **Failing rows**, once due: the lane looks for the first due row about
//!   once a second. A retry that waits out a PubAck timeout holds up only
//!   other failing rows, and after a retry cycle that sent nothing the lane
//!   waits a second, so rows that can never go out cost at most a cycle a
//!   second.
//!
//! Either lane backs off, from 100 ms doubling up to `max_backoff`, while
//! NATS is away or the database fails, and the fresh lane reads (and
//! discards) its notifications meanwhile.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
#[cfg(feature = "fault-injection")]
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

use super::lag::lag;
use super::stats::{Cycle, Published, RelayStats};
use super::wake::{Poll, Wakeup};
use super::{MAX_SUBJECT_LEN, check_subject, message_headers};

/// Rows that never failed, in id order; of those, as many as fit in
/// `$2` bytes (always the first). `locked` is how many the take locked.
const TAKE_FRESH_SQL: &str = "\
WITH taken AS (
    SELECT id, octet_length(payload)::int8 + coalesce(pg_column_size(headers), 0)::int8 AS bytes
      FROM idem_outbox WHERE not_before IS NULL
     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED),
sized AS (
    SELECT id, sum(bytes) OVER (ORDER BY id) AS running, row_number() OVER (ORDER BY id) AS n,
           count(*) OVER () AS locked
      FROM taken)
SELECT o.id, o.msg_id, o.subject, o.payload, o.headers::text, o.attempts, s.locked
  FROM sized s JOIN idem_outbox o ON o.id = s.id
 WHERE s.n = 1 OR s.running <= $2
 ORDER BY o.id";

/// Failing rows that are due, the earliest due first, within `$2` bytes as
/// above; published in id order.
const TAKE_DUE_SQL: &str = "\
WITH taken AS (
    SELECT id, not_before, octet_length(payload)::int8 + coalesce(pg_column_size(headers), 0)::int8 AS bytes
      FROM idem_outbox WHERE not_before <= clock_timestamp()
     ORDER BY not_before, id LIMIT $1 FOR UPDATE SKIP LOCKED),
sized AS (
    SELECT id, sum(bytes) OVER (ORDER BY not_before, id) AS running,
           row_number() OVER (ORDER BY not_before, id) AS n, count(*) OVER () AS locked
      FROM taken)
SELECT o.id, o.msg_id, o.subject, o.payload, o.headers::text, o.attempts, s.locked
  FROM sized s JOIN idem_outbox o ON o.id = s.id
 WHERE s.n = 1 OR s.running <= $2
 ORDER BY o.id";

const DELETE_SQL: &str = "DELETE FROM idem_outbox WHERE id = ANY($1)";

/// Records failures: each row's error and back-off (seconds).
const MARK_SQL: &str = "\
UPDATE idem_outbox o
   SET attempts = o.attempts + 1, last_error = f.error, failed_at = clock_timestamp(),
       not_before = clock_timestamp() + f.backoff * interval '1 second'
  FROM unnest($1::int8[], $2::text[], $3::float8[]) AS f(id, error, backoff)
 WHERE o.id = f.id";

/// How long until the first failing row is due (negative: it is).
const NEXT_DUE_SQL: &str = "\
SELECT extract(epoch FROM min(not_before) - clock_timestamp())::float8
  FROM idem_outbox WHERE not_before IS NOT NULL";

type Row = (i64, String, String, Vec<u8>, Option<String>, i32, i64);

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
/// failures of the others, and COMMIT. While NATS is away the rows stay as
/// they are and the relay backs off (from 100 ms, doubling, up to
/// `max_backoff`). A row that fails while NATS answers (no stream stores its
/// subject, it is too big, the relay may not publish to its subject) waits
/// out a back-off of its own (from 1 s, doubling, up to `max_row_backoff`)
/// and is retried apart from the fresh rows, which go on meanwhile. A relay
/// that dies between the PubAck and its COMMIT leaves the rows pending, and
/// the next cycle publishes them again with the same ids: JetStream drops
/// them within its duplicate window, downstream dedup after it.
///
/// It wakes when a handler of its process has committed a transaction that
/// queued messages (see [`wake_local_relays`](super::wake_local_relays)),
/// and polls: every `min_poll_interval` (10 ms) while polls find rows,
/// doubling while they find none, up to `poll_interval` (1 s). The poll is
/// what a relay in another process than the handlers runs on, and what finds
/// rows whose wake-up was lost. Where the NOTIFY trigger is enabled again
/// (opt-in, see the guide), each notification wakes it too.
#[derive(Clone)]
pub struct Relay {
    batch_size: usize,
    max_cycle_bytes: usize,
    min_poll_interval: Duration,
    poll_interval: Duration,
    max_backoff: Duration,
    max_row_backoff: Duration,
    stats: RelayStats,
    #[cfg(feature = "fault-injection")]
    after_pubacks: Option<Arc<AfterPubAcksHook>>,
}

#[cfg(feature = "fault-injection")]
type AfterPubAcksHook = dyn Fn(&[Published]) -> crate::fault::AfterPubAcks + Send + Sync;

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("max_cycle_bytes", &self.max_cycle_bytes)
            .field("min_poll_interval", &self.min_poll_interval)
            .field("poll_interval", &self.poll_interval)
            .field("max_backoff", &self.max_backoff)
            .field("max_row_backoff", &self.max_row_backoff)
            .finish_non_exhaustive()
    }
}

impl Default for Relay {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A fault hook made the relay die after the PubAcks, before its DELETE
    /// (feature `fault-injection`).
    #[error("the relay was crashed by a fault hook after {0} PubAcks, before deleting its rows")]
    InjectedCrash(usize),
    /// The outbox could not be read or written.
    #[error("the outbox relay's database work failed: {0}")]
    Database(#[from] sqlx::Error),
}

/// A cycle's `idle_in_transaction_session_timeout` (see
/// [`Relay::cycle`](Relay)): far above a cycle's longest pause (its
/// PubAcks' timeout, 5 s by default, and a 2 s probe of JetStream), so that
/// only a cycle whose process or network is gone reaches it; its rows are
/// then released to the other relays, and to this one's next cycle.
const CYCLE_SERVER_TIMEOUT_SETTING: &str = "60s";

/// The first wait of a lane's back-off.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// A failing row's first back-off; it doubles with each failure.
const FIRST_ROW_BACKOFF: Duration = Duration::from_secs(1);

/// How long the PubAcks still missing are waited for after the last
/// answer (or as long as that answer took, if longer).
const STRAGGLER_GRACE: Duration = Duration::from_secs(1);

/// How long [`nats_answers`] waits for JetStream's account info.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the retry lane looks for a failing row that is due.
const RETRY_CHECK_EVERY: Duration = Duration::from_secs(1);

/// The longest `last_error` recorded on a row.
const MAX_ERROR_LEN: usize = 1024;

/// The shortest time between two readings of the [`lag`] by a relay (a
/// `count(*)` of the outbox), however short its poll interval.
const LAG_READ_EVERY: Duration = Duration::from_secs(1);

/// The most cycles a relay runs after it is told to stop (see
/// [`Relay::run_until`]): a stop is not held up by a long backlog.
pub const FINAL_CYCLES: usize = 8;

/// Which rows a cycle takes.
#[derive(Debug, Clone, Copy)]
enum Lane {
    /// Rows that never failed.
    Fresh,
    /// Failing rows that are due.
    Retry,
}

/// A row taken, while its publish is out.
struct Taken {
    id: i64,
    msg_id: String,
    subject: String,
    attempts: i32,
}

/// What a cycle's publishing left ([`Relay::send_rows`]).
struct Sends {
    /// Rows the client refused, or would panic on, each with why: the
    /// row's own fault, whatever NATS does.
    refused: Vec<(Taken, String)>,
    /// Why a publish could not be queued, if one could not: the rows from
    /// it on were not sent.
    unsent: Option<String>,
    /// The rows sent, with their PubAcks to come.
    in_flight: Vec<(Taken, PublishAckFuture)>,
}

/// A cycle's failed rows, each with why, by who answered for it; what
/// [`Relay::blame`] leaves of them is recorded on the rows.
struct Failed {
    /// Refused by the client (or it would panic).
    refused: Vec<(Taken, String)>,
    /// Failures the server answered for (no stream, a JetStream error).
    answered: Vec<(Taken, String)>,
    /// Failures it did not answer for (no PubAck in time, given up on).
    unanswered: Vec<(Taken, String)>,
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
            batch_size: 1024,
            max_cycle_bytes: 8 * 1024 * 1024,
            min_poll_interval: Duration::from_millis(10),
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(5),
            max_row_backoff: Duration::from_secs(60),
            stats: RelayStats::default(),
            #[cfg(feature = "fault-injection")]
            after_pubacks: None,
        }
    }

    /// Rows per cycle (default 1024, at least 1): all published before the
    /// first PubAck is awaited, and held locked until the cycle commits.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// The most payload and header bytes a cycle takes (default 8 MiB),
    /// which bounds the relay's memory: a cycle takes rows while they fit,
    /// and always at least one, however big.
    pub fn max_cycle_bytes(mut self, bytes: usize) -> Self {
        self.max_cycle_bytes = bytes.max(1);
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
        self.max_row_backoff = backoff.max(FIRST_ROW_BACKOFF);
        self
    }

    /// This relay's counters (shared with its clones).
    pub fn stats(&self) -> RelayStats {
        self.stats.clone()
    }

    /// Calls `hook` with each cycle's acknowledged messages, before the
    /// DELETE: [`AfterPubAcks::Crash`](crate::fault::AfterPubAcks::Crash)
    /// ends the relay as if its process died there.
    #[cfg(feature = "fault-injection")]
    pub fn fault_after_pubacks(
        mut self,
        hook: impl Fn(&[Published]) -> crate::fault::AfterPubAcks + Send + Sync + 'static,
    ) -> Self {
        self.after_pubacks = Some(Arc::new(hook));
        self
    }

    /// Runs both lanes until `shutdown` completes (checked between cycles
    /// and while waiting, never during a cycle), or a cycle dies. Database
    /// errors are logged and retried after a back-off.
    ///
    /// When `shutdown` completes, the relay first publishes what is pending
    /// then, in up to [`FINAL_CYCLES`] more cycles of fresh rows, and stops
    /// early at the first cycle that is not full or finds NATS away: those
    /// rows stay for the next relay. The retry lane ends its cycle and
    /// stops.
    pub async fn run_until(
        self,
        nats: async_nats::Client,
        pool: PgPool,
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

    /// The fresh lane: a wake-up, then cycles while they take all they
    /// can, then a wait; a back-off instead while NATS is away.
    async fn run_fresh(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
        shutdown: impl Future<Output = ()>,
        mut stopped: watch::Receiver<bool>,
        away: &LaneAway,
    ) -> Result<(), RelayError> {
        let mut shutdown = pin!(shutdown);
        let mut wakeup = Wakeup::new(self.stats.clone());
        let mut backoff = Backoff::default();
        let mut lost = LostConnections::default();
        let mut poll = Poll::new(self.min_poll_interval, self.poll_interval);
        let mut lag_read: Option<Instant> = None;
        loop {
            // About once per poll interval, whether woken by notifications
            // or by the poll: a relay kept busy by notifications still
            // reports how far behind it is.
            if lag_read.is_none_or(|at| at.elapsed() >= self.poll_interval.max(LAG_READ_EVERY)) {
                self.read_lag(pool).await;
                lag_read = Some(Instant::now());
            }
            wakeup.listen(pool).await;
            loop {
                if shutdown.as_mut().now_or_never().is_some() {
                    return self.final_cycles(js, pool).await;
                }
                if *stopped.borrow() {
                    return Ok(());
                }
                let (cycle, notified) = wakeup
                    .during(self.cycle(js, pool, Lane::Fresh, lost.alone()))
                    .await;
                match cycle {
                    Ok(cycle) => {
                        lost.count(&cycle);
                        poll.after(cycle.taken > 0);
                        // Notified meanwhile: rows may have committed after
                        // this cycle took its own.
                        let again = cycle.more || notified;
                        if self.settle(&cycle, &mut backoff, away, Lane::Fresh) || !again {
                            break;
                        }
                    }
                    Err(RelayError::Database(error)) => {
                        let wait = backoff.next(self.max_backoff);
                        tracing::warn!(%error, backoff_ms = wait.as_millis() as u64, "outbox relay cycle failed; backing off");
                        break;
                    }
                    Err(error) => return Err(error),
                }
            }
            // A back-off reads and discards notifications; otherwise the
            // first one ends the wait (see `wake.rs`).
            let (wait, early) = match backoff.current() {
                Some(wait) => (wait, false),
                None => (poll.wait(), true),
            };
            tokio::select! {
                () = &mut shutdown => return self.final_cycles(js, pool).await,
                _ = stopped.changed() => return Ok(()),
                _ = wakeup.wait(wait, early) => {}
            }
        }
    }

    /// The retry lane: a cycle whenever a failing row is due (looked for
    /// about once a second), a back-off while NATS is away.
    async fn run_retries(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
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
                None => match next_due(pool).await {
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
            match self.cycle(js, pool, Lane::Retry, lost.alone()).await {
                Ok(cycle) => {
                    lost.count(&cycle);
                    self.settle(&cycle, &mut backoff, away, Lane::Retry);
                    pause = cycle.taken > 0 && cycle.published.is_empty();
                }
                Err(RelayError::Database(error)) => {
                    let wait = backoff.next(self.max_backoff);
                    tracing::warn!(%error, backoff_ms = wait.as_millis() as u64, "outbox relay's retry cycle failed; backing off");
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// What a lane does after a cycle: back off (and say why) if it found
    /// NATS away, else end any back-off. Returns whether it backs off.
    fn settle(&self, cycle: &Cycle, backoff: &mut Backoff, away: &LaneAway, lane: Lane) -> bool {
        match &cycle.nats_away {
            Some(cause) => {
                let wait = backoff.next(self.max_backoff);
                tracing::warn!(
                    cause = cause.as_str(),
                    lane = lane.name(),
                    failed = cycle.failed,
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
    async fn final_cycles(&self, js: &jetstream::Context, pool: &PgPool) -> Result<(), RelayError> {
        for _ in 0..FINAL_CYCLES {
            match self.relay_batch(js, pool).await {
                Ok(cycle) if cycle.nats_away.is_none() && cycle.more => {}
                Ok(cycle) => {
                    if let Some(cause) = cycle.nats_away {
                        tracing::warn!(
                            cause,
                            failed = cycle.failed,
                            "outbox publishes failed while stopping and NATS seems away; the rows stay pending for the next relay"
                        );
                    }
                    return Ok(());
                }
                Err(RelayError::Database(error)) => {
                    tracing::warn!(%error, "outbox relay cycle failed while stopping; its rows stay pending for the next relay");
                    return Ok(());
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Reads the outbox's lag into the stats and the metrics, and traces
    /// it: at info when a row has waited longer than a poll interval (the
    /// relays are behind, or cannot publish) or some rows are failing, at
    /// debug otherwise.
    async fn read_lag(&self, pool: &PgPool) {
        match lag(pool).await {
            Ok(lag) => {
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
                self.stats.record_lag(lag);
            }
            Err(error) => tracing::debug!(%error, "outbox lag unreadable"),
        }
    }

    /// One cycle of the fresh lane: takes up to `batch_size` rows that never
    /// failed, in id order (as many as fit in `max_cycle_bytes`, at least
    /// one), publishes them, and in one transaction deletes those JetStream
    /// acknowledged and records the failures NATS answered for (see the
    /// [module docs](super)).
    pub async fn relay_batch(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
    ) -> Result<Cycle, RelayError> {
        self.cycle(js, pool, Lane::Fresh, false).await
    }

    /// One cycle of the retry lane: as [`relay_batch`](Self::relay_batch),
    /// for failing rows that are due, the earliest due first.
    pub async fn retry_batch(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
    ) -> Result<Cycle, RelayError> {
        self.cycle(js, pool, Lane::Retry, false).await
    }

    /// One cycle of `lane` (see the module docs); `alone` takes a single
    /// row, to find one over which the server drops the connection
    /// ([`LostConnections`]).
    ///
    /// The module docs' five steps in order, in one transaction: BEGIN and
    /// COMMIT stay here, so that the steps in between are all a reader has
    /// to look up.
    async fn cycle(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
        lane: Lane,
        alone: bool,
    ) -> Result<Cycle, RelayError> {
        let limit = if alone { 1 } else { self.batch_size };
        let mut tx = pool.begin().await?;
        let rows = self.take(&mut tx, lane, limit).await?;
        let Some(&(.., locked)) = rows.first() else {
            tx.commit().await?;
            self.stats.empty_cycle();
            return Ok(Cycle::default());
        };
        let locked = usize::try_from(locked).unwrap_or(usize::MAX);
        let mut cycle = Cycle {
            taken: rows.len(),
            more: locked >= limit || rows.len() < locked,
            ..Cycle::default()
        };
        let statistics = js.client().statistics();
        let connects = statistics.connects.load(Ordering::Relaxed);

        let Sends {
            refused,
            unsent,
            in_flight,
        } = Self::send_rows(js, rows, &mut cycle).await;
        let acks = await_acks(in_flight, || {
            statistics.connects.load(Ordering::Relaxed) != connects
        })
        .await;
        let (sent, mut failed) = Self::sort_acks(acks, refused, &mut cycle);
        cycle.failed += failed.refused.len() + failed.answered.len() + failed.unanswered.len();
        cycle.reconnected = statistics.connects.load(Ordering::Relaxed) != connects;
        let away = Self::blame(js, &cycle, alone, unsent, &mut failed).await;

        #[cfg(feature = "fault-injection")]
        if let Some(hook) = &self.after_pubacks
            && hook(&cycle.published) == crate::fault::AfterPubAcks::Crash
        {
            // As a dead process's connection would: its locks go now. (A
            // dropped transaction's ROLLBACK waits in its pooled connection
            // until that is used again, and the rows stay locked meanwhile.)
            tx.rollback().await?;
            return Err(RelayError::InjectedCrash(cycle.published.len()));
        }
        let marked = self.record(&mut tx, sent, failed).await?;
        tx.commit().await?;
        cycle.failing = marked.len();
        cycle.nats_away = away;
        self.warn_failing(&marked, lane);
        self.report(&cycle, lane);
        Ok(cycle)
    }

    /// Step 1, take: bounds the cycle's transaction on the server, then
    /// locks up to `limit` of `lane`'s rows (as many as fit in
    /// `max_cycle_bytes`, at least one). Each row also says how many the
    /// take locked.
    async fn take(
        &self,
        tx: &mut PgConnection,
        lane: Lane,
        limit: usize,
    ) -> Result<Vec<Row>, RelayError> {
        // Bounded on the server: a cycle whose process froze, or whose
        // network went away without a reset, must not keep its rows locked
        // (every relay skips them) until TCP keepalive gives up, hours
        // later. A cycle is idle in its transaction only while it waits for
        // PubAcks, which time out far sooner. (No statement_timeout: it
        // would also cut a COMMIT waiting for a synchronous standby.)
        sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
            .bind(CYCLE_SERVER_TIMEOUT_SETTING)
            .execute(&mut *tx)
            .await?;
        let rows: Vec<Row> = sqlx::query_as(lane.take_sql())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(i64::try_from(self.max_cycle_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        Ok(rows)
    }

    /// Step 2, publish: sends every row, in id order, before any PubAck is
    /// awaited. A row the client refuses, or would panic on, fails at once;
    /// once a publish cannot be queued, the rest of the cycle is left as it
    /// is (counted as failed in `cycle`), since each further send would
    /// wait out its own timeout.
    async fn send_rows(js: &jetstream::Context, rows: Vec<Row>, cycle: &mut Cycle) -> Sends {
        // Refused by the client (or it would panic): the row's own fault,
        // whatever NATS does.
        let mut refused: Vec<(Taken, String)> = Vec::new();
        let mut unsent: Option<String> = None;
        let mut in_flight = Vec::with_capacity(rows.len());
        let taken = rows.len();
        for (sent, (id, msg_id, subject, payload, headers, attempts, _)) in
            rows.into_iter().enumerate()
        {
            let row = Taken {
                id,
                msg_id,
                subject,
                attempts,
            };
            if check_subject(&row.subject).is_err() {
                refused.push((row, format!("not a valid publish subject (empty, a wildcard, whitespace, or longer than {MAX_SUBJECT_LEN} bytes): it can never be published; delete the row")));
                continue;
            }
            let headers = match message_headers(headers, &row.msg_id) {
                Ok(headers) => headers,
                Err(why) => {
                    refused.push((row, why));
                    continue;
                }
            };
            let publish = PublishMessage::build()
                .payload(Bytes::from(payload))
                .headers(headers);
            match js.send_publish(row.subject.clone(), publish).await {
                Ok(ack) => in_flight.push((row, ack)),
                Err(error) if error.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    refused.push((row, reason(&error)));
                }
                Err(error) => {
                    // The client could not queue it: each further send would
                    // wait out its own timeout, so the rest stay as they are.
                    tracing::warn!(%error, msg_id = row.msg_id, subject = row.subject, "outbox publish not sent; the rest of the cycle waits for the next");
                    cycle.failed += taken - sent;
                    unsent = Some(format!(
                        "the NATS client could not queue a publish: {error}"
                    ));
                    break;
                }
            }
        }
        Sends {
            refused,
            unsent,
            in_flight,
        }
    }

    /// Step 3's PubAcks, sorted: the ids of the rows JetStream acknowledged
    /// (each recorded in `cycle` as published), and the failures, with the
    /// rows the client `refused`.
    fn sort_acks(
        acks: Acks,
        refused: Vec<(Taken, String)>,
        cycle: &mut Cycle,
    ) -> (Vec<i64>, Failed) {
        let mut sent = Vec::with_capacity(acks.answered.len());
        let mut answered: Vec<(Taken, String)> = Vec::new();
        let mut unanswered: Vec<(Taken, String)> = Vec::new();
        for (row, ack) in acks.answered {
            match ack {
                Ok(ack) => {
                    sent.push(row.id);
                    cycle.published.push(Published {
                        msg_id: row.msg_id,
                        subject: row.subject,
                        stream_sequence: ack.sequence,
                        duplicate: ack.duplicate,
                    });
                }
                Err(error) => {
                    let why = reason(&error);
                    match error.kind() {
                        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                            unanswered.push((row, why));
                        }
                        _ => answered.push((row, why)),
                    }
                }
            }
        }
        unanswered.extend(acks.stragglers.into_iter().map(|row| {
            (row, "no PubAck while others of its cycle came back: the relay's NATS user may lack permission to publish to this subject (the server drops a refused publish without an answer), or its stream is slow or has no leader".to_owned())
        }));
        let failed = Failed {
            refused,
            answered,
            unanswered,
        };
        (sent, failed)
    }

    /// Step 4, whose fault (see the module docs): drops from `failed` what
    /// is not the rows' doing, so that it is not recorded on them, and
    /// returns why NATS is away, if it is. `unsent` is why a publish could
    /// not be queued, if one could not.
    async fn blame(
        js: &jetstream::Context,
        cycle: &Cycle,
        alone: bool,
        unsent: Option<String>,
        failed: &mut Failed,
    ) -> Option<String> {
        let Failed {
            answered,
            unanswered,
            ..
        } = failed;
        let published = !cycle.published.is_empty();
        let failures = !answered.is_empty() || !unanswered.is_empty();
        let mut away = None;
        if let Some(cause) = unsent {
            // The client is clogged or cut off: what did not come back may
            // be its doing.
            away = Some(cause);
            unanswered.clear();
            if !published {
                answered.clear();
            }
        } else if cycle.reconnected && failures {
            // The connection was lost while these were out: what did not
            // come back is NATS's doing, unless this row was published
            // alone after earlier cycles lost it too, and JetStream answers
            // at once after: then the server dropped the connection over
            // this row (a protocol line it would not take, say).
            let answers = nats_answers(js).await;
            if alone && answers.is_ok() {
                for (_, why) in unanswered.iter_mut() {
                    *why = "the NATS connection was lost each time this row was published, alone too, and JetStream answered at once after: the server may refuse it (a subject or header too long for it); fix or delete the row".to_owned();
                }
            } else {
                unanswered.clear();
                if !published {
                    answered.clear();
                    away = Some(match answers {
                        Ok(()) => "the NATS connection was lost during the cycle".to_owned(),
                        Err(cause) => cause,
                    });
                }
            }
        } else if !published && failures {
            match probe(js).await {
                Probe::Answers => {}
                // Connected, but JetStream's account info went unanswered,
                // while the server did answer for some of these rows (no
                // stream, say): a NATS user that may not request
                // `$JS.API.INFO` looks like this, and taking the rows'
                // answers for an outage would retake the same head rows for
                // ever. The rows keep their failures; the relay says why it
                // cannot tell.
                Probe::Unanswered(cause) if !answered.is_empty() => {
                    // Only what the server answered for is the rows' own
                    // fault; what timed out stays as it is.
                    unanswered.clear();
                    tracing::warn!(
                        cause,
                        "JetStream did not answer the relay's probe, though it answered for the rows that failed: their failures are recorded on them, as when NATS answers. Allow the relay's NATS user to request $JS.API.INFO, so that the relay can tell NATS being away from rows that fail"
                    );
                }
                Probe::Away(cause) | Probe::Unanswered(cause) => {
                    away = Some(cause);
                    answered.clear();
                    unanswered.clear();
                }
            }
        }
        away
    }

    /// Step 5, up to the COMMIT: deletes the rows JetStream acknowledged
    /// (`sent`), and records each failure on its row with its own back-off.
    /// Returns the failures recorded.
    async fn record(
        &self,
        tx: &mut PgConnection,
        sent: Vec<i64>,
        failed: Failed,
    ) -> Result<Vec<(Taken, String)>, RelayError> {
        if !sent.is_empty() {
            sqlx::query(DELETE_SQL)
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
        }
        let mut marked = failed.refused;
        marked.extend(failed.answered);
        marked.extend(failed.unanswered);
        if !marked.is_empty() {
            let ids: Vec<i64> = marked.iter().map(|(row, _)| row.id).collect();
            let errors: Vec<&str> = marked.iter().map(|(_, why)| why.as_str()).collect();
            let backoffs: Vec<f64> = marked
                .iter()
                .map(|(row, _)| self.row_backoff(row.attempts).as_secs_f64())
                .collect();
            sqlx::query(MARK_SQL)
                .bind(&ids)
                .bind(&errors)
                .bind(&backoffs)
                .execute(&mut *tx)
                .await?;
        }
        Ok(marked)
    }

    /// Counts a committed cycle into the stats and the metrics, and traces
    /// it.
    fn report(&self, cycle: &Cycle, lane: Lane) {
        let duplicates = cycle.published.iter().filter(|p| p.duplicate).count();
        self.stats.record_cycle(cycle, duplicates);
        tracing::debug!(
            lane = lane.name(),
            taken = cycle.taken,
            published = cycle.published.len(),
            duplicates,
            failed = cycle.failed,
            failing = cycle.failing,
            reconnected = cycle.reconnected,
            "outbox cycle"
        );
    }

    /// A failing row's next wait, after `attempts` earlier failures.
    fn row_backoff(&self, attempts: i32) -> Duration {
        let doublings = attempts.clamp(0, 20) as u32;
        FIRST_ROW_BACKOFF
            .saturating_mul(1 << doublings)
            .min(self.max_row_backoff)
    }

    /// One warning per subject and error of the rows a cycle recorded as
    /// failing, naming both.
    fn warn_failing(&self, marked: &[(Taken, String)], lane: Lane) {
        let mut groups: BTreeMap<(&str, &str), (usize, i32)> = BTreeMap::new();
        for (row, why) in marked {
            let group = groups
                .entry((row.subject.as_str(), why.as_str()))
                .or_default();
            group.0 += 1;
            group.1 = group.1.max(row.attempts + 1);
        }
        for ((subject, error), (rows, attempts)) in groups {
            let retry_in_ms = self.row_backoff(attempts - 1).as_millis() as u64;
            tracing::warn!(
                subject,
                error,
                rows,
                attempts,
                retry_in_ms,
                lane = lane.name(),
                "outbox rows failed to publish; each is retried after its own back-off, and the rows after them go on (`idem outbox retry` once the cause is fixed)"
            );
        }
    }
}

impl Lane {
    fn take_sql(self) -> &'static str {
        match self {
            Lane::Fresh => TAKE_FRESH_SQL,
            Lane::Retry => TAKE_DUE_SQL,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Lane::Fresh => "fresh",
            Lane::Retry => "retry",
        }
    }
}

/// Cycles in a row of one lane that lost the NATS connection while their
/// publishes were out. After two, the lane publishes one row per cycle
/// until one goes through: if a row makes the server drop the connection,
/// it is then found alone, and blamed (see `Relay::blame`), instead of
/// cutting the relay off at every cycle.
#[derive(Debug, Default)]
struct LostConnections(u32);

impl LostConnections {
    const BEFORE_ALONE: u32 = 2;

    fn alone(&self) -> bool {
        self.0 >= Self::BEFORE_ALONE
    }

    fn count(&mut self, cycle: &Cycle) {
        if cycle.reconnected && cycle.failing == 0 {
            self.0 += 1;
        } else if cycle.taken > 0 {
            self.0 = 0;
        }
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

/// How long until the first failing row is due (zero if one is); `None`
/// when no row is failing.
async fn next_due(pool: &PgPool) -> Result<Option<Duration>, sqlx::Error> {
    let due: Option<f64> = sqlx::query_scalar(NEXT_DUE_SQL).fetch_one(pool).await?;
    Ok(due.map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)))
}

/// What [`await_acks`] found.
struct Acks {
    /// Rows whose PubAck (or error) came back.
    answered: Vec<(Taken, Result<PublishAck, PublishError>)>,
    /// Rows given up on: unanswered once others had come back, or the
    /// connection was re-established meanwhile.
    stragglers: Vec<Taken>,
}

/// How often [`await_acks`] looks whether the connection was
/// re-established.
const RECONNECT_CHECK_EVERY: Duration = Duration::from_millis(100);

/// Awaits the PubAcks of a cycle's publishes. Each waits up to the
/// client's timeout, but the rest are given up on
///
/// - once a publish has been acknowledged and the others are still
///   unanswered [`STRAGGLER_GRACE`] after the last acknowledgement (or as
///   long as it took, if longer): NATS is up, and they are not coming (a
///   publish refused for want of permission gets no answer);
/// - once the client has connected again (`reconnected`): the PubAcks of
///   the lost connection are not coming either.
async fn await_acks(
    in_flight: Vec<(Taken, PublishAckFuture)>,
    reconnected: impl Fn() -> bool,
) -> Acks {
    let started = tokio::time::Instant::now();
    let (rows, acks): (Vec<Taken>, Vec<PublishAckFuture>) = in_flight.into_iter().unzip();
    let mut results: Vec<Option<Result<PublishAck, PublishError>>> =
        rows.iter().map(|_| None).collect();
    let mut pending: FuturesUnordered<_> = acks
        .into_iter()
        .enumerate()
        .map(|(i, ack)| async move { (i, ack.await) })
        .collect();
    let mut give_up_at: Option<tokio::time::Instant> = None;
    // Racing the PubAcks (not a transaction) with a timer is safe: a
    // PubAck given up on only leaves its row pending.
    while !pending.is_empty() && !reconnected() {
        let check = tokio::time::Instant::now() + RECONNECT_CHECK_EVERY;
        let until = give_up_at.map_or(check, |at| at.min(check));
        match tokio::time::timeout_at(until, pending.next()).await {
            Ok(Some((i, ack))) => {
                if ack.is_ok() {
                    give_up_at =
                        Some(tokio::time::Instant::now() + started.elapsed().max(STRAGGLER_GRACE));
                }
                results[i] = Some(ack);
            }
            Ok(None) => break,
            Err(_) if give_up_at.is_some_and(|at| at <= tokio::time::Instant::now()) => break,
            Err(_) => {}
        }
    }
    let mut acks = Acks {
        answered: Vec::with_capacity(rows.len()),
        stragglers: Vec::new(),
    };
    for (row, result) in rows.into_iter().zip(results) {
        match result {
            Some(ack) => acks.answered.push((row, ack)),
            None => acks.stragglers.push(row),
        }
    }
    acks
}

/// Whether NATS and JetStream answer now: the client is connected and
/// JetStream gives its account info (`$JS.API.INFO`, which the relay's
/// NATS user must be allowed to request) within [`PROBE_TIMEOUT`]. Asked
/// when nothing of a cycle went out, to tell NATS being away (the rows keep
/// their state) from the rows' own failures (recorded on them).
async fn nats_answers(js: &jetstream::Context) -> Result<(), String> {
    match probe(js).await {
        Probe::Answers => Ok(()),
        Probe::Away(cause) | Probe::Unanswered(cause) => Err(cause),
    }
}

/// What [`probe`] found.
enum Probe {
    /// Connected, and JetStream gave its account info.
    Answers,
    /// Not connected, or JetStream answered with an error (no responders:
    /// JetStream is not enabled, or not up yet).
    Away(String),
    /// Connected, but no answer within [`PROBE_TIMEOUT`]: NATS is away
    /// (JetStream without a leader, a connection not yet seen as lost), or
    /// the relay's NATS user may not request `$JS.API.INFO` (the server
    /// drops a request it refuses without an answer).
    Unanswered(String),
}

/// Asks whether NATS and JetStream answer now (see [`nats_answers`]).
async fn probe(js: &jetstream::Context) -> Probe {
    let state = js.client().connection_state();
    if state != State::Connected {
        return Probe::Away(format!("the NATS client is {state}"));
    }
    match tokio::time::timeout(PROBE_TIMEOUT, js.query_account()).await {
        Ok(Ok(_)) => Probe::Answers,
        Ok(Err(error)) => Probe::Away(format!("JetStream's account info failed: {error}")),
        Err(_) => Probe::Unanswered(format!(
            "JetStream did not answer an account info request within {PROBE_TIMEOUT:?} (NATS is away, or the relay's NATS user may not request $JS.API.INFO)"
        )),
    }
}

/// What a failed publish means, for `last_error` and the warnings.
fn reason(error: &PublishError) -> String {
    let hint = match error.kind() {
        PublishErrorKind::StreamNotFound => {
            "no stream stores this subject: create one (or fix the subject), then `idem outbox retry`"
        }
        PublishErrorKind::MaxPayloadExceeded => {
            "larger than the server's max_payload: it cannot be published as it is"
        }
        PublishErrorKind::TimedOut => {
            "the relay's NATS user may lack permission to publish to this subject (the server drops a refused publish without an answer), or its stream has no leader"
        }
        _ => "",
    };
    let mut text = if hint.is_empty() {
        error.to_string()
    } else {
        format!("{error}; {hint}")
    };
    // The server's text goes into a PostgreSQL text column, which takes no
    // NUL: a MARK that failed over one would fail its whole cycle.
    text.retain(|c| c != '\0');
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}
