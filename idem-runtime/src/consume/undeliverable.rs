//! Messages JetStream gave up on: their deliveries ran out without an ack.
//!
//! The runtime enforces the retry policy's delivery limit itself and holds a
//! message rather than let its deliveries run out, so JetStream's own limit
//! (the route's plus a margin) is only reached by a message that never gets
//! settled: the workers that took it died each time, or a header that is not
//! UTF-8 made the client drop its connection on every delivery (async-nats
//! treats it as a protocol error). JetStream then stops redelivering it and
//! publishes a `MAX_DELIVERIES` advisory.
//!
//! Advisories are core NATS messages, at most once: one sent while no
//! worker listens, or whose handling fails, would be lost, and the message
//! with it, silently. So every advisory of this kind is captured in the
//! stream [`ADVISORY_STREAM`], and each route reads its own through a durable
//! consumer. For each, the watcher reads the message raw from the stream
//! (bytes, not parsed headers), resolves the id it was deduplicated by,
//! publishes it as a dead letter (`Idem-Failure: undeliverable`) with its
//! original header block in `Idem-Original-Headers-Base64` (or, too big for
//! that, moved to the object store: see `dead_letter/moved.rs`), and only
//! then acks the advisory. A failure leaves the advisory to be tried again.
//!
//! The id must be the one the pipeline claimed the message by, byte for
//! byte, or a replay is applied twice (or lost as a duplicate of another
//! message), so the header block is read as async-nats reads it
//! (`header_block.rs`): the handler's key if the payload decodes, else the
//! id [`MessageId::of_delivery`] gives (its `Nats-Msg-Id`, folded lines
//! joined; else its stream position). A block async-nats cannot read never
//! reached a handler; its `Nats-Msg-Id` is taken only where JetStream and a
//! client would read it alike (no bare CR or LF in it, not folded, UTF-8),
//! else the id is unknown and a replay is refused until allowed.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::{FutureExt, StreamExt};
use serde::Deserialize;
use std::panic::AssertUnwindSafe;

use crate::codec::Decode;
use crate::consume::pipeline::Pipeline;
use crate::dead_letter::header_block;
use crate::dead_letter::{self, ADVISORY_STREAM, Failure, Kept, Origin, Replicas};
use crate::error::Error;
use crate::handler::Handler;
use crate::handler::delivery::{Delivery, Fields};
use crate::message_id::MessageId;
use crate::observe::recorder::Event;
use crate::route::Route;
use crate::store::backend::Backend;

const ADVISORY_SUBJECTS: &str = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>";

/// JetStream's error code for "no message found".
const NO_MESSAGE_FOUND: u64 = 10037;

/// How long a failed advisory waits before it is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// The fields of a `MAX_DELIVERIES` advisory that matter here.
#[derive(Debug, Deserialize)]
struct MaxDeliveries {
    stream_seq: u64,
    deliveries: u64,
}

/// The answer to `STREAM.MSG.GET`.
#[derive(Debug, Deserialize)]
struct RawGet {
    message: Option<stream::RawMessage>,
    error: Option<serde_json::Value>,
}

/// The advisory subject for a consumer's given-up messages.
fn advisory_subject(stream: &str, durable: &str) -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}")
}

/// The durable consumer that reads a route's advisories: one per
/// (stream, durable), the stream's length first so that no two pairs map to
/// one name (`S-A` + `c` and `S` + `A-c` differ).
fn watcher_name(stream: &str, durable: &str) -> String {
    format!("idem-given-up-{}-{stream}-{durable}", stream.len())
}

/// Creates [`ADVISORY_STREAM`] if it is missing (with the largest replicas
/// of the routes' streams), and the route's durable consumer on it. Done
/// before the route pulls, so that no advisory of it is missed from then
/// on. An advisory stream with fewer replicas than the route's stream gets
/// a warning, and is left as it is.
pub(crate) async fn bind(
    js: &jetstream::Context,
    route: &Route,
    replicas: &Replicas,
) -> Result<PullConsumer, Error> {
    let jetstream_error = |source: async_nats::Error| Error::JetStream {
        route: route.durable.clone(),
        source,
    };
    let advisories = js
        .get_or_create_stream(stream::Config {
            name: ADVISORY_STREAM.to_owned(),
            subjects: vec![ADVISORY_SUBJECTS.to_owned()],
            retention: stream::RetentionPolicy::WorkQueue,
            max_age: Duration::from_secs(7 * 24 * 3600),
            description: Some(
                "JetStream's MAX_DELIVERIES advisories, kept until idem has dead-lettered the message each names".into(),
            ),
            num_replicas: replicas.advisories(),
            ..Default::default()
        })
        .await
        .map_err(|e| jetstream_error(e.into()))?;
    replicas.warn_if_fewer(route, &advisories.cached_info().config);
    advisories
        .create_consumer(pull::Config {
            durable_name: Some(watcher_name(&route.stream, &route.durable)),
            filter_subject: advisory_subject(&route.stream, &route.durable),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .map_err(|e| jetstream_error(e.into()))
}

/// Dead-letters each message the route's advisories name, until shutdown.
pub(crate) async fn watch<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend>(
    pipeline: Arc<Pipeline<H, S, DB>>,
    js: jetstream::Context,
    advisories: PullConsumer,
) {
    let mut shutdown = pipeline.shutdown.clone();
    let route = &pipeline.route;
    loop {
        let opened = advisories
            .stream()
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await;
        let mut messages = match opened {
            Ok(messages) => messages,
            Err(error) => {
                tracing::warn!(%error, route = route.durable, "reading given-up advisories failed; retrying");
                tokio::select! {
                    biased;
                    _ = shutdown.fired() => return,
                    _ = tokio::time::sleep(RETRY) => continue,
                }
            }
        };
        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.fired() => return,
                next = messages.next() => next,
            };
            let advisory = match next {
                Some(Ok(advisory)) => advisory,
                Some(Err(error)) => {
                    tracing::debug!(%error, route = route.durable, "advisory pull interrupted");
                    continue;
                }
                None => break,
            };
            let handled = match serde_json::from_slice::<MaxDeliveries>(&advisory.payload) {
                // Whatever the message holds, it does not stop the watcher.
                Ok(given_up) => AssertUnwindSafe(pipeline.dead_letter_given_up(&js, &given_up))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|panic| {
                        Err(format!(
                            "it panicked: {}",
                            crate::consume::pipeline::panic_text(&*panic)
                        )
                        .into())
                    })
                    .inspect(|()| {
                        pipeline
                            .recorder
                            .record(Event::DeadLettered(Failure::Undeliverable))
                    }),
                Err(error) => {
                    tracing::error!(%error, route = route.durable, "unreadable MAX_DELIVERIES advisory; dropped");
                    Ok(())
                }
            };
            let settled = match handled {
                Ok(()) => advisory.ack().await,
                Err(error) => {
                    tracing::error!(
                        %error,
                        route = route.durable,
                        "dead-lettering a message JetStream gave up on failed; it is tried again"
                    );
                    advisory.ack_with(AckKind::Nak(Some(RETRY))).await
                }
            };
            if let Err(error) = settled {
                tracing::warn!(%error, "settling an advisory failed; it is redelivered, and its dead letter is deduplicated");
            }
        }
    }
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Pipeline<H, S, DB> {
    /// Dead-letters the message a `MAX_DELIVERIES` advisory names (see the
    /// module docs): read raw from its stream, under the id it was (or
    /// would have been) deduplicated by; only a record of it, if its stream
    /// no longer has it. A replay for another handler is left alone.
    async fn dead_letter_given_up(
        &self,
        js: &jetstream::Context,
        given_up: &MaxDeliveries,
    ) -> Result<(), async_nats::Error> {
        let stream = &self.route.stream;
        let got: RawGet = js
            .request(
                format!("STREAM.MSG.GET.{stream}"),
                &serde_json::json!({ "seq": given_up.stream_seq }),
            )
            .await?;
        let why = format!(
            "JetStream stopped redelivering it after {} deliveries without an ack: the workers that took it died each time, or a header that is not UTF-8 made the client drop the connection",
            given_up.deliveries
        );
        let no_message = got
            .error
            .as_ref()
            .and_then(|error| error.get("err_code"))
            .and_then(serde_json::Value::as_u64)
            == Some(NO_MESSAGE_FOUND);
        let raw = match got.message {
            Some(raw) => raw,
            None if !no_message => {
                return Err(format!("reading the message failed: {:?}", got.error).into());
            }
            // Its stream's retention removed it first: nothing is left but
            // the record of it.
            None => {
                return self
                    .dead_letter_record(js, given_up, &why, got.error.as_ref())
                    .await;
            }
        };
        let payload = bytes::Bytes::from(BASE64.decode(raw.payload.as_bytes())?);
        let block = match &raw.headers {
            Some(encoded) => Some(BASE64.decode(encoded.as_bytes())?),
            None => None,
        };
        let (parsed, readable) = read_headers(block.as_deref());
        if self.is_replay_for_another(&parsed, given_up) {
            return Ok(());
        }
        let delivery = self.delivery_of_raw(&raw, &parsed, given_up);
        let message_id = self.id_of_raw(&payload, block.as_deref(), readable, &delivery);
        let kept = Kept {
            headers: dead_letter::kept_headers(Some(&parsed)),
            block,
            payload,
        };
        self.publish_given_up(js, &raw, given_up, message_id, kept, &why)
            .await
    }

    /// Dead-letters what is left of a message JetStream gave up on and its
    /// stream's retention removed: the record of it, without payload or
    /// headers. `error` is JetStream's answer to reading it.
    async fn dead_letter_record(
        &self,
        js: &jetstream::Context,
        given_up: &MaxDeliveries,
        why: &str,
        error: Option<&serde_json::Value>,
    ) -> Result<(), async_nats::Error> {
        let stream = &self.route.stream;
        let why = format!("{why}; the message is no longer in the stream ({error:?})");
        let origin = Origin {
            subject: "",
            position: Some((stream, given_up.stream_seq)),
            stored_at: None,
            message_id: None,
            handler: self.handler.name(),
            delivered: Some(given_up.deliveries),
            consumer: Some(&self.route.durable),
        };
        Ok(dead_letter::publish_letter(
            js,
            self.route.dead_letter_target(),
            origin,
            Kept::default(),
            Failure::Undeliverable,
            &why,
        )
        .await?)
    }

    /// Whether the message is a replay for another handler: this route
    /// acks one unrun, so it is never its to dead-letter (the route it is
    /// for has a copy of its own); given up on, the acks were lost.
    fn is_replay_for_another(&self, headers: &HeaderMap, given_up: &MaxDeliveries) -> bool {
        if let Some(target) = headers.get(dead_letter::REPLAY_FOR)
            && target.as_str() != self.handler.name()
        {
            tracing::warn!(
                route = self.route.durable,
                stream_seq = given_up.stream_seq,
                replay_for = target.as_str(),
                "JetStream gave up on a replay of another handler's dead letter; not this route's to dead-letter, so it is left (the route it is for takes its own copy)"
            );
            return true;
        }
        false
    }

    /// What a delivery of the raw message would have carried, for the
    /// handler's key; `headers` are its headers as read.
    fn delivery_of_raw(
        &self,
        raw: &stream::RawMessage,
        headers: &HeaderMap,
        given_up: &MaxDeliveries,
    ) -> Delivery {
        let stream = &self.route.stream;
        Delivery::new(Fields {
            subject: raw.subject.clone(),
            stream: stream.clone(),
            consumer: self.route.durable.clone(),
            stream_sequence: given_up.stream_seq,
            delivered: given_up.deliveries,
            stored_at: raw.time,
            headers: headers.clone(),
            message_id: MessageId::from_stream_position(stream, given_up.stream_seq, raw.time),
            handler: "",
        })
    }

    /// Publishes the dead letter of the raw message, with what is `kept` of
    /// it, under `message_id` (unknown: `None`), and says so.
    async fn publish_given_up(
        &self,
        js: &jetstream::Context,
        raw: &stream::RawMessage,
        given_up: &MaxDeliveries,
        message_id: Option<MessageId>,
        kept: Kept,
        why: &str,
    ) -> Result<(), async_nats::Error> {
        let stream = &self.route.stream;
        let origin = Origin {
            subject: &raw.subject,
            position: Some((stream, given_up.stream_seq)),
            stored_at: Some(raw.time),
            message_id: message_id.as_ref(),
            handler: self.handler.name(),
            delivered: Some(given_up.deliveries),
            consumer: Some(&self.route.durable),
        };
        dead_letter::publish_letter(
            js,
            self.route.dead_letter_target(),
            origin,
            kept,
            Failure::Undeliverable,
            why,
        )
        .await?;
        tracing::error!(
            route = self.route.durable,
            stream_seq = given_up.stream_seq,
            message_id = message_id.as_ref().map(MessageId::as_str),
            "dead-lettered a message JetStream gave up on"
        );
        Ok(())
    }

    /// The id a stored message was, or would have been, deduplicated by, as
    /// the pipeline resolves it; `None` if it cannot be known (the key
    /// panics, or the id is not valid, or it comes from a header block
    /// async-nats cannot read (`readable` false) and is not unambiguous
    /// there).
    fn id_of_raw(
        &self,
        payload: &bytes::Bytes,
        block: Option<&[u8]>,
        readable: bool,
        delivery: &Delivery,
    ) -> Option<MessageId> {
        let keyed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            <H::Codec as Decode<H::Payload>>::decode(payload)
                .ok()
                .map(|decoded| self.handler.message_key(&decoded, delivery))
        }));
        match keyed {
            Ok(Some(Some(key))) => return MessageId::from_key(key).ok(),
            Ok(_) => {}
            // The key panics: no id can be known.
            Err(_) => return None,
        }
        if readable {
            // Exactly what the pipeline would have resolved.
            return MessageId::of_delivery(
                delivery.headers(),
                delivery.stream(),
                delivery.stream_sequence(),
                delivery.stored_at(),
            )
            .ok();
        }
        match block.and_then(|block| header_block::unambiguous(block, NATS_MESSAGE_ID.as_ref())) {
            Some(Ok(value)) => MessageId::from_header(value).ok(),
            Some(Err(())) => None,
            None => Some(MessageId::from_stream_position(
                delivery.stream(),
                delivery.stream_sequence(),
                delivery.stored_at(),
            )),
        }
    }
}

/// The headers of a raw message's header block as a delivery would have
/// carried them, where async-nats can read them, else what can be kept of
/// them; and whether async-nats can read it (true when there is none).
fn read_headers(block: Option<&[u8]>) -> (HeaderMap, bool) {
    let read = block.map(header_block::read);
    let parsed = match (&read, &block) {
        (Some(Ok(headers)), _) => header_block::to_map(headers),
        (_, Some(block)) => header_block::lenient(block),
        _ => HeaderMap::new(),
    };
    let readable = !matches!(read, Some(Err(_)));
    (parsed, readable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watcher_names_of_different_routes_differ() {
        assert_ne!(watcher_name("S-A", "c"), watcher_name("S", "A-c"));
    }
}
