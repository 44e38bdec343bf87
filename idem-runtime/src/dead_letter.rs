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
//! | `Idem-Message-Id` | the dedup id it resolved to (empty if none) |
//! | `Idem-Handler` | the handler name |
//! | `Idem-Delivered` | how many times it was delivered |
//! | `Idem-Failure` | `permanent`, `exhausted`, `undecodable`, `bad-message-id` or `undeliverable` |
//! | `Idem-Error` | the last error's text (one line, at most 1 KiB) |
//! | `Idem-Dead-Lettered-At` | RFC 3339 time |
//!
//! The original is TERMed only after JetStream acknowledges the dead letter;
//! if that publish fails, the original is NAKed and tried again, so nothing
//! is lost. [`replay`] sends a dead letter back to its subject once the cause
//! is fixed.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::{self, Message, stream};

use crate::delivery::Delivery;
use crate::error::Error;
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
    /// JetStream stopped redelivering it before it ever reached the handler
    /// (a header that is not UTF-8 makes the client drop the connection).
    Undeliverable,
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
    if route.dead_letter_subject.is_none() {
        js.get_or_create_stream(stream::Config {
            name: DEFAULT_STREAM.to_owned(),
            subjects: vec![DEFAULT_SUBJECTS.to_owned()],
            description: Some("Messages idem could not process; see Idem-* headers".into()),
            ..Default::default()
        })
        .await
        .map_err(|e| Error::JetStream {
            route: route.durable.clone(),
            source: e.into(),
        })?;
        return Ok(());
    }
    match js.stream_by_subject(&subject).await {
        Ok(_) => Ok(()),
        Err(_) => Err(Error::DeadLetterStreamMissing {
            route: route.durable.clone(),
            subject,
        }),
    }
}

/// Where a dead letter came from: the context its headers record.
pub(crate) struct Origin<'a> {
    pub(crate) subject: &'a str,
    pub(crate) stream: &'a str,
    pub(crate) sequence: u64,
    pub(crate) message_id: &'a str,
    pub(crate) handler: &'a str,
    pub(crate) delivered: u64,
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
    headers.insert("Idem-Original-Stream", origin.stream);
    headers.insert(
        "Idem-Original-Sequence",
        origin.sequence.to_string().as_str(),
    );
    headers.insert("Idem-Message-Id", origin.message_id);
    headers.insert("Idem-Handler", origin.handler);
    headers.insert("Idem-Delivered", origin.delivered.to_string().as_str());
    headers.insert("Idem-Failure", failure.as_str());
    headers.insert("Idem-Error", one_line(error).as_str());
    headers.insert("Idem-Dead-Lettered-At", now_rfc3339().as_str());
    // A retried dead-letter publish (after a lost PubAck, or by a second
    // worker) is dropped by JetStream's own dedup inside its window.
    headers.insert(
        NATS_MESSAGE_ID,
        format!(
            "idem-dead:{}:{}:{}",
            origin.handler, origin.stream, origin.sequence
        )
        .as_str(),
    );
    js.publish_with_headers(subject, headers, payload)
        .await?
        .await?;
    Ok(())
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
    let mut headers = HeaderMap::new();
    for (name, values) in delivery.headers().iter() {
        let name_str: &str = name.as_ref();
        if name_str.starts_with("Nats-") {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    let origin = Origin {
        subject: delivery.subject(),
        stream: delivery.stream(),
        sequence: delivery.stream_sequence(),
        message_id: delivery.message_id().as_str(),
        handler,
        delivered: delivery.delivered(),
    };
    publish_letter(
        &message.context,
        subject,
        origin,
        headers,
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
}

/// Sends dead letter `sequence` of stream `dead_letter_stream` back to its
/// original subject, with its original headers, and `Nats-Msg-Id` set to the
/// message id it was deduplicated by, so that the replay is deduplicated
/// exactly like the original: if the original was in fact processed, the
/// replay is skipped.
///
/// The dead letter itself stays in its stream; delete or purge it when done.
pub async fn replay(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    sequence: u64,
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

/// How long to wait before retrying a failed dead-letter publish.
pub(crate) const PUBLISH_RETRY: Duration = Duration::from_secs(1);

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
