//! One message's way through the runtime: decode, claim and handle inside a
//! transaction, commit, and only then ack; or retry, or dead-letter.

use std::sync::Arc;

use async_nats::jetstream::Message;
use sqlx::{PgPool, PgTransaction};
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::ack;
use crate::claim;
use crate::connections::Connections;
use crate::dead_letter::{self, Failure};
use crate::delivery::Delivery;
use crate::error::{HandlerError, RejectedMessage};
use crate::failure::ErrorClass;
use crate::handler::{Handler, Outcome};
use crate::heartbeat::Heartbeat;
use crate::message_id::MessageId;
use crate::route::Route;
use crate::stats::Stats;

/// Everything a route needs to process its messages.
pub(crate) struct Pipeline<H> {
    pub(crate) route: Route,
    pub(crate) handler: H,
    pub(crate) pool: PgPool,
    pub(crate) connections: Arc<Connections>,
    pub(crate) stats: Arc<Stats>,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::fault::FaultHooks,
}

/// How one delivery ended, before it is settled with JetStream.
pub(crate) enum Verdict {
    /// Committed: ack.
    Processed,
    /// Already processed: rolled back, ack.
    Duplicate,
    /// BEGIN, the claim or the body failed: rolled back; retry or
    /// dead-letter by the error's class.
    Failed(HandlerError),
    /// COMMIT failed, so its outcome is unknown: NAK, never ack. If it did
    /// commit, the redelivery finds the dedup row.
    CommitUnknown(sqlx::Error),
    /// Can never succeed: dead-letter.
    Rejected(RejectedMessage),
    /// Arrived past the delivery limit without a dedup row: earlier attempts
    /// never finished (the worker died, say). Dead-letter without running.
    Exhausted,
}

impl<H: Handler> Pipeline<H> {
    /// Processes one message. `_slot` is the concurrency permit, released when
    /// the message is settled.
    pub(crate) async fn process(self: Arc<Self>, message: Message, _slot: OwnedSemaphorePermit) {
        Stats::bump(&self.stats.received);
        let Some(delivery) = self.delivery_of(&message).await else {
            return;
        };
        let span = tracing::info_span!(
            "idem.message",
            handler = self.handler.name(),
            subject = %delivery.subject(),
            stream_seq = delivery.stream_sequence(),
            message_id = tracing::field::Empty,
            delivered = delivery.delivered(),
        );
        self.run(message, delivery).instrument(span).await;
    }

    /// The delivery metadata of `message`, or `None` after terminating a
    /// message that has none: it is not a JetStream consumer delivery, so
    /// there is nothing to dedup it by or redeliver.
    pub(crate) async fn delivery_of(&self, message: &Message) -> Option<Delivery> {
        match Delivery::from_message(message) {
            Ok(delivery) => Some(delivery),
            Err(error) => {
                tracing::error!(%error, subject = %message.subject, "not a JetStream delivery; terminating it");
                Stats::bump(&self.stats.rejected);
                ack::term(message).await;
                None
            }
        }
    }

    /// Runs a handler call under the route's handler timeout, which covers
    /// the handler alone, never BEGIN or COMMIT.
    pub(crate) async fn within_timeout(
        &self,
        handled: impl Future<Output = Result<Outcome, HandlerError>>,
    ) -> Result<Outcome, HandlerError> {
        match self.route.handler_timeout {
            Some(limit) => tokio::time::timeout(limit, handled)
                .await
                .unwrap_or(Err(HandlerError::TimedOut(limit))),
            None => handled.await,
        }
    }

    async fn run(&self, message: Message, mut delivery: Delivery) {
        // The heartbeat covers the wait for a pooled connection too.
        let heartbeat = Heartbeat::start(&message, self.route.heartbeat_interval());
        let verdict = match self.prepare(&message, &mut delivery) {
            Err(rejected) => Verdict::Rejected(rejected),
            Ok(payload) => self.decide(&message, payload, &delivery).await,
        };
        heartbeat.stop().await;
        self.settle(&message, &delivery, verdict).await;
    }

    /// Runs a prepared message on its own, in its own transaction.
    pub(crate) async fn decide(
        &self,
        message: &Message,
        payload: H::Payload,
        delivery: &Delivery,
    ) -> Verdict {
        if delivery.delivered() > self.route.retry.max_deliver {
            return self.past_limit(delivery).await;
        }
        self.transact_with_retries(message, payload, delivery).await
    }

    /// Decodes the payload and resolves the message id. Both happen before
    /// BEGIN, so a poison message never takes a connection.
    pub(crate) fn prepare(
        &self,
        message: &Message,
        delivery: &mut Delivery,
    ) -> Result<H::Payload, RejectedMessage> {
        let payload: H::Payload = serde_json::from_slice(&message.payload)?;
        delivery.message_id = MessageId::resolve(
            self.handler.message_key(&payload),
            delivery.headers(),
            delivery.stream(),
            delivery.stream_sequence(),
        )?;
        tracing::Span::current().record("message_id", delivery.message_id().as_str());
        Ok(payload)
    }

    /// A message past its delivery limit: ack it if it was processed after
    /// all, else dead-letter it.
    async fn past_limit(&self, delivery: &Delivery) -> Verdict {
        match claim::is_processed(&self.pool, self.handler.name(), delivery.message_id()).await {
            Ok(true) => Verdict::Duplicate,
            Ok(false) => Verdict::Exhausted,
            Err(error) => Verdict::Failed(HandlerError::Claim(error)),
        }
    }

    /// Runs the transaction, and runs it again at once (a few times, with a
    /// short pause) when the failure is one the database asks to retry:
    /// a serialization failure, a deadlock, a lost connection.
    pub(crate) async fn transact_with_retries(
        &self,
        message: &Message,
        mut payload: H::Payload,
        delivery: &Delivery,
    ) -> Verdict {
        let policy = &self.route.retry;
        let mut attempt = 1;
        loop {
            let verdict = self.transact(payload, delivery).await;
            let Verdict::Failed(error) = &verdict else {
                return verdict;
            };
            if error.class() != ErrorClass::RetryNow || attempt >= policy.in_process_attempts {
                return verdict;
            }
            Stats::bump(&self.stats.retried_in_process);
            tracing::info!(%error, attempt, "retrying at once");
            tokio::time::sleep(policy.in_process_backoff * attempt).await;
            attempt += 1;
            // It decoded a moment ago, so it decodes again.
            payload = match serde_json::from_slice(&message.payload) {
                Ok(payload) => payload,
                Err(error) => return Verdict::Rejected(error.into()),
            };
        }
    }

    /// Runs the handler in its own transaction.
    ///
    /// Neither BEGIN nor COMMIT is raced against a timer or `select!`: a
    /// cancelled BEGIN can return a pooled connection still inside a
    /// transaction (sqlx#4393), and a cancelled COMMIT has an unknown outcome.
    /// The handler timeout covers the handler alone.
    async fn transact(&self, payload: H::Payload, delivery: &Delivery) -> Verdict {
        let mut connection = match self.connections.take().await {
            Ok(connection) => connection,
            Err(error) => return Verdict::Failed(HandlerError::Claim(error)),
        };
        let mut tx = match sqlx::Connection::begin(&mut *connection).await {
            Ok(tx) => tx,
            Err(error) => return Verdict::Failed(HandlerError::Claim(error)),
        };
        let outcome = self
            .within_timeout(self.handler.handle(&mut tx, payload, delivery))
            .await;
        // Only a connection whose transaction ended cleanly is reused; after
        // a failure it goes back to the pool, which checks it first.
        let (verdict, clean) = match outcome {
            Ok(Outcome::Processed) => match tx.commit().await {
                Ok(()) => (Verdict::Processed, true),
                Err(error) => (Verdict::CommitUnknown(error), false),
            },
            Ok(Outcome::Duplicate) => (Verdict::Duplicate, rollback(tx).await),
            Err(error) => {
                rollback(tx).await;
                (Verdict::Failed(error), false)
            }
        };
        if clean {
            self.connections.put_back(connection);
        }
        verdict
    }

    /// Tells JetStream how the delivery ended.
    pub(crate) async fn settle(&self, message: &Message, delivery: &Delivery, verdict: Verdict) {
        let stats = &self.stats;
        let retry = &self.route.retry;
        match verdict {
            Verdict::Processed => {
                Stats::bump(&stats.processed);
                #[cfg(feature = "fault-injection")]
                if self.faults.decide_after_commit(delivery)
                    == crate::fault::AfterCommit::DropWithoutAck
                {
                    tracing::warn!("fault injection: committed but not acking");
                    Stats::bump(&stats.dropped_by_fault);
                    return;
                }
                ack::ack(message, self.route.ack_mode).await;
                tracing::debug!("processed");
            }
            Verdict::Duplicate => {
                ack::ack(message, self.route.ack_mode).await;
                Stats::bump(&stats.duplicates);
                tracing::info!("already processed; acked without running the handler");
            }
            Verdict::Failed(error) => {
                Stats::bump(&stats.failed);
                let class = error.class();
                if class == ErrorClass::Permanent {
                    self.dead_letter(message, delivery, Failure::Permanent, &error.to_string())
                        .await;
                } else if retry.exhausted(delivery.delivered()) {
                    self.dead_letter(message, delivery, Failure::Exhausted, &error.to_string())
                        .await;
                } else {
                    let delay = retry.nak_delay(delivery.delivered());
                    ack::nak(message, delay).await;
                    tracing::warn!(%error, ?class, retry_in = ?delay, "handler failed; rolled back and NAKed for redelivery");
                }
            }
            Verdict::CommitUnknown(error) => {
                Stats::bump(&stats.commit_failed);
                let delay = retry.nak_delay(delivery.delivered());
                ack::nak(message, delay).await;
                tracing::warn!(%error, "COMMIT failed with an unknown outcome; NAKed, and the dedup row decides the redelivery");
            }
            Verdict::Rejected(error) => {
                Stats::bump(&stats.rejected);
                let failure = match error {
                    RejectedMessage::Decode(_) => Failure::Undecodable,
                    RejectedMessage::MessageId(_) => Failure::BadMessageId,
                };
                self.dead_letter(message, delivery, failure, &error.to_string())
                    .await;
            }
            Verdict::Exhausted => {
                let text = format!(
                    "delivered {} times, past the limit of {}, and never processed: earlier attempts did not finish",
                    delivery.delivered(),
                    retry.max_deliver
                );
                self.dead_letter(message, delivery, Failure::Exhausted, &text)
                    .await;
            }
        }
    }

    /// Publishes a dead letter, then TERMs the original; NAKs it instead if
    /// the publish fails, so that nothing is lost.
    async fn dead_letter(
        &self,
        message: &Message,
        delivery: &Delivery,
        failure: Failure,
        error: &str,
    ) {
        let subject = self.route.dead_letter_target();
        match dead_letter::publish(
            message,
            delivery,
            self.handler.name(),
            subject.clone(),
            failure,
            error,
        )
        .await
        {
            Ok(()) => {
                ack::term(message).await;
                Stats::bump(&self.stats.dead_lettered);
                tracing::error!(
                    failure = failure.as_str(),
                    error,
                    dead_letter_subject = subject,
                    "dead-lettered; replay it with idem_runtime::dead_letter::replay once fixed"
                );
            }
            Err(publish_error) => {
                ack::nak(message, dead_letter::PUBLISH_RETRY).await;
                Stats::bump(&self.stats.dead_letter_failed);
                tracing::error!(
                    %publish_error,
                    error,
                    "publishing the dead letter failed; NAKed, it will be tried again"
                );
            }
        }
    }
}

/// Rolls back; says whether the connection is known to be clean.
pub(crate) async fn rollback(tx: PgTransaction<'_>) -> bool {
    match tx.rollback().await {
        Ok(()) => true,
        Err(error) => {
            // sqlx closes a connection whose ROLLBACK failed rather than
            // return it to the pool in an unknown state.
            tracing::warn!(%error, "ROLLBACK failed");
            false
        }
    }
}
