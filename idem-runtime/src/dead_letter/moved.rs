//! What does not fit in a dead letter: moved to a JetStream object store.
//!
//! A dead letter is its original's payload and headers plus idem's context
//! headers (about 530 B, and up to 1 KiB of error text); one of a message
//! JetStream gave up on also keeps the original header block in base64. So
//! an original that was near a limit cannot be dead-lettered as it is:
//! async-nats refuses a message above the server's `max_payload` on the
//! client (`MaxPayloadExceeded`), and a dead-letter stream refuses one above
//! its `max_msg_size` (JetStream error 10054) or with too many header bytes
//! (10097). That is a property of this message, not an outage: the same
//! publish never succeeds, and while it was retried, its heartbeats keeping
//! it leased, the route stood still for good behind it.
//!
//! So a dead letter is published in the first of these forms that is
//! stored (a refusal for size moves on to the next; any other failure is an
//! outage, and the message is held as before):
//!
//! 1. as it is;
//! 2. with `Idem-Error` cut to [`CUT_ERROR`] bytes (`Idem-Error-Cut`: how
//!    many were cut);
//! 3. with the original payload moved out (`Idem-Payload-Moved`: the
//!    object, `Idem-Payload-Bytes`: its size) and an empty payload;
//! 4. with the original headers moved out too (`Idem-Headers-Moved`,
//!    `Idem-Headers-Bytes`: the header block, as JetStream stored it for a
//!    message it gave up on, else as async-nats writes it), leaving only
//!    idem's own headers.
//!
//! `Idem-Moved-To` names the object store bucket. No byte of the original
//! is lost: [`original`](super::original) reads the moved parts back,
//! [`replay`](super::replay) sends them, and
//! [`discard`](super::discard) deletes them with their dead letter. A dead
//! letter that does not fit even in form 4 (a dead-letter stream whose
//! `max_msg_size` is smaller than idem's own headers) is refused as
//! [`StoreError::TooBig`], which holds the message: the route then stops, and
//! says why, until the stream's limit is raised.
//!
//! Why an object store: it keeps any size, in chunks (an original payload
//! alone may not fit in one message beside a single header), with
//! JetStream's durability, and `nats object get` reads it without idem.
//! The bucket, [`BUCKET`] (its stream `OBJ_IDEM_DEAD_LETTERS`), is created
//! on first use with the replicas of the stream that stores the dead
//! letter; one made beforehand is used as it is. Each part is named after
//! its dead letter (`<dead letter's name>/payload`, `.../headers`), so a
//! retried publish overwrites the same object rather than leave another.

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::object_store::{self, ObjectMetadata, ObjectStore};
use async_nats::jetstream::{self, ErrorCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use tokio::io::AsyncReadExt;

use crate::dead_letter::header_block;

/// The object store bucket that keeps what did not fit in dead letters.
pub const BUCKET: &str = "IDEM_DEAD_LETTERS";

/// The header that names the bucket the moved parts are in.
pub(crate) const MOVED_TO: &str = "Idem-Moved-To";
/// The header that names the object the payload was moved to.
pub(crate) const PAYLOAD_MOVED: &str = "Idem-Payload-Moved";
/// The header that gives the moved payload's size in bytes.
pub(crate) const PAYLOAD_BYTES: &str = "Idem-Payload-Bytes";
/// The header that names the object the header block was moved to.
pub(crate) const HEADERS_MOVED: &str = "Idem-Headers-Moved";
/// The header that gives the moved header block's size in bytes.
pub(crate) const HEADERS_BYTES: &str = "Idem-Headers-Bytes";
/// The header that says how many bytes of `Idem-Error` were cut.
pub(crate) const ERROR_CUT: &str = "Idem-Error-Cut";
/// The header that keeps a raw header block, in base64, beside the headers
/// that could be parsed from it.
pub(crate) const ORIGINAL_HEADERS_BASE64: &str = "Idem-Original-Headers-Base64";
/// The header that holds the last error.
pub(crate) const ERROR: &str = "Idem-Error";

/// How much of `Idem-Error` a dead letter cut for size keeps.
pub(crate) const CUT_ERROR: usize = 128;

/// The object store's default chunk, used unless the server's
/// `max_payload` calls for a smaller one.
const CHUNK: usize = 128 * 1024;

/// The original message a dead letter keeps.
#[derive(Debug, Clone, Default)]
pub(crate) struct Kept {
    /// Its headers, without the `Nats-*` ones that steer JetStream.
    pub(crate) headers: HeaderMap,
    /// Its header block as JetStream stored it, when it was read raw (a
    /// message JetStream gave up on): kept in base64 beside `headers`.
    pub(crate) block: Option<Vec<u8>>,
    /// Its payload.
    pub(crate) payload: Bytes,
}

/// A dead letter, ready to be fitted and published.
pub(crate) struct Letter {
    /// The dead-letter subject.
    pub(crate) subject: String,
    /// idem's headers (`Nats-Msg-Id` included), without `Idem-Error`.
    pub(crate) context: HeaderMap,
    /// The last error, one line.
    pub(crate) error: String,
    /// The original.
    pub(crate) kept: Kept,
    /// What its moved parts are named after (unique to the dead letter).
    pub(crate) name: String,
}

/// What had to be done to store a dead letter.
#[derive(Debug, Default)]
pub(crate) struct Fitted {
    /// Bytes of `Idem-Error` cut.
    pub(crate) error_cut: usize,
    /// The object the payload was moved to.
    pub(crate) payload_moved: Option<String>,
    /// The object the header block was moved to.
    pub(crate) headers_moved: Option<String>,
}

/// Why a dead letter was not stored.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    /// The dead-letter stream, or the object store, cannot be written now
    /// (away, no stream for the subject, no permission): wait and retry.
    #[error("{0}")]
    Unavailable(async_nats::Error),
    /// Refused for its size even with its payload and headers moved out:
    /// the dead-letter stream takes less than idem's own headers.
    #[error(
        "even with the original's payload and headers moved to object store bucket {BUCKET}, the dead letter ({size} bytes) is refused for its size: {source}; raise the dead-letter stream's max_msg_size (and the server's max_payload, {max_payload} bytes) above a few KiB"
    )]
    TooBig {
        /// Its size then: idem's headers.
        size: usize,
        /// The server's `max_payload`.
        max_payload: usize,
        /// The last refusal.
        source: async_nats::Error,
    },
}

/// Whether a publish failed because of the message's size: the client's
/// `max_payload`, or the stream's `max_msg_size` or header limit.
pub(crate) fn too_big(error: &PublishError) -> bool {
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => true,
        PublishErrorKind::Other => std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|error| {
                matches!(
                    error.error_code(),
                    ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                        | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
                )
            }),
        _ => false,
    }
}

/// Publishes `letter` in the first form that is stored (see the module
/// docs) and waits for JetStream's ack.
pub(crate) async fn publish(js: &jetstream::Context, letter: Letter) -> Result<Fitted, StoreError> {
    let mut fitted = Fitted::default();
    let mut error = letter.error.clone();
    let mut last_refusal: Option<async_nats::Error> = None;
    let mut last_size = 0;
    for form in 1..=4 {
        match form {
            2 if error.len() > CUT_ERROR => {
                let mut end = CUT_ERROR;
                while !error.is_char_boundary(end) {
                    end -= 1;
                }
                fitted.error_cut = error.len() - end;
                error.truncate(end);
            }
            3 if !letter.kept.payload.is_empty() => {
                let name = format!("{}/payload", letter.name);
                put(js, &letter.subject, &name, &letter.kept.payload).await?;
                fitted.payload_moved = Some(name);
            }
            4 if !letter.kept.headers.is_empty() || letter.kept.block.is_some() => {
                let block = letter
                    .kept
                    .block
                    .clone()
                    .unwrap_or_else(|| header_block::write(&letter.kept.headers));
                let name = format!("{}/headers", letter.name);
                put(js, &letter.subject, &name, &block).await?;
                fitted.headers_moved = Some(name);
            }
            1 => {}
            // Nothing to cut or move in this form: the last one stands.
            _ => continue,
        }
        let (headers, payload) = assemble(&letter, &error, &fitted);
        last_size = header_block::wire_len(&headers) + payload.len();
        let refusal = match js
            .publish_with_headers(letter.subject.clone(), headers, payload)
            .await
        {
            Ok(ack) => match ack.await {
                Ok(ack) => {
                    if ack.duplicate {
                        tracing::debug!("the dead letter was stored before");
                    }
                    return Ok(fitted);
                }
                Err(error) if too_big(&error) => error,
                Err(error) => return Err(StoreError::Unavailable(error.into())),
            },
            Err(error) if too_big(&error) => error,
            Err(error) => return Err(StoreError::Unavailable(error.into())),
        };
        last_refusal = Some(refusal.into());
    }
    Err(StoreError::TooBig {
        size: last_size,
        max_payload: js.client().max_payload(),
        source: last_refusal.unwrap_or_else(|| "refused for its size".into()),
    })
}

/// The dead letter's headers and payload in the form `fitted` says.
fn assemble(letter: &Letter, error: &str, fitted: &Fitted) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    if fitted.headers_moved.is_none() {
        for (name, values) in letter.kept.headers.iter() {
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        if let Some(block) = &letter.kept.block {
            headers.insert(ORIGINAL_HEADERS_BASE64, BASE64.encode(block).as_str());
        }
    }
    for (name, values) in letter.context.iter() {
        for value in values {
            headers.insert(name.clone(), value.clone());
        }
    }
    headers.insert(ERROR, error);
    if fitted.error_cut > 0 {
        headers.insert(ERROR_CUT, fitted.error_cut.to_string().as_str());
    }
    if fitted.payload_moved.is_some() || fitted.headers_moved.is_some() {
        headers.insert(MOVED_TO, BUCKET);
    }
    if let Some(object) = &fitted.payload_moved {
        headers.insert(PAYLOAD_MOVED, object.as_str());
        headers.insert(
            PAYLOAD_BYTES,
            letter.kept.payload.len().to_string().as_str(),
        );
    }
    if let Some(object) = &fitted.headers_moved {
        let size = letter
            .kept
            .block
            .as_ref()
            .map_or_else(|| header_block::wire_len(&letter.kept.headers), Vec::len);
        headers.insert(HEADERS_MOVED, object.as_str());
        headers.insert(HEADERS_BYTES, size.to_string().as_str());
    }
    let payload = if fitted.payload_moved.is_some() {
        Bytes::new()
    } else {
        letter.kept.payload.clone()
    };
    (headers, payload)
}

/// Stores `bytes` as object `name` of [`BUCKET`], creating the bucket if
/// it is missing, with the replicas of the stream that stores `subject`.
async fn put(
    js: &jetstream::Context,
    subject: &str,
    name: &str,
    bytes: &[u8],
) -> Result<(), StoreError> {
    let unavailable = |error: async_nats::Error| StoreError::Unavailable(error);
    let store = match js.get_object_store(BUCKET).await {
        Ok(store) => store,
        Err(_) => create(js, subject).await.map_err(unavailable)?,
    };
    // Smaller chunks where the server takes smaller messages.
    let chunk = CHUNK.min(js.client().max_payload() / 2).max(1);
    let meta = ObjectMetadata {
        name: name.to_owned(),
        description: Some("part of an idem dead letter that did not fit in it".into()),
        chunk_size: Some(chunk),
        ..Default::default()
    };
    let mut reader = bytes;
    store
        .put(meta, &mut reader)
        .await
        .map_err(|error| unavailable(error.into()))?;
    Ok(())
}

async fn create(js: &jetstream::Context, subject: &str) -> Result<ObjectStore, async_nats::Error> {
    let stream = js.stream_by_subject(subject).await?;
    let replicas = js
        .get_stream(&stream)
        .await?
        .cached_info()
        .config
        .num_replicas;
    let store = js
        .create_object_store(object_store::Config {
            bucket: BUCKET.to_owned(),
            description: Some(
                "What did not fit in idem's dead letters; see their Idem-Moved-To headers".into(),
            ),
            num_replicas: replicas.max(1),
            ..Default::default()
        })
        .await?;
    Ok(store)
}

/// Object `name` of `bucket`, whole.
pub(crate) async fn get(
    js: &jetstream::Context,
    bucket: &str,
    name: &str,
) -> Result<Bytes, async_nats::Error> {
    let store = js.get_object_store(bucket).await?;
    let mut object = store.get(name).await?;
    let mut bytes = Vec::with_capacity(object.info().size);
    object.read_to_end(&mut bytes).await?;
    Ok(bytes.into())
}

/// Deletes object `name` of `bucket`.
pub(crate) async fn delete(
    js: &jetstream::Context,
    bucket: &str,
    name: &str,
) -> Result<(), async_nats::Error> {
    js.get_object_store(bucket).await?.delete(name).await?;
    Ok(())
}
