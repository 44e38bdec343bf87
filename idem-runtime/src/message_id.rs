//! Which id a message is deduplicated by.

use std::fmt;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;

/// The header a targeted replay of a dead letter carries its original's id
/// in (see [`dead_letter::replay`](crate::dead_letter::replay)): the replay's
/// own `Nats-Msg-Id` is the dead letter's, so that replays of several
/// routes' dead letters of one message are not taken for one another by
/// JetStream's publish dedup.
pub(crate) const REPLAY_ID: &str = "Idem-Replay-Id";
/// Where the id in [`REPLAY_ID`] came from ([`MessageIdSource::as_str`]).
pub(crate) const REPLAY_ID_SOURCE: &str = "Idem-Replay-Id-Source";

/// The longest message id accepted, in bytes. Ids are stored in the dedup
/// table's primary key, so they must stay small; a longer explicit key or
/// `Nats-Msg-Id` is refused rather than truncated, because truncation could
/// make two different messages collide.
pub const MAX_MESSAGE_ID_LEN: usize = 512;

/// The id a message is deduplicated by, per handler.
///
/// It is chosen in this order:
/// 1. the handler's explicit `key = <expr>` over the decoded payload;
/// 2. the `Nats-Msg-Id` header, which publishers also use for JetStream's own
///    (time-limited) publish dedup;
/// 3. the message's position: `<stream>:<stream sequence>:<stored at>`, the
///    last part being the time JetStream stored it, in nanoseconds since the
///    Unix epoch. It is unique per stored message, also across a stream that
///    is deleted and recreated (its sequences start over at 1, its times do
///    not), but it differs between two stored copies of one logical message
///    (a publisher retry after JetStream's duplicate window).
///
/// An explicit key or a `Nats-Msg-Id` that is empty, longer than
/// [`MAX_MESSAGE_ID_LEN`] bytes, or holds a NUL character is an
/// [`InvalidMessageId`] error: the message is dead-lettered on its first
/// delivery (not retried), because no retry can change its id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageId {
    value: String,
    source: MessageIdSource,
}

/// Where a [`MessageId`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MessageIdSource {
    /// The handler's `key = <expr>`.
    Key,
    /// The `Nats-Msg-Id` header.
    Header,
    /// `<stream>:<stream sequence>:<stored at>`.
    StreamPosition,
}

impl MessageIdSource {
    /// The name used in the `Idem-Message-Id-Source` header of dead letters.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageIdSource::Key => "key",
            MessageIdSource::Header => "header",
            MessageIdSource::StreamPosition => "stream-position",
        }
    }

    /// The source an `Idem-Message-Id-Source` value names.
    ///
    /// ```
    /// use idem_runtime::MessageIdSource;
    /// assert_eq!(MessageIdSource::parse("key"), Some(MessageIdSource::Key));
    /// assert_eq!(MessageIdSource::parse("unknown"), None);
    /// ```
    pub fn parse(text: &str) -> Option<Self> {
        [
            MessageIdSource::Key,
            MessageIdSource::Header,
            MessageIdSource::StreamPosition,
        ]
        .into_iter()
        .find(|source| source.as_str() == text)
    }
}

/// A message id that cannot be used as a dedup key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessageId {
    /// The id is the empty string.
    #[error("the {0:?} message id is empty; give the message a non-empty id")]
    Empty(MessageIdSource),
    /// The id is longer than [`MAX_MESSAGE_ID_LEN`].
    #[error(
        "the {origin:?} message id is {len} bytes, more than the {max}-byte limit; use a shorter id (a hash of it, say)",
        max = MAX_MESSAGE_ID_LEN
    )]
    TooLong {
        /// Where the id came from.
        origin: MessageIdSource,
        /// Its length in bytes.
        len: usize,
    },
    /// The id holds a NUL character, which PostgreSQL text cannot store.
    #[error("the {0:?} message id holds a NUL character; give the message an id without one")]
    Nul(MessageIdSource),
    /// The id holds a line break, which no NATS header (a dead letter's
    /// `Idem-Message-Id`, a replay's `Nats-Msg-Id`) can carry.
    #[error("the {0:?} message id holds a line break; give the message an id without one")]
    LineBreak(MessageIdSource),
    /// The handler's `key = ...` panicked.
    #[error("the handler's key panicked: {0}")]
    KeyPanicked(String),
    /// A request ([`ReplyRoute`](crate::ReplyRoute)) came without a
    /// `Nats-Msg-Id` header, and its handler has no `key = ...`: there is
    /// nothing to tell its retries by.
    #[error(
        "the request has no Nats-Msg-Id header, and its handler no key: send each request with a Nats-Msg-Id, the same on every retry of it"
    )]
    Missing,
}

impl MessageId {
    /// The id a delivery has before its payload is decoded: for a targeted
    /// replay of a dead letter, the id its original was deduplicated by
    /// ([`REPLAY_ID`], from the source [`REPLAY_ID_SOURCE`] names); else its
    /// `Nats-Msg-Id`, else its stream position. A handler's key, once the
    /// payload decodes, takes precedence ([`MessageId::from_key`]).
    ///
    /// A replay reaches the pipeline only on the route it is for (the
    /// others ack it unrun), so the replay headers are taken as they are.
    pub(crate) fn of_delivery(
        headers: &HeaderMap,
        stream: &str,
        stream_sequence: u64,
        stored_at: time::OffsetDateTime,
    ) -> Result<Self, InvalidMessageId> {
        if let Some(replayed) = headers.get_last(REPLAY_ID) {
            // An unnamed source is the header's: a bounded claim is then
            // bounded by the replay's recorded storage time (`consume/pipeline.rs`).
            let source = headers
                .get_last(REPLAY_ID_SOURCE)
                .and_then(|source| MessageIdSource::parse(source.as_str()))
                .unwrap_or(MessageIdSource::Header);
            return Self::checked(replayed.as_str().to_owned(), source);
        }
        match headers.get_last(NATS_MESSAGE_ID) {
            Some(header) => Self::checked(header.as_str().to_owned(), MessageIdSource::Header),
            None => Ok(Self::from_stream_position(
                stream,
                stream_sequence,
                stored_at,
            )),
        }
    }

    /// The id a handler's `key = <expr>` gave.
    pub(crate) fn from_key(key: String) -> Result<Self, InvalidMessageId> {
        Self::checked(key, MessageIdSource::Key)
    }

    /// A `Nats-Msg-Id` read from a raw header block.
    pub(crate) fn from_header(value: String) -> Result<Self, InvalidMessageId> {
        Self::checked(value, MessageIdSource::Header)
    }

    /// No id yet: what a request's delivery carries until its id is
    /// resolved.
    pub(crate) fn none() -> Self {
        Self {
            value: String::new(),
            source: MessageIdSource::Header,
        }
    }

    /// `<stream>:<stream sequence>:<stored at, in Unix nanoseconds>`.
    pub(crate) fn from_stream_position(
        stream: &str,
        stream_sequence: u64,
        stored_at: time::OffsetDateTime,
    ) -> Self {
        Self {
            value: format!(
                "{stream}:{stream_sequence}:{}",
                stored_at.unix_timestamp_nanos()
            ),
            source: MessageIdSource::StreamPosition,
        }
    }

    fn checked(value: String, source: MessageIdSource) -> Result<Self, InvalidMessageId> {
        if value.is_empty() {
            return Err(InvalidMessageId::Empty(source));
        }
        if value.len() > MAX_MESSAGE_ID_LEN {
            return Err(InvalidMessageId::TooLong {
                origin: source,
                len: value.len(),
            });
        }
        if value.contains('\0') {
            return Err(InvalidMessageId::Nul(source));
        }
        if value.contains(['\r', '\n']) {
            return Err(InvalidMessageId::LineBreak(source));
        }
        Ok(Self { value, source })
    }

    /// The id as stored in the dedup table.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// Whether a header can carry the id exactly: async-nats trims a value
    /// it reads at both ends (Unicode whitespace), so an id that starts or
    /// ends with whitespace (a key can) would be read back as another id.
    /// Line breaks and NUL are refused when an id is resolved.
    pub(crate) fn recordable(&self) -> bool {
        self.value.trim() == self.value
    }

    /// Where the id came from.
    pub fn source(&self) -> MessageIdSource {
        self.source
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers_with_id(id: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, id);
        headers
    }

    fn stored_at(nanos: i128) -> time::OffsetDateTime {
        time::OffsetDateTime::from_unix_timestamp_nanos(nanos).unwrap()
    }

    #[test]
    fn the_header_is_the_id_of_a_delivery() {
        let id = MessageId::of_delivery(&headers_with_id("h-1"), "S", 7, stored_at(1)).unwrap();
        assert_eq!((id.as_str(), id.source()), ("h-1", MessageIdSource::Header));
    }

    #[test]
    fn the_stream_position_is_the_fallback_and_includes_the_storage_time() {
        let id = MessageId::of_delivery(
            &HeaderMap::new(),
            "ORDERS",
            42,
            stored_at(1_764_000_000_123_456_789),
        )
        .unwrap();
        assert_eq!(
            (id.as_str(), id.source()),
            (
                "ORDERS:42:1764000000123456789",
                MessageIdSource::StreamPosition
            )
        );
        // The same sequence in a recreated stream is another message.
        let recreated = MessageId::of_delivery(
            &HeaderMap::new(),
            "ORDERS",
            42,
            stored_at(1_764_000_999_000_000_000),
        )
        .unwrap();
        assert_ne!(id, recreated);
    }

    #[test]
    fn a_targeted_replay_carries_its_original_s_id() {
        let mut headers = headers_with_id("idem-replay:IDEM_DEAD_LETTERS:4:17");
        headers.insert(REPLAY_ID, "ORDERS:9:123");
        headers.insert(REPLAY_ID_SOURCE, "stream-position");
        let id = MessageId::of_delivery(&headers, "ORDERS", 12, stored_at(1)).unwrap();
        assert_eq!(
            (id.as_str(), id.source()),
            ("ORDERS:9:123", MessageIdSource::StreamPosition)
        );
        let mut headers = headers_with_id("idem-replay:IDEM_DEAD_LETTERS:4:17");
        headers.insert(REPLAY_ID, "ORDERS:9:123");
        let id = MessageId::of_delivery(&headers, "ORDERS", 12, stored_at(1)).unwrap();
        assert_eq!(id.source(), MessageIdSource::Header);
    }

    #[test]
    fn an_id_with_whitespace_at_an_end_cannot_be_recorded() {
        assert!(MessageId::from_key("a b".into()).unwrap().recordable());
        assert!(!MessageId::from_key(" a".into()).unwrap().recordable());
        assert!(!MessageId::from_key("a\u{a0}".into()).unwrap().recordable());
    }

    #[test]
    fn empty_oversized_and_nul_ids_are_refused() {
        assert_eq!(
            MessageId::from_key(String::new()),
            Err(InvalidMessageId::Empty(MessageIdSource::Key))
        );
        let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
        assert!(matches!(
            MessageId::of_delivery(&headers_with_id(&long), "S", 1, stored_at(1)),
            Err(InvalidMessageId::TooLong {
                origin: MessageIdSource::Header,
                ..
            })
        ));
        assert_eq!(
            MessageId::from_key("a\0b".into()),
            Err(InvalidMessageId::Nul(MessageIdSource::Key))
        );
        assert_eq!(
            MessageId::from_key("a\rb".into()),
            Err(InvalidMessageId::LineBreak(MessageIdSource::Key))
        );
    }
}
