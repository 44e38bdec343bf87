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
//! | `Idem-Original-Stored-At` | when the stream stored the original (RFC 3339); for a replay, the earliest copy's time |
//! | `Idem-Retention` | how long its route keeps claims: `forever`, or seconds (`604800s`) |
//! | `Idem-Copy-Spread` | how far apart copies of one message may be stored (the route's publisher-retry horizon, when longer than the stream's duplicate window), in seconds; absent if 0 |
//!
//! A route records its retention and copy spread on its consumer (metadata
//! `idem.retention` and `idem.copy_spread`, written at start-up), and a dead
//! letter copies them from there, so that every worker's dead letters say
//! the same.
//!
//! The original is TERMed only after JetStream acknowledges the dead letter.
//! While that publish fails, the original is held (its heartbeats keep it
//! leased, no delivery is used up) and the publish retried, so nothing is
//! lost however long the dead-letter stream is away. [`replay`] sends a dead
//! letter back to its subject once the cause is fixed, under the id it was
//! deduplicated by; a dead letter without one is replayed only when asked
//! for explicitly ([`replay_with`]).
//!
//! A replay is deduplicated by its original's claim only while that claim
//! is kept: [`replay`] refuses a dead letter whose original may have
//! outlived it ([`ReplayError::OutsideRetention`]). The claim, if the
//! original was processed, was stamped no earlier than the first copy of
//! the message was stored, which is at most `Idem-Copy-Spread` before
//! `Idem-Original-Stored-At`, and it is kept `Idem-Retention` after its
//! stamp. So a replay is refused once `now − Idem-Original-Stored-At >
//! Idem-Retention − Idem-Copy-Spread`. A dead letter without
//! `Idem-Retention` (written before it existed) is replayed as before.

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::{self, Message, stream};

use crate::delivery::Delivery;
use crate::error::Error;
use crate::message_id::MessageId;
use crate::retention_floor::{self, COPY_SPREAD_KEY, Human, RETENTION_KEY};
use crate::route::Route;

mod browse;

pub use browse::{
    DeadLetter, DeadLetterError, Filter, check_replay, discard, get, list, subject_counts,
};

/// The header that records when the stream stored the original.
pub(crate) const STORED_AT: &str = "Idem-Original-Stored-At";
/// The header a replayed message carries: `<dead-letter stream>:<sequence>`.
pub(crate) const REPLAYED_FROM: &str = "Idem-Replayed-From";
/// The header that names the subject the original was published to.
const ORIGINAL_SUBJECT: &str = "Idem-Original-Subject";
/// The header that records the id the original was deduplicated by.
const MESSAGE_ID: &str = "Idem-Message-Id";
/// The header that records how long the original's route keeps claims.
const RETENTION: &str = "Idem-Retention";
/// The header that records how far apart copies of the original may be
/// stored.
const COPY_SPREAD: &str = "Idem-Copy-Spread";

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
    /// The durable consumer it came through, whose metadata records the
    /// route's retention.
    pub(crate) consumer: Option<&'a str>,
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
    headers.insert(ORIGINAL_SUBJECT, origin.subject);
    if let Some((stream, sequence)) = origin.position {
        headers.insert("Idem-Original-Stream", stream);
        headers.insert("Idem-Original-Sequence", sequence.to_string().as_str());
    }
    let (id, source) = origin
        .message_id
        .map_or(("", "unknown"), |id| (id.as_str(), id.source().as_str()));
    headers.insert(MESSAGE_ID, id);
    headers.insert("Idem-Message-Id-Source", source);
    headers.insert("Idem-Handler", origin.handler);
    if let Some(delivered) = origin.delivered {
        headers.insert("Idem-Delivered", delivered.to_string().as_str());
    }
    headers.insert("Idem-Failure", failure.as_str());
    headers.insert("Idem-Error", one_line(error).as_str());
    headers.insert("Idem-Dead-Lettered-At", now_rfc3339().as_str());
    record_retention(js, &origin, &mut headers).await?;
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

/// Adds what a replay needs to tell whether the original's claim may be
/// purged: its storage time (the earliest of the copies this one descends
/// from: a replay carries its original's), and its route's retention and
/// copy spread, read from its consumer's metadata. A consumer that records
/// no retention (set up by an older idem) adds no retention header.
async fn record_retention(
    js: &jetstream::Context,
    origin: &Origin<'_>,
    headers: &mut HeaderMap,
) -> Result<(), async_nats::Error> {
    let earlier = headers
        .get(STORED_AT)
        .and_then(|value| parse_time(value.as_str()));
    let stored_at = match (earlier, origin.stored_at) {
        (Some(earlier), Some(this)) => Some(earlier.min(this)),
        (one, other) => one.or(other),
    };
    // Only what this runtime records, never what the original carried.
    *headers = without(headers, &[STORED_AT, RETENTION, COPY_SPREAD]);
    if let Some(stored_at) = stored_at {
        headers.insert(STORED_AT, rfc3339(stored_at).as_str());
    }
    let (Some((stream, _)), Some(consumer)) = (origin.position, origin.consumer) else {
        return Ok(());
    };
    let consumer: jetstream::consumer::Consumer<jetstream::consumer::Config> =
        js.get_consumer_from_stream(consumer, stream).await?;
    let metadata = &consumer.cached_info().config.metadata;
    if let Some(retention) = metadata.get(RETENTION_KEY) {
        headers.insert(RETENTION, retention.as_str());
        if let Some(spread) = metadata.get(COPY_SPREAD_KEY) {
            headers.insert(COPY_SPREAD, spread.as_str());
        }
    }
    Ok(())
}

/// `headers` without those named in `names`.
fn without(headers: &HeaderMap, names: &[&str]) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter() {
        if names.contains(&name.as_ref()) {
            continue;
        }
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
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
        consumer: Some(delivery.consumer()),
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
        consumer: None,
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
    rfc3339(time::OffsetDateTime::now_utc())
}

fn rfc3339(at: time::OffsetDateTime) -> String {
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

pub(crate) fn parse_time(text: &str) -> Option<time::OffsetDateTime> {
    time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()
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
    /// The original's claim may already be purged: it was stored longer ago
    /// than its route keeps claims (less the copy spread), so if it was
    /// processed, the replay would apply it again.
    #[error("{}", outside_retention_message(*.sequence, *.age, *.retention, *.copy_spread))]
    OutsideRetention {
        /// The dead letter's sequence.
        sequence: u64,
        /// How long ago the original was stored (`None`: not recorded).
        age: Option<std::time::Duration>,
        /// How long its route keeps claims (`Idem-Retention`).
        retention: std::time::Duration,
        /// How far apart copies of it may be stored (`Idem-Copy-Spread`).
        copy_spread: std::time::Duration,
    },
}

fn outside_retention_message(
    sequence: u64,
    age: Option<std::time::Duration>,
    retention: std::time::Duration,
    copy_spread: std::time::Duration,
) -> String {
    let age = match age {
        Some(age) => format!("was stored {} ago", Human(age)),
        None => "has no recorded storage time".to_owned(),
    };
    let spread = if copy_spread.is_zero() {
        String::new()
    } else {
        format!(
            " (less {}, how much earlier another copy of it may have been stored)",
            Human(copy_spread)
        )
    };
    format!(
        "dead letter {sequence}: its original {age}, and its route keeps claims for {}{spread}, so if the original was processed its claim may already be purged and a replay would apply it again; check that it was not processed, then replay with `ReplayOptions::allow_outside_retention`",
        Human(retention)
    )
}

/// How [`replay_with`] replays.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ReplayOptions {
    allow_new_message_id: bool,
    allow_outside_retention: bool,
}

impl ReplayOptions {
    /// Replay a dead letter that records no message id: it gets a new one,
    /// so nothing can tell it from a message never processed. Only for dead
    /// letters you know were not processed. The new id is the dead letter's
    /// own (`idem-replay:<dead-letter stream>:<sequence>:<its storage time>`),
    /// so replaying the same dead letter again (a retried bulk replay) is
    /// still dropped by JetStream's window and skipped by the claim.
    pub fn allow_new_message_id(mut self) -> Self {
        self.allow_new_message_id = true;
        self
    }

    /// Replay a dead letter whose original was stored longer ago than its
    /// route keeps claims ([`ReplayError::OutsideRetention`]): if the
    /// original was processed, its claim may be purged, and the replay is
    /// then processed as new, its effects applied again. Only for dead
    /// letters you know were not processed.
    pub fn allow_outside_retention(mut self) -> Self {
        self.allow_outside_retention = true;
        self
    }
}

/// Sends dead letter `sequence` of stream `dead_letter_stream` back to its
/// original subject, with its original headers, and `Nats-Msg-Id` set to the
/// message id it was deduplicated by, so that the replay is deduplicated
/// exactly like the original: if the original was in fact processed, the
/// replay is skipped. A dead letter that records no id is refused
/// ([`ReplayError::NoMessageId`]), and so is one whose original's claim may
/// already be purged ([`ReplayError::OutsideRetention`]); see
/// [`replay_with`].
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
    replay_checks(
        &stored.headers,
        sequence,
        &options,
        time::OffsetDateTime::now_utc(),
    )?;
    let original_subject = stored
        .headers
        .get(ORIGINAL_SUBJECT)
        .map(|v| v.as_str().to_owned())
        .ok_or(ReplayError::NotADeadLetter(sequence))?;
    let message_id = stored
        .headers
        .get(MESSAGE_ID)
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    let stored_at = stored
        .headers
        .get(STORED_AT)
        .and_then(|value| parse_time(value.as_str()));

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
    let replayed_from = format!("{dead_letter_stream}:{sequence}");
    // Without the original's id (allowed by the options), one of the dead
    // letter's own: a second replay of it is then a duplicate, not a new
    // message. Its storage time keeps it apart from the dead letter that
    // takes the same sequence in a recreated stream.
    let replay_id = if message_id.is_empty() {
        format!(
            "idem-replay:{replayed_from}:{}",
            stored.time.unix_timestamp_nanos()
        )
    } else {
        message_id.clone()
    };
    headers.insert(NATS_MESSAGE_ID, replay_id.as_str());
    headers.insert(REPLAYED_FROM, replayed_from.as_str());
    // Should the replay be dead-lettered too, its dead letter keeps the
    // original's storage time, which the claim's age is measured from.
    if let Some(stored_at) = stored_at {
        headers.insert(STORED_AT, rfc3339(stored_at).as_str());
    }
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

/// The safety rules of a replay at `now` of dead letter `sequence`, whose
/// headers are `headers`: it must be an idem dead letter, record the id it
/// was deduplicated by, and be young enough for its original's claim to be
/// kept, unless `options` allow otherwise. [`replay_with`] applies them before
/// it publishes, and [`check_replay`] without publishing.
fn replay_checks(
    headers: &HeaderMap,
    sequence: u64,
    options: &ReplayOptions,
    now: time::OffsetDateTime,
) -> Result<(), ReplayError> {
    if headers.get(ORIGINAL_SUBJECT).is_none() {
        return Err(ReplayError::NotADeadLetter(sequence));
    }
    let has_message_id = headers
        .get(MESSAGE_ID)
        .is_some_and(|value| !value.as_str().is_empty());
    if !has_message_id && !options.allow_new_message_id {
        return Err(ReplayError::NoMessageId(sequence));
    }
    if !options.allow_outside_retention {
        let stored_at = headers
            .get(STORED_AT)
            .and_then(|value| parse_time(value.as_str()));
        check_retention(headers, stored_at, sequence, now)?;
    }
    Ok(())
}

/// Refuses a replay at `now` of a dead letter with `headers` whose original
/// was stored at `stored_at`, if the original's claim may be purged by
/// then. Without `Idem-Retention` (an older dead letter) or with
/// `forever`, nothing is refused.
fn check_retention(
    headers: &HeaderMap,
    stored_at: Option<time::OffsetDateTime>,
    sequence: u64,
    now: time::OffsetDateTime,
) -> Result<(), ReplayError> {
    let Some(recorded) = headers.get(RETENTION) else {
        return Ok(());
    };
    if recorded.as_str() == "forever" {
        return Ok(());
    }
    let duration = |name: &str| {
        headers
            .get(name)
            .and_then(|value| retention_floor::decode_duration(value.as_str()))
    };
    // A value that does not read is taken as the shortest retention.
    let retention = duration(RETENTION).unwrap_or_default();
    let copy_spread = duration(COPY_SPREAD).unwrap_or_default();
    let age = stored_at
        .map(|stored_at| std::time::Duration::try_from(now - stored_at).unwrap_or_default());
    match age {
        Some(age) if age <= retention.saturating_sub(copy_spread) => Ok(()),
        age => Err(ReplayError::OutsideRetention {
            sequence,
            age,
            retention,
            copy_spread,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_is_refused_once_the_original_may_have_outlived_its_claim() {
        let stored_at = time::OffsetDateTime::UNIX_EPOCH + time::Duration::days(1);
        let at = |seconds: i64| stored_at + time::Duration::seconds(seconds);
        let mut headers = HeaderMap::new();
        // An older dead letter: no retention recorded.
        check_retention(&headers, Some(stored_at), 7, at(1_000_000)).unwrap();
        headers.insert(RETENTION, "forever");
        check_retention(&headers, Some(stored_at), 7, at(1_000_000)).unwrap();

        headers.insert(RETENTION, "3600s");
        check_retention(&headers, Some(stored_at), 7, at(3600)).unwrap();
        let refused = check_retention(&headers, Some(stored_at), 7, at(3601)).unwrap_err();
        assert!(
            matches!(refused, ReplayError::OutsideRetention { sequence: 7, age: Some(age), .. } if age.as_secs() == 3601),
            "{refused:?}"
        );
        assert_eq!(
            refused.to_string(),
            "dead letter 7: its original was stored 1h 1s ago, and its route keeps claims for 1h, so if the original was processed its claim may already be purged and a replay would apply it again; check that it was not processed, then replay with `ReplayOptions::allow_outside_retention`"
        );
        // A copy may have been stored, and processed, 10 min earlier.
        headers.insert(COPY_SPREAD, "600s");
        check_retention(&headers, Some(stored_at), 7, at(3000)).unwrap();
        let refused = check_retention(&headers, Some(stored_at), 7, at(3001)).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("for 1h (less 10m, how much earlier"),
            "{refused}"
        );
        // No storage time, or an unreadable retention: refused.
        assert!(check_retention(&headers, None, 7, at(0)).is_err());
        headers.insert(RETENTION, "a week");
        assert!(check_retention(&headers, Some(stored_at), 7, at(1)).is_err());
    }

    #[test]
    fn error_headers_are_one_bounded_line() {
        let text = format!("first\nsecond\r{}", "é".repeat(2000));
        let line = one_line(&text);
        assert!(!line.contains('\n') && !line.contains('\r'));
        assert!(line.len() <= MAX_ERROR_HEADER);
        assert!(line.starts_with("first second "));
    }
}
