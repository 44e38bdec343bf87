//! One message's way through the runtime: decode, claim and handle inside a
//! transaction, commit, and only then ack.

use std::sync::Arc;

use async_nats::jetstream::Message;
use sqlx::{PgPool, PgTransaction};
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::ack;
use crate::delivery::Delivery;
use crate::error::{HandlerError, RejectedMessage};
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
    pub(crate) stats: Arc<Stats>,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::fault::FaultHooks,
}

/// How one delivery ended, before it is settled with JetStream.
enum Verdict {
    /// Committed: ack.
    Processed,
    /// Already processed: rolled back, ack.
    Duplicate,
    /// BEGIN, the claim or the body failed: rolled back, NAK.
    Failed(HandlerError),
    /// COMMIT failed, so its outcome is unknown: NAK, never ack. If it did
    /// commit, the redelivery finds the dedup row.
    CommitUnknown(sqlx::Error),
    /// Can never succeed: TERM.
    Rejected(RejectedMessage),
}

impl<H: Handler> Pipeline<H> {
    /// Processes one message. `_slot` is the concurrency permit, released when
    /// the message is settled.
    pub(crate) async fn process(self: Arc<Self>, message: Message, _slot: OwnedSemaphorePermit) {
        Stats::bump(&self.stats.received);
        let delivery = match Delivery::from_message(&message) {
            Ok(delivery) => delivery,
            Err(error) => {
                // Without delivery metadata there is no stream sequence to
                // dedup by; such a message is not from a JetStream consumer.
                tracing::error!(%error, subject = %message.subject, "not a JetStream delivery; terminating it");
                Stats::bump(&self.stats.rejected);
                ack::term(&message).await;
                return;
            }
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

    async fn run(&self, message: Message, mut delivery: Delivery) {
        // The heartbeat covers the wait for a pooled connection too.
        let heartbeat = Heartbeat::start(&message, self.route.heartbeat_interval());
        let verdict = match self.prepare(&message, &mut delivery) {
            Ok(payload) => self.transact(payload, &delivery).await,
            Err(rejected) => Verdict::Rejected(rejected),
        };
        heartbeat.stop().await;
        self.settle(&message, &delivery, verdict).await;
    }

    /// Decodes the payload and resolves the message id. Both happen before
    /// BEGIN, so a poison message never takes a connection.
    fn prepare(
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

    /// Runs the handler in its own transaction.
    ///
    /// Neither BEGIN nor COMMIT is raced against a timer or `select!`: a
    /// cancelled BEGIN can return a pooled connection still inside a
    /// transaction (sqlx#4393), and a cancelled COMMIT has an unknown outcome.
    async fn transact(&self, payload: H::Payload, delivery: &Delivery) -> Verdict {
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(error) => return Verdict::Failed(HandlerError::Claim(error)),
        };
        match self.handler.handle(&mut tx, payload, delivery).await {
            Ok(Outcome::Processed) => match tx.commit().await {
                Ok(()) => Verdict::Processed,
                Err(error) => Verdict::CommitUnknown(error),
            },
            Ok(Outcome::Duplicate) => {
                rollback(tx).await;
                Verdict::Duplicate
            }
            Err(error) => {
                rollback(tx).await;
                Verdict::Failed(error)
            }
        }
    }

    /// Tells JetStream how the delivery ended.
    async fn settle(&self, message: &Message, delivery: &Delivery, verdict: Verdict) {
        let stats = &self.stats;
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
                ack::nak(message, self.route.nak_delay).await;
                Stats::bump(&stats.failed);
                tracing::warn!(%error, retry_in = ?self.route.nak_delay, "handler failed; rolled back and NAKed for redelivery");
            }
            Verdict::CommitUnknown(error) => {
                ack::nak(message, self.route.nak_delay).await;
                Stats::bump(&stats.commit_failed);
                tracing::warn!(%error, "COMMIT failed with an unknown outcome; NAKed, and the dedup row decides the redelivery");
            }
            Verdict::Rejected(error) => {
                ack::term(message).await;
                Stats::bump(&stats.rejected);
                tracing::error!(
                    %error,
                    stream = delivery.stream(),
                    stream_seq = delivery.stream_sequence(),
                    "message can never be processed; terminated (it stays in the stream for inspection)"
                );
            }
        }
    }
}

async fn rollback(tx: PgTransaction<'static>) {
    if let Err(error) = tx.rollback().await {
        // The connection is closed rather than returned to the pool in an
        // unknown state.
        tracing::warn!(%error, "ROLLBACK failed");
    }
}
