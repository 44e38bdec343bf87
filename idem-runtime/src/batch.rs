//! Batch mode: claim many messages in one statement and commit them once.
//!
//! Per-message mode pays four round trips per message (pool check, BEGIN,
//! claim, COMMIT) besides the handler's own statements. A batch pays them
//! once for up to `batch` messages: one BEGIN, one claim statement
//! (`INSERT ... SELECT unnest($2) ... ON CONFLICT DO NOTHING RETURNING`), the
//! handler's statements for each fresh message, one COMMIT. No savepoints:
//! more than 64 subtransactions overflow PostgreSQL's per-backend cache.
//!
//! A failure inside the batch must not fail its neighbours, so on any
//! failure (a handler error, a timeout, the claim or the COMMIT) the whole
//! batch is rolled back and each message is run again in a transaction of
//! its own, where it takes the normal retry and dead-letter path. A COMMIT
//! with an unknown outcome resolves the same way: each message's own claim
//! finds its row if the batch did commit.

use std::sync::Arc;

use async_nats::jetstream::Message;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::claim;
use crate::delivery::Delivery;
use crate::error::HandlerError;
use crate::handler::{Handler, Outcome};
use crate::heartbeat::Heartbeat;
use crate::pipeline::{Pipeline, Verdict, rollback};
use crate::stats::Stats;

/// A message ready for the batch: decoded, with its id resolved.
struct Ready<P> {
    message: Message,
    delivery: Delivery,
    payload: Option<P>,
}

/// Why a batch fell back to one transaction per message.
#[derive(Debug, thiserror::Error)]
enum BatchFailure {
    #[error("BEGIN or the batch claim failed: {0}")]
    Claim(#[from] sqlx::Error),
    #[error("a handler failed: {0}")]
    Handler(HandlerError),
    #[error("COMMIT failed, outcome unknown: {0}")]
    Commit(sqlx::Error),
}

impl<H: Handler> Pipeline<H> {
    /// Processes a batch of messages. `_slot` is the concurrency permit.
    pub(crate) async fn process_batch(
        self: Arc<Self>,
        messages: Vec<Message>,
        _slot: OwnedSemaphorePermit,
    ) {
        let span = tracing::info_span!(
            "idem.batch",
            handler = self.handler.name(),
            size = messages.len()
        );
        self.run_batch(messages).instrument(span).await;
    }

    async fn run_batch(&self, messages: Vec<Message>) {
        let heartbeat = Heartbeat::start_many(&messages, self.route.heartbeat_interval());
        let mut ready = Vec::with_capacity(messages.len());
        for message in messages {
            Stats::bump(&self.stats.received);
            let Some(mut delivery) = self.delivery_of(&message).await else {
                continue;
            };
            match self.prepare(&message, &mut delivery) {
                Err(rejected) => {
                    self.settle(&message, &delivery, Verdict::Rejected(rejected))
                        .await
                }
                // Past its delivery limit: decided on its own, as in
                // per-message mode.
                Ok(payload) if delivery.delivered() > self.route.retry.max_deliver => {
                    let verdict = self.decide(&message, payload, &delivery).await;
                    self.settle(&message, &delivery, verdict).await;
                }
                Ok(payload) => ready.push(Ready {
                    message,
                    delivery,
                    payload: Some(payload),
                }),
            }
        }
        if ready.is_empty() {
            heartbeat.stop().await;
            return;
        }

        match self.transact_batch(&mut ready).await {
            Ok(fresh) => {
                heartbeat.stop().await;
                self.stats.record_batch(ready.len());
                for (item, fresh) in ready.into_iter().zip(fresh) {
                    let verdict = if fresh {
                        Verdict::Processed
                    } else {
                        Verdict::Duplicate
                    };
                    self.settle(&item.message, &item.delivery, verdict).await;
                }
            }
            Err(failure) => {
                Stats::bump(&self.stats.batch_fallbacks);
                tracing::warn!(%failure, size = ready.len(), "batch rolled back; running its messages one per transaction");
                for item in ready {
                    let verdict = match serde_json::from_slice(&item.message.payload) {
                        Ok(payload) => self.decide(&item.message, payload, &item.delivery).await,
                        Err(error) => Verdict::Rejected(error.into()),
                    };
                    self.settle(&item.message, &item.delivery, verdict).await;
                }
                heartbeat.stop().await;
            }
        }
    }

    /// Claims the batch in one statement, runs the handler for each fresh
    /// message, and commits once. Returns, per message, whether it was fresh.
    ///
    /// As in per-message mode, neither BEGIN nor COMMIT is raced against a
    /// timer; the handler timeout covers each handler call alone.
    async fn transact_batch(
        &self,
        ready: &mut [Ready<H::Payload>],
    ) -> Result<Vec<bool>, BatchFailure> {
        let mut connection = self.connections.take().await?;
        let mut tx = sqlx::Connection::begin(&mut *connection).await?;
        let ids: Vec<&str> = ready
            .iter()
            .map(|item| item.delivery.message_id().as_str())
            .collect();
        let mut unclaimed = match claim::claim_many(&mut tx, self.handler.name(), &ids).await {
            Ok(fresh) => fresh,
            Err(error) => {
                rollback(tx).await;
                return Err(error.into());
            }
        };
        let mut fresh = Vec::with_capacity(ready.len());
        for item in ready.iter_mut() {
            // An id twice in one batch: only its first message is fresh.
            let is_fresh = unclaimed.remove(item.delivery.message_id().as_str());
            fresh.push(is_fresh);
            if !is_fresh {
                continue;
            }
            let payload = item.payload.take().expect("each payload is used once");
            let outcome = self
                .within_timeout(self.handler.run_claimed(&mut tx, payload, &item.delivery))
                .await;
            match outcome {
                Ok(Outcome::Processed | Outcome::Duplicate) => {}
                Err(error) => {
                    rollback(tx).await;
                    return Err(BatchFailure::Handler(error));
                }
            }
        }
        tx.commit().await.map_err(BatchFailure::Commit)?;
        self.connections.put_back(connection);
        Ok(fresh)
    }
}
