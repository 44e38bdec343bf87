//! Reading and removing dead letters: what an operator needs besides
//! [`replay`](super::replay), as library functions (the `idem` command is a
//! thin layer over them).
//!
//! Dead letters are read straight from their stream by sequence
//! (`STREAM.MSG.GET` with `next_by_subject`), one request each: no consumer
//! is created, so reading leaves nothing behind on the server and ends
//! exactly at the stream's last message. Each is read raw, its header block
//! parsed as async-nats parses a delivery's (see `header_block.rs`), so a
//! header the original had twice is kept twice, and an id reads back
//! exactly as it was recorded.
//!
//! A dead letter too big to be stored as it was has parts moved to the
//! object store ([`DeadLetter::payload_moved`], see `moved.rs`):
//! [`original`] reads them back, and [`discard`] deletes them with it.
//!
//! ```no_run
//! # async fn f(js: async_nats::jetstream::Context) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_runtime::dead_letter::{self, Failure, Filter};
//!
//! let filter = Filter::new().handler("ledger.credit.v1").failure(Failure::Permanent);
//! for letter in dead_letter::list(&js, dead_letter::DEFAULT_STREAM, &filter).await? {
//!     println!("{} {:?}: {:?}", letter.sequence, letter.message_id(), letter.error());
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures_util::TryStreamExt;
use serde::Deserialize;
use time::OffsetDateTime;

use super::moved::{self, BUCKET};
use super::{
    Failure, MESSAGE_ID, ORIGINAL_SUBJECT, REPLAYED_FROM, ReplayError, ReplayOptions, STORED_AT,
    parse_time, replay_checks,
};
use crate::dead_letter::header_block;

/// JetStream's error code for "no message found".
const NO_MESSAGE_FOUND: u64 = 10037;

/// A dead letter as its stream stores it: the original's payload and
/// headers, and the `Idem-*` headers that say where it came from and why it
/// failed (see the [module docs](super)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The dead-letter stream it is in.
    pub stream: String,
    /// Its sequence in that stream: what [`get`], [`replay`](super::replay)
    /// and [`discard`] take.
    pub sequence: u64,
    /// The subject it is stored under (`idem.dead.<stream>.<durable>` for
    /// a route with the default dead-letter subject).
    pub subject: String,
    /// When the dead-letter stream stored it.
    pub stored_at: OffsetDateTime,
    /// Its headers: the original's (without `Nats-*`) and the `Idem-*` ones.
    pub headers: HeaderMap,
    /// The original payload.
    pub payload: Bytes,
}

impl DeadLetter {
    /// The value of header `name`, if it has one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|value| value.as_str())
    }

    /// The handler that gave up on it (`Idem-Handler`).
    pub fn handler(&self) -> Option<&str> {
        self.header("Idem-Handler")
    }

    /// Why it was dead-lettered, as recorded (`Idem-Failure`); see
    /// [`Failure::parse`].
    pub fn failure(&self) -> Option<&str> {
        self.header("Idem-Failure")
    }

    /// The last error, one line (`Idem-Error`).
    pub fn error(&self) -> Option<&str> {
        self.header("Idem-Error")
    }

    /// The id it was deduplicated by (`Idem-Message-Id`); `None` if none
    /// could be known, in which case a replay is refused unless allowed
    /// ([`ReplayOptions::allow_new_message_id`]).
    pub fn message_id(&self) -> Option<&str> {
        self.header(MESSAGE_ID).filter(|id| !id.is_empty())
    }

    /// The subject the original was published to, where a replay goes.
    pub fn original_subject(&self) -> Option<&str> {
        self.header(ORIGINAL_SUBJECT)
    }

    /// The original's stream and sequence, when it came from a stream.
    pub fn original_position(&self) -> Option<(&str, u64)> {
        let stream = self.header("Idem-Original-Stream")?;
        let sequence = self.header("Idem-Original-Sequence")?.parse().ok()?;
        Some((stream, sequence))
    }

    /// How many times the original was delivered (`Idem-Delivered`).
    pub fn delivered(&self) -> Option<u64> {
        self.header("Idem-Delivered")?.parse().ok()
    }

    /// When the original was stored (`Idem-Original-Stored-At`; for a
    /// replay, its first copy's).
    pub fn original_stored_at(&self) -> Option<OffsetDateTime> {
        parse_time(self.header(STORED_AT)?)
    }

    /// The dead letter this one's original was replayed from
    /// (`<stream>:<sequence>`), if it was a replay that failed again.
    pub fn replayed_from(&self) -> Option<&str> {
        self.header(REPLAYED_FROM)
    }

    /// Where the original payload was moved, if it did not fit in the dead
    /// letter (`Idem-Payload-Moved`); [`DeadLetter::payload`] is then empty.
    pub fn payload_moved(&self) -> Option<MovedPart> {
        self.moved(moved::PAYLOAD_MOVED, moved::PAYLOAD_BYTES)
    }

    /// Where the original header block was moved, if it did not fit in the
    /// dead letter (`Idem-Headers-Moved`); the original's headers are then
    /// not among [`DeadLetter::headers`].
    pub fn headers_moved(&self) -> Option<MovedPart> {
        self.moved(moved::HEADERS_MOVED, moved::HEADERS_BYTES)
    }

    /// How many bytes of the error text were cut to make it fit
    /// (`Idem-Error-Cut`).
    pub fn error_cut(&self) -> Option<u64> {
        self.header(moved::ERROR_CUT)?.parse().ok()
    }

    fn moved(&self, object: &str, bytes: &str) -> Option<MovedPart> {
        Some(MovedPart {
            bucket: self.header(moved::MOVED_TO).unwrap_or(BUCKET).to_owned(),
            object: self.header(object)?.to_owned(),
            bytes: self.header(bytes).and_then(|bytes| bytes.parse().ok()),
        })
    }

    fn from_raw(stream: &str, raw: stream::RawMessage) -> Result<DeadLetter, async_nats::Error> {
        let payload = BASE64.decode(raw.payload.as_bytes())?;
        let headers = match raw.headers.as_deref() {
            Some(encoded) => {
                let block = BASE64.decode(encoded.as_bytes())?;
                match header_block::read(&block) {
                    Ok(headers) => header_block::to_map(&headers),
                    Err(_) => header_block::lenient(&block),
                }
            }
            None => HeaderMap::new(),
        };
        Ok(DeadLetter {
            stream: stream.to_owned(),
            sequence: raw.sequence,
            subject: raw.subject,
            stored_at: raw.time,
            headers,
            payload: payload.into(),
        })
    }
}

/// A part of a dead letter's original that did not fit in it, and where it
/// is: an object of a JetStream object store (`nats object get <bucket>
/// <object>` reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MovedPart {
    /// The object store bucket ([`super::BUCKET`] unless recorded
    /// otherwise).
    pub bucket: String,
    /// The object's name.
    pub object: String,
    /// Its size, as recorded.
    pub bytes: Option<u64>,
}

/// A dead letter's original message, with any part that was moved out of
/// it read back: what [`replay`](super::replay) sends.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Original {
    /// Its headers, without the `Nats-*` ones (which steer JetStream) and
    /// without `Idem-*` ones (idem's own).
    pub headers: HeaderMap,
    /// Its header block as JetStream stored it, where idem read the
    /// original raw (a message JetStream gave up on); also a moved header
    /// block, as it was moved.
    pub header_block: Option<Bytes>,
    /// Its payload.
    pub payload: Bytes,
}

/// The original message of `letter`, its moved parts (if any) read back
/// from the object store.
pub async fn original(
    js: &jetstream::Context,
    letter: &DeadLetter,
) -> Result<Original, DeadLetterError> {
    let fetch = async |part: &'static str, moved: MovedPart| {
        let bytes = moved::get(js, &moved.bucket, &moved.object).await;
        let source = match bytes {
            Ok(bytes) if moved.bytes.is_none_or(|size| size == bytes.len() as u64) => {
                return Ok(bytes);
            }
            Ok(bytes) => format!(
                "it holds {} bytes, not the {:?} recorded",
                bytes.len(),
                moved.bytes
            )
            .into(),
            Err(error) => error,
        };
        Err(DeadLetterError::Moved {
            stream: letter.stream.clone(),
            sequence: letter.sequence,
            part,
            bucket: moved.bucket,
            object: moved.object,
            source,
        })
    };
    let payload = match letter.payload_moved() {
        Some(moved) => fetch("payload", moved).await?,
        None => letter.payload.clone(),
    };
    let (headers, header_block) = match letter.headers_moved() {
        Some(moved) => {
            let block = fetch("header block", moved).await?;
            let headers = match header_block::read(&block) {
                Ok(headers) => header_block::to_map(&headers),
                Err(_) => header_block::lenient(&block),
            };
            (headers, Some(block))
        }
        None => {
            let block = letter
                .header(moved::ORIGINAL_HEADERS_BASE64)
                .and_then(|encoded| BASE64.decode(encoded).ok())
                .map(Bytes::from);
            (letter.headers.clone(), block)
        }
    };
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter() {
        let name_str: &str = name.as_ref();
        if name_str.starts_with("Idem-") || name_str.starts_with("Nats-") {
            continue;
        }
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    Ok(Original {
        headers: kept,
        header_block,
        payload,
    })
}

/// The answer to `STREAM.MSG.GET`.
#[derive(Debug, Deserialize)]
struct RawGet {
    message: Option<stream::RawMessage>,
    error: Option<serde_json::Value>,
}

/// Message `sequence` of `stream` (with `next_by_subject`, the first at or
/// after it under that subject), raw; `None` if there is none.
async fn get_raw(
    js: &jetstream::Context,
    stream: &str,
    sequence: u64,
    next_by_subject: Option<&str>,
) -> Result<Option<stream::RawMessage>, async_nats::Error> {
    let request = match next_by_subject {
        Some(subject) => serde_json::json!({ "seq": sequence, "next_by_subj": subject }),
        None => serde_json::json!({ "seq": sequence }),
    };
    let got: RawGet = js
        .request(format!("STREAM.MSG.GET.{stream}"), &request)
        .await?;
    match (got.message, got.error) {
        (Some(message), _) => Ok(Some(message)),
        (None, Some(error))
            if error.get("err_code").and_then(serde_json::Value::as_u64)
                == Some(NO_MESSAGE_FOUND) =>
        {
            Ok(None)
        }
        (None, error) => Err(format!("the server answered {error:?}").into()),
    }
}

impl Failure {
    /// Every kind of failure, in the order of the module docs.
    pub const ALL: [Failure; 6] = [
        Failure::Permanent,
        Failure::Exhausted,
        Failure::Undecodable,
        Failure::BadMessageId,
        Failure::Undeliverable,
        Failure::NotADelivery,
    ];

    /// The failure an `Idem-Failure` value names.
    ///
    /// ```
    /// use idem_runtime::dead_letter::Failure;
    /// assert_eq!(Failure::parse("exhausted"), Some(Failure::Exhausted));
    /// assert_eq!(Failure::parse("tired"), None);
    /// ```
    pub fn parse(text: &str) -> Option<Failure> {
        Failure::ALL
            .into_iter()
            .find(|failure| failure.as_str() == text)
    }
}

/// Which dead letters [`list`] returns. Every condition set must hold; the
/// default selects all of them.
///
/// ```
/// use idem_runtime::dead_letter::{Failure, Filter};
/// let recent_permanent = Filter::new()
///     .failure(Failure::Permanent)
///     .since(time::OffsetDateTime::now_utc() - time::Duration::hours(1));
/// # drop(recent_permanent);
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Filter {
    subject: Option<String>,
    handler: Option<String>,
    failure: Option<Failure>,
    since: Option<OffsetDateTime>,
    until: Option<OffsetDateTime>,
    limit: Option<usize>,
}

impl Filter {
    /// All dead letters.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only those stored under `subject` (wildcards allowed), such as one
    /// route's `idem.dead.<stream>.<durable>`. The server filters, so the
    /// others are not read.
    pub fn subject(mut self, subject: impl Into<String>) -> Filter {
        self.subject = Some(subject.into());
        self
    }

    /// Only those of the handler named `name`.
    pub fn handler(mut self, name: impl Into<String>) -> Filter {
        self.handler = Some(name.into());
        self
    }

    /// Only those that failed this way.
    pub fn failure(mut self, failure: Failure) -> Filter {
        self.failure = Some(failure);
        self
    }

    /// Only those the dead-letter stream stored at or after `at`.
    pub fn since(mut self, at: OffsetDateTime) -> Filter {
        self.since = Some(at);
        self
    }

    /// Only those the dead-letter stream stored before `at`.
    pub fn until(mut self, at: OffsetDateTime) -> Filter {
        self.until = Some(at);
        self
    }

    /// At most `n` of them, the oldest: [`list`] stops reading there.
    pub fn limit(mut self, n: usize) -> Filter {
        self.limit = Some(n);
        self
    }

    /// Whether `letter` passes every condition but the subject (which the
    /// server applies) and the limit.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        self.handler
            .as_deref()
            .is_none_or(|handler| letter.handler() == Some(handler))
            && self
                .failure
                .is_none_or(|failure| letter.failure() == Some(failure.as_str()))
            && self.since.is_none_or(|since| letter.stored_at >= since)
            && self.until.is_none_or(|until| letter.stored_at < until)
    }
}

/// Why dead letters could not be read or removed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeadLetterError {
    /// The stream could not be read.
    #[error(
        "dead-letter stream `{stream}` cannot be read: {source}; check that NATS is reachable and the stream exists (routes with the default dead-letter subject use `IDEM_DEAD_LETTERS`, created when a router starts)"
    )]
    Stream {
        /// The dead-letter stream.
        stream: String,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// No message has that sequence (never stored, discarded, or aged out).
    #[error(
        "stream `{stream}` has no message {sequence}: it was discarded or aged out, or never existed; list the dead letters to see their sequences"
    )]
    NotFound {
        /// The dead-letter stream.
        stream: String,
        /// The sequence asked for.
        sequence: u64,
    },
    /// Reading one message failed.
    #[error("reading message {sequence} of stream `{stream}` failed: {source}")]
    Read {
        /// The dead-letter stream.
        stream: String,
        /// The sequence asked for.
        sequence: u64,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// The message has no `Idem-Original-Subject` header; it was left alone.
    #[error(
        "message {sequence} of stream `{stream}` has no Idem-Original-Subject header: it is not an idem dead letter, so it was left alone"
    )]
    NotADeadLetter {
        /// The stream.
        stream: String,
        /// The message's sequence.
        sequence: u64,
    },
    /// Deleting it failed.
    #[error(
        "deleting dead letter {sequence} of stream `{stream}` failed: {source}; it is still there (a stream with deny_delete refuses deletes)"
    )]
    Delete {
        /// The dead-letter stream.
        stream: String,
        /// Its sequence.
        sequence: u64,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// A part of its original that was moved out of it cannot be read.
    #[error(
        "dead letter {sequence} of stream `{stream}`: its {part} was moved to object `{object}` of object store bucket `{bucket}`, which cannot be read: {source}; check the bucket (`nats object ls {bucket}`)"
    )]
    Moved {
        /// The dead-letter stream.
        stream: String,
        /// Its sequence.
        sequence: u64,
        /// Which part: `payload` or `header block`.
        part: &'static str,
        /// The object store bucket.
        bucket: String,
        /// The object.
        object: String,
        /// Why it cannot be read.
        source: async_nats::Error,
    },
    /// It was deleted, but a part moved out of it could not be.
    #[error(
        "dead letter {sequence} of stream `{stream}` was deleted, but its moved part `{object}` is still in object store bucket `{bucket}`: {source}; delete it with `nats object rm {bucket} '{object}'`"
    )]
    MovedPartLeft {
        /// The dead-letter stream.
        stream: String,
        /// Its sequence.
        sequence: u64,
        /// The object store bucket.
        bucket: String,
        /// The object left.
        object: String,
        /// The server's answer.
        source: async_nats::Error,
    },
}

/// The dead letters of `dead_letter_stream` that pass `filter`, oldest
/// first. Messages without idem's headers are skipped.
pub async fn list(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    filter: &Filter,
) -> Result<Vec<DeadLetter>, DeadLetterError> {
    let stream_error = |source: async_nats::Error| DeadLetterError::Stream {
        stream: dead_letter_stream.to_owned(),
        source,
    };
    let mut stream = js
        .get_stream(dead_letter_stream)
        .await
        .map_err(|e| stream_error(e.into()))?;
    let info = stream.info().await.map_err(|e| stream_error(e.into()))?;
    // Dead letters stored while this reads are left for the next reading.
    let (first, last) = (info.state.first_sequence, info.state.last_sequence);
    let subject = filter.subject.clone().unwrap_or_else(|| ">".to_owned());
    let mut letters = Vec::new();
    let mut next = first.max(1);
    let limit = filter.limit.unwrap_or(usize::MAX);
    while next <= last && letters.len() < limit {
        let read_error = |source: async_nats::Error| DeadLetterError::Read {
            stream: dead_letter_stream.to_owned(),
            sequence: next,
            source,
        };
        let message = match get_raw(js, dead_letter_stream, next, Some(&subject)).await {
            Ok(Some(message)) => message,
            Ok(None) => break,
            Err(error) => return Err(read_error(error)),
        };
        if message.sequence > last {
            break;
        }
        let sequence = message.sequence;
        let letter = DeadLetter::from_raw(dead_letter_stream, message).map_err(read_error)?;
        next = sequence + 1;
        if letter.original_subject().is_some() && filter.matches(&letter) {
            letters.push(letter);
        }
    }
    Ok(letters)
}

/// Dead letter `sequence` of `dead_letter_stream`, with its payload.
pub async fn get(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    sequence: u64,
) -> Result<DeadLetter, DeadLetterError> {
    js.get_stream_no_info(dead_letter_stream)
        .await
        .map_err(|e| DeadLetterError::Stream {
            stream: dead_letter_stream.to_owned(),
            source: e.into(),
        })?;
    let read_error = |source: async_nats::Error| DeadLetterError::Read {
        stream: dead_letter_stream.to_owned(),
        sequence,
        source,
    };
    let message = match get_raw(js, dead_letter_stream, sequence, None).await {
        Ok(Some(message)) => message,
        Ok(None) => {
            return Err(DeadLetterError::NotFound {
                stream: dead_letter_stream.to_owned(),
                sequence,
            });
        }
        Err(error) => return Err(read_error(error)),
    };
    let letter = DeadLetter::from_raw(dead_letter_stream, message).map_err(read_error)?;
    if letter.original_subject().is_none() {
        return Err(DeadLetterError::NotADeadLetter {
            stream: dead_letter_stream.to_owned(),
            sequence,
        });
    }
    Ok(letter)
}

/// Deletes dead letter `sequence` from `dead_letter_stream`, for good: once
/// its cause is fixed and it was replayed, or when it should never be
/// processed; then the parts moved out of it, if any (after the dead
/// letter, so that a failure leaves an orphaned object, never a dead letter
/// without its payload). A message that is not an idem dead letter is
/// refused ([`DeadLetterError::NotADeadLetter`]) and left alone.
pub async fn discard(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    sequence: u64,
) -> Result<(), DeadLetterError> {
    let letter = get(js, dead_letter_stream, sequence).await?;
    let stream = js
        .get_stream_no_info(dead_letter_stream)
        .await
        .map_err(|e| DeadLetterError::Stream {
            stream: dead_letter_stream.to_owned(),
            source: e.into(),
        })?;
    if let Err(error) = stream.delete_message(sequence).await {
        return Err(DeadLetterError::Delete {
            stream: dead_letter_stream.to_owned(),
            sequence,
            source: error.into(),
        });
    }
    for part in [letter.payload_moved(), letter.headers_moved()]
        .into_iter()
        .flatten()
    {
        if let Err(source) = moved::delete(js, &part.bucket, &part.object).await {
            return Err(DeadLetterError::MovedPartLeft {
                stream: dead_letter_stream.to_owned(),
                sequence,
                bucket: part.bucket,
                object: part.object,
                source,
            });
        }
    }
    Ok(())
}

/// Whether [`replay_with`](super::replay_with) with `options` would replay
/// `letter` now, by the same rules, without publishing anything: for a dry
/// run. (Whether JetStream would drop the replay inside its duplicate
/// window, [`ReplayError::InsideDuplicateWindow`], only a publish can tell.)
pub fn check_replay(letter: &DeadLetter, options: &ReplayOptions) -> Result<(), ReplayError> {
    replay_checks(
        &letter.headers,
        letter.sequence,
        options,
        OffsetDateTime::now_utc(),
    )
}

/// How many messages `dead_letter_stream` holds under each subject that
/// matches `subjects` (wildcards allowed): one request, whatever the number
/// of messages. With the default subjects, that is the dead letters of each
/// route (`idem.dead.<stream>.<durable>`).
pub async fn subject_counts(
    js: &jetstream::Context,
    dead_letter_stream: &str,
    subjects: &str,
) -> Result<BTreeMap<String, u64>, DeadLetterError> {
    let stream_error = |source: async_nats::Error| DeadLetterError::Stream {
        stream: dead_letter_stream.to_owned(),
        source,
    };
    let stream = js
        .get_stream_no_info(dead_letter_stream)
        .await
        .map_err(|e| stream_error(e.into()))?;
    let counts = stream
        .info_with_subjects(subjects)
        .await
        .map_err(|e| stream_error(e.into()))?;
    counts
        .map_ok(|(subject, count)| (subject, count as u64))
        .try_collect()
        .await
        .map_err(|e| stream_error(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(handler: &str, failure: Failure, message_id: &str, at: OffsetDateTime) -> DeadLetter {
        let mut headers = HeaderMap::new();
        headers.insert(ORIGINAL_SUBJECT, "orders.placed");
        headers.insert("Idem-Handler", handler);
        headers.insert("Idem-Failure", failure.as_str());
        headers.insert(MESSAGE_ID, message_id);
        DeadLetter {
            stream: super::super::DEFAULT_STREAM.to_owned(),
            sequence: 7,
            subject: "idem.dead.ORDERS.placed".to_owned(),
            stored_at: at,
            headers,
            payload: Bytes::new(),
        }
    }

    #[test]
    fn a_filter_passes_only_what_meets_every_condition() {
        let at = OffsetDateTime::UNIX_EPOCH + time::Duration::days(1);
        let letter = letter("orders.v1", Failure::Exhausted, "o-1", at);
        assert!(Filter::new().matches(&letter));
        assert!(
            Filter::new()
                .handler("orders.v1")
                .failure(Failure::Exhausted)
                .since(at)
                .until(at + time::Duration::SECOND)
                .matches(&letter)
        );
        assert!(!Filter::new().handler("orders.v2").matches(&letter));
        assert!(!Filter::new().failure(Failure::Permanent).matches(&letter));
        assert!(
            !Filter::new()
                .since(at + time::Duration::SECOND)
                .matches(&letter)
        );
        assert!(!Filter::new().until(at).matches(&letter), "until excludes");
    }

    #[test]
    fn a_dry_run_applies_the_replay_rules() {
        let now = OffsetDateTime::now_utc();
        let fine = letter("orders.v1", Failure::Permanent, "o-1", now);
        check_replay(&fine, &ReplayOptions::default()).unwrap();

        let no_id = letter("orders.v1", Failure::Permanent, "", now);
        assert!(matches!(
            check_replay(&no_id, &ReplayOptions::default()),
            Err(ReplayError::NoMessageId(7))
        ));
        check_replay(&no_id, &ReplayOptions::default().allow_new_message_id()).unwrap();

        let mut old = letter("orders.v1", Failure::Permanent, "o-1", now);
        old.headers.insert("Idem-Retention", "3600s");
        old.headers.insert(STORED_AT, "2020-01-01T00:00:00Z");
        assert!(matches!(
            check_replay(&old, &ReplayOptions::default()),
            Err(ReplayError::OutsideRetention { .. })
        ));
        check_replay(&old, &ReplayOptions::default().allow_outside_retention()).unwrap();

        let mut stranger = letter("orders.v1", Failure::Permanent, "o-1", now);
        stranger.headers = HeaderMap::new();
        assert!(matches!(
            check_replay(&stranger, &ReplayOptions::default()),
            Err(ReplayError::NotADeadLetter(7))
        ));
    }
}
