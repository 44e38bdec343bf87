//! Metrics, through the [`metrics`] facade.
//!
//! idem records; the application chooses the exporter (for Prometheus,
//! `metrics-exporter-prometheus`) and installs it **before** it starts the
//! router: each route takes its handles from the recorder installed when
//! it starts. Without a recorder every call here is a no-op.
//!
//! This module owns every name, label and description. The counters sit
//! beside [`Stats`](crate::Stats) and move with it; per route they are
//! labelled `route`, the durable consumer's name (a request route's
//! subject). Each route builds its handles once, when it starts, so the
//! per-message path allocates nothing: a counter is an atomic add in the
//! recorder.
//!
//! | name | type | labels | what it counts |
//! |---|---|---|---|
//! | `idem_messages_received_total` | counter | `route` | messages taken from the consumer |
//! | `idem_messages_processed_total` | counter | `route` | committed (the body ran), then acked |
//! | `idem_messages_duplicate_total` | counter | `route` | found already processed by the claim: acked, body not run |
//! | `idem_messages_failed_total` | counter | `route` | deliveries that failed after their in-process retries: NAKed or dead-lettered |
//! | `idem_messages_retried_total` | counter | `route` | transactions run again at once (serialization failure, deadlock, lost connection, a lost unique race) |
//! | `idem_messages_dead_lettered_total` | counter | `route`, `reason` | dead letters stored (then the original TERMed); `reason` is the `Idem-Failure` header |
//! | `idem_messages_rejected_total` | counter | `route` | can never succeed (undecodable, unusable id, not a JetStream delivery) |
//! | `idem_commit_unknown_total` | counter | `route` | COMMIT's outcome unknown (connection lost): NAKed, never acked |
//! | `idem_dead_letter_publish_failures_total` | counter | `route` | dead-letter publishes that failed (the message is held and the publish retried) |
//! | `idem_infrastructure_errors_total` | counter | `route` | attempts that failed before the handler ran because the database could not be used (held, no delivery used up) |
//! | `idem_batch_fallbacks_total` | counter | `route` | batches rolled back and rerun one message per transaction |
//! | `idem_abandoned_transactions_total` | counter | `route` | transactions the database stopped answering, no longer waited for |
//! | `idem_replays_skipped_total` | counter | `route` | replays of another handler's dead letters: acked, handler not run |
//! | `idem_batch_size` | histogram | `route` | messages per committed batch (batch mode) |
//! | `idem_handler_duration_seconds` | histogram | `route` | one handler call (a batch handler's call covers its batch), failed calls included |
//! | `idem_end_to_end_duration_seconds` | histogram | `route` | from the message's JetStream timestamp (when it was stored) to its ack as processed, retries included |
//! | `idem_connection_wait_seconds` | histogram | `route` | how long a message (or batch) waited for its turn at the router's connections, which are handed out in the order asked for, across routes; long waits: the pool is smaller than the routes' concurrency |
//! | `idem_messages_in_flight` | gauge | `route` | messages taken and not yet settled (a batch's, until its last one settles) |
//! | `idem_route_paused` | gauge | `route` | 1 while the route takes no new messages because its database cannot be used (attempts failed before their handlers ran, twice in a row), else 0; a warning says so when it pauses |
//! | `idem_pull_requests_refused_total` | counter | `route`, `reason` | pull requests the server turned away or ended early: `no_responders` (the consumer has no leader, or is gone), `max_waiting` (its wait list is full), `leadership_change` (asked again of the new leader), `max_request_batch` (capped, asked again), `request_limits`, `consumer_gone`, `lost` (past its expiry without a word, and not filled), `other`; a route whose requests are refused for 10 s in a row also logs a warning naming the cause |
//! | `idem_pull_request_capped` | gauge | `route` | 1 while the route's pull requests are capped by the consumer's `max_batch` below `concurrency x batch` (fewer messages are fetched ahead), else 0; `idem status` shows it too |
//! | `idem_consumer_pending_messages` | gauge | `route` | the consumer's `num_pending`: stored, not yet delivered |
//! | `idem_consumer_ack_pending_messages` | gauge | `route` | the consumer's `num_ack_pending`: delivered, not yet acked |
//! | `idem_outbox_pending_rows` | gauge | | outbox rows committed and not yet published |
//! | `idem_outbox_oldest_age_seconds` | gauge | | how long ago the oldest pending row was queued (0 when none) |
//! | `idem_outbox_published_total` | counter | | messages a relay published and JetStream acknowledged (duplicates included), counted as the PubAcks come |
//! | `idem_outbox_publish_failures_total` | counter | | relay publishes that failed (their rows stay pending) |
//! | `idem_outbox_failing_rows` | gauge | | pending rows whose last publish failed while NATS answered (no stream, too big, not permitted): each waits out its own back-off; the reasons are in `outbox::lag` and `idem status` |
//! | `idem_outbox_nats_unreachable` | gauge | | 1 while a relay of this process backs off because nothing went out and JetStream does not answer, else 0 |
//! | `idem_outbox_relays_blocked` | gauge | | relay statements (of any process; PostgreSQL) that have waited over a second for a lock another session holds (`LOCK TABLE`, `ALTER TABLE` or `VACUUM FULL` of `idem_outbox` left open); the holders are in a warning, `outbox::lag` and `idem status` |
//! | `idem_purge_failures_total` | counter | | runs of a router's claims purge that failed (each is logged at `warn`; the next run resumes) |
//! | `idem_purge_last_success_timestamp_seconds` | gauge | | Unix time of the last purge run that succeeded, in any process |
//! | `idem_expiry_due_generations` | gauge | | claims generations past the retention and not yet dropped |
//! | `idem_expiry_overdue_seconds` | gauge | | how long past its expiry the oldest of those is (0 when none) |
//! | `idem_expiry_rotation_overdue_seconds` | gauge | | how long past its rotation the current generation is, with no transition under way (0 when not): above a few purge intervals, no purge is running |
//! | `idem_expiry_transition_seconds` | gauge | | how long the rotation in transition has lasted (0 when none) |
//! | `idem_expiry_transition_blocking_transactions` | gauge | | transactions that rotation still waits for, as the last purge run found them |
//! | `idem_startup_retries_total` | counter | `server` | start-up attempts that failed because the database (`postgresql`, `sqlite` or `mariadb`) or `nats` could not be reached, or a lock held elsewhere kept the handlers from being registered (the database's label; the router tries again; it takes no message until then) |
//!
//! The expiry gauges are read by a router's purge after each of its runs
//! (one cheap query; every router on a database reports the same figures).
//! The consumer and outbox gauges are read by one task per router every
//! [`POLL_INTERVAL`], not per message: one consumer-info request per route
//! and one `count(*)` of the outbox; a relay also sets the outbox gauges
//! each time it reads the lag itself. Every router on a database reports the
//! same outbox figures (take the `max` across instances).
//!
//! Histograms have no buckets of their own in the facade; give an exporter
//! that needs them [`HISTOGRAM_BUCKETS`]. With `metrics-exporter-prometheus`
//! (what the example services do):
//!
//! ```no_run
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut exporter = PrometheusBuilder::new().with_http_listener(([127, 0, 0, 1], 9464));
//! for (name, buckets) in idem_runtime::observe::metrics::HISTOGRAM_BUCKETS {
//!     exporter = exporter.set_buckets_for_metric(Matcher::Full(name.into()), buckets)?;
//! }
//! exporter.install()?; // before the router starts: GET http://127.0.0.1:9464/metrics
//! # Ok(())
//! # }
//! ```

use std::time::{Duration, Instant};

use metrics::{Counter, Gauge, Histogram, Unit};

use crate::error::Failure;

/// Messages taken from the consumer.
pub const RECEIVED: &str = "idem_messages_received_total";
/// Messages committed and acked.
pub const PROCESSED: &str = "idem_messages_processed_total";
/// Messages the claim found already processed.
pub const DUPLICATE: &str = "idem_messages_duplicate_total";
/// Deliveries that failed after their in-process retries.
pub const FAILED: &str = "idem_messages_failed_total";
/// Transactions run again at once.
pub const RETRIED: &str = "idem_messages_retried_total";
/// Dead letters stored.
pub const DEAD_LETTERED: &str = "idem_messages_dead_lettered_total";
/// Messages that can never succeed.
pub const REJECTED: &str = "idem_messages_rejected_total";
/// COMMITs of unknown outcome.
pub const COMMIT_UNKNOWN: &str = "idem_commit_unknown_total";
/// Dead-letter publishes that failed.
pub const DEAD_LETTER_PUBLISH_FAILURES: &str = "idem_dead_letter_publish_failures_total";
/// Attempts that failed because the database could not be used.
pub const INFRASTRUCTURE_ERRORS: &str = "idem_infrastructure_errors_total";
/// Batches rerun one message per transaction.
pub const BATCH_FALLBACKS: &str = "idem_batch_fallbacks_total";
/// Transactions no longer waited for.
pub const ABANDONED_TRANSACTIONS: &str = "idem_abandoned_transactions_total";
/// Replays of another handler's dead letters, acked without running the handler.
pub const REPLAYS_SKIPPED: &str = "idem_replays_skipped_total";
/// Messages per committed batch.
pub const BATCH_SIZE: &str = "idem_batch_size";
/// One handler call.
pub const HANDLER_DURATION: &str = "idem_handler_duration_seconds";
/// From a message's storage in JetStream to its ack as processed.
pub const END_TO_END_DURATION: &str = "idem_end_to_end_duration_seconds";
/// A message's (or batch's) wait for its turn at the router's connections.
pub const CONNECTION_WAIT: &str = "idem_connection_wait_seconds";
/// Messages taken and not yet settled.
pub const IN_FLIGHT: &str = "idem_messages_in_flight";
/// 1 while a route takes nothing new, its database unusable.
pub const ROUTE_PAUSED: &str = "idem_route_paused";
/// Pull requests the server turned away or ended early, by `reason`.
pub const PULL_REQUESTS_REFUSED: &str = "idem_pull_requests_refused_total";
/// 1 while a route's pull requests are capped by the consumer's `max_batch`.
pub const PULL_REQUEST_CAPPED: &str = "idem_pull_request_capped";
/// The consumer's `num_pending`.
pub const CONSUMER_PENDING: &str = "idem_consumer_pending_messages";
/// The consumer's `num_ack_pending`.
pub const CONSUMER_ACK_PENDING: &str = "idem_consumer_ack_pending_messages";
/// How much longer an operator's pause of the consumer lasts (0: not
/// paused).
pub const CONSUMER_PAUSED: &str = "idem_consumer_paused_seconds";
/// Outbox rows not yet published.
pub const OUTBOX_PENDING: &str = "idem_outbox_pending_rows";
/// Age of the oldest pending outbox row.
pub const OUTBOX_OLDEST_AGE: &str = "idem_outbox_oldest_age_seconds";
/// Messages a relay published.
pub const OUTBOX_PUBLISHED: &str = "idem_outbox_published_total";
/// Relay publishes that failed.
pub const OUTBOX_PUBLISH_FAILURES: &str = "idem_outbox_publish_failures_total";
/// Pending outbox rows whose last publish failed while NATS answered.
pub const OUTBOX_FAILING: &str = "idem_outbox_failing_rows";
/// Whether a relay of this process finds NATS away.
pub const OUTBOX_NATS_UNREACHABLE: &str = "idem_outbox_nats_unreachable";
/// Relay statements waiting for a lock another session holds.
pub const OUTBOX_RELAYS_BLOCKED: &str = "idem_outbox_relays_blocked";

/// Purge runs that failed.
pub const PURGE_FAILURES: &str = "idem_purge_failures_total";
/// When a purge run last succeeded.
pub const PURGE_LAST_SUCCESS: &str = "idem_purge_last_success_timestamp_seconds";
/// Claims generations due to be dropped.
pub const EXPIRY_DUE: &str = "idem_expiry_due_generations";
/// How long past its expiry the oldest due generation is.
pub const EXPIRY_OVERDUE: &str = "idem_expiry_overdue_seconds";
/// How long past its rotation the current generation is.
pub const EXPIRY_ROTATION_OVERDUE: &str = "idem_expiry_rotation_overdue_seconds";
/// How long the rotation in transition has lasted.
pub const TRANSITION_SECONDS: &str = "idem_expiry_transition_seconds";
/// Transactions the rotation in transition waits for.
pub const TRANSITION_BLOCKERS: &str = "idem_expiry_transition_blocking_transactions";

/// Start-up attempts that failed on a server that could not be reached.
pub const STARTUP_RETRIES: &str = "idem_startup_retries_total";

/// The label every per-route metric carries: the durable consumer's name
/// (a request route's subject).
pub const ROUTE_LABEL: &str = "route";
/// The label of [`DEAD_LETTERED`]: the dead letter's `Idem-Failure`.
pub const REASON_LABEL: &str = "reason";
/// The label of [`STARTUP_RETRIES`]: the database (`postgresql`, `sqlite`
/// or `mariadb`) or `nats`.
pub const SERVER_LABEL: &str = "server";

/// How often each router reads its consumers' info and the outbox's lag.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);

/// Buckets for latencies in seconds: 1 ms to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets for batch sizes: powers of two up to 1024.
pub const BATCH_SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];
/// Each histogram idem records, with the buckets suggested for it.
pub const HISTOGRAM_BUCKETS: [(&str, &[f64]); 4] = [
    (HANDLER_DURATION, LATENCY_BUCKETS),
    (END_TO_END_DURATION, LATENCY_BUCKETS),
    (CONNECTION_WAIT, LATENCY_BUCKETS),
    (BATCH_SIZE, BATCH_SIZE_BUCKETS),
];

/// Describes every metric to the installed recorder (an exporter prints the
/// descriptions as `# HELP`). The router calls it when it starts; call it
/// yourself to have the descriptions before then.
///
/// Its body is one table of every metric's description, kept in one place
/// on purpose (so one reads them all together), hence its length.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(RECEIVED, Unit::Count, "Messages taken from the consumer.");
    describe_counter!(
        PROCESSED,
        Unit::Count,
        "Messages whose claim was fresh: the handler ran, the transaction committed, then the message was acked."
    );
    describe_counter!(
        DUPLICATE,
        Unit::Count,
        "Messages the claim found already processed: rolled back and acked without running the handler."
    );
    describe_counter!(
        FAILED,
        Unit::Count,
        "Deliveries whose handler, or COMMIT, failed after in-process retries: rolled back, then NAKed or dead-lettered."
    );
    describe_counter!(
        RETRIED,
        Unit::Count,
        "Transactions run again at once after a serialization failure, a deadlock, a lost connection or a lost unique race."
    );
    describe_counter!(
        DEAD_LETTERED,
        Unit::Count,
        "Dead letters stored (the original then TERMed), by reason (the Idem-Failure header)."
    );
    describe_counter!(
        REJECTED,
        Unit::Count,
        "Messages that can never succeed (undecodable payload, unusable id, not a JetStream delivery): dead-lettered."
    );
    describe_counter!(
        COMMIT_UNKNOWN,
        Unit::Count,
        "COMMITs whose outcome is unknown (the connection was lost): NAKed, never acked; the claim decides the redelivery."
    );
    describe_counter!(
        DEAD_LETTER_PUBLISH_FAILURES,
        Unit::Count,
        "Dead-letter publishes that failed: the message is held and the publish retried."
    );
    describe_counter!(
        INFRASTRUCTURE_ERRORS,
        Unit::Count,
        "Attempts that failed before the handler ran because the database could not be used: held, no delivery used up."
    );
    describe_counter!(
        BATCH_FALLBACKS,
        Unit::Count,
        "Batches rolled back and rerun one message per transaction."
    );
    describe_counter!(
        ABANDONED_TRANSACTIONS,
        Unit::Count,
        "Transactions the database stopped answering, no longer waited for; their messages settled as of unknown outcome."
    );
    describe_counter!(
        REPLAYS_SKIPPED,
        Unit::Count,
        "Replays of dead letters another handler dead-lettered (Idem-Replay-For): acked without running this route's handler."
    );
    describe_histogram!(
        BATCH_SIZE,
        Unit::Count,
        "Messages per committed batch (batch mode)."
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "One handler call, failed calls included (a batch handler's call covers its batch)."
    );
    describe_histogram!(
        END_TO_END_DURATION,
        Unit::Seconds,
        "From the message's JetStream timestamp (stored) to its ack as processed, retries included."
    );
    describe_histogram!(
        CONNECTION_WAIT,
        Unit::Seconds,
        "How long a message (or batch) waited for its turn at the router's database connections, handed out in the order asked for across routes; long waits mean the pool is smaller than the routes' concurrency."
    );
    describe_gauge!(
        IN_FLIGHT,
        Unit::Count,
        "Messages taken from the consumer and not yet settled."
    );
    describe_gauge!(
        ROUTE_PAUSED,
        "1 while the route takes no new messages because its database cannot be used (attempts failed before their handlers ran, twice in a row); 0 otherwise."
    );
    describe_counter!(
        PULL_REQUESTS_REFUSED,
        Unit::Count,
        "Pull requests the server turned away or ended early, by reason: no_responders (the consumer has no leader, or is gone), max_waiting, leadership_change, max_request_batch, request_limits, consumer_gone, lost (past its expiry without a word, not filled), other."
    );
    describe_gauge!(
        PULL_REQUEST_CAPPED,
        "1 while the route's pull requests are capped by the consumer's max_batch below concurrency x batch (fewer messages fetched ahead); 0 otherwise."
    );
    describe_gauge!(
        CONSUMER_PENDING,
        Unit::Count,
        "The consumer's num_pending: messages stored and not yet delivered."
    );
    describe_gauge!(
        CONSUMER_ACK_PENDING,
        Unit::Count,
        "The consumer's num_ack_pending: messages delivered and not yet acked."
    );
    describe_gauge!(
        CONSUMER_PAUSED,
        Unit::Seconds,
        "How much longer the consumer is paused (nats consumer pause): JetStream delivers its route nothing meanwhile; 0 when not paused."
    );
    describe_gauge!(
        OUTBOX_PENDING,
        Unit::Count,
        "Outbox rows committed and not yet published."
    );
    describe_gauge!(
        OUTBOX_OLDEST_AGE,
        Unit::Seconds,
        "How long ago the oldest pending outbox row was queued (0 when none is pending)."
    );
    describe_counter!(
        OUTBOX_PUBLISHED,
        Unit::Count,
        "Messages a relay published and JetStream acknowledged (duplicates included), counted as the PubAcks come, before the rows are deleted."
    );
    describe_counter!(
        OUTBOX_PUBLISH_FAILURES,
        Unit::Count,
        "Relay publishes that failed; their rows stay pending."
    );
    describe_gauge!(
        OUTBOX_FAILING,
        Unit::Count,
        "Pending outbox rows whose last publish failed while NATS answered (no stream, too big, not permitted); each is retried after its own back-off. Reasons: idem status."
    );
    describe_gauge!(
        OUTBOX_NATS_UNREACHABLE,
        "1 while a relay of this process backs off because nothing went out and JetStream does not answer; 0 otherwise."
    );
    describe_gauge!(
        OUTBOX_RELAYS_BLOCKED,
        Unit::Count,
        "Relay statements (any process; PostgreSQL) waiting over a second for a lock another session holds on idem_outbox; holders: the relay's warning, idem status."
    );
    describe_counter!(
        PURGE_FAILURES,
        Unit::Count,
        "Runs of the router's claims purge that failed; the next run resumes where it stopped."
    );
    describe_gauge!(
        PURGE_LAST_SUCCESS,
        Unit::Seconds,
        "Unix time of the last claims purge run that succeeded, in any process."
    );
    describe_gauge!(
        EXPIRY_DUE,
        Unit::Count,
        "Claims generations past the retention and not yet dropped."
    );
    describe_gauge!(
        EXPIRY_OVERDUE,
        Unit::Seconds,
        "How long past its expiry the oldest claims generation not yet dropped is (0 when none)."
    );
    describe_gauge!(
        EXPIRY_ROTATION_OVERDUE,
        Unit::Seconds,
        "How long past its rotation the current claims generation is, with no transition under way (0 when not); above a few purge intervals, no purge is running."
    );
    describe_gauge!(
        TRANSITION_SECONDS,
        Unit::Seconds,
        "How long the claims rotation in transition has lasted (0 when none); claims go into two generations meanwhile."
    );
    describe_gauge!(
        TRANSITION_BLOCKERS,
        Unit::Count,
        "Transactions the claims rotation in transition still waits for."
    );
    describe_counter!(
        STARTUP_RETRIES,
        Unit::Count,
        "Router start-up attempts that failed because a server (label server: postgresql, sqlite, mariadb or nats) could not be reached; the router tries again and takes no message until then."
    );
}

/// Every dead-letter reason, in the order of [`RouteMetrics::dead_lettered`]'s
/// handles.
const REASONS: [Failure; 6] = [
    Failure::Permanent,
    Failure::Exhausted,
    Failure::Undecodable,
    Failure::BadMessageId,
    Failure::Undeliverable,
    Failure::NotADelivery,
];

fn reason_index(failure: Failure) -> usize {
    match failure {
        Failure::Permanent => 0,
        Failure::Exhausted => 1,
        Failure::Undecodable => 2,
        Failure::BadMessageId => 3,
        Failure::Undeliverable => 4,
        Failure::NotADelivery => 5,
    }
}

/// One route's handles, built once when it starts.
#[derive(Clone)]
pub(super) struct RouteMetrics {
    received: Counter,
    processed: Counter,
    duplicate: Counter,
    failed: Counter,
    retried: Counter,
    dead_lettered: [Counter; REASONS.len()],
    rejected: Counter,
    commit_unknown: Counter,
    dead_letter_publish_failures: Counter,
    infrastructure_errors: Counter,
    batch_fallbacks: Counter,
    abandoned_transactions: Counter,
    replays_skipped: Counter,
    batch_size: Histogram,
    handler_duration: Histogram,
    end_to_end: Histogram,
    connection_wait: Histogram,
    in_flight: Gauge,
    paused: Gauge,
}

impl RouteMetrics {
    /// The handles of route `route` from the recorder installed now.
    pub(super) fn new(route: &str) -> Self {
        use metrics::{counter, gauge, histogram};
        // Shared by every handle of the route: one allocation, here.
        let route = metrics::SharedString::from(route.to_owned());
        let labels = [metrics::Label::new(ROUTE_LABEL, route.clone())];
        Self {
            received: counter!(RECEIVED, labels.iter()),
            processed: counter!(PROCESSED, labels.iter()),
            duplicate: counter!(DUPLICATE, labels.iter()),
            failed: counter!(FAILED, labels.iter()),
            retried: counter!(RETRIED, labels.iter()),
            dead_lettered: REASONS.map(|reason| {
                counter!(DEAD_LETTERED, ROUTE_LABEL => route.clone(), REASON_LABEL => reason.as_str())
            }),
            rejected: counter!(REJECTED, labels.iter()),
            commit_unknown: counter!(COMMIT_UNKNOWN, labels.iter()),
            dead_letter_publish_failures: counter!(DEAD_LETTER_PUBLISH_FAILURES, labels.iter()),
            infrastructure_errors: counter!(INFRASTRUCTURE_ERRORS, labels.iter()),
            batch_fallbacks: counter!(BATCH_FALLBACKS, labels.iter()),
            abandoned_transactions: counter!(ABANDONED_TRANSACTIONS, labels.iter()),
            replays_skipped: counter!(REPLAYS_SKIPPED, labels.iter()),
            batch_size: histogram!(BATCH_SIZE, labels.iter()),
            handler_duration: histogram!(HANDLER_DURATION, labels.iter()),
            end_to_end: histogram!(END_TO_END_DURATION, labels.iter()),
            connection_wait: histogram!(CONNECTION_WAIT, labels.iter()),
            in_flight: gauge!(IN_FLIGHT, labels.iter()),
            paused: gauge!(ROUTE_PAUSED, labels.iter()),
        }
    }

    pub(super) fn received(&self) {
        self.received.increment(1);
    }

    pub(super) fn processed(&self) {
        self.processed.increment(1);
    }

    /// A message committed and then acked: counts it, and its time from
    /// storage (`stored_at`, the JetStream timestamp) to now.
    pub(super) fn acked_processed(&self, stored_at: time::OffsetDateTime) {
        // The NATS server's clock stamps the message; a skewed one must not
        // record a negative latency.
        let since = (time::OffsetDateTime::now_utc() - stored_at).as_seconds_f64();
        self.end_to_end.record(since.max(0.0));
    }

    pub(super) fn duplicate(&self) {
        self.duplicate.increment(1);
    }

    pub(super) fn failed(&self) {
        self.failed.increment(1);
    }

    pub(super) fn retried(&self) {
        self.retried.increment(1);
    }

    pub(super) fn dead_lettered(&self, failure: Failure) {
        self.dead_lettered[reason_index(failure)].increment(1);
    }

    pub(super) fn rejected(&self) {
        self.rejected.increment(1);
    }

    pub(super) fn commit_unknown(&self) {
        self.commit_unknown.increment(1);
    }

    pub(super) fn dead_letter_publish_failed(&self) {
        self.dead_letter_publish_failures.increment(1);
    }

    pub(super) fn infrastructure_error(&self) {
        self.infrastructure_errors.increment(1);
    }

    pub(super) fn batch_fallback(&self) {
        self.batch_fallbacks.increment(1);
    }

    pub(super) fn replay_skipped(&self) {
        self.replays_skipped.increment(1);
    }

    pub(super) fn abandoned_transaction(&self) {
        self.abandoned_transactions.increment(1);
    }

    pub(super) fn batch_committed(&self, size: usize) {
        self.batch_size.record(size as f64);
    }

    /// A message (or batch) waited `waited` for its turn at the router's
    /// connections.
    pub(super) fn connection_waited(&self, waited: Duration) {
        self.connection_wait.record(waited);
    }

    /// Times one handler call, until the returned guard drops.
    pub(super) fn handler_call(&self) -> Timer<'_> {
        Timer {
            histogram: &self.handler_duration,
            started: Instant::now(),
        }
    }

    pub(super) fn paused(&self, paused: bool) {
        self.paused.set(if paused { 1.0 } else { 0.0 });
    }

    /// Counts `messages` in flight until the returned guard drops, however
    /// their task ends (settled, or cancelled at shutdown).
    pub(super) fn in_flight(&self, messages: usize) -> InFlight {
        let messages = messages as f64;
        self.in_flight.increment(messages);
        InFlight {
            gauge: self.in_flight.clone(),
            messages,
        }
    }
}

/// Records the time since it was made into a histogram when dropped.
pub(crate) struct Timer<'a> {
    histogram: &'a Histogram,
    started: Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.histogram.record(self.started.elapsed());
    }
}

/// Takes its messages off the in-flight gauge when dropped.
pub(crate) struct InFlight {
    gauge: Gauge,
    messages: f64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.decrement(self.messages);
    }
}

/// A start-up attempt that failed on a server that could not be reached.
pub(crate) fn start_up_retry(server: &'static str) {
    metrics::counter!(STARTUP_RETRIES, SERVER_LABEL => server).increment(1);
}

/// Messages JetStream acknowledged to a relay, counted as the PubAcks come.
pub(crate) fn outbox_published(published: usize) {
    metrics::counter!(OUTBOX_PUBLISHED).increment(published as u64);
}

/// Publishes of an outbox cycle that failed.
pub(crate) fn outbox_publish_failures(failed: usize) {
    metrics::counter!(OUTBOX_PUBLISH_FAILURES).increment(failed as u64);
}

/// Whether a relay of this process finds NATS away (set when that
/// changes).
pub(crate) fn outbox_nats_unreachable(away: bool) {
    metrics::gauge!(OUTBOX_NATS_UNREACHABLE).set(if away { 1.0 } else { 0.0 });
}

/// A pull request of route `route` turned away or ended early, for
/// `reason`.
pub(crate) fn pull_request_refused(route: &str, reason: &'static str) {
    metrics::counter!(PULL_REQUESTS_REFUSED, ROUTE_LABEL => route.to_owned(), REASON_LABEL => reason)
        .increment(1);
}

/// Whether route `route`'s pull requests are capped by its consumer's
/// `max_batch` (set when that changes).
pub(crate) fn pull_request_capped(route: &str, capped: bool) {
    metrics::gauge!(PULL_REQUEST_CAPPED, ROUTE_LABEL => route.to_owned()).set(if capped {
        1.0
    } else {
        0.0
    });
}

/// A purge run failed.
pub(crate) fn purge_failed() {
    metrics::counter!(PURGE_FAILURES).increment(1);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{HistogramFn, Key, KeyName, Metadata, Recorder, SharedString};

    use super::*;

    /// A recorder that keeps every registered metric by its key, rendered
    /// as `name{label=value,...}`, and counts registrations.
    #[derive(Default)]
    struct Recording {
        registrations: AtomicU64,
        counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
        gauges: Mutex<HashMap<String, Arc<AtomicU64>>>,
        histograms: Mutex<HashMap<String, Arc<Samples>>>,
    }

    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    fn render(key: &Key) -> String {
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    impl Recorder for Recording {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            self.registrations.fetch_add(1, Ordering::Relaxed);
            let mut counters = self.counters.lock().unwrap();
            Counter::from_arc(counters.entry(render(key)).or_default().clone())
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            self.registrations.fetch_add(1, Ordering::Relaxed);
            let mut gauges = self.gauges.lock().unwrap();
            Gauge::from_arc(gauges.entry(render(key)).or_default().clone())
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            self.registrations.fetch_add(1, Ordering::Relaxed);
            let mut histograms = self.histograms.lock().unwrap();
            Histogram::from_arc(histograms.entry(render(key)).or_default().clone())
        }
    }

    impl Recording {
        fn counter(&self, key: &str) -> u64 {
            self.counters.lock().unwrap()[key].load(Ordering::Relaxed)
        }
        fn gauge(&self, key: &str) -> f64 {
            f64::from_bits(self.gauges.lock().unwrap()[key].load(Ordering::Relaxed))
        }
        fn samples(&self, key: &str) -> Vec<f64> {
            self.histograms.lock().unwrap()[key]
                .0
                .lock()
                .unwrap()
                .clone()
        }
    }

    #[test]
    fn the_per_message_path_records_through_handles_built_once() {
        let recorder = Recording::default();
        let route = metrics::with_local_recorder(&recorder, || RouteMetrics::new("orders-place"));
        let built = recorder.registrations.load(Ordering::Relaxed);
        for _ in 0..1000 {
            route.received();
            let in_flight = route.in_flight(1);
            {
                let _call = route.handler_call();
            }
            route.processed();
            route.acked_processed(time::OffsetDateTime::now_utc() - Duration::from_millis(20));
            drop(in_flight);
        }
        route.dead_lettered(Failure::Undecodable);
        let batch = route.in_flight(3);
        assert_eq!(
            recorder.gauge("idem_messages_in_flight{route=orders-place}"),
            3.0
        );
        drop(batch);
        route.batch_committed(3);

        assert_eq!(
            recorder.registrations.load(Ordering::Relaxed),
            built,
            "nothing is registered (no key or label built) per message"
        );
        assert_eq!(
            recorder.counter("idem_messages_received_total{route=orders-place}"),
            1000
        );
        assert_eq!(
            recorder.counter("idem_messages_processed_total{route=orders-place}"),
            1000
        );
        assert_eq!(
            recorder.counter(
                "idem_messages_dead_lettered_total{route=orders-place,reason=undecodable}"
            ),
            1
        );
        assert_eq!(
            recorder
                .counter("idem_messages_dead_lettered_total{route=orders-place,reason=permanent}"),
            0
        );
        assert_eq!(
            recorder.gauge("idem_messages_in_flight{route=orders-place}"),
            0.0
        );
        assert_eq!(
            recorder
                .samples("idem_handler_duration_seconds{route=orders-place}")
                .len(),
            1000
        );
        let end_to_end = recorder.samples("idem_end_to_end_duration_seconds{route=orders-place}");
        assert_eq!(end_to_end.len(), 1000);
        assert!(
            end_to_end.iter().all(|&seconds| seconds >= 0.02),
            "from the stored time"
        );
        assert_eq!(
            recorder.samples("idem_batch_size{route=orders-place}"),
            [3.0]
        );
    }

    #[test]
    fn a_message_stamped_by_a_clock_ahead_records_no_negative_latency() {
        let recorder = Recording::default();
        let route = metrics::with_local_recorder(&recorder, || RouteMetrics::new("r"));
        route.acked_processed(time::OffsetDateTime::now_utc() + Duration::from_secs(60));
        assert_eq!(
            recorder.samples("idem_end_to_end_duration_seconds{route=r}"),
            [0.0]
        );
    }

    #[test]
    fn every_reason_has_its_own_handle() {
        for (index, reason) in REASONS.into_iter().enumerate() {
            assert_eq!(reason_index(reason), index, "{}", reason.as_str());
        }
    }

    #[test]
    fn the_expiry_figures_set_their_gauges() {
        let recorder = Recording::default();
        let at = time::OffsetDateTime::from_unix_timestamp(1_764_500_000).unwrap();
        let status = crate::retention::status::ExpiryStatus {
            retention: Some(Duration::from_secs(10)),
            current_generation: 7,
            generations: 3,
            due: 2,
            oldest_due_sealed: Some(Duration::from_secs(30)),
            overdue: Duration::from_secs(20),
            transition: Some(crate::retention::expiry::Transition {
                generation: 7,
                waited: Duration::from_millis(4500),
                waiting_for: 3,
                blockers: Vec::new(),
            }),
            last_success: Some(at),
            last_success_age: Some(Duration::from_secs(40)),
            failures: 4,
            last_error: Some("lock timeout".into()),
            last_failure_age: Some(Duration::from_secs(1)),
            current_generation_age: Some(Duration::from_millis(4500)),
        };
        metrics::with_local_recorder(&recorder, || {
            crate::retention::status::record_gauges(&status);
            purge_failed();
            purge_failed();
        });
        assert_eq!(recorder.gauge("idem_expiry_due_generations{}"), 2.0);
        assert_eq!(recorder.gauge("idem_expiry_overdue_seconds{}"), 20.0);
        assert_eq!(recorder.gauge("idem_expiry_transition_seconds{}"), 4.5);
        assert_eq!(
            recorder.gauge("idem_expiry_transition_blocking_transactions{}"),
            3.0
        );
        assert_eq!(
            recorder.gauge("idem_purge_last_success_timestamp_seconds{}"),
            1_764_500_000.0
        );
        assert_eq!(recorder.counter("idem_purge_failures_total{}"), 2);
        let ended = crate::retention::status::ExpiryStatus {
            transition: None,
            ..status
        };
        metrics::with_local_recorder(&recorder, || {
            crate::retention::status::record_gauges(&ended)
        });
        assert_eq!(recorder.gauge("idem_expiry_transition_seconds{}"), 0.0);
        assert_eq!(
            recorder.gauge("idem_expiry_transition_blocking_transactions{}"),
            0.0
        );
    }

    #[test]
    fn the_pull_records_its_refusals_by_reason_and_its_cap() {
        let recorder = Recording::default();
        metrics::with_local_recorder(&recorder, || {
            pull_request_refused("orders", "no_responders");
            pull_request_refused("orders", "no_responders");
            pull_request_refused("orders", "max_waiting");
            pull_request_capped("orders", true);
        });
        assert_eq!(
            recorder.counter("idem_pull_requests_refused_total{route=orders,reason=no_responders}"),
            2
        );
        assert_eq!(
            recorder.counter("idem_pull_requests_refused_total{route=orders,reason=max_waiting}"),
            1
        );
        assert_eq!(
            recorder.gauge("idem_pull_request_capped{route=orders}"),
            1.0
        );
        metrics::with_local_recorder(&recorder, || pull_request_capped("orders", false));
        assert_eq!(
            recorder.gauge("idem_pull_request_capped{route=orders}"),
            0.0
        );
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        let counters = [
            RECEIVED,
            PROCESSED,
            DUPLICATE,
            FAILED,
            RETRIED,
            DEAD_LETTERED,
            REJECTED,
            COMMIT_UNKNOWN,
            DEAD_LETTER_PUBLISH_FAILURES,
            INFRASTRUCTURE_ERRORS,
            BATCH_FALLBACKS,
            ABANDONED_TRANSACTIONS,
            OUTBOX_PUBLISHED,
            OUTBOX_PUBLISH_FAILURES,
            PURGE_FAILURES,
            STARTUP_RETRIES,
            PULL_REQUESTS_REFUSED,
        ];
        for name in counters {
            assert!(
                name.starts_with("idem_") && name.ends_with("_total"),
                "{name}"
            );
        }
        for name in [
            HANDLER_DURATION,
            END_TO_END_DURATION,
            CONNECTION_WAIT,
            OUTBOX_OLDEST_AGE,
            PURGE_LAST_SUCCESS,
            EXPIRY_OVERDUE,
            EXPIRY_ROTATION_OVERDUE,
            TRANSITION_SECONDS,
        ] {
            assert!(name.ends_with("_seconds"), "{name}");
        }
        for (_, buckets) in HISTOGRAM_BUCKETS {
            assert!(buckets.windows(2).all(|pair| pair[0] < pair[1]));
        }
    }
}
