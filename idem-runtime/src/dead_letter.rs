//! Dead letters: where a message goes when it can never succeed.
//!
//! A message is dead-lettered when its handler fails permanently, when it
//! runs out of deliveries, or when it cannot be decoded or has an unusable
//! id. The dead letter is the original payload and headers, published with
//! JetStream to the route's dead-letter subject, plus headers that say where
//! it came from and why it failed:
//!
//! | header | value |
//! |---|---|
//! | `Idem-Original-Subject` | the subject it was published to |
//! | `Idem-Original-Stream` | its stream |
//! | `Idem-Original-Sequence` | its stream sequence |
//! | `Idem-Message-Id` | the dedup id it resolved to (empty if none could be) |
//! | `Idem-Message-Id-Source` | `key`, `header`, `stream-position`, or `unknown` |
//! | `Idem-Handler` | the handler name |
//! | `Idem-Delivered` | how many times it was delivered |
//! | `Idem-Failure` | `permanent`, `exhausted`, `undecodable`, `bad-message-id`, `undeliverable` or `not-a-jetstream-delivery` |
//! | `Idem-Error` | the last error's text (one line, at most 1 KiB) |
//! | `Idem-Dead-Lettered-At` | RFC 3339 time |
//!
//! The original is TERMed only after JetStream acknowledges the dead letter.
//! While that publish fails, the original is held (its heartbeats keep it
//! leased, no delivery is used up) and the publish retried, so nothing is
//! lost however long the dead-letter stream is away. [`replay`] sends a dead
//! letter back to its subject once the cause is fixed, under the id it was
//! deduplicated by; a dead letter without one is replayed only when asked
//! for explicitly ([`replay_with`]).

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::{self, Message, stream};

use crate::delivery::Delivery;
use crate::error::Error;
use crate::message_id::MessageId;
use crate::route::Route;

/// The stream that stores dead letters unless a route names its own subject.
pub const DEFAULT_STREAM: &str = "IDEM_DEAD_LETTERS";

/// The subjects of [`DEFAULT_STREAM`]; a route's default dead-letter subject
/// is `idem.dead.<stream>.<durable>`.
pub const DEFAULT_SUBJECTS: &str = "idem.dead.>";

const MAX_ERROR_HEADER: usize = 1024;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// The handler failed with a permanent error.
    Permanent,
    /// The handler kept failing until the route's delivery limit.
    Exhausted,
    /// The payload does not decode.
    Undecodable,
    /// The message id is empty or too long.
    BadMessageId,
    /// JetStream stopped redelivering it (its deliveries ran out without an
    /// ack: the workers that took it died, or a header that is not UTF-8
    /// made the client drop the connection each time).
    Undeliverable,
    /// It reached the route without JetStream delivery metadata, so it can be
    /// neither deduplicated nor redelivered.
    NotADelivery,
}

impl Failure {
    /// The `Idem-Failure` header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Permanent => "permanent",
            Failure::Exhausted => "exhausted",
            Failure::Undecodable => "undecodable",
            Failure::BadMessageId => "bad-message-id",
            Failure::Undeliverable => "undeliverable",
            Failure::NotADelivery => "not-a-jetstream-delivery",
        }
    }
}

/// The default dead-letter subject of a route.
pub(crate) fn default_subject(stream: &str, durable: &str) -> String {
    format!("idem.dead.{stream}.{durable}")
}

/// Makes sure a stream stores the route's dead letters: creates
/// [`DEFAULT_STREAM`] when the route uses the default subject, or checks that
/// some stream captures the route's own subject.
pub(crate) async fn ensure_stream(js: &jetstream::Context, route: &Route) -> Result<(), Error> {
    let subject = route.dead_letter_target();
    let jetstream_error = |source: async_nats::Error| Error::JetStream {
        route: route.durable.clone(),
        source,
    };
    let mut stream = if route.dead_letter_subject.is_none() {
        js.get_or_create_stream(stream::Config {
            name: DEFAULT_STREAM.to_owned(),
            subjects: vec![DEFAULT_SUBJECTS.to_owned()],
            description: Some("Messages idem could not process; see Idem-* headers".into()),
            ..Default::default()
        })
        .await
        .map_err(|e| jetstream_error(e.into()))?
    } else {
        match js.stream_by_subject(&subject).await {
            Ok(name) => js
                .get_stream(&name)
                .await
                .map_err(|e| jetstream_error(e.into()))?,
            Err(_) => {
                return Err(Error::DeadLetterStreamMissing {
                    route: route.durable.clone(),
                    subject,
                });
            }
        }
    };
    // A PubAck from a stream that keeps nothing (interest retention and no
    // consumer) would let the original be terminated with no dead letter
    // anywhere.
    let config = &stream
        .info()
        .await
        .map_err(|e| jetstream_error(e.into()))?
        .config;
    if config.retention == stream::RetentionPolicy::Interest {
        return Err(Error::DeadLetterStreamRetention {
            route: route.durable.clone(),
            subject,
            stream: config.name.clone(),
            retention: "interest".into(),
        });
    }
    Ok(())
}

/// Where a dead letter came from: the context its headers record.
pub(crate) struct Origin<'a> {
    pub(crate) subject: &'a str,
    /// The stream and sequence, when the message came from one.
    pub(crate) position: Option<(&'a str, u64)>,
    /// When the stream stored it, if known.
    pub(crate) stored_at: Option<time::OffsetDateTime>,
    /// The id it was (or would have been) deduplicated by, if known.
    pub(crate) message_id: Option<&'a MessageId>,
    pub(crate) handler: &'a str,
    pub(crate) delivered: Option<u64>,
}

/// Publishes a dead letter of `payload` to `subject` and waits for
/// JetStream's ack. `headers` are the original's (without its `Nats-*`
/// ones, which steer JetStream); the `Idem-*` context headers are added.
pub(crate) async fn publish_letter(
    js: &jetstream::Context,
    subject: String,
    origin: Origin<'_>,
    mut headers: HeaderMap,
    payload: bytes::Bytes,
    failure: Failure,
    error: &str,
) -> Result<(), async_nats::Error> {
    headers.insert("Idem-Original-Subject", origin.subject);
    if let Some((stream, sequence)) = origin.position {
        headers.insert("Idem-Original-Stream", stream);
        headers.insert("Idem-Original-Sequence", sequence.to_string().as_str());
    }
    let (id, source) = origin
        .message_id
        .map_or(("", "unknown"), |id| (id.as_str(), id.source().as_str()));
    headers.insert("Idem-Message-Id", id);
    headers.insert("Idem-Message-Id-Source", source);
    headers.insert("Idem-Handler", origin.handler);
    if let Some(delivered) = origin.delivered {
        headers.insert("Idem-Delivered", delivered.to_string().as_str());
    }
    headers.insert("Idem-Failure", failure.as_str());
    headers.insert("Idem-Error", one_line(error).as_str());
    headers.insert("Idem-Dead-Lettered-At", now_rfc3339().as_str());
    // A retried dead-letter publish (after a lost PubAck, or by a second
    // worker, or by the watcher of given-up messages) is dropped by
    // JetStream's own dedup inside its window. The storage time keeps a
    // recreated stream's messages apart from the old ones.
    if let (Some((stream, sequence)), Some(stored_at)) = (origin.position, origin.stored_at) {
        headers.insert(
            NATS_MESSAGE_ID,
            format!(
                "idem-dead:{}:{stream}:{sequence}:{}",
                origin.handler,
                stored_at.unix_timestamp_nanos()
            )
            .as_str(),
        );
    }
    let ack = js
        .publish_with_headers(subject, headers, payload)
        .await?
        .await?;
    if ack.duplicate {
        tracing::debug!("the dead letter was stored before");
    }
    Ok(())
}

/// The original's headers, without the `Nats-*` ones that steer JetStream.
pub(crate) fn kept_headers(original: Option<&HeaderMap>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(|headers| headers.iter()) {
        let name_str: &str = name.as_ref();
        if name_str.starts_with("Nats-") {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    headers
}

/// Publishes a delivered `message` as a dead letter.
pub(crate) async fn publish(
    message: &Message,
    delivery: &Delivery,
    handler: &str,
    subject: String,
    failure: Failure,
    error: &str,
) -> Result<(), async_nats::Error> {
    let origin = Origin {
        subject: delivery.subject(),
        position: Some((delivery.stream(), delivery.stream_sequence())),
        stored_at: Some(delivery.stored_at()),
        message_id: Some(delivery.message_id()),
        handler,
        delivered: Some(delivery.delivered()),
    };
    publish_letter(
        &message.context,
        subject,
        origin,
        kept_headers(Some(delivery.headers())),
        message.payload.clone(),
        failure,
        error,
    )
    .await
}

/// Publishes a message that is not a JetStream delivery as a dead letter,
/// with what little is known of it.
pub(crate) async fn publish_stray(
    message: &Message,
    handler: &str,
    subject: String,
    failure: Failure,
    error: &str,
) -> Result<(), async_nats::Error> {
    let origin = Origin {
        subject: message.subject.as_str(),
        position: None,
        stored_at: None,
        message_id: None,
        handler,
        delivered: None,
    };
    publish_letter(
        &message.context,
        subject,
        origin,
        kept_headers(message.headers.as_ref()),
        message.payload.clone(),
        failure,
        error,
    )
    .await
}

fn one_line(text: &str) -> String {
    let mut line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.len() > MAX_ERROR_HEADER {
        let mut end = MAX_ERROR_HEADER;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Why a dead letter could not be replayed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// Reading the dead letter failed (wrong stream or sequence?).
    #[error("reading dead letter {sequence} of stream `{stream}` failed: {source}")]
    Read {
        /// The dead-letter stream.
        stream: String,
        /// The sequence asked for.
        sequence: u64,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// The message is not an idem dead letter.
    #[error("message {0} has no Idem-Original-Subject header; it is not an idem dead letter")]
    NotADeadLetter(u64),
    /// Publishing it back failed.
    #[error("publishing the replay failed: {0}")]
    Publish(async_nats::Error),
    /// JetStream dropped the replay as a duplicate of the original publish,
    /// whose `Nats-Msg-Id` is still inside the stream's duplicate window.
    #[error(
        "JetStream dropped the replay as a duplicate: the original's Nats-Msg-Id is still inside the stream's duplicate window; replay again after it passes"
    )]
    InsideDuplicateWindow,
    /// The dead letter records no message id (its `Nats-Msg-Id` was not
    /// UTF-8, say), so a replay would be deduplicated by a new one: if the
    /// original was in fact processed, it would be applied again.
    #[error(
        "dead letter {0} records no message id, so a replay could apply an effect the original already applied; check that it was not processed, then replay with `ReplayOptions::allow_new_message_id`"
    )]
    NoMessageId(u64),
}

/// How [`replay_with`] replays.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ReplayOptions {
    allow_new_message_id: bool,
}

impl ReplayOptions {
    /// Replay a dead letter that records no message id: it gets a new one,
    /// so nothing can tell it from a message never processed. Only for dead
    /// letters you know were not processed.
    pub fn allow_new_message_id(mut self) -> Self {
        self.allow_new_message_id = true;
        self
    }
}

/// Sends dead letter `sequence` of stream `dead_letter_stream` back to its
/// original subject, with its original headers, and `Nats-Msg-Id` set to the
/// message id it was deduplicated by, so that the replay is deduplicated
/// exactly like the original: if the original was in fact processed, the
/// replay is skipped. A dead letter that records no id is refused
/// ([`ReplayError::NoMessageId`]); see [`replay_with`].
///
/// The dead letter itself stays in its stream; delete or purge it when done.
pub async fn replay(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    sequence: u64,
) -> Result<jetstream::publish::PublishAck, ReplayError> {
    replay_with(js, dead_letter_stream, sequence, ReplayOptions::default()).await
}

/// [`replay`], with options.
pub async fn replay_with(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    sequence: u64,
    options: ReplayOptions,
) -> Result<jetstream::publish::PublishAck, ReplayError> {
    let read_error = |source: async_nats::Error| ReplayError::Read {
        stream: dead_letter_stream.to_owned(),
        sequence,
        source,
    };
    let stored = js
        .get_stream(dead_letter_stream)
        .await
        .map_err(|e| read_error(e.into()))?
        .get_raw_message(sequence)
        .await
        .map_err(|e| read_error(e.into()))?;
    let original_subject = stored
        .headers
        .get("Idem-Original-Subject")
        .map(|v| v.as_str().to_owned())
        .ok_or(ReplayError::NotADeadLetter(sequence))?;
    let message_id = stored
        .headers
        .get("Idem-Message-Id")
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    if message_id.is_empty() && !options.allow_new_message_id {
        return Err(ReplayError::NoMessageId(sequence));
    }

    let mut headers = HeaderMap::new();
    for (name, values) in stored.headers.iter() {
        let name_str: &str = name.as_ref();
        if name_str.starts_with("Idem-") || name_str.starts_with("Nats-") {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    if !message_id.is_empty() {
        headers.insert(NATS_MESSAGE_ID, message_id.as_str());
    }
    headers.insert(
        "Idem-Replayed-From",
        format!("{dead_letter_stream}:{sequence}").as_str(),
    );
    let ack = js
        .publish_with_headers(original_subject, headers, stored.payload)
        .await
        .map_err(|e| ReplayError::Publish(e.into()))?
        .await
        .map_err(|e| ReplayError::Publish(e.into()))?;
    if ack.duplicate {
        return Err(ReplayError::InsideDuplicateWindow);
    }
    Ok(ack)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_headers_are_one_bounded_line() {
        let text = format!("first\nsecond\r{}", "é".repeat(2000));
        let line = one_line(&text);
        assert!(!line.contains('\n') && !line.contains('\r'));
        assert!(line.len() <= MAX_ERROR_HEADER);
        assert!(line.starts_with("first second "));
    }
}
