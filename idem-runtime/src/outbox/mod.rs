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
//!  │ claim (handler, message id)  │  wake-up │ SELECT .. FOR UPDATE SKIP LOCKED │
//!  │ business writes              │ in proc. │ publish each, Nats-Msg-Id = id   │──▶ JetStream
//!  │ INSERT INTO idem_outbox ─────┼─────────▶│ await every PubAck               │    (drops a
//!  └──────────────────────────────┘  or poll │ DELETE the acked rows; COMMIT    │◀── republish
//!                                            └──────────────────────────────────┘    in its window)
//! ```
//!
//! While one relay transaction awaits its PubAcks, the one before it
//! commits and the one after it takes its rows, on a second connection.
//!
//! That is PostgreSQL's relay, and MariaDB's (whose cycles run at READ
//! COMMITTED, see the guide's MariaDB chapter). On SQLite, which has one
//! writer at a time, a cycle leases its rows in a short write transaction,
//! publishes with none open, and deletes them in a second one (see the
//! guide's SQLite chapter). The same [`Outbox`], [`Relay`], [`lag`](fn@lag)
//! and [`retry_failing`] serve all three: a handler's transaction, and the
//! pool a relay is given, choose the database.
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
//! # When a publish fails
//!
//! A relay tells two failures apart, so that neither stops the outbox:
//!
//! - **NATS is away.** When no publish of a cycle succeeds, the relay asks
//!   JetStream for its account info. If that gets no answer either, nothing
//!   is recorded on the rows: they stay as they were, the relay backs off
//!   (100 ms, doubling up to [`Relay::max_backoff`]) and goes on reading,
//!   and discarding, its notifications meanwhile, so that PostgreSQL's
//!   server-wide notification queue does not fill. Once NATS answers again
//!   the rows go out within about `max_backoff`.
//! - **A row's own failure** (no stream stores its subject, it is above the
//!   stream's `max_msg_size` or the server's `max_payload`, the relay's
//!   NATS user may not publish to its subject) is recorded on the row:
//!   `attempts`, `last_error`, and `not_before`, its own back-off (1 s,
//!   doubling up to [`Relay::max_row_backoff`]). Such a row is retried
//!   apart, in a lane of its own, so it never holds up the rows queued after
//!   it, and a retry that waits out a PubAck timeout holds up no fresh row.
//!   Failing rows are reported with their subject and error in the
//!   [`lag`](fn@lag) ([`Lag::failures`]), in the metric
//!   `idem_outbox_failing_rows`, in a warning at each failure, and by `idem
//!   status`. Once the cause is fixed, [`retry_failing`] (`idem outbox
//!   retry`) makes them due at once.
//!
//! A PubAck that does not come while those of later publishes of its cycle
//! did (a publish the server refused for want of permission gets no answer
//! at all) is given up on a second (or as long as the last answer took, if
//! longer) after the last answer, and its row counts as failed; PubAcks
//! missing only after the last answer (a stream that is slow, and answers
//! in order) wait out the client's timeout. If that publish still lands,
//! JetStream drops the retry as a duplicate. PubAcks lost with the
//! connection are not blamed on their rows; a row over which the server
//! drops the connection is found by publishing one row per cycle after two
//! cycles in a row lost it.
//!
//! # Ordering
//!
//! One relay publishes the rows it takes in id order (the order they were
//! queued within each transaction), and publishes its next batch only after
//! the last one's PubAcks (it may take it earlier, locking the rows after
//! the last batch's): so with **one relay** the messages one transaction
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
//! The code: `relay.rs` holds the relay's two lanes (fresh rows; failing
//! rows once due), `cycle.rs` one cycle's steps (take, publish, PubAcks,
//! blame, finish), `drain.rs` how the fresh lane overlaps its cycles,
//! `store/outbox.rs` what a relay asks of its database (`OutboxStore`)
//! and the messages a cycle sends PostgreSQL (each step one round trip;
//! `store/sqlite/outbox.rs` and `store/mariadb/outbox.rs` for the others), `wake.rs` what wakes the fresh lane (this process's commits,
//! notifications and the poll, folded into one wake-up), `stats.rs` what
//! the relay counts, `lag.rs` what an operator reads and retries.
//!
//! # Batch handlers
//!
//! A batch handler (`#[idempotent(batch)]`) takes a [`BatchOutbox`]: one
//! [`Outbox`] per message of the batch, in the order of the messages it is
//! given, each with the ids that message would get from a per-message
//! handler. So a batch rolled back and rerun one message per transaction
//! (the batch fallback) queues the same ids again.

mod cycle;
mod drain;
mod lag;
mod relay;
mod stats;
mod wake;

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

use async_nats::HeaderMap;
use sqlx::Transaction;

use crate::codec::{Encode, EncodeError, Json};
use crate::error::class::{Classifier, Classify, ErrorClass};
use crate::handler::delivery::Delivery;
use crate::handler::state::{FromBatch, FromDelivery, Parameter};
use crate::store::outbox::OutboxStore;

pub use cycle::RelayError;
pub(crate) use lag::notify_trigger_enabled;
pub(crate) use lag::record_gauges as record_lag_gauges;
pub use lag::{BLOCKED_AFTER, Blocked, Failing, Lag, MOST_FAILURES, lag, retry_failing};
pub use relay::{FINAL_CYCLES, Relay};
pub use stats::{Cycle, Drain, Published, RelayStats};
pub(crate) use wake::{Bell, after_commit};
pub use wake::{wake_local_relays, wake_relays};

/// The channel the outbox's trigger notifies on each queuing transaction.
pub const CHANNEL: &str = "idem_outbox";

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
    /// The handler call's delivery, marked when a message is queued, so
    /// that the runtime wakes this process's relays after its COMMIT.
    delivery: Option<Delivery>,
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
        Self {
            delivery: Some(delivery.clone()),
            ..Self::scoped(crate::store::claim::key(
                delivery.handler(),
                delivery.message_id().as_str(),
            ))
        }
    }

    /// An outbox whose ids derive from `key` and each message's index:
    /// the same key queues the same ids, so a retry of the work is dropped
    /// downstream. Keys share one namespace, apart from handlers'.
    ///
    /// Outside a handler the runtime does not see your COMMIT: call
    /// [`wake_local_relays`] after it, or a relay finds the rows at its next
    /// poll.
    ///
    /// ```
    /// # use idem_runtime::outbox::Outbox;
    /// let first: Outbox = Outbox::keyed("checkout:4711");
    /// let retry: Outbox = Outbox::keyed("checkout:4711");
    /// assert_eq!(first.next_id(), retry.next_id());
    /// ```
    pub fn keyed(key: &str) -> Self {
        Self::scoped(crate::store::claim::key("", key))
    }

    /// An outbox that gives each message a random id: for work that is never
    /// retried (every retry sends again).
    pub fn random() -> Self {
        Self {
            scope: Scope::Random,
            next: AtomicU32::new(0),
            delivery: None,
            codec: PhantomData,
        }
    }

    fn scoped(key: String) -> Self {
        Self {
            scope: Scope::Keyed(key),
            next: AtomicU32::new(0),
            delivery: None,
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
    /// an owned one; a transaction of any database idem runs on, or its
    /// connection: see [`Transactional`]). Returns
    /// the message's `Nats-Msg-Id`.
    pub async fn send<T>(
        &self,
        conn: &mut impl Transactional,
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
        conn: &mut impl Transactional,
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
        if let Some(delivery) = &self.delivery {
            delivery.mark_outbox_queued();
        }
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
    conn: &mut impl Transactional,
    msg_id: &str,
    subject: &str,
    payload: &[u8],
    headers: &HeaderMap,
) -> Result<(), OutboxError> {
    check_subject(subject)?;
    // The queuing span's context, taken now: the relay publishes later.
    #[cfg(feature = "otel")]
    let headers = &*crate::observe::trace::with_current_context(headers);
    if !valid_id(msg_id) {
        return Err(OutboxError::InvalidId(msg_id.to_owned()));
    }
    conn.queue(msg_id, subject, payload, headers_to_json(headers))
        .await?;
    Ok(())
}

/// What an outbox message is queued in: a transaction (`&mut
/// sqlx::Transaction<'_, DB>`) on a database idem runs on, or the
/// connection of one (`&mut sqlx::PgConnection`, `&mut
/// sqlx::SqliteConnection`, `&mut sqlx::MySqlConnection`, each with its
/// feature), or a pooled connection (the row then commits on its own).
/// Sealed: idem implements it for those types only.
pub trait Transactional: sealed::Sealed + Send {
    /// Queues a row in the transaction this is, or belongs to.
    #[doc(hidden)]
    fn queue(
        &mut self,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        headers: Option<String>,
    ) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send;
}

mod sealed {
    pub trait Sealed {}
}

/// `$type`, on `$database`, as a [`Transactional`]: its row goes in
/// through `$database`'s [`OutboxStore::queue`], given `&mut *self` (a
/// transaction or a pooled connection derefs to its connection).
macro_rules! transactional {
    ([$($generics:tt)*] $type:ty, $database:ty) => {
        impl $($generics)* sealed::Sealed for $type {}

        impl $($generics)* Transactional for $type {
            async fn queue(
                &mut self,
                msg_id: &str,
                subject: &str,
                payload: &[u8],
                headers: Option<String>,
            ) -> Result<(), sqlx::Error> {
                <$database as OutboxStore>::queue(&mut *self, msg_id, subject, payload, headers)
                    .await
            }
        }
    };
}

transactional!([<'c, DB: OutboxStore>] Transaction<'c, DB>, DB);
// A pooled connection outside a transaction: the row is queued on its own.
transactional!([<DB: OutboxStore>] sqlx::pool::PoolConnection<DB>, DB);
transactional!([] sqlx::PgConnection, sqlx::Postgres);
#[cfg(feature = "sqlite")]
transactional!([] sqlx::SqliteConnection, sqlx::Sqlite);
#[cfg(feature = "mariadb")]
transactional!([] sqlx::MySqlConnection, sqlx::MySql);

/// A message that could not be queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The value does not encode with the outbox's codec (permanent).
    #[error("an outbox message does not encode")]
    Encode(#[from] EncodeError),
    /// The subject cannot be published to (permanent).
    #[error(
        "outbox subject `{0}` is not a valid publish subject (empty, a wildcard, whitespace, or longer than MAX_SUBJECT_LEN)"
    )]
    InvalidSubject(String),
    /// The id is empty, longer than `MAX_MESSAGE_ID_LEN`, or holds a
    /// carriage return or line feed (no NATS header can carry one) or NUL
    /// (permanent).
    #[error(
        "outbox message id {0:?} is empty, too long, or holds a carriage return, line feed or NUL"
    )]
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

/// The longest subject the outbox takes. nats-server reads at most
/// `max_control_line` (4 KiB by default) of a protocol line, subject and
/// reply inbox included, and closes the connection of a client that sends
/// a longer one: a row with such a subject would cut its relay off NATS at
/// every attempt.
pub const MAX_SUBJECT_LEN: usize = 1024;

fn check_subject(subject: &str) -> Result<(), OutboxError> {
    let valid = !subject.is_empty()
        && subject.len() <= MAX_SUBJECT_LEN
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

/// The headers of a row, with its `Nats-Msg-Id`, as the relay publishes
/// them; or why they cannot be sent. The NATS client panics on a header
/// name or value it cannot encode, and a row written by hand may hold one,
/// so each is checked here first: such a row is reported, not fatal.
fn message_headers(json: Option<String>, msg_id: &str) -> Result<HeaderMap, String> {
    use async_nats::{HeaderName, HeaderValue};
    use std::str::FromStr;

    let value = |text: &str, what: &str| {
        HeaderValue::from_str(text).map_err(|_| {
            format!("{what} holds a carriage return or line feed, which no NATS header can carry: it can never be published; delete the row")
        })
    };
    let mut headers = HeaderMap::new();
    let json = json.and_then(|text| serde_json::from_str(&text).ok());
    if let Some(serde_json::Value::Array(pairs)) = json {
        for pair in pairs {
            if let Some(
                [
                    serde_json::Value::String(name),
                    serde_json::Value::String(text),
                ],
            ) = pair.as_array().map(Vec::as_slice)
            {
                let header = HeaderName::from_str(name).map_err(|_| {
                    format!("header name `{name}` is not a valid NATS header name (control characters, spaces, non-ASCII or `:`): it can never be published; delete the row")
                })?;
                headers.append(header, value(text, &format!("header `{name}`"))?);
            }
        }
    }
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        value(msg_id, "its message id (the Nats-Msg-Id header)")?,
    );
    Ok(headers)
}

/// Whether `msg_id` can be a `Nats-Msg-Id`: not empty, not longer than
/// `MAX_MESSAGE_ID_LEN`, and without a carriage return or line feed (no
/// NATS header can carry one) or NUL (PostgreSQL's text cannot).
fn valid_id(msg_id: &str) -> bool {
    !msg_id.is_empty()
        && msg_id.len() <= crate::MAX_MESSAGE_ID_LEN
        && !msg_id.contains(['\r', '\n', '\0'])
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
        let key = crate::store::claim::key("orders.place.v1", "order-7");
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
    fn ids_a_header_cannot_carry_are_refused() {
        assert!(valid_id("order-7.0"));
        assert!(valid_id("tab\tis-fine"));
        for bad in ["", "line\nfeed", "carriage\rreturn", "nul\0"] {
            assert!(!valid_id(bad), "{bad:?}");
        }
        assert!(!valid_id(&"x".repeat(crate::MAX_MESSAGE_ID_LEN + 1)));
        assert!(message_headers(None, "line\nfeed").is_err());
        let bad_name = Some(r#"[["a name", "v"]]"#.to_owned());
        assert!(
            message_headers(bad_name, "id")
                .unwrap_err()
                .contains("header name")
        );
    }

    #[test]
    fn subjects_are_checked() {
        assert!(check_subject("orders.paid").is_ok());
        for bad in ["", "orders.*", "orders.>", "a..b", "a b", ".a"] {
            assert!(check_subject(bad).is_err(), "{bad:?}");
        }
        assert!(check_subject(&"a".repeat(MAX_SUBJECT_LEN)).is_ok());
        assert!(check_subject(&"a".repeat(MAX_SUBJECT_LEN + 1)).is_err());
    }

    #[test]
    fn headers_round_trip_without_the_msg_id() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "ignored");
        headers.append("X-Trace", "a");
        headers.append("X-Trace", "b");
        let back = message_headers(headers_to_json(&headers), "the-id").unwrap();
        assert_eq!(back.get("Nats-Msg-Id").unwrap().as_str(), "the-id");
        let traces: Vec<&str> = back.get_all("X-Trace").map(|v| v.as_str()).collect();
        assert_eq!(traces, ["a", "b"]);
        assert!(headers_to_json(&HeaderMap::new()).is_none());
    }
}
