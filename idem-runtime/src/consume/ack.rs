//! Acknowledgements: how a message leaves the consumer.
//!
//! Every path ends in exactly one of these: `ack` after a commit or for a
//! duplicate, `nak` after a failure (redelivered later), or `term` for a
//! message that can never succeed. A failed ack is not retried here: the
//! message is redelivered after ack_wait and its dedup row makes the
//! redelivery a duplicate.

use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};

use crate::route::AckMode;

/// Acks a finished (committed or duplicate) message.
pub(crate) async fn ack(message: &Message, mode: AckMode) {
    let result = match mode {
        AckMode::Ack => message.ack().await,
        AckMode::DoubleAck => message.double_ack().await,
    };
    if let Err(error) = result {
        tracing::warn!(%error, "ack failed; the message will be redelivered and skipped as a duplicate");
    }
}

/// NAKs a message so it is redelivered after `delay`.
pub(crate) async fn nak(message: &Message, delay: Duration) {
    if let Err(error) = message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::warn!(%error, "nak failed; the message will be redelivered after ack_wait");
    }
}

/// TERMs a message: JetStream stops redelivering it. It stays in the stream
/// (under the stream's retention) for inspection.
pub(crate) async fn term(message: &Message) {
    if let Err(error) = message.ack_with(AckKind::Term).await {
        tracing::warn!(%error, "term failed; the message will be redelivered and rejected again");
    }
}
