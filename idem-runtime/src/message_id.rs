//! Which id a message is deduplicated by.

use std::fmt;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;

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
/// 3. `<stream>:<stream sequence>`, which is unique per stored message but
///    changes if a publisher stores the same logical message twice.
///
/// An explicit key or a `Nats-Msg-Id` that is empty, or longer than
/// [`MAX_MESSAGE_ID_LEN`] bytes, is an [`InvalidMessageId`] error: the message
/// is dead-lettered on its first delivery (not retried), because no retry
/// can change its id.
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
    /// `<stream>:<stream sequence>`.
    StreamSequence,
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
}

impl MessageId {
    /// Resolves the id of a delivery: the explicit key if the handler has one,
    /// else the `Nats-Msg-Id` header, else `<stream>:<stream sequence>`.
    pub fn resolve(
        key: Option<String>,
        headers: &HeaderMap,
        stream: &str,
        stream_sequence: u64,
    ) -> Result<Self, InvalidMessageId> {
        if let Some(key) = key {
            return Self::checked(key, MessageIdSource::Key);
        }
        if let Some(header) = headers.get_last(NATS_MESSAGE_ID) {
            return Self::checked(header.as_str().to_owned(), MessageIdSource::Header);
        }
        Ok(Self::from_stream_sequence(stream, stream_sequence))
    }

    pub(crate) fn from_stream_sequence(stream: &str, stream_sequence: u64) -> Self {
        Self {
            value: format!("{stream}:{stream_sequence}"),
            source: MessageIdSource::StreamSequence,
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
        Ok(Self { value, source })
    }

    /// The id as stored in the dedup table.
    pub fn as_str(&self) -> &str {
        &self.value
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

    #[test]
    fn explicit_key_wins_over_header_and_sequence() {
        let id = MessageId::resolve(Some("k-1".into()), &headers_with_id("h-1"), "S", 7).unwrap();
        assert_eq!((id.as_str(), id.source()), ("k-1", MessageIdSource::Key));
    }

    #[test]
    fn header_wins_over_sequence() {
        let id = MessageId::resolve(None, &headers_with_id("h-1"), "S", 7).unwrap();
        assert_eq!((id.as_str(), id.source()), ("h-1", MessageIdSource::Header));
    }

    #[test]
    fn stream_sequence_is_the_fallback() {
        let id = MessageId::resolve(None, &HeaderMap::new(), "ORDERS", 42).unwrap();
        assert_eq!(
            (id.as_str(), id.source()),
            ("ORDERS:42", MessageIdSource::StreamSequence)
        );
    }

    #[test]
    fn empty_and_oversized_ids_are_refused() {
        assert_eq!(
            MessageId::resolve(Some(String::new()), &HeaderMap::new(), "S", 1),
            Err(InvalidMessageId::Empty(MessageIdSource::Key))
        );
        let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
        assert!(matches!(
            MessageId::resolve(None, &headers_with_id(&long), "S", 1),
            Err(InvalidMessageId::TooLong {
                origin: MessageIdSource::Header,
                ..
            })
        ));
    }
}
