//! The transactional outbox: messages a transaction publishes if, and only
//! if, it commits.
//!
//! A handler that publishes before COMMIT leaves a phantom message when it
//! rolls back; one that publishes after COMMIT loses the message if it
//! crashes in between. Instead, the handler queues the message with
//! [`Outbox::send`]: a row of `idem_outbox`, written in the handler's own
//! transaction, which commits or rolls back with the claim and the business
//! writes. A [`Relay`] publishes committed rows to JetStream and deletes them
//! once JetStream has acknowledged them.
//!
//! ```text
//!  handler transaction (one COMMIT)          relay transaction
//!  ┌──────────────────────────────┐          ┌──────────────────────────────────┐
//!  │ claim (handler, message id)  │          │ SELECT .. FOR UPDATE SKIP LOCKED │
//!  │ business writes              │  NOTIFY  │ publish each, Nats-Msg-Id = id   │──▶ JetStream
//!  │ INSERT INTO idem_outbox ─────┼─────────▶│ await every PubAck               │    (drops a
//!  └──────────────────────────────┘  or poll │ DELETE the acked rows; COMMIT    │◀── republish
//!                                            └──────────────────────────────────┘    in its window)
//! ```
//!
//! # Ids
//!
//! Every queued message carries a `Nats-Msg-Id`, so that JetStream drops a
//! republish (a relay that crashed after the PubAck and before its DELETE)
//! within the stream's duplicate window, and a downstream `#[idempotent]`
//! handler, whose default message id is the `Nats-Msg-Id`, skips one after
//! it.
//!
//! - **In a handler** ([`Outbox`] as a parameter): `<claim key>.<n>`, where
//!   the claim key derives from the handler name and the incoming message id
//!   (the uuid `idem_key(handler, message_id)` gives in SQL) and `n` counts
//!   the messages this call queued, from 0. A rerun after a rollback queues
//!   the same ids; so does a rerun after the claim's retention, which a
//!   downstream handler then skips.
//! - **Outside handlers**, in any transaction: [`Outbox::keyed`] derives the
//!   ids from a key you choose in the same way. Choose it when the work can
//!   be retried (an HTTP request with an idempotency key, a job with an id):
//!   a retry then queues the same ids, and is dropped downstream.
//!   [`Outbox::random`] gives each message a fresh random id: only for work
//!   that is never retried, since every retry sends again.
//!
//! # Ordering
//!
//! One relay publishes the rows it takes in id order (the order they were
//! queued within each transaction), and takes its next batch only after the
//! last one's PubAcks: so with **one relay** the messages one transaction
//! queued reach the stream in the order they were queued, unless a publish
//! fails (the failed message is published again later, after those that
//! followed it). Transactions that commit concurrently may interleave. With
//! **several relays**, nothing is ordered: one may take a transaction's
//! later rows while another holds its earlier ones.
//!
//! # Running a relay
//!
//! [`Router::relay`](crate::Router::relay) runs one beside the router's
//! handlers, stopped only after they have settled their last message; its
//! counters and the outbox's lag are in
//! [`RouterHandle::relay`](crate::RouterHandle::relay). A relay can also run
//! in a process of its own ([`Relay::run_until`]), as many as you like.
//!
//! # Batch handlers
//!
//! A batch handler (`#[idempotent(batch)]`) takes a [`BatchOutbox`]: one
//! [`Outbox`] per message of the batch, in the order of the messages it is
//! given, each with the ids that message would get from a per-message
//! handler. So a batch rolled back and rerun one message per transaction
//! (the batch fallback) queues the same ids again.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use bytes::Bytes;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};

use crate::codec::{Encode, EncodeError, Json};
use crate::delivery::Delivery;
use crate::failure::{Classifier, Classify, ErrorClass};
use crate::state::{FromBatch, FromDelivery, Parameter};

/// The channel the outbox's trigger notifies on each queuing transaction.
pub const CHANNEL: &str = "idem_outbox";

const INSERT_SQL: &str = "\
INSERT INTO idem_outbox (msg_id, subject, payload, headers) VALUES ($1, $2, $3, $4::jsonb) \
ON CONFLICT (msg_id) DO NOTHING";

const TAKE_SQL: &str = "\
SELECT id, msg_id, subject, payload, headers::text FROM idem_outbox \
 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

const DELETE_SQL: &str = "DELETE FROM idem_outbox WHERE id = ANY($1)";

/// Queues messages in the outbox, in the caller's transaction, encoded with
/// codec `C` (JSON by default).
///
/// A handler takes it as a parameter, between the transaction and the
/// message:
///
/// ```
/// use idem_runtime::{idempotent, outbox::Outbox};
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order: i64, amount: i64 }
/// #[derive(serde::Serialize)]
/// struct PaymentRequested { order: i64, amount: i64 }
///
/// #[idempotent(name = "orders.place.v1")]
/// async fn place(
///     tx: &mut sqlx::PgTransaction<'_>,
///     outbox: Outbox,
///     placed: OrderPlaced,
/// ) -> Result<(), idem_runtime::outbox::OutboxError> {
///     sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
///         .bind(placed.order)
///         .bind(placed.amount)
///         .execute(&mut **tx)
///         .await?;
///     let request = PaymentRequested { order: placed.order, amount: placed.amount };
///     outbox.send(tx, "payments.requested", &request).await?;
///     Ok(())
/// }
/// ```
///
/// Outside a handler, make one with [`Outbox::keyed`] or [`Outbox::random`]
/// (see the [module docs](self) for which to choose) and send in any
/// transaction.
pub struct Outbox<C = Json> {
    scope: Scope,
    next: AtomicU32,
    codec: PhantomData<fn() -> C>,
}

enum Scope {
    /// Ids `<key>.<n>`.
    Keyed(String),
    Random,
}

impl<C> std::fmt::Debug for Outbox<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scope = match &self.scope {
            Scope::Keyed(key) => key.as_str(),
            Scope::Random => "random",
        };
        f.debug_struct("Outbox")
            .field("scope", &scope)
            .field("queued", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl<C> Outbox<C> {
    /// The outbox of one handler call: ids derive from the handler the
    /// delivery is handed to and its message id. What the runtime gives a
    /// handler that takes an `Outbox`.
    pub fn for_delivery(delivery: &Delivery) -> Self {
        Self::scoped(crate::claim::key(
            delivery.handler(),
            delivery.message_id().as_str(),
        ))
    }

    /// An outbox whose ids derive from `key` and each message's index:
    /// the same key queues the same ids, so a retry of the work is dropped
    /// downstream. Keys share one namespace, apart from handlers'.
    ///
    /// ```
    /// # use idem_runtime::outbox::Outbox;
    /// let first: Outbox = Outbox::keyed("checkout:4711");
    /// let retry: Outbox = Outbox::keyed("checkout:4711");
    /// assert_eq!(first.next_id(), retry.next_id());
    /// ```
    pub fn keyed(key: &str) -> Self {
        Self::scoped(crate::claim::key("", key))
    }

    /// An outbox that gives each message a random id: for work that is never
    /// retried (every retry sends again).
    pub fn random() -> Self {
        Self {
            scope: Scope::Random,
            next: AtomicU32::new(0),
            codec: PhantomData,
        }
    }

    fn scoped(key: String) -> Self {
        Self {
            scope: Scope::Keyed(key),
            next: AtomicU32::new(0),
            codec: PhantomData,
        }
    }

    /// The id the next message sent will get.
    pub fn next_id(&self) -> String {
        self.id_of(self.next.load(Ordering::Relaxed))
    }

    fn id_of(&self, index: u32) -> String {
        match &self.scope {
            Scope::Keyed(key) => format!("{key}.{index}"),
            Scope::Random => {
                let bits: u128 = rand::random();
                format!("{bits:032x}")
            }
        }
    }

    /// Queues `value`, encoded with `C`, for `subject`, in the transaction
    /// `conn` belongs to (`tx` for a `tx: &mut PgTransaction`, `&mut tx` for
    /// an owned one). Returns
    /// the message's `Nats-Msg-Id`.
    pub async fn send<T>(
        &self,
        conn: &mut PgConnection,
        subject: &str,
        value: &T,
    ) -> Result<String, OutboxError>
    where
        C: Encode<T>,
    {
        self.send_with_headers(conn, subject, value, &HeaderMap::new())
            .await
    }

    /// [`send`](Self::send) with headers. A `Nats-Msg-Id` among them is
    /// replaced by the outbox's id.
    pub async fn send_with_headers<T>(
        &self,
        conn: &mut PgConnection,
        subject: &str,
        value: &T,
        headers: &HeaderMap,
    ) -> Result<String, OutboxError>
    where
        C: Encode<T>,
    {
        let payload = C::encode(value)?;
        check_subject(subject)?;
        let id = self.id_of(self.next.fetch_add(1, Ordering::Relaxed));
        enqueue(conn, &id, subject, &payload, headers).await?;
        Ok(id)
    }
}

impl<C> Parameter for Outbox<C> {}

impl<S, C> FromDelivery<S> for Outbox<C> {
    fn from_delivery(delivery: &Delivery, _: &S) -> Self {
        Self::for_delivery(delivery)
    }
}

/// The outboxes of a batch handler's messages: [`message(i)`](Self::message)
/// is the [`Outbox`] of the batch's message `i` (the handler's messages and
/// deliveries come in the same order), with that message's ids, as a
/// per-message handler of the same name would queue them.
///
/// ```
/// use idem_runtime::{idempotent, outbox::BatchOutbox};
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order: i64 }
/// #[derive(serde::Serialize)]
/// struct PaymentRequested { order: i64 }
///
/// #[idempotent(name = "orders.place_many.v1", batch)]
/// async fn place_many(
///     tx: &mut sqlx::PgTransaction<'_>,
///     outbox: BatchOutbox,
///     placed: Vec<OrderPlaced>,
/// ) -> Result<(), idem_runtime::outbox::OutboxError> {
///     for (i, placed) in placed.iter().enumerate() {
///         let request = PaymentRequested { order: placed.order };
///         outbox.message(i).send(tx, "payments.requested", &request).await?;
///     }
///     Ok(())
/// }
/// ```
pub struct BatchOutbox<C = Json> {
    outboxes: Vec<Outbox<C>>,
}

impl<C> std::fmt::Debug for BatchOutbox<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.outboxes).finish()
    }
}

impl<C> BatchOutbox<C> {
    /// The outboxes of `deliveries`, in their order: what the runtime gives
    /// a batch handler.
    pub fn for_deliveries(deliveries: &[Delivery]) -> Self {
        Self {
            outboxes: deliveries.iter().map(Outbox::for_delivery).collect(),
        }
    }

    /// The outbox of the batch's message `index`.
    ///
    /// # Panics
    ///
    /// If `index` is not below [`len`](Self::len): the batch has no such
    /// message, and a message queued under another's ids would be dropped
    /// downstream as a duplicate.
    pub fn message(&self, index: usize) -> &Outbox<C> {
        match self.outboxes.get(index) {
            Some(outbox) => outbox,
            None => panic!(
                "BatchOutbox::message({index}): the batch has {} messages",
                self.outboxes.len()
            ),
        }
    }

    /// How many messages the batch has.
    pub fn len(&self) -> usize {
        self.outboxes.len()
    }

    /// Whether the batch has no message (never so for a batch handler).
    pub fn is_empty(&self) -> bool {
        self.outboxes.is_empty()
    }
}

impl<C> Parameter for BatchOutbox<C> {}

impl<S, C> FromBatch<S> for BatchOutbox<C> {
    fn from_batch(deliveries: &[Delivery], _: &S) -> Self {
        Self::for_deliveries(deliveries)
    }
}

/// Queues an already encoded message with exactly the id `msg_id`, in the
/// transaction `conn` belongs to. A pending message with the same id makes
/// this one a no-op (JetStream would drop it anyway).
pub async fn enqueue(
    conn: &mut PgConnection,
    msg_id: &str,
    subject: &str,
    payload: &[u8],
    headers: &HeaderMap,
) -> Result<(), OutboxError> {
    check_subject(subject)?;
    // The queuing span's context, taken now: the relay publishes later.
    #[cfg(feature = "otel")]
    let headers = &*crate::trace::with_current_context(headers);
    if msg_id.is_empty() || msg_id.len() > crate::MAX_MESSAGE_ID_LEN {
        return Err(OutboxError::InvalidId(msg_id.to_owned()));
    }
    sqlx::query(INSERT_SQL)
        .bind(msg_id)
        .bind(subject)
        .bind(payload)
        .bind(headers_to_json(headers))
        .execute(conn)
        .await?;
    Ok(())
}

/// A message that could not be queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The value does not encode with the outbox's codec (permanent).
    #[error("an outbox message does not encode")]
    Encode(#[from] EncodeError),
    /// The subject cannot be published to (permanent).
    #[error("outbox subject `{0}` is not a valid publish subject (empty, wildcard or whitespace)")]
    InvalidSubject(String),
    /// The id is empty or longer than `MAX_MESSAGE_ID_LEN` (permanent).
    #[error("outbox message id `{0}` is empty or too long")]
    InvalidId(String),
    /// The INSERT failed (classed as its `sqlx::Error`).
    #[error("queuing an outbox message failed")]
    Database(#[from] sqlx::Error),
}

impl Classify for OutboxError {
    fn class(&self) -> ErrorClass {
        match self {
            OutboxError::Database(error) => ErrorClass::of_sqlx(error),
            _ => ErrorClass::Permanent,
        }
    }
}

inventory::submit! { Classifier::of::<OutboxError>() }

fn check_subject(subject: &str) -> Result<(), OutboxError> {
    let valid = !subject.is_empty()
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
        && !subject.chars().any(char::is_whitespace);
    if valid {
        Ok(())
    } else {
        Err(OutboxError::InvalidSubject(subject.to_owned()))
    }
}

fn headers_to_json(headers: &HeaderMap) -> Option<String> {
    let pairs: Vec<serde_json::Value> = headers
        .iter()
        .filter(|(name, _)| !AsRef::<str>::as_ref(*name).eq_ignore_ascii_case("Nats-Msg-Id"))
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| serde_json::json!([AsRef::<str>::as_ref(name), value.as_str()]))
        })
        .collect();
    (!pairs.is_empty()).then(|| serde_json::Value::Array(pairs).to_string())
}

fn headers_from_json(json: Option<String>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let json = json.and_then(|text| serde_json::from_str(&text).ok());
    if let Some(serde_json::Value::Array(pairs)) = json {
        for pair in pairs {
            if let Some(
                [
                    serde_json::Value::String(name),
                    serde_json::Value::String(value),
                ],
            ) = pair.as_array().map(Vec::as_slice)
            {
                headers.append(name.as_str(), value.as_str());
            }
        }
    }
    headers
}

/// How far the relays are behind: what [`lag`] reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lag {
    /// Committed rows not yet published and deleted.
    pub pending: i64,
    /// How long ago the oldest of them was queued (its transaction's start);
    /// zero when none is pending.
    pub oldest: Duration,
}

/// The outbox's lag: rows pending and the age of the oldest.
pub async fn lag(pool: &PgPool) -> Result<Lag, sqlx::Error> {
    let (pending, oldest): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*), extract(epoch FROM now() - min(created_at))::float8 FROM idem_outbox",
    )
    .fetch_one(pool)
    .await?;
    Ok(Lag {
        pending,
        oldest: Duration::from_secs_f64(oldest.unwrap_or(0.0).max(0.0)),
    })
}

/// Publishes committed outbox rows to JetStream; see the [module docs](self).
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
/// with `FOR UPDATE SKIP LOCKED` (so relays never take the same row),
/// publish them all without waiting, then await every PubAck, delete the
/// rows that were acknowledged and COMMIT. A row whose publish failed stays
/// and is retried; while no publish succeeds (NATS down) the relay backs off
/// (from 100 ms, doubling, up to `max_backoff`). A row no stream stores the
/// subject of stays pending (and in the [`lag`]) until one does. A relay that dies between the PubAck and
/// its COMMIT leaves the rows pending, and the next cycle publishes them
/// again with the same ids: JetStream drops them within its duplicate
/// window, downstream dedup after it.
///
/// It wakes on `NOTIFY idem_outbox` (sent once by each queuing
/// transaction), and polls every `poll_interval` in case a notification was
/// lost (a dropped LISTEN connection) or the trigger is disabled.
#[derive(Clone)]
pub struct Relay {
    batch_size: usize,
    poll_interval: Duration,
    max_backoff: Duration,
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
            .field("poll_interval", &self.poll_interval)
            .field("max_backoff", &self.max_backoff)
            .finish_non_exhaustive()
    }
}

impl Default for Relay {
    fn default() -> Self {
        Self::new()
    }
}

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
pub struct Cycle {
    /// Rows taken.
    pub taken: usize,
    /// Rows published, acknowledged and deleted, in id order.
    pub published: Vec<Published>,
    /// Rows whose publish failed (left pending).
    pub failed: usize,
}

/// Counters of one relay (and its clones), readable while it runs.
#[derive(Debug, Clone, Default)]
pub struct RelayStats(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    cycles: AtomicU64,
    /// The last [`lag`] the relay read, and when.
    lag: Mutex<Option<(Lag, Instant)>>,
}

impl RelayStats {
    /// Messages published and deleted, duplicates included.
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

    /// Cycles that took at least one row.
    pub fn cycles(&self) -> u64 {
        self.0.cycles.load(Ordering::Relaxed)
    }

    /// The outbox's [`lag`] as the relay last read it (about once per poll
    /// interval, at most once a second, while it runs), and how long ago; `None` before the first
    /// reading. The lag counts every relay's rows, not only this one's.
    pub fn lag(&self) -> Option<(Lag, Duration)> {
        let reading = *self.0.lag.lock().unwrap_or_else(|e| e.into_inner());
        reading.map(|(lag, at)| (lag, at.elapsed()))
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

enum Wake {
    Notified,
    Polled,
    ListenFailed(sqlx::Error),
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The shortest time between two readings of the [`lag`] by a relay (a
/// `count(*)` of the outbox), however short its poll interval.
const LAG_READ_EVERY: Duration = Duration::from_secs(1);

/// The most cycles a relay runs after it is told to stop (see
/// [`Relay::run_until`]): a stop is not held up by a long backlog.
pub const FINAL_CYCLES: usize = 8;

impl Relay {
    /// A relay with the defaults: batches of 1024 rows, a poll every second,
    /// backoff up to 5 s.
    pub fn new() -> Self {
        Self {
            batch_size: 1024,
            poll_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(5),
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

    /// How often the relay looks for rows without a notification
    /// (default 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The longest wait between cycles while publishes fail (default 5 s).
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff.max(FIRST_BACKOFF);
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

    /// Runs cycles until `shutdown` completes (checked between cycles and
    /// while waiting, never during a cycle), or a cycle dies. Database
    /// errors are logged and retried after a backoff.
    ///
    /// When `shutdown` completes, the relay first publishes what is pending
    /// then, in up to [`FINAL_CYCLES`] more cycles, and stops early at the
    /// first cycle that is not full or has a failed publish (NATS away):
    /// those rows stay for the next relay.
    pub async fn run_until(
        self,
        nats: async_nats::Client,
        pool: PgPool,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RelayError> {
        let js = jetstream::new(nats);
        let mut shutdown = pin!(shutdown);
        let mut listener = None;
        let mut backoff: Option<Duration> = None;
        let mut lag_read: Option<Instant> = None;
        loop {
            // About once per poll interval, whether woken by notifications
            // or by the poll: a relay kept busy by notifications still
            // reports how far behind it is.
            if lag_read.is_none_or(|at| at.elapsed() >= self.poll_interval.max(LAG_READ_EVERY)) {
                self.read_lag(&pool).await;
                lag_read = Some(Instant::now());
            }
            if listener.is_none() {
                listener = listen(&pool).await;
            }
            // Drain: full batches mean more may be waiting.
            loop {
                if futures_util::FutureExt::now_or_never(shutdown.as_mut()).is_some() {
                    return self.final_cycles(&js, &pool).await;
                }
                match self.relay_batch(&js, &pool).await {
                    // Nothing went out: NATS is down (or no stream stores
                    // any of these subjects). Wait before trying again.
                    Ok(cycle) if cycle.failed > 0 && cycle.published.is_empty() => {
                        let next = backoff.map_or(FIRST_BACKOFF, |b| (b * 2).min(self.max_backoff));
                        tracing::warn!(
                            failed = cycle.failed,
                            published = cycle.published.len(),
                            backoff_ms = next.as_millis() as u64,
                            "outbox publishes failed; backing off"
                        );
                        backoff = Some(next);
                        break;
                    }
                    // Some went out: NATS is up. A row whose publish keeps
                    // failing (no stream stores its subject) stays pending,
                    // visible in the lag, without slowing the others.
                    Ok(cycle) => {
                        if cycle.failed > 0 {
                            tracing::warn!(
                                failed = cycle.failed,
                                published = cycle.published.len(),
                                "some outbox publishes failed; they stay pending"
                            );
                        }
                        backoff = None;
                        if cycle.taken < self.batch_size {
                            break;
                        }
                    }
                    Err(RelayError::Database(error)) => {
                        let next = backoff.map_or(FIRST_BACKOFF, |b| (b * 2).min(self.max_backoff));
                        tracing::warn!(%error, backoff_ms = next.as_millis() as u64, "outbox relay cycle failed; backing off");
                        backoff = Some(next);
                        break;
                    }
                    Err(error) => return Err(error),
                }
            }
            let wait = backoff.unwrap_or(self.poll_interval);
            // Only waits are raced here, never BEGIN or COMMIT (sqlx#4393):
            // a cycle always runs to its end.
            let waited = async {
                match listener.as_mut() {
                    Some(l) if backoff.is_none() => {
                        match tokio::time::timeout(wait, l.try_recv()).await {
                            Ok(Ok(Some(_))) => {
                                // One cycle serves every notification so far.
                                while l.next_buffered().is_some() {}
                                Wake::Notified
                            }
                            // The LISTEN connection was lost; it reconnects
                            // on the next call.
                            Ok(Ok(None)) | Err(_) => Wake::Polled,
                            Ok(Err(error)) => Wake::ListenFailed(error),
                        }
                    }
                    _ => {
                        tokio::time::sleep(wait).await;
                        Wake::Polled
                    }
                }
            };
            let wake = tokio::select! {
                () = &mut shutdown => return self.final_cycles(&js, &pool).await,
                wake = waited => wake,
            };
            match wake {
                Wake::Notified | Wake::Polled => {}
                Wake::ListenFailed(error) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling");
                    listener = None;
                }
            }
        }
    }

    /// The cycles a stopping relay runs, so that a router's relay publishes
    /// what its last handlers queued (see [`Relay::run_until`]).
    async fn final_cycles(&self, js: &jetstream::Context, pool: &PgPool) -> Result<(), RelayError> {
        for _ in 0..FINAL_CYCLES {
            match self.relay_batch(js, pool).await {
                Ok(cycle) if cycle.failed == 0 && cycle.taken == self.batch_size => {}
                Ok(cycle) => {
                    if cycle.failed > 0 {
                        tracing::warn!(
                            failed = cycle.failed,
                            "outbox publishes failed while stopping; they stay pending for the next relay"
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

    /// Reads the outbox's lag into the stats, and traces it: at info when
    /// a row has waited longer than a poll interval (the relays are behind,
    /// or cannot publish), at debug otherwise.
    async fn read_lag(&self, pool: &PgPool) {
        match lag(pool).await {
            Ok(lag) => {
                *self.stats.0.lag.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((lag, Instant::now()));
                crate::metrics::outbox_lag(&lag);
                let oldest_ms = lag.oldest.as_millis() as u64;
                if lag.oldest >= self.poll_interval {
                    tracing::info!(pending = lag.pending, oldest_ms, "outbox lag");
                } else {
                    tracing::debug!(pending = lag.pending, oldest_ms, "outbox lag");
                }
            }
            Err(error) => tracing::debug!(%error, "outbox lag unreadable"),
        }
    }

    /// One cycle: takes up to `batch_size` pending rows, publishes them,
    /// and deletes those JetStream acknowledged, in one transaction.
    pub async fn relay_batch(
        &self,
        js: &jetstream::Context,
        pool: &PgPool,
    ) -> Result<Cycle, RelayError> {
        type Row = (i64, String, String, Vec<u8>, Option<String>);
        let mut tx = pool.begin().await?;
        let rows: Vec<Row> = sqlx::query_as(TAKE_SQL)
            .bind(i64::try_from(self.batch_size).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(Cycle::default());
        }
        let mut cycle = Cycle {
            taken: rows.len(),
            ..Cycle::default()
        };
        // Send every publish, then await the PubAcks: one round trip's wait
        // for the whole batch.
        let mut in_flight = Vec::with_capacity(rows.len());
        let taken = rows.len();
        for (sent, (id, msg_id, subject, payload, headers)) in rows.into_iter().enumerate() {
            let publish = PublishMessage::build()
                .payload(Bytes::from(payload))
                .headers(headers_from_json(headers))
                .message_id(&msg_id);
            match js.send_publish(subject.clone(), publish).await {
                Ok(ack) => in_flight.push((id, msg_id, subject, ack)),
                // This row can never be sent (too big for the server): it
                // stays pending, in the lag, and the rest go on.
                Err(error) if error.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    tracing::error!(%error, msg_id, subject, "outbox message too big to publish; it stays pending");
                    cycle.failed += 1;
                }
                Err(error) => {
                    // The client could not queue it (disconnected, its
                    // buffer full): each further send would wait out its own
                    // timeout, so the rest stay pending for the next cycle.
                    tracing::warn!(%error, msg_id, subject, "outbox publish not sent; the rest of the batch waits");
                    cycle.failed += taken - sent;
                    break;
                }
            }
        }
        let (ids, acks): (Vec<_>, Vec<_>) = in_flight
            .into_iter()
            .map(|(id, msg_id, subject, ack)| ((id, msg_id, subject), ack.into_future()))
            .unzip();
        let acks = futures_util::future::join_all(acks).await;
        let mut sent = Vec::with_capacity(ids.len());
        for ((id, msg_id, subject), ack) in ids.into_iter().zip(acks) {
            match ack {
                Ok(ack) => {
                    sent.push(id);
                    cycle.published.push(Published {
                        msg_id,
                        subject,
                        stream_sequence: ack.sequence,
                        duplicate: ack.duplicate,
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, msg_id, subject, "outbox publish not acknowledged");
                    cycle.failed += 1;
                }
            }
        }
        #[cfg(feature = "fault-injection")]
        if let Some(hook) = &self.after_pubacks
            && hook(&cycle.published) == crate::fault::AfterPubAcks::Crash
        {
            drop(tx);
            return Err(RelayError::InjectedCrash(cycle.published.len()));
        }
        if !sent.is_empty() {
            sqlx::query(DELETE_SQL)
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        let duplicates = cycle.published.iter().filter(|p| p.duplicate).count();
        crate::metrics::outbox_cycle(cycle.published.len(), cycle.failed);
        let counters = &self.stats.0;
        counters.cycles.fetch_add(1, Ordering::Relaxed);
        counters
            .published
            .fetch_add(cycle.published.len() as u64, Ordering::Relaxed);
        counters
            .duplicates
            .fetch_add(duplicates as u64, Ordering::Relaxed);
        counters
            .failed
            .fetch_add(cycle.failed as u64, Ordering::Relaxed);
        tracing::debug!(
            taken = cycle.taken,
            published = cycle.published.len(),
            duplicates,
            failed = cycle.failed,
            "outbox cycle"
        );
        Ok(cycle)
    }
}

async fn listen(pool: &PgPool) -> Option<PgListener> {
    let listener = async {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(CHANNEL).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    match listener.await {
        Ok(listener) => Some(listener),
        Err(error) => {
            tracing::warn!(%error, "outbox LISTEN failed; polling");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deterministic_per_scope_and_index() {
        let delivery = Delivery::for_test("orders.placed", "ORDERS", 7)
            .with_header("Nats-Msg-Id", "order-7")
            .for_handler("orders.place.v1");
        let first: Outbox = Outbox::for_delivery(&delivery);
        let rerun: Outbox = Outbox::for_delivery(&delivery);
        let key = crate::claim::key("orders.place.v1", "order-7");
        assert_eq!(first.id_of(0), format!("{key}.0"));
        assert_eq!(first.id_of(3), rerun.id_of(3));
        let other: Outbox = Outbox::for_delivery(&delivery.clone().for_handler("other"));
        assert_ne!(first.id_of(0), other.id_of(0));
        let random: Outbox = Outbox::random();
        assert_ne!(random.id_of(0), random.id_of(0));
    }

    #[test]
    fn a_batch_message_gets_the_ids_a_per_message_handler_would() {
        let deliveries: Vec<Delivery> = (1..=3)
            .map(|seq| {
                Delivery::for_test("orders.placed", "ORDERS", seq)
                    .with_header("Nats-Msg-Id", &format!("order-{seq}"))
                    .for_handler("orders.place_many.v1")
            })
            .collect();
        let batch: BatchOutbox = BatchOutbox::for_deliveries(&deliveries);
        assert_eq!(batch.len(), 3);
        for (i, delivery) in deliveries.iter().enumerate() {
            let alone: Outbox = Outbox::for_delivery(delivery);
            assert_eq!(batch.message(i).next_id(), alone.next_id());
        }
        // The fallback's batch of one message queues that message's ids.
        let fallback: BatchOutbox = BatchOutbox::for_deliveries(&deliveries[1..2]);
        assert_eq!(fallback.message(0).next_id(), batch.message(1).next_id());
    }

    #[test]
    fn subjects_are_checked() {
        assert!(check_subject("orders.paid").is_ok());
        for bad in ["", "orders.*", "orders.>", "a..b", "a b", ".a"] {
            assert!(check_subject(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn headers_round_trip_without_the_msg_id() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "ignored");
        headers.append("X-Trace", "a");
        headers.append("X-Trace", "b");
        let back = headers_from_json(headers_to_json(&headers));
        assert!(back.get("Nats-Msg-Id").is_none());
        let traces: Vec<&str> = back.get_all("X-Trace").map(|v| v.as_str()).collect();
        assert_eq!(traces, ["a", "b"]);
        assert!(headers_to_json(&HeaderMap::new()).is_none());
    }
}
