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
//! (bytes, not parsed headers), resolves the id it was deduplicated by (the
//! handler's key if the payload decodes, else its `Nats-Msg-Id`, else its
//! stream position; none if its `Nats-Msg-Id` is not UTF-8), publishes it
//! as a dead letter (`Idem-Failure: undeliverable`) with its original header
//! block in `Idem-Original-Headers-Base64`, and only then acks the advisory.
//! A failure leaves the advisory to be tried again.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::{FutureExt, StreamExt};
use serde::Deserialize;
use std::panic::AssertUnwindSafe;

use crate::codec::Decode;
use crate::dead_letter::{self, Failure, Origin};
use crate::delivery::{Delivery, Fields};
use crate::error::Error;
use crate::handler::Handler;
use crate::message_id::MessageId;
use crate::pipeline::Pipeline;
use crate::route::Route;

/// The stream that keeps JetStream's `MAX_DELIVERIES` advisories until a
/// watcher has dead-lettered the message each names (work-queue retention:
/// an advisory is removed once handled; at most 7 days otherwise).
pub const ADVISORY_STREAM: &str = "IDEM_ADVISORIES";

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

/// Creates [`ADVISORY_STREAM`] if it is missing, and the route's durable
/// consumer on it. Done before the route pulls, so that no advisory of it
/// is missed from then on.
pub(crate) async fn bind(js: &jetstream::Context, route: &Route) -> Result<PullConsumer, Error> {
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
            ..Default::default()
        })
        .await
        .map_err(|e| jetstream_error(e.into()))?;
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
pub(crate) async fn watch<S: Send + Sync + 'static, H: Handler<S>>(
    pipeline: Arc<Pipeline<H, S>>,
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
                        Err(format!("it panicked: {}", crate::pipeline::panic_text(&*panic)).into())
                    })
                    .inspect(|()| pipeline.metrics.dead_lettered(Failure::Undeliverable)),
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

impl<S: Send + Sync + 'static, H: Handler<S>> Pipeline<H, S> {
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
                let why = format!(
                    "{why}; the message is no longer in the stream ({:?})",
                    got.error
                );
                let origin = Origin {
                    subject: "",
                    position: Some((stream, given_up.stream_seq)),
                    stored_at: None,
                    message_id: None,
                    handler: self.handler.name(),
                    delivered: Some(given_up.deliveries),
                    consumer: Some(&self.route.durable),
                };
                return dead_letter::publish_letter(
                    js,
                    self.route.dead_letter_target(),
                    origin,
                    HeaderMap::new(),
                    bytes::Bytes::new(),
                    Failure::Undeliverable,
                    &why,
                )
                .await;
            }
        };
        let payload = bytes::Bytes::from(BASE64.decode(raw.payload.as_bytes())?);
        let header_block = match &raw.headers {
            Some(encoded) => Some(BASE64.decode(encoded.as_bytes())?),
            None => None,
        };
        let parsed = header_block
            .as_deref()
            .map(parse_header_block)
            .unwrap_or_default();
        // What a delivery of it would have carried, for the handler's key.
        let delivery = Delivery::new(Fields {
            subject: raw.subject.clone(),
            stream: stream.clone(),
            consumer: self.route.durable.clone(),
            stream_sequence: given_up.stream_seq,
            delivered: given_up.deliveries,
            stored_at: raw.time,
            headers: parsed.clone(),
            message_id: MessageId::from_stream_position(stream, given_up.stream_seq, raw.time),
            handler: "",
        });
        let message_id = self.id_of_raw(&payload, header_block.as_deref(), &delivery);
        let mut headers = dead_letter::kept_headers(Some(&parsed));
        if let Some(encoded) = &raw.headers {
            headers.insert("Idem-Original-Headers-Base64", encoded.as_str());
        }
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
            headers,
            payload,
            Failure::Undeliverable,
            &why,
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
    /// the pipeline resolves it; `None` if it cannot be known (its
    /// `Nats-Msg-Id` is not UTF-8, or not a valid id).
    fn id_of_raw(
        &self,
        payload: &bytes::Bytes,
        header_block: Option<&[u8]>,
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
        match header_block.and_then(raw_nats_msg_id) {
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

/// The lines of a raw NATS header block (`NATS/1.0\r\nName: value\r\n...`)
/// as (name, value) byte pairs.
fn header_lines(block: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    block
        .split(|&byte| byte == b'\n')
        .skip(1)
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|&byte| byte == b':')?;
            Some((line[..colon].trim_ascii(), line[colon + 1..].trim_ascii()))
        })
}

/// The last `Nats-Msg-Id` of a raw header block: `Err` if it is not UTF-8.
/// The name is matched exactly, as async-nats (and so the pipeline) and
/// JetStream's own publish dedup match it.
fn raw_nats_msg_id(block: &[u8]) -> Option<Result<String, ()>> {
    header_lines(block)
        .filter(|(name, _)| *name == b"Nats-Msg-Id")
        .last()
        .map(|(_, value)| String::from_utf8(value.to_vec()).map_err(|_| ()))
}

/// The headers of a raw block that are valid UTF-8 and valid names.
fn parse_header_block(block: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in header_lines(block) {
        let (Ok(name), Ok(value)) = (std::str::from_utf8(name), std::str::from_utf8(value)) else {
            continue;
        };
        // Fallible parses: async-nats panics on a value with a bare CR.
        if let (Ok(name), Ok(value)) = (HeaderName::from_str(name), HeaderValue::from_str(value)) {
            headers.append(name, value);
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nats_msg_id_of_a_raw_header_block() {
        let block = b"NATS/1.0\r\nTrace: t-1\r\nNats-Msg-Id: order-7\r\n\r\n";
        assert_eq!(raw_nats_msg_id(block), Some(Ok("order-7".to_owned())));
        let lower_case = b"NATS/1.0\r\nnats-msg-id: order-7\r\n\r\n";
        assert_eq!(
            raw_nats_msg_id(lower_case),
            None,
            "matched exactly, as the pipeline does"
        );
        let bare_cr = b"NATS/1.0\r\nX: a\rb\r\nY: fine\r\n\r\n";
        let headers = parse_header_block(bare_cr);
        assert!(headers.get("X").is_none());
        assert_eq!(headers.get("Y").map(|v| v.as_str()), Some("fine"));
        assert_ne!(watcher_name("S-A", "c"), watcher_name("S", "A-c"));
        let not_utf8 = b"NATS/1.0\r\nNats-Msg-Id: \xff\xfe-x\r\n\r\n";
        assert_eq!(raw_nats_msg_id(not_utf8), Some(Err(())));
        assert_eq!(raw_nats_msg_id(b"NATS/1.0\r\nA: b\r\n\r\n"), None);
        let headers = parse_header_block(not_utf8);
        assert!(headers.get("Nats-Msg-Id").is_none());
        let headers = parse_header_block(block);
        assert_eq!(headers.get("Trace").map(|v| v.as_str()), Some("t-1"));
    }
}
