//! Where a handler's messages come from, and how they are paced.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream;

use crate::error::Error;
use crate::error::retention::Inputs;
use crate::error::retention::{RetentionFloor, Unbounded};
use crate::retention::floor;

pub(crate) mod metadata;
pub mod partition;
pub(crate) mod retry;

pub use retry::RetryPolicy;

/// The largest batch: one claim statement binds this many ids.
const MAX_BATCH: usize = 1000;

/// The largest batch of an adaptive route unless it says otherwise
/// ([`Route::adaptive_batch`]).
pub const DEFAULT_ADAPTIVE_MAX: usize = 64;

/// The largest batch of an adaptive route whose handler takes a batch in one
/// call (`#[idempotent(batch)]`), unless the route says otherwise. With the
/// default `max_ack_pending` (1000) and concurrency (8), 125: as many as
/// fit ([`Route::adaptive_batch`] caps every adaptive route so).
///
/// Larger than [`DEFAULT_ADAPTIVE_MAX`] because such a handler writes a
/// batch with set-based statements, whose cost per message keeps falling
/// with the batch's size. Measured with `idem-bench idem-batch-handler
/// --adaptive --messages 200000`, three interleaved pairs on one machine
/// (2026-12-07): up to 125 ran 1.17×, 1.04× and 1.10× up to 64. A handler
/// called once per message gained too little to tell from the noise
/// (0.91×, 1.15×, 1.06×), and keeps [`DEFAULT_ADAPTIVE_MAX`].
pub const DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER: usize = 128;

/// Deliveries past the retry policy's limit after which JetStream itself
/// stops redelivering a message.
const SERVER_BACKSTOP: u64 = 3;

/// How progress heartbeats are sent while a handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeartbeatSetting {
    /// Every third of ack_wait.
    Auto,
    Every(Duration),
    Off,
}

/// How the runtime acks a message after its transaction commits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AckMode {
    /// A plain `+ACK`: no reply from the server. The fastest; a lost ack only
    /// causes a redelivery that the dedup row absorbs.
    #[default]
    Ack,
    /// AckSync (`double_ack`): wait for the server to confirm the ack, so a
    /// message counts as finished only once JetStream has recorded it.
    DoubleAck,
}

/// The default dead-letter subject of a route.
pub(crate) fn default_dead_letter_subject(stream: &str, durable: &str) -> String {
    format!("idem.dead.{stream}.{durable}")
}

/// One binding of a handler to a JetStream durable pull consumer.
///
/// Defaults, each checked at start-up:
///
/// | setting | default |
/// |---|---|
/// | `ack_wait` | 30 s (JetStream's default) |
/// | retry | [`RetryPolicy::default`]: 10 deliveries, backoff 1 s doubling to 5 min, ±20 % jitter |
/// | dead letters | `idem.dead.<stream>.<durable>` in stream `IDEM_DEAD_LETTERS` |
/// | `handler_timeout` | 5 min (the handler only; never BEGIN or COMMIT) |
/// | `max_ack_pending` | 1000 (JetStream's default); must be ≥ `concurrency` |
/// | `concurrency` | 8 messages (or batches) in flight per route in this process |
/// | batching | adaptive, up to [`DEFAULT_ADAPTIVE_MAX`] messages per transaction ([`DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER`] for a batch handler, within `max_ack_pending` / `concurrency`; [`adaptive_batch`](Route::adaptive_batch)); per message for a handler that declares [`PER_MESSAGE`](crate::handler::Handler::PER_MESSAGE), or where the route's retention fits only the per-message floor |
/// | heartbeat | `+WPI` every ack_wait / 3 while a handler runs |
/// | ack | plain `+ACK` ([`AckMode::Ack`]) |
/// | existing consumer | used if its settings match; refused if they differ, unless `update_consumer()` |
/// | `retention` | none: claims are kept forever; a retention is refused below the [retention floor](crate::retention::floor) |
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{AckMode, Route};
///
/// let route = Route::new("LEDGER", "ledger-credit")
///     .filter_subject("ledger.credit")
///     .ack_wait(Duration::from_secs(10))
///     .concurrency(16)
///     .ack_mode(AckMode::DoubleAck);
/// assert_eq!(route.durable_name(), "ledger-credit");
/// ```
#[derive(Debug, Clone)]
pub struct Route {
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) filter_subjects: Vec<String>,
    pub(crate) create_stream: Option<stream::Config>,
    pub(crate) ack_wait: Duration,
    pub(crate) max_ack_pending: i64,
    pub(crate) concurrency: usize,
    /// The most messages per transaction: the fixed size, or an adaptive
    /// route's largest.
    pub(crate) batch: usize,
    /// Whether batches are sized by the backlog and by conflicts (see
    /// `consume/sizing.rs`), up to `batch`.
    pub(crate) adaptive: bool,
    /// Whether the user chose how the route batches (`batch`,
    /// `adaptive_batch` or `per_message`), rather than taking the default:
    /// only the default gives way to a per-message handler or a retention
    /// that fits only the per-message floor.
    pub(crate) batching_chosen: bool,
    /// Whether the route's handler must have its transaction to itself
    /// ([`Handler::PER_MESSAGE`](crate::handler::Handler::PER_MESSAGE)).
    pub(crate) handler_per_message: bool,
    heartbeat: HeartbeatSetting,
    pub(crate) handler_timeout: Option<Duration>,
    allow_redelivery_while_running: bool,
    pub(crate) ack_mode: AckMode,
    pub(crate) retry: RetryPolicy,
    pub(crate) dead_letter_subject: Option<String>,
    pub(crate) update_consumer: bool,
    /// How long the route's claims are kept after processing; `None` keeps
    /// them forever.
    pub(crate) retention: Option<Duration>,
    /// How long after a message's first publish a publisher may publish it
    /// again; `None` if not declared.
    pub(crate) publisher_retry_horizon: Option<Duration>,
    /// Unbounded terms of the retention floor the route accepts.
    pub(crate) accepted_unbounded: Vec<Unbounded>,
    /// The partitioned consumer this route is one partition of (see
    /// [`crate::route::partition`]): routes of one group may share a handler.
    pub(crate) partition_of: Option<String>,
}

impl Route {
    /// A route that reads `stream` through the durable consumer `durable`.
    /// The consumer is created, or updated to this route's settings, at
    /// start-up.
    pub fn new(stream: impl Into<String>, durable: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            durable: durable.into(),
            filter_subjects: Vec::new(),
            create_stream: None,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            concurrency: 8,
            batch: DEFAULT_ADAPTIVE_MAX,
            adaptive: true,
            batching_chosen: false,
            handler_per_message: false,
            heartbeat: HeartbeatSetting::Auto,
            handler_timeout: Some(Duration::from_secs(300)),
            allow_redelivery_while_running: false,
            ack_mode: AckMode::Ack,
            retry: RetryPolicy::default(),
            dead_letter_subject: None,
            update_consumer: false,
            retention: None,
            publisher_retry_horizon: None,
            accepted_unbounded: Vec::new(),
            partition_of: None,
        }
    }

    /// Only deliver messages whose subject matches `subject` (wildcards
    /// allowed). May be called more than once.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subjects.push(subject.into());
        self
    }

    /// Create the stream with `config` if it is missing, or update it to
    /// `config` if it exists. Without this, a missing stream is a start-up
    /// error.
    pub fn create_stream(mut self, config: stream::Config) -> Self {
        self.create_stream = Some(config);
        self
    }

    /// How long JetStream waits for an ack before redelivering.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// The retry policy: delivery limit, backoff and in-process retries.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Shorthand for `retry(policy.max_deliver(n))`: a message whose n-th
    /// delivery fails transiently is dead-lettered.
    pub fn max_deliver(mut self, max_deliver: u64) -> Self {
        self.retry = self.retry.max_deliver(max_deliver);
        self
    }

    /// Shorthand for `retry(policy.backoff(initial, max))`.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.retry = self.retry.backoff(initial, max);
        self
    }

    /// Publish dead letters to `subject`, which a stream you manage must
    /// store (checked at start-up). By default they go to
    /// `idem.dead.<stream>.<durable>` in the stream `IDEM_DEAD_LETTERS`,
    /// which the router creates if it is missing.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// The subject this route's dead letters are published to.
    pub fn dead_letter_target(&self) -> String {
        self.dead_letter_subject.clone().unwrap_or_else(|| {
            crate::route::default_dead_letter_subject(&self.stream, &self.durable)
        })
    }

    /// Fail a handler that runs longer than `timeout` (a transient failure:
    /// rolled back and retried). Default 5 minutes. The timer covers the
    /// handler and the storing of the value it returns (if any; see
    /// [`results`](crate::handler::results)), never BEGIN or COMMIT.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// Let a handler run as long as it likes (heartbeats keep its message).
    pub fn without_handler_timeout(mut self) -> Self {
        self.handler_timeout = None;
        self
    }

    /// Marks the route as one partition of the partitioned consumer `group`
    /// ([`crate::route::partition::Partitions::routes`]).
    pub(crate) fn partition_of(mut self, group: &str) -> Self {
        self.partition_of = Some(group.to_owned());
        self
    }

    /// Overwrite an existing durable consumer whose settings differ from
    /// this route's, instead of refusing to start.
    pub fn update_consumer(mut self) -> Self {
        self.update_consumer = true;
        self
    }

    /// The most unacked messages JetStream hands out for this consumer,
    /// across all workers. Delivery stalls silently when it is reached.
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending;
        self
    }

    /// The most messages this process handles at once for this route. Each
    /// holds a pooled connection while it runs, so keep the pool at least as
    /// large as the sum over routes.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Fixed batches: take whatever messages are ready, up to `size`,
    /// claim them in one statement, run the handler for each fresh one in
    /// one transaction, commit once, then ack them all. It never waits to
    /// fill a batch, and never sizes it down (the default,
    /// [`adaptive_batch`](Self::adaptive_batch), does). If a handler in the
    /// batch fails (or the COMMIT does), the batch is rolled back and its
    /// messages are tried again so that one failure never fails its
    /// neighbours: the failed one alone, where it takes the normal retry
    /// and dead-letter path (see the [batch guide](crate::guide::batch)).
    /// `size` 1 is per-message mode.
    ///
    /// In batch mode, `concurrency` counts batches in flight, so up to
    /// `concurrency × size` messages are taken at once.
    pub fn batch(mut self, size: usize) -> Self {
        self.batch = size;
        self.adaptive = false;
        self.batching_chosen = true;
        self
    }

    /// Adaptive batching, what a route does by default (with `max`
    /// [`DEFAULT_ADAPTIVE_MAX`], or [`DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER`]
    /// for a batch handler): batches whose size follows the backlog and
    /// the conflicts, up to `max` messages per transaction. See the
    /// [batch guide](crate::guide::batch).
    ///
    /// - A message that arrives alone runs alone, in a transaction of its
    ///   own, as in per-message mode: an idle route keeps per-message
    ///   latency. It never waits to fill a batch.
    /// - Under a backlog, each full batch that commits grows the size: it
    ///   doubles until the first fallback, then grows by one.
    /// - A batch that fails halves it; its messages are tried again so that
    ///   a failure never fails its neighbours.
    /// - Batches that conflict (a deadlock, a serialization failure, a row
    ///   lock waited for past 200 ms) make the route run one batch at a
    ///   time for a while.
    ///
    /// Inside a batch a handler shares its transaction with the other
    /// messages of the batch: its writes are visible to the next message's
    /// handler, its row locks are held until the batch commits, and `SET
    /// LOCAL` or `pg_advisory_xact_lock` last until then too. A handler that
    /// depends on having the transaction to itself declares it
    /// (`#[idempotent(per_message)]`): a route left at the default runs it
    /// per message, and one that asks for batches is refused.
    ///
    /// `concurrency` counts batches in flight; the size is capped so that
    /// `concurrency × size` stays within `max_ack_pending`.
    ///
    /// ```
    /// use idem_runtime::Route;
    ///
    /// let route = Route::new("LEDGER", "ledger-credit").adaptive_batch(128);
    /// # drop(route);
    /// ```
    pub fn adaptive_batch(mut self, max: usize) -> Self {
        self.batch = max;
        self.adaptive = true;
        self.batching_chosen = true;
        self
    }

    /// Per-message mode: each message in a transaction of its own.
    pub fn per_message(mut self) -> Self {
        self.batch = 1;
        self.adaptive = false;
        self.batching_chosen = true;
        self
    }

    /// The route as it runs a handler that declares `handler_per_message`
    /// and `handler_batches` (`Handler::PER_MESSAGE`, `Handler::BATCHES`):
    /// a route left at the default batching runs a handler that must have
    /// its transaction to itself per message, and a batch handler in
    /// batches of up to [`DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER`]. A route
    /// that chose batches keeps them (with a per-message handler it is
    /// refused at start-up, [`validate`](Self::validate)).
    pub(crate) fn for_handler(mut self, handler_per_message: bool, handler_batches: bool) -> Self {
        self.handler_per_message = handler_per_message;
        if !self.batching_chosen {
            if handler_per_message {
                self.batch = 1;
                self.adaptive = false;
            } else if handler_batches {
                self.batch = DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER;
            }
        }
        self
    }

    /// Whether the route batches by default (it chose nothing), and so may
    /// run per message instead where its retention fits only that floor.
    pub(crate) fn batches_by_default(&self) -> bool {
        !self.batching_chosen && self.batch > 1
    }

    /// The same route, one message per transaction, as the default gives
    /// way (see [`batches_by_default`](Self::batches_by_default)).
    pub(crate) fn defaulted_to_per_message(mut self) -> Self {
        self.batch = 1;
        self.adaptive = false;
        self
    }

    /// The most messages one transaction takes: the fixed size, or an
    /// adaptive route's largest, capped so that `concurrency` batches fit
    /// in `max_ack_pending`.
    pub(crate) fn batch_cap(&self) -> usize {
        if !self.adaptive || self.max_ack_pending < 0 {
            return self.batch;
        }
        let fits = (self.max_ack_pending as usize) / self.concurrency.max(1);
        self.batch.min(fits).max(1)
    }

    /// Send a progress heartbeat (`+WPI`) every `interval` while a handler
    /// runs, instead of every ack_wait / 3.
    pub fn heartbeat_every(mut self, interval: Duration) -> Self {
        self.heartbeat = HeartbeatSetting::Every(interval);
        self
    }

    /// Send no progress heartbeats. A handler that outlives ack_wait would
    /// then be redelivered while it runs, so the route must also have a
    /// handler timeout shorter than ack_wait (checked at start-up).
    pub fn without_heartbeat(mut self) -> Self {
        self.heartbeat = HeartbeatSetting::Off;
        self
    }

    /// Accept settings under which a message can be redelivered while its
    /// first attempt still runs (heartbeats off and a handler timeout not
    /// below ack_wait). The claim still keeps it to one effect, but work is
    /// wasted and locks are held longer; meant for tests that provoke it.
    pub fn allow_redelivery_while_running(mut self) -> Self {
        self.allow_redelivery_while_running = true;
        self
    }

    /// Keeps this route's claims for at least `period` after a message is
    /// processed; the purge removes them after that. Without it, claims are
    /// kept forever.
    ///
    /// A duplicate that arrives after its claim is purged is processed
    /// again, so at start-up the router refuses a `period` below the
    /// route's [retention floor](crate::retention::floor): the longest a
    /// duplicate can still arrive, from `ack_wait`, the retry policy, the
    /// handler timeout, the stream's `max_age` and `duplicate_window`, and
    /// the [publisher-retry horizon](Self::publisher_retry_horizon). A floor
    /// with no bound (a stream that keeps messages forever, no handler
    /// timeout, no declared horizon) is refused too, unless the route
    /// accepts it with
    /// [`accept_duplicates_after_retention`](Self::accept_duplicates_after_retention).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::Route;
    ///
    /// const DAY: Duration = Duration::from_secs(24 * 3600);
    /// // On a stream with max_age 7 days, whose publishers retry for a minute.
    /// let route = Route::new("LEDGER", "credit")
    ///     .retention(8 * DAY)
    ///     .publisher_retry_horizon(Duration::from_secs(60));
    /// # drop(route);
    /// ```
    pub fn retention(mut self, period: Duration) -> Self {
        self.retention = Some(period);
        self
    }

    /// Declares how long after a message's first publish its publishers may
    /// publish it again (a retry after a lost PubAck, an outbox relay that
    /// restarts). JetStream drops a retry inside the stream's
    /// `duplicate_window`, and stores one after it as a new copy, which the
    /// claim must still catch: a horizon longer than the window adds to the
    /// [retention floor](crate::retention::floor). Only checked on a route
    /// with a [`retention`](Self::retention); without a declared horizon such
    /// a route is refused, unless it accepts
    /// [`Unbounded::PublisherRetryHorizon`]. `Duration::ZERO` declares that
    /// publishers never publish a message twice.
    pub fn publisher_retry_horizon(mut self, horizon: Duration) -> Self {
        self.publisher_retry_horizon = Some(horizon);
        self
    }

    /// Accepts that the retention floor's `term` has no bound, so that a
    /// route with a [`retention`](Self::retention) starts anyway. The term
    /// counts 0 and the rest of the floor is still checked.
    ///
    /// The consequence: **a duplicate that `term` lets arrive after the
    /// retention is processed again**, its effects applied twice. With
    /// [`Unbounded::StreamMaxAge`], a replay of an old message (a consumer's
    /// ack floor reset, a consumer created again) after the retention; with
    /// [`Unbounded::HandlerTimeout`], a redelivery after a transaction that
    /// ran longer than the retention; with
    /// [`Unbounded::PublisherRetryHorizon`], a publisher's retry after the
    /// retention. Use it when the handler's effects tolerate that, or when
    /// something else rules it out. Call it once for each term to accept.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::Route;
    /// use idem_runtime::retention::Unbounded;
    ///
    /// // The stream keeps messages forever; old replays may apply twice.
    /// let route = Route::new("AUDIT", "archive")
    ///     .retention(Duration::from_secs(30 * 24 * 3600))
    ///     .publisher_retry_horizon(Duration::ZERO)
    ///     .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
    /// # drop(route);
    /// ```
    pub fn accept_duplicates_after_retention(mut self, term: Unbounded) -> Self {
        if !self.accepted_unbounded.contains(&term) {
            self.accepted_unbounded.push(term);
        }
        self
    }

    /// This route's retention floor on a stream with `stream`'s settings,
    /// and how it is computed: what the router checks the retention against
    /// at start-up. See [`retention_floor`](crate::retention::floor).
    ///
    /// With batches, every later delivery of a message also counts a
    /// batch's transaction, so the floor is higher. A route left at the
    /// default batching whose retention covers only the per-message floor
    /// runs one message per transaction (start-up warns), and this is then
    /// that floor.
    pub fn retention_floor(&self, stream: &stream::Config) -> RetentionFloor {
        match self.judged_floor(stream) {
            Ok((floor, _)) => floor,
            Err(_) => self.floor_as_is(stream),
        }
    }

    /// The floor of the route as it is set, without the default giving
    /// way.
    fn floor_as_is(&self, stream: &stream::Config) -> RetentionFloor {
        floor::compute(self.floor_inputs(stream))
    }

    /// How a committed message is acked.
    pub fn ack_mode(mut self, ack_mode: AckMode) -> Self {
        self.ack_mode = ack_mode;
        self
    }

    /// The durable consumer's name, which also names the route in logs and
    /// errors.
    pub fn durable_name(&self) -> &str {
        &self.durable
    }

    /// The stream the route reads.
    ///
    /// ```
    /// let route = idem_runtime::Route::new("LEDGER", "ledger-credit");
    /// assert_eq!(route.stream_name(), "LEDGER");
    /// ```
    pub fn stream_name(&self) -> &str {
        &self.stream
    }

    /// The heartbeat interval in force, if any.
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        match self.heartbeat {
            HeartbeatSetting::Auto => Some(self.ack_wait / 3),
            HeartbeatSetting::Every(interval) => Some(interval),
            HeartbeatSetting::Off => None,
        }
    }

    /// Refuses settings that stall or misbehave.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let refuse = |reason: String| {
            Err(Error::Config {
                route: self.durable.clone(),
                reason,
            })
        };
        if self.stream.is_empty() || self.durable.is_empty() {
            return refuse("the stream and durable consumer names must not be empty".into());
        }
        if self.concurrency == 0 {
            return refuse("concurrency must be at least 1".into());
        }
        if self.batch == 0 || self.batch > MAX_BATCH {
            return refuse(format!(
                "the batch size must be between 1 and {MAX_BATCH}, not {}",
                self.batch
            ));
        }
        if self.handler_per_message && self.batch > 1 {
            return refuse(format!(
                "the route asks for batches of up to {} messages, but its handler must have its transaction to itself (`#[idempotent(per_message)]`, `Handler::PER_MESSAGE`); remove `batch`/`adaptive_batch` from the route, or `per_message` from the handler",
                self.batch
            ));
        }
        if self.ack_wait.is_zero() {
            return refuse("ack_wait must be positive".into());
        }
        // PostgreSQL takes the server-side bounds in milliseconds, as an
        // int: the idle bound (the timeout plus 1 s) must fit.
        if let Some(timeout) = self.handler_timeout
            && (timeout.is_zero() || timeout.as_millis() + 1000 > i32::MAX as u128)
        {
            return refuse(format!(
                "the handler timeout ({timeout:?}) must be between 1 ms and about 24.8 days (the bound idem sets on the database's statements is in milliseconds, a 32-bit integer); use `without_handler_timeout()` for none"
            ));
        }
        let in_flight = self.concurrency.saturating_mul(self.batch_cap()) as u64;
        if self.max_ack_pending >= 0 && (self.max_ack_pending as u64) < in_flight {
            return refuse(format!(
                "max_ack_pending ({}) is below the messages in flight (concurrency {} × batch {}); raise max_ack_pending or lower concurrency",
                self.max_ack_pending, self.concurrency, self.batch
            ));
        }
        if self.heartbeat_interval().is_none() && !self.allow_redelivery_while_running {
            match self.handler_timeout {
                Some(timeout) if timeout < self.ack_wait => {}
                timeout => {
                    return refuse(format!(
                        "heartbeats are off and the handler timeout ({timeout:?}) is not below ack_wait ({:?}), so a message could be redelivered while its handler runs; turn heartbeats on, or set a handler timeout below ack_wait",
                        self.ack_wait
                    ));
                }
            }
        }
        if let Some(interval) = self.heartbeat_interval()
            && (interval.is_zero() || interval >= self.ack_wait)
        {
            return refuse(format!(
                "the heartbeat interval ({interval:?}) must be positive and shorter than ack_wait ({:?})",
                self.ack_wait
            ));
        }
        Ok(())
    }

    /// JetStream's delivery limit for the consumer: a little beyond the
    /// retry policy's, see [`consumer_config`](Self::consumer_config).
    pub(crate) fn server_max_deliver(&self) -> u64 {
        self.retry.max_deliver.saturating_add(SERVER_BACKSTOP)
    }

    /// The durable pull consumer this route reads from.
    pub(crate) fn consumer_config(&self) -> pull::Config {
        let (filter_subject, filter_subjects) = match self.filter_subjects.as_slice() {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: self.ack_wait,
            // The runtime enforces the retry policy's limit itself, so that a
            // failed dead-letter publish can be NAKed and tried again. The
            // server-side limit is a backstop, a little further out, for a
            // message that never reaches the runtime: async-nats drops the
            // whole connection on a header that is not UTF-8, so without it
            // such a message would reset the connection every ack_wait,
            // forever. The advisory JetStream then sends is dead-lettered by
            // consume/undeliverable.rs.
            max_deliver: i64::try_from(self.server_max_deliver()).unwrap_or(i64::MAX),
            max_ack_pending: self.max_ack_pending,
            filter_subject,
            filter_subjects,
            ..Default::default()
        }
    }
}

impl Route {
    /// The route's retention floor, judged against its retention, as
    /// start-up judges it. A route that batches by default and whose
    /// retention is below its floor with batches (every later delivery of a
    /// message then counts a batch's claim wait) runs per message instead,
    /// if its retention covers that floor: `true` with the per-message
    /// floor. If it covers neither, the refusal is the per-message floor's:
    /// the least the route needs.
    pub(crate) fn judged_floor(
        &self,
        stream: &stream::Config,
    ) -> Result<(RetentionFloor, bool), Error> {
        let judged = floor::judge(&self.durable, self.retention, self.floor_as_is(stream));
        match judged {
            Err(_) if self.batches_by_default() => {
                let alone = self.clone().defaulted_to_per_message();
                let floor =
                    floor::judge(&alone.durable, alone.retention, alone.floor_as_is(stream))?;
                Ok((floor, true))
            }
            judged => judged.map(|floor| (floor, false)),
        }
    }

    /// What this route's retention floor is computed from, reading `stream`.
    fn floor_inputs(&self, stream: &stream::Config) -> Inputs {
        let policy = &self.retry;
        Inputs {
            ack_wait: self.ack_wait,
            max_deliver: policy.max_deliver,
            server_max_deliver: self.server_max_deliver(),
            nak_delays: policy.nak_delay_runs(),
            jitter: policy.jitter,
            handler_timeout: self.handler_timeout,
            batch: self.batch_cap(),
            max_age: stream.max_age,
            duplicate_window: stream.duplicate_window,
            publisher_retry_horizon: self.publisher_retry_horizon,
            accepted: self.accepted_unbounded.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_heartbeat_is_a_third_of_ack_wait() {
        let route = Route::new("S", "c");
        route.validate().unwrap();
        assert_eq!(route.heartbeat_interval(), Some(Duration::from_secs(10)));
    }

    #[test]
    fn settings_that_stall_are_refused() {
        let err = Route::new("S", "c")
            .concurrency(10)
            .max_ack_pending(5)
            .validate()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("max_ack_pending (5) is below the messages in flight")
        );
        let err = Route::new("S", "c")
            .ack_wait(Duration::from_secs(1))
            .heartbeat_every(Duration::from_secs(2))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("shorter than ack_wait"));
    }

    #[test]
    fn an_adaptive_route_caps_its_size_to_fit_max_ack_pending_where_a_fixed_one_is_refused() {
        let adaptive = Route::new("S", "c")
            .concurrency(16)
            .max_ack_pending(100)
            .adaptive_batch(64);
        adaptive.validate().unwrap();
        assert_eq!(adaptive.batch_cap(), 6, "16 batches of 6 fit in 100");
        let fixed = adaptive.clone().batch(64);
        let err = fixed.validate().unwrap_err();
        assert!(err.to_string().contains("max_ack_pending (100)"), "{err}");
        assert_eq!(adaptive.per_message().batch_cap(), 1);
    }

    #[test]
    fn a_default_route_sizes_its_batches_by_its_handler_and_a_chosen_size_is_kept() {
        let default = Route::new("S", "c");
        let once_per_message = default.clone().for_handler(false, false);
        assert_eq!(once_per_message.batch_cap(), DEFAULT_ADAPTIVE_MAX);
        let batch_handler = default.clone().for_handler(false, true);
        assert!(batch_handler.adaptive);
        assert_eq!(
            batch_handler.batch_cap(),
            125,
            "128, within the default max_ack_pending (1000) over concurrency 8"
        );
        let unbounded = default.clone().max_ack_pending(-1).for_handler(false, true);
        assert_eq!(unbounded.batch_cap(), DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER);
        let per_message = default.clone().for_handler(true, false);
        assert_eq!((per_message.batch_cap(), per_message.adaptive), (1, false));
        let chosen = default.clone().adaptive_batch(32).for_handler(false, true);
        assert_eq!(chosen.batch_cap(), 32, "the route's own cap is kept");
        let fixed = default.batch(16).for_handler(false, true);
        assert_eq!((fixed.batch_cap(), fixed.adaptive), (16, false));
    }

    #[test]
    fn a_handler_timeout_postgresql_cannot_take_is_refused() {
        let err = Route::new("S", "c")
            .handler_timeout(Duration::from_secs(30 * 24 * 3600))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("about 24.8 days"), "{err}");
        Route::new("S", "c")
            .handler_timeout(Duration::from_secs(20 * 24 * 3600))
            .validate()
            .unwrap();
    }

    #[test]
    fn heartbeats_off_need_a_handler_timeout_below_ack_wait() {
        let route = Route::new("S", "c")
            .ack_wait(Duration::from_secs(30))
            .without_heartbeat();
        let err = route.clone().validate().unwrap_err();
        assert!(err.to_string().contains("heartbeats are off"), "{err}");
        route
            .clone()
            .handler_timeout(Duration::from_secs(10))
            .validate()
            .unwrap();
        route.allow_redelivery_while_running().validate().unwrap();
    }
}
