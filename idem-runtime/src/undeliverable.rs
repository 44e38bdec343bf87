//! Messages JetStream gave up on before they ever reached a handler.
//!
//! A message whose headers are not UTF-8 never reaches idem: async-nats
//! treats it as a protocol error and drops the connection, and JetStream
//! redelivers it after ack_wait, which drops the connection again. The
//! consumer's server-side `max_deliver` (the retry policy's limit plus a
//! small margin) ends that loop, and JetStream then publishes a
//! `MAX_DELIVERIES` advisory. This watcher takes the advisory, reads the
//! message raw from the stream (bytes, not parsed headers), and publishes it
//! as a dead letter (`Idem-Failure: undeliverable`) with its original header
//! block in `Idem-Original-Headers-Base64`, so nothing is lost. The same
//! path catches a message whose dead-letter publishes kept failing until the
//! server-side limit.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream::RawMessage};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::StreamExt;
use serde::Deserialize;

use crate::dead_letter::{self, Failure, Origin};
use crate::shutdown::Signal;

/// The fields of a `MAX_DELIVERIES` advisory that matter here.
#[derive(Debug, Deserialize)]
struct MaxDeliveries {
    stream_seq: u64,
    deliveries: u64,
}

/// The answer to `STREAM.MSG.GET`.
#[derive(Debug, Deserialize)]
struct RawGet {
    message: Option<RawMessage>,
    error: Option<serde_json::Value>,
}

/// What the watcher needs to know about its route.
pub(crate) struct Watch {
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) handler: &'static str,
    pub(crate) dead_letter_subject: String,
}

/// The advisory subject for a consumer's given-up messages.
pub(crate) fn advisory_subject(stream: &str, durable: &str) -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}")
}

/// Subscribes before the route starts pulling, so that no advisory is
/// missed while this worker runs.
pub(crate) async fn subscribe(
    client: &async_nats::Client,
    watch: &Watch,
) -> Result<async_nats::Subscriber, async_nats::SubscribeError> {
    client
        .subscribe(advisory_subject(&watch.stream, &watch.durable))
        .await
}

/// Dead-letters each message the advisories name, until shutdown.
pub(crate) async fn run(
    js: jetstream::Context,
    mut advisories: async_nats::Subscriber,
    watch: Watch,
    mut shutdown: Signal,
) {
    loop {
        let advisory = tokio::select! {
            biased;
            _ = shutdown.fired() => return,
            next = advisories.next() => match next {
                Some(advisory) => advisory,
                None => return,
            },
        };
        let Ok(given_up) = serde_json::from_slice::<MaxDeliveries>(&advisory.payload) else {
            tracing::warn!(route = watch.durable, "unreadable MAX_DELIVERIES advisory");
            continue;
        };
        if let Err(error) = dead_letter_raw(&js, &watch, &given_up).await {
            tracing::error!(
                %error,
                route = watch.durable,
                stream_seq = given_up.stream_seq,
                "JetStream gave up on a message and dead-lettering it failed; it stays in the stream"
            );
        }
    }
}

async fn dead_letter_raw(
    js: &jetstream::Context,
    watch: &Watch,
    given_up: &MaxDeliveries,
) -> Result<(), async_nats::Error> {
    let got: RawGet = js
        .request(
            format!("STREAM.MSG.GET.{}", watch.stream),
            &serde_json::json!({ "seq": given_up.stream_seq }),
        )
        .await?;
    let raw = match (got.message, got.error) {
        (Some(raw), _) => raw,
        (None, error) => return Err(format!("reading the message failed: {error:?}").into()),
    };
    let payload = BASE64.decode(raw.payload.as_bytes())?;
    let mut headers = HeaderMap::new();
    if let Some(original) = &raw.headers {
        headers.insert("Idem-Original-Headers-Base64", original.as_str());
    }
    let origin = Origin {
        subject: &raw.subject,
        stream: &watch.stream,
        sequence: given_up.stream_seq,
        message_id: "",
        handler: watch.handler,
        delivered: given_up.deliveries,
    };
    let error = format!(
        "JetStream stopped redelivering it after {} deliveries that never reached the handler (a header that is not UTF-8 makes the client drop the connection)",
        given_up.deliveries
    );
    dead_letter::publish_letter(
        js,
        watch.dead_letter_subject.clone(),
        origin,
        headers,
        payload.into(),
        Failure::Undeliverable,
        &error,
    )
    .await?;
    tracing::error!(
        route = watch.durable,
        stream_seq = given_up.stream_seq,
        "dead-lettered a message JetStream gave up on before it reached the handler"
    );
    Ok(())
}
