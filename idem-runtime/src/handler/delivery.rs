//! What a handler may know about the delivery it is processing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::HeaderMap;
use async_nats::jetstream::Message;

use crate::message_id::MessageId;

/// The metadata of one JetStream delivery, handed to a handler that asks for it.
///
/// A handler opts in by taking `&Delivery` between the transaction and the
/// message:
///
/// ```
/// use idem_runtime::{Delivery, idempotent};
///
/// #[derive(serde::Deserialize)]
/// struct Ping {}
///
/// #[idempotent]
/// async fn ping(
///     tx: &mut sqlx::PgTransaction<'_>,
///     delivery: &Delivery,
///     _ping: Ping,
/// ) -> Result<(), sqlx::Error> {
///     tracing::info!(seq = delivery.stream_sequence(), attempt = delivery.delivered(), "ping");
///     Ok(())
/// }
/// ```
///
/// Cloning one is cheap (a reference count): the runtime hands the same
/// delivery to a transaction, its retries and its dead letter.
///
/// A request on a [`ReplyRoute`](crate::ReplyRoute) is not stored in a
/// stream: its delivery has the request's subject, headers and message id,
/// an empty [`stream`](Delivery::stream) and [`consumer`](Delivery::consumer),
/// [`stream_sequence`](Delivery::stream_sequence) 0,
/// [`delivered`](Delivery::delivered) 1 (each retry of a request is a new
/// request), and [`stored_at`](Delivery::stored_at) the time it was
/// received.
#[derive(Clone)]
pub struct Delivery(Arc<Fields>, Arc<AtomicBool>);

#[derive(Debug, Clone)]
pub(crate) struct Fields {
    pub(crate) subject: String,
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) stream_sequence: u64,
    pub(crate) delivered: u64,
    pub(crate) stored_at: time::OffsetDateTime,
    pub(crate) headers: HeaderMap,
    pub(crate) message_id: MessageId,
    pub(crate) handler: &'static str,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields = &*self.0;
        f.debug_struct("Delivery")
            .field("subject", &fields.subject)
            .field("stream", &fields.stream)
            .field("consumer", &fields.consumer)
            .field("stream_sequence", &fields.stream_sequence)
            .field("delivered", &fields.delivered)
            .field("stored_at", &fields.stored_at)
            .field("headers", &fields.headers)
            .field("message_id", &fields.message_id)
            .field("handler", &fields.handler)
            .finish()
    }
}

impl Delivery {
    /// Reads the delivery metadata off a JetStream message. The message id is
    /// resolved later, by the pipeline; until then it is the stream-position
    /// fallback.
    pub(crate) fn from_message(message: &Message) -> Result<Self, async_nats::Error> {
        let info = message.info()?;
        let stream = info.stream.to_owned();
        let stream_sequence = info.stream_sequence;
        let stored_at = info.published;
        Ok(Self::new(Fields {
            subject: message.subject.to_string(),
            consumer: info.consumer.to_owned(),
            delivered: u64::try_from(info.delivered).unwrap_or(0),
            stored_at,
            headers: message.headers.clone().unwrap_or_default(),
            message_id: MessageId::from_stream_position(&stream, stream_sequence, stored_at),
            handler: "",
            stream,
            stream_sequence,
        }))
    }

    /// The delivery of a core NATS request (see the type's docs), with its
    /// resolved message id.
    pub(crate) fn for_request(
        subject: &str,
        headers: HeaderMap,
        message_id: MessageId,
    ) -> Delivery {
        Delivery::new(Fields {
            subject: subject.to_owned(),
            stream: String::new(),
            consumer: String::new(),
            stream_sequence: 0,
            delivered: 1,
            stored_at: time::OffsetDateTime::now_utc(),
            headers,
            message_id,
            handler: "",
        })
    }

    pub(crate) fn new(fields: Fields) -> Self {
        Delivery(Arc::new(fields), Arc::default())
    }

    /// Notes that a transaction of this delivery queued outbox rows (set by
    /// [`Outbox::send`](crate::outbox::Outbox::send)), so that the runtime
    /// wakes the relays of this process once it has committed (see
    /// `outbox/wake.rs`). Shared by every clone.
    pub(crate) fn mark_outbox_queued(&self) {
        self.1.store(true, Ordering::Release);
    }

    /// Whether outbox rows were queued since the last call, clearing the
    /// mark: asked after each COMMIT. A mark left by an attempt that rolled
    /// back costs at most one empty relay cycle.
    pub(crate) fn take_outbox_queued(&self) -> bool {
        self.1.swap(false, Ordering::AcqRel)
    }

    /// Sets the id the delivery is deduplicated by, once resolved.
    pub(crate) fn set_message_id(&mut self, id: MessageId) {
        Arc::make_mut(&mut self.0).message_id = id;
    }

    /// Names the handler the delivery is handed to (by the pipeline, before
    /// the handler runs), for the ids of the messages it queues.
    pub(crate) fn set_handler(&mut self, handler: &'static str) {
        Arc::make_mut(&mut self.0).handler = handler;
    }

    /// This delivery as handed to the handler named `handler`: for a test of
    /// a handler that queues messages in the [outbox](crate::outbox), whose
    /// ids derive from the handler name.
    ///
    /// ```
    /// let delivery = idem_runtime::Delivery::for_test("orders.placed", "ORDERS", 7)
    ///     .for_handler("orders.place.v1");
    /// assert_eq!(delivery.handler(), "orders.place.v1");
    /// ```
    pub fn for_handler(mut self, handler: &'static str) -> Delivery {
        self.set_handler(handler);
        self
    }

    /// A delivery made up for a test of a handler: the first delivery of
    /// message `stream_sequence` of `stream`, published to `subject`, stored
    /// now, without headers. Its message id is its stream position until a
    /// header or the runtime says otherwise.
    ///
    /// ```
    /// let delivery = idem_runtime::Delivery::for_test("orders.placed", "ORDERS", 7)
    ///     .with_header("Nats-Msg-Id", "order-7");
    /// assert_eq!(delivery.subject(), "orders.placed");
    /// assert_eq!(delivery.message_id().as_str(), "order-7");
    /// ```
    pub fn for_test(
        subject: impl Into<String>,
        stream: impl Into<String>,
        stream_sequence: u64,
    ) -> Delivery {
        let stream = stream.into();
        let stored_at = time::OffsetDateTime::now_utc();
        Delivery::new(Fields {
            subject: subject.into(),
            consumer: "test".into(),
            delivered: 1,
            stored_at,
            headers: HeaderMap::new(),
            message_id: MessageId::from_stream_position(&stream, stream_sequence, stored_at),
            handler: "",
            stream,
            stream_sequence,
        })
    }

    /// This delivery with header `name` set to `value` (a `Nats-Msg-Id`
    /// becomes its message id).
    pub fn with_header(mut self, name: &str, value: &str) -> Delivery {
        let fields = Arc::make_mut(&mut self.0);
        fields.headers.insert(name, value);
        if let Ok(id) = MessageId::of_delivery(
            &fields.headers,
            &fields.stream,
            fields.stream_sequence,
            fields.stored_at,
        ) {
            fields.message_id = id;
        }
        self
    }

    /// The subject the message was published to.
    pub fn subject(&self) -> &str {
        &self.0.subject
    }

    /// The JetStream stream that stores the message.
    pub fn stream(&self) -> &str {
        &self.0.stream
    }

    /// The durable consumer that delivered the message.
    pub fn consumer(&self) -> &str {
        &self.0.consumer
    }

    /// The message's sequence number in its stream.
    pub fn stream_sequence(&self) -> u64 {
        self.0.stream_sequence
    }

    /// When JetStream stored the message.
    pub fn stored_at(&self) -> time::OffsetDateTime {
        self.0.stored_at
    }

    /// How many times the message has been delivered, this delivery included
    /// (1 on the first attempt).
    pub fn delivered(&self) -> u64 {
        self.0.delivered
    }

    /// The message headers (empty when the message had none).
    pub fn headers(&self) -> &HeaderMap {
        &self.0.headers
    }

    /// The name of the handler the delivery is handed to ("" until the
    /// runtime hands it to one).
    pub fn handler(&self) -> &'static str {
        self.0.handler
    }

    /// The id this delivery is deduplicated by. See [`MessageId`] for the order
    /// in which it is chosen.
    pub fn message_id(&self) -> &MessageId {
        &self.0.message_id
    }
}
