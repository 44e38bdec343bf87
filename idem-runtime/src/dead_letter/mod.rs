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
//! | `Idem-Error-Cut` | how many bytes of `Idem-Error` were cut to make the dead letter fit; absent if none |
//! | `Idem-Moved-To` | the object store bucket that keeps what did not fit (see [below](#too-big-to-fit)); absent if nothing was moved |
//! | `Idem-Payload-Moved`, `Idem-Payload-Bytes` | the object the original payload was moved to, and its size; the dead letter's own payload is then empty |
//! | `Idem-Headers-Moved`, `Idem-Headers-Bytes` | the object the original header block was moved to, and its size; the original's headers are then not on the dead letter |
//!
//! A message idem read raw from its stream (one JetStream gave up on) also
//! keeps its header block as stored, in `Idem-Original-Headers-Base64`. An
//! id that a header cannot carry exactly (a key with whitespace at an end:
//! async-nats trims what it reads) is recorded as unknown.
//!
//! A route records its retention and copy spread on its consumer (metadata
//! `idem.retention` and `idem.copy_spread`, written at start-up), and a dead
//! letter copies them from there, so that every worker's dead letters say
//! the same.
//!
//! The original is TERMed only after JetStream acknowledges the dead letter.
//! While that publish fails, the original is held (its heartbeats keep it
//! leased, no delivery is used up) and the publish retried, so nothing is
//! lost however long the dead-letter stream is away.
//!
//! # Too big to fit
//!
//! A refusal for size (the server's `max_payload`, the dead-letter stream's
//! `max_msg_size`) is a property of the message, not an outage, and is not
//! retried as one: the dead letter is stored with `Idem-Error` cut, else
//! with the original's payload, and then its headers, moved to the object
//! store bucket [`BUCKET`] (see `dead_letter/moved.rs`). [`original`] reads
//! them back; [`replay`] sends them; [`discard`] deletes them.
//!
//! # Replays
//!
//! [`replay`] sends a dead letter back to its subject once the cause is
//! fixed, for the handler that dead-lettered it alone (`Idem-Replay-For`),
//! under the id its original was deduplicated by (`Idem-Replay-Id`, with
//! its source in `Idem-Replay-Id-Source`). Every other idem route of the
//! subject, or of a stream that sources it, acks the replay without running
//! its handler ([`Stats::replays_skipped`](crate::Stats::replays_skipped)),
//! so a message another route applied is not applied there again. The
//! replay's own `Nats-Msg-Id` is the dead letter's
//! (`idem-replay:<dead-letter stream>:<sequence>:<its storage time>`): a
//! second replay of one dead letter inside the stream's duplicate window is
//! dropped by JetStream ([`ReplayError::InsideDuplicateWindow`]), after it
//! the target's claim skips it, and replays of several routes' dead letters
//! of one message are all stored. A consumer that is not idem sees the
//! replay as a new message; it should skip messages with `Idem-Replay-For`.
//! (A replay written by an older idem, without `Idem-Replay-For`, carries
//! the id in `Nats-Msg-Id` and is processed by every route, as then.)
//!
//! A replay goes to the subject the original was published to: for a
//! partitioned stream, the one its transform maps to the stored subject
//! (see [`crate::route::partition`]), so that it is stored in its key's partition.
//! A dead letter without a known id is replayed only when asked for
//! explicitly ([`replay_with`]); one whose handler no consumer of its
//! stream records (renamed, removed) is refused
//! ([`ReplayError::NoRouteForHandler`]), as a replay no route would apply.
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

use std::collections::HashMap;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::{self, Message, stream};
use futures_util::StreamExt;

use crate::error::Error;
use crate::error::retention::Human;
use crate::handler::delivery::Delivery;
use crate::message_id::{MessageId, REPLAY_ID, REPLAY_ID_SOURCE};
use crate::route::Route;
use crate::route::metadata::{COPY_SPREAD_KEY, HANDLER_KEY, RETENTION_KEY};

mod browse;
pub(crate) mod header_block;
mod moved;
pub use crate::error::Failure;

pub use browse::{
    DeadLetter, DeadLetterError, Filter, MovedPart, Original, check_replay, discard, get, list,
    original, subject_counts,
};
pub use moved::BUCKET;
pub(crate) use moved::{Kept, StoreError};

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
/// The header that names the handler a replay is for: every other route
/// acks it without running its handler.
pub(crate) const REPLAY_FOR: &str = "Idem-Replay-For";
/// The header that records the handler that dead-lettered the original.
const HANDLER: &str = "Idem-Handler";
/// The header that records where the recorded id came from.
const MESSAGE_ID_SOURCE: &str = "Idem-Message-Id-Source";

/// A dead-letter stream limit below which not even idem's own headers fit
/// (start-up warns).
const SMALLEST_USEFUL_MESSAGE: i32 = 4096;

/// The stream that stores dead letters unless a route names its own subject.
pub const DEFAULT_STREAM: &str = "IDEM_DEAD_LETTERS";

/// The stream that keeps JetStream's `MAX_DELIVERIES` advisories until a
/// watcher has dead-lettered the message each names (work-queue retention:
/// an advisory is removed once handled; at most 7 days otherwise).
pub const ADVISORY_STREAM: &str = "IDEM_ADVISORIES";

/// The subjects of [`DEFAULT_STREAM`]; a route's default dead-letter subject
/// is `idem.dead.<stream>.<durable>`.
pub const DEFAULT_SUBJECTS: &str = "idem.dead.>";

const MAX_ERROR_HEADER: usize = 1024;

/// The replicas idem's own streams should have: those of the streams the
/// routes read, so that a lost node does not take a route's dead letters,
/// or the advisories of what JetStream gave up on, with it.
#[derive(Debug, Default)]
pub(crate) struct Replicas {
    /// The replicas of each route's stream, by stream name, where known
    /// (its `create_stream` config, or the stream as it is).
    streams: HashMap<String, usize>,
    /// The largest among routes with the default dead-letter subject.
    dead_letters: usize,
    /// The largest among all routes.
    advisories: usize,
}

impl Replicas {
    /// The replicas of `routes`' streams. A stream that is missing (and not
    /// created by its route) counts as one replica; binding its route then
    /// fails on it.
    pub(crate) async fn of(js: &jetstream::Context, routes: &[&Route]) -> Self {
        let mut replicas = Replicas {
            streams: HashMap::new(),
            dead_letters: 1,
            advisories: 1,
        };
        for &route in routes {
            let of_stream = match &route.create_stream {
                Some(config) => Some(config.num_replicas),
                None => js
                    .get_stream(&route.stream)
                    .await
                    .ok()
                    .map(|stream| stream.cached_info().config.num_replicas),
            };
            let Some(count) = of_stream.map(|count| count.max(1)) else {
                continue;
            };
            replicas.streams.insert(route.stream.clone(), count);
            replicas.advisories = replicas.advisories.max(count);
            if route.dead_letter_subject.is_none() {
                replicas.dead_letters = replicas.dead_letters.max(count);
            }
        }
        replicas
    }

    /// The replicas the advisory stream should have.
    pub(crate) fn advisories(&self) -> usize {
        self.advisories
    }

    /// Warns when `existing` (one of idem's streams, or the route's own
    /// dead-letter stream) has fewer replicas than `route`'s stream: a
    /// stream an operator made is not changed behind their back.
    pub(crate) fn warn_if_fewer(&self, route: &Route, existing: &stream::Config) {
        let Some(&wanted) = self.streams.get(&route.stream) else {
            return;
        };
        if existing.num_replicas.max(1) < wanted {
            tracing::warn!(
                stream = existing.name,
                replicas = existing.num_replicas.max(1),
                route = route.durable,
                route_stream = route.stream,
                route_stream_replicas = wanted,
                "stream {} has {} replica(s), fewer than the {wanted} of stream {}, which route {} reads: losing a node can lose what it keeps for the route; it is left as it is (raise it with `nats stream edit {} --replicas {wanted}`)",
                existing.name,
                existing.num_replicas.max(1),
                route.stream,
                route.durable,
                existing.name,
            );
        }
    }
}

/// Makes sure a stream stores the route's dead letters: creates
/// [`DEFAULT_STREAM`] when the route uses the default subject (with the
/// largest replicas of the routes that use it), or checks that some stream
/// captures the route's own subject. A stream with fewer replicas than the
/// route's own gets a warning, and is left as it is.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    route: &Route,
    replicas: &Replicas,
) -> Result<(), Error> {
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
            num_replicas: replicas.dead_letters,
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
    replicas.warn_if_fewer(route, config);
    if config.max_message_size > 0 && config.max_message_size < SMALLEST_USEFUL_MESSAGE {
        tracing::warn!(
            stream = config.name,
            max_msg_size = config.max_message_size,
            route = route.durable,
            "dead-letter stream {} takes messages of at most {} bytes: a dead letter whose own idem headers do not fit cannot be stored, and holds its route until the limit is raised",
            config.name,
            config.max_message_size,
        );
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

/// Publishes a dead letter of `kept` (the original) to `subject`, with the
/// `Idem-*` context headers, and waits for JetStream's ack. What does not
/// fit is moved out (see `dead_letter/moved.rs`); a failure is an outage
/// ([`StoreError::Unavailable`]: hold and retry) unless even the smallest
/// form is refused for its size ([`StoreError::TooBig`]).
pub(crate) async fn publish_letter(
    js: &jetstream::Context,
    subject: String,
    origin: Origin<'_>,
    mut kept: Kept,
    failure: Failure,
    error: &str,
) -> Result<(), StoreError> {
    let mut context = HeaderMap::new();
    context.insert(ORIGINAL_SUBJECT, origin.subject);
    if let Some((stream, sequence)) = origin.position {
        context.insert("Idem-Original-Stream", stream);
        context.insert("Idem-Original-Sequence", sequence.to_string().as_str());
    }
    // An id a header would not carry exactly is as good as unknown: a
    // replay under what the header reads back is another message.
    let (id, source) = origin
        .message_id
        .filter(|id| id.recordable())
        .map_or(("", "unknown"), |id| (id.as_str(), id.source().as_str()));
    context.insert(MESSAGE_ID, id);
    context.insert(MESSAGE_ID_SOURCE, source);
    context.insert(HANDLER, origin.handler);
    if let Some(delivered) = origin.delivered {
        context.insert("Idem-Delivered", delivered.to_string().as_str());
    }
    context.insert("Idem-Failure", failure.as_str());
    context.insert("Idem-Dead-Lettered-At", now_rfc3339().as_str());
    record_retention(js, &origin, &mut kept.headers, &mut context)
        .await
        .map_err(StoreError::Unavailable)?;
    // A retried dead-letter publish (after a lost PubAck, or by a second
    // worker, or by the watcher of given-up messages) is dropped by
    // JetStream's own dedup inside its window. The storage time keeps a
    // recreated stream's messages apart from the old ones. Moved parts are
    // named after the same identity, so a retry overwrites them.
    let name = match (origin.position, origin.stored_at) {
        (Some((stream, sequence)), Some(stored_at)) => {
            let nanos = stored_at.unix_timestamp_nanos();
            context.insert(
                NATS_MESSAGE_ID,
                format!("idem-dead:{}:{stream}:{sequence}:{nanos}", origin.handler).as_str(),
            );
            format!("{}/{stream}/{sequence}/{nanos}", origin.handler)
        }
        (Some((stream, sequence)), None) => {
            format!("{}/{stream}/{sequence}/unstored", origin.handler)
        }
        _ => format!("{}/stray/{:032x}", origin.handler, rand::random::<u128>()),
    };
    let fitted = moved::publish(
        js,
        moved::Letter {
            subject: subject.clone(),
            context,
            error: one_line(error),
            kept,
            name,
        },
    )
    .await?;
    if fitted.payload_moved.is_some() || fitted.headers_moved.is_some() || fitted.error_cut > 0 {
        tracing::warn!(
            dead_letter_subject = subject,
            error_cut = fitted.error_cut,
            payload_moved = fitted.payload_moved,
            headers_moved = fitted.headers_moved,
            bucket = BUCKET,
            "the dead letter did not fit as it is: stored with its error cut, or its payload or headers moved to the object store (nothing of the original lost; a replay sends it back)"
        );
    }
    Ok(())
}

/// Adds to `context` what a replay needs to tell whether the original's
/// claim may be purged: its storage time (the earliest of the copies this
/// one descends from: a replay carries its original's, in `original`'s
/// headers), and its route's retention and copy spread, read from its
/// consumer's metadata. A consumer that records no retention (set up by an
/// older idem) adds no retention header. The original's own headers of
/// these names are dropped.
async fn record_retention(
    js: &jetstream::Context,
    origin: &Origin<'_>,
    original: &mut HeaderMap,
    context: &mut HeaderMap,
) -> Result<(), async_nats::Error> {
    let earlier = original
        .get(STORED_AT)
        .and_then(|value| parse_time(value.as_str()));
    let stored_at = match (earlier, origin.stored_at) {
        (Some(earlier), Some(this)) => Some(earlier.min(this)),
        (one, other) => one.or(other),
    };
    // Only what this runtime records, never what the original carried.
    *original = without(original, &[STORED_AT, RETENTION, COPY_SPREAD]);
    if let Some(stored_at) = stored_at {
        context.insert(STORED_AT, rfc3339(stored_at).as_str());
    }
    let (Some((stream, _)), Some(consumer)) = (origin.position, origin.consumer) else {
        return Ok(());
    };
    let consumer: jetstream::consumer::Consumer<jetstream::consumer::Config> =
        js.get_consumer_from_stream(consumer, stream).await?;
    let metadata = &consumer.cached_info().config.metadata;
    if let Some(retention) = metadata.get(RETENTION_KEY) {
        context.insert(RETENTION, retention.as_str());
        if let Some(spread) = metadata.get(COPY_SPREAD_KEY) {
            context.insert(COPY_SPREAD, spread.as_str());
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
) -> Result<(), StoreError> {
    let origin = Origin {
        subject: delivery.subject(),
        position: Some((delivery.stream(), delivery.stream_sequence())),
        stored_at: Some(delivery.stored_at()),
        message_id: Some(delivery.message_id()),
        handler,
        delivered: Some(delivery.delivered()),
        consumer: Some(delivery.consumer()),
    };
    let kept = Kept {
        headers: kept_headers(Some(delivery.headers())),
        block: None,
        payload: message.payload.clone(),
    };
    publish_letter(&message.context, subject, origin, kept, failure, error).await
}

/// Publishes a message that is not a JetStream delivery as a dead letter,
/// with what little is known of it.
pub(crate) async fn publish_stray(
    message: &Message,
    handler: &str,
    subject: String,
    failure: Failure,
    error: &str,
) -> Result<(), StoreError> {
    let origin = Origin {
        subject: message.subject.as_str(),
        position: None,
        stored_at: None,
        message_id: None,
        handler,
        delivered: None,
        consumer: None,
    };
    let kept = Kept {
        headers: kept_headers(message.headers.as_ref()),
        block: None,
        payload: message.payload.clone(),
    };
    publish_letter(&message.context, subject, origin, kept, failure, error).await
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
    /// JetStream dropped the replay as a duplicate: this dead letter was
    /// replayed less than the stream's duplicate window ago (a replay's
    /// `Nats-Msg-Id` is its dead letter's).
    #[error(
        "JetStream dropped the replay as a duplicate: this dead letter was replayed less than its stream's duplicate window ago, and that replay is stored; nothing was published again"
    )]
    InsideDuplicateWindow,
    /// The replay would be larger than the server or the stream takes: the
    /// original was within a few hundred bytes of the limit, and a replay
    /// adds its own headers.
    #[error(
        "dead letter {sequence}: its replay would be {size} bytes ({replay_headers} of them the replay's own headers), more than the {limit} bytes {what} takes; it was not published. Raise the limit, or publish its original (`idem dead-letters show {sequence}`) by hand with the headers `Nats-Msg-Id` (the id it was deduplicated by) and `Idem-Replay-For: <its handler>`: without the second, every other route on its subject runs it too"
    )]
    TooLarge {
        /// The dead letter's sequence.
        sequence: u64,
        /// The replay's size: headers and payload, as sent.
        size: usize,
        /// How many of those bytes are the headers a replay adds.
        replay_headers: usize,
        /// The limit it is over.
        limit: usize,
        /// Whose limit: the server's `max_payload`, or the stream's
        /// `max_msg_size`.
        what: &'static str,
    },
    /// No stream captures the subject the replay would go to.
    #[error(
        "dead letter {sequence}: no stream captures `{subject}`, where its replay would go; if its stream is partitioned (created by an older idem with a transform idem cannot map back), add that subject to the stream (`nats stream edit <stream> --subjects ...`), or publish the original by hand with the headers `Nats-Msg-Id` (the id it was deduplicated by) and `Idem-Replay-For: <its handler>`: without the second, every other route on its subject runs it too"
    )]
    NoStreamForSubject {
        /// The dead letter's sequence.
        sequence: u64,
        /// The subject.
        subject: String,
    },
    /// No consumer of the original's stream records the handler the replay
    /// is for (renamed, or its route removed), so no route would apply it:
    /// every idem route acks a replay for another handler unrun.
    #[error(
        "dead letter {sequence}: no consumer of stream `{stream}` runs handler `{handler}`, so no route would apply its replay (the others skip it); start that route, or, if the handler was renamed, replay it for the new name with `ReplayOptions::for_handler` (`--for-handler`), after checking the new one did not process it"
    )]
    NoRouteForHandler {
        /// The dead letter's sequence.
        sequence: u64,
        /// The handler it is for.
        handler: String,
        /// The stream the original came from.
        stream: String,
    },
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
    handler: Option<String>,
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

    /// Replay it for the handler named `name` instead of the one that
    /// dead-lettered it (`Idem-Handler`): after a rename, the new name.
    /// Claims are per handler, so if the new one processed the message
    /// (a rename reprocesses what the old one did), it is applied again.
    ///
    /// ```
    /// use idem_runtime::dead_letter::ReplayOptions;
    /// let options = ReplayOptions::default().for_handler("orders.place.v2");
    /// # drop(options);
    /// ```
    pub fn for_handler(mut self, name: impl Into<String>) -> Self {
        self.handler = Some(name.into());
        self
    }
}

/// Sends dead letter `sequence` of stream `dead_letter_stream` back to its
/// original subject, with its original payload and headers (parts moved out
/// of it included), for the handler that dead-lettered it alone, under the
/// message id it was deduplicated by (see [Replays](self#replays)): if the
/// original was in fact processed, the replay is skipped. A dead letter
/// that records no id is refused ([`ReplayError::NoMessageId`]), and so is
/// one whose original's claim may already be purged
/// ([`ReplayError::OutsideRetention`]), one whose replay would be too large
/// ([`ReplayError::TooLarge`]), and one no route would apply
/// ([`ReplayError::NoRouteForHandler`]); see [`replay_with`].
///
/// The dead letter itself stays in its stream; [`discard`] it when done.
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
    let letter = match get(js, dead_letter_stream, sequence).await {
        Ok(letter) => letter,
        Err(DeadLetterError::NotADeadLetter { .. }) => {
            return Err(ReplayError::NotADeadLetter(sequence));
        }
        Err(error) => return Err(read_error(error.into())),
    };
    replay_checks(
        &letter.headers,
        sequence,
        &options,
        time::OffsetDateTime::now_utc(),
    )?;
    let original_subject = letter
        .original_subject()
        .map(str::to_owned)
        .ok_or(ReplayError::NotADeadLetter(sequence))?;
    let target = options.handler.clone().or_else(|| {
        letter
            .handler()
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
    });
    if let Some(handler) = &target {
        check_route(js, &letter, handler).await?;
    }
    let original = original(js, &letter)
        .await
        .map_err(|error| read_error(error.into()))?;

    let mut headers = carried_headers(&original.headers);
    let original_bytes = header_block::wire_len(&headers) + original.payload.len();
    add_replay_headers(
        &mut headers,
        &letter,
        target.as_deref(),
        dead_letter_stream,
        sequence,
    );
    publish_replay(
        js,
        &letter,
        original_subject,
        headers,
        original.payload,
        sequence,
        original_bytes,
    )
    .await
}

/// The original's headers that its replay carries: all but idem's own
/// (`Idem-*`) and those that steer JetStream (`Nats-*`).
fn carried_headers(original: &HeaderMap) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.iter() {
        let name_str: &str = name.as_ref();
        if name_str.starts_with("Idem-") || name_str.starts_with("Nats-") {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    headers
}

/// Adds what makes the replay of dead letter `sequence` of
/// `dead_letter_stream` one (see [Replays](self#replays)): the id it is
/// deduplicated by, for `target`, the handler it is for (if the dead
/// letter names one), where it came from, and the original's storage time.
fn add_replay_headers(
    headers: &mut HeaderMap,
    letter: &DeadLetter,
    target: Option<&str>,
    dead_letter_stream: &str,
    sequence: u64,
) {
    let replayed_from = format!("{dead_letter_stream}:{sequence}");
    // The dead letter's own id: a second replay of it is a duplicate, not
    // a new message. Its storage time keeps it apart from the dead letter
    // that takes the same sequence in a recreated stream.
    let own_id = format!(
        "idem-replay:{replayed_from}:{}",
        letter.stored_at.unix_timestamp_nanos()
    );
    let recorded = letter.message_id().map(str::to_owned);
    match target {
        Some(handler) => {
            headers.insert(NATS_MESSAGE_ID, own_id.as_str());
            headers.insert(REPLAY_FOR, handler);
            // Without the original's id (allowed by the options), the dead
            // letter's own, from the header.
            let (id, source) = match &recorded {
                Some(id) => (
                    id.as_str(),
                    letter.header(MESSAGE_ID_SOURCE).unwrap_or("header"),
                ),
                None => (own_id.as_str(), "header"),
            };
            headers.insert(REPLAY_ID, id);
            headers.insert(REPLAY_ID_SOURCE, source);
        }
        // A dead letter that names no handler: as older idem replayed.
        None => headers.insert(NATS_MESSAGE_ID, recorded.as_deref().unwrap_or(&own_id)),
    }
    headers.insert(REPLAYED_FROM, replayed_from.as_str());
    // Should the replay be dead-lettered too, its dead letter keeps the
    // original's storage time, which the claim's age is measured from.
    if let Some(stored_at) = letter.original_stored_at() {
        headers.insert(STORED_AT, rfc3339(stored_at).as_str());
    }
}

/// Publishes the replay to the subject its original's stream stores
/// `original_subject` under, unless it is too large for the server or
/// that stream (`original_bytes` of it are the original's headers and
/// payload), and awaits its PubAck: a replay JetStream drops as a
/// duplicate is [`ReplayError::InsideDuplicateWindow`].
async fn publish_replay(
    js: &jetstream::Context,
    letter: &DeadLetter,
    original_subject: String,
    headers: HeaderMap,
    payload: bytes::Bytes,
    sequence: u64,
    original_bytes: usize,
) -> Result<jetstream::publish::PublishAck, ReplayError> {
    let (subject, stream_limit) = replay_subject(js, letter, original_subject).await;
    let size = header_block::wire_len(&headers) + payload.len();
    let too_large = |limit: usize, what: &'static str| ReplayError::TooLarge {
        sequence,
        size,
        replay_headers: size.saturating_sub(original_bytes),
        limit,
        what,
    };
    let max_payload = js.client().max_payload();
    if size > max_payload {
        return Err(too_large(max_payload, "the server's max_payload"));
    }
    if let Some(limit) = stream_limit.filter(|&limit| size > limit) {
        return Err(too_large(limit, "its stream's max_msg_size"));
    }
    let published = match js
        .publish_with_headers(subject.clone(), headers, payload)
        .await
    {
        Ok(ack) => ack.await,
        Err(error) => Err(error),
    };
    let ack = match published {
        Ok(ack) => ack,
        Err(error) if moved::too_big(&error) => {
            return Err(too_large(
                stream_limit.unwrap_or(max_payload),
                "its stream's max_msg_size",
            ));
        }
        Err(error) if error.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
            return Err(ReplayError::NoStreamForSubject { sequence, subject });
        }
        Err(error) => return Err(ReplayError::Publish(error.into())),
    };
    if ack.duplicate {
        return Err(ReplayError::InsideDuplicateWindow);
    }
    Ok(ack)
}

/// Refuses a replay for `handler` that no route would apply: the
/// original's stream has idem consumers, and none of them records
/// `handler`. A stream that cannot be read, or whose consumers record no
/// handler at all (set up by an older idem), is not refused.
async fn check_route(
    js: &jetstream::Context,
    letter: &DeadLetter,
    handler: &str,
) -> Result<(), ReplayError> {
    let Some((stream, _)) = letter.original_position() else {
        return Ok(());
    };
    let Ok(found) = js.get_stream_no_info(stream).await else {
        return Ok(());
    };
    let mut consumers = found.consumers();
    let mut recorded = false;
    while let Some(info) = consumers.next().await {
        let Ok(info) = info else {
            return Ok(());
        };
        match info.config.metadata.get(HANDLER_KEY) {
            Some(name) if name == handler => return Ok(()),
            Some(_) => recorded = true,
            None => {}
        }
    }
    if !recorded {
        return Ok(());
    }
    Err(ReplayError::NoRouteForHandler {
        sequence: letter.sequence,
        handler: handler.to_owned(),
        stream: stream.to_owned(),
    })
}

/// Where a replay of `letter` goes, and the `max_msg_size` of its
/// original's stream, if it has one: its original subject, if the stream
/// captures it; else, for a partitioned stream (which stores a message
/// under another subject than it was published to), the subject its
/// transform maps to the stored one (see
/// [`partition::published_subject`](crate::route::partition)).
async fn replay_subject(
    js: &jetstream::Context,
    letter: &DeadLetter,
    subject: String,
) -> (String, Option<usize>) {
    let Some((stream, _)) = letter.original_position() else {
        return (subject, None);
    };
    let Ok(found) = js.get_stream(stream).await else {
        return (subject, None);
    };
    let config = &found.cached_info().config;
    let limit = usize::try_from(config.max_message_size)
        .ok()
        .filter(|&limit| limit > 0);
    if config
        .subjects
        .iter()
        .any(|filter| subject_matches(filter, &subject))
    {
        return (subject, limit);
    }
    let published = config
        .subject_transform
        .as_ref()
        .and_then(|transform| crate::route::partition::published_subject(transform, &subject));
    (published.unwrap_or(subject), limit)
}

/// Whether `subject` matches the subject filter `filter` (`*` one token,
/// `>` the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for pattern in filter.split('.') {
        match (pattern, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (literal, Some(token)) if literal == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
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
            .and_then(|value| crate::error::retention::decode_duration(value.as_str()))
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
    fn subjects_match_filters_token_by_token() {
        assert!(subject_matches("orders.*", "orders.o-1"));
        assert!(!subject_matches("orders.*", "orders.p.3.o-1"));
        assert!(subject_matches("orders.>", "orders.p.3.o-1"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders.placed", "orders.placed"));
        assert!(!subject_matches("orders.placed", "orders.placed.eu"));
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
