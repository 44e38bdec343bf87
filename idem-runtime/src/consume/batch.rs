//! Batch mode: claim many messages in one statement and commit them once.
//!
//! Per-message mode pays BEGIN, the claim and COMMIT for every message. A
//! batch pays them once for up to `batch` messages: one BEGIN, one claim
//! statement (`INSERT ... SELECT unnest($2) ... ON CONFLICT DO NOTHING
//! RETURNING`), the handler's statements for each fresh message, one COMMIT
//! (checked like every COMMIT, see [`crate::store::transaction`]). No
//! savepoints: more than 64 subtransactions overflow PostgreSQL's
//! per-backend cache.
//!
//! A batch handler (`#[idempotent(batch)]`, [`Handler::BATCHES`]) takes
//! the fresh messages of the batch in one call instead of one call each, so
//! that it can write them all with one statement (`INSERT ... SELECT * FROM
//! unnest($1, $2)`): a batch then costs a fixed four round trips, whatever
//! its size.
//!
//! A failure inside the batch must not fail its neighbours. On a handler's
//! error, or a COMMIT that did not commit (a deadlock, a serialization
//! failure), the batch is rolled back and *split*: each half is tried again
//! as a batch, and a half that fails is split again, down to single
//! messages, which run in a transaction of their own and take the normal
//! retry and dead-letter path there. One bad message in a batch of `n` then
//! costs about `2 log2 n` batch transactions instead of `n` single ones, and
//! its good neighbours still commit in batches. A handler that timed out or
//! panicked is not run again in halves (each half would wait out its
//! timeout again): its batch falls back to one transaction per message at
//! once. A COMMIT with an unknown outcome does too: each message's own
//! claim finds its row if the batch did commit. If the database cannot be
//! used at all (BEGIN or the claim fails), the batch is held and retried
//! whole, as one message would be.
//!
//! Every batch that committed, and every one that fell back, tells the
//! route's [`BatchSizer`](crate::consume::sizing::BatchSizer), which sizes an
//! adaptive route's next batches.

use std::sync::Arc;

use async_nats::jetstream::Message;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::consume::heartbeat::Lease;
use crate::consume::pipeline::{Outage, Pipeline, Verdict, no_answer};
use crate::error::HandlerError;
use crate::handler::Handler;
use crate::handler::delivery::Delivery;
use crate::observe::recorder::Event;
use crate::store::claim;
use crate::store::transaction::{self, Ended};

/// A message ready for the batch: decoded, with its id resolved, leased.
struct Ready<P> {
    message: Message,
    delivery: Delivery,
    payload: Option<P>,
    lease: Lease,
}

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
enum BatchFailure {
    // (Split in halves on these two; not on the others, see the module docs.)
    #[error("the database could not be used: {0}")]
    Infrastructure(sqlx::Error),
    #[error("a handler failed: {0}")]
    Handler(HandlerError),
    #[error("the batch did not commit: {0}")]
    NotCommitted(HandlerError),
    #[error("COMMIT failed, outcome unknown: {0}")]
    CommitUnknown(sqlx::Error),
}

impl BatchFailure {
    /// Whether the batch is tried again in halves (see the module docs).
    fn splits(&self) -> bool {
        match self {
            BatchFailure::Handler(HandlerError::TimedOut(_) | HandlerError::Panicked(_)) => false,
            BatchFailure::Handler(_) | BatchFailure::NotCommitted(_) => true,
            BatchFailure::Infrastructure(_) | BatchFailure::CommitUnknown(_) => false,
        }
    }
}

impl<S: Send + Sync + 'static, H: Handler<S>> Pipeline<H, S> {
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
        #[cfg(feature = "otel")]
        crate::observe::trace::link_each(&span, messages.iter().filter_map(|m| m.headers.as_ref()));
        self.run_batch(messages).instrument(span).await;
    }

    /// Runs a batch (see the module docs): its messages are made ready,
    /// those ready are committed in one transaction, and if that fails,
    /// each is run again in a transaction of its own.
    async fn run_batch(self: &Arc<Self>, messages: Vec<Message>) {
        let _in_flight = self.recorder.in_flight(messages.len());
        let ready = self.make_ready(messages).await;
        if ready.is_empty() {
            return;
        }
        let Some((failure, ready)) = self.commit_batch(ready).await else {
            return;
        };
        self.recorder.record(Event::BatchFallback);
        self.sizer.fell_back();
        self.fall_back(failure, ready).await;
    }

    /// Decodes each message, resolves its id and leases it. One that is not
    /// for the batch is settled on its own: not a delivery, a replay for
    /// another handler, rejected, or past its delivery limit.
    async fn make_ready(self: &Arc<Self>, messages: Vec<Message>) -> Vec<Ready<H::Payload>> {
        let mut ready = Vec::with_capacity(messages.len());
        for message in messages {
            self.recorder.record(Event::Received);
            let Some(mut delivery) = self.delivery_of(&message).await else {
                continue;
            };
            if self.skip_replay_for_another(&message, &delivery).await {
                continue;
            }
            let lease = self.heartbeats.lease(&message);
            match self.prepare(&message, &mut delivery) {
                Err(rejected) => {
                    self.settle(&message, &delivery, Verdict::Rejected(rejected), lease)
                        .await;
                }
                // Past its delivery limit: decided on its own, as in
                // per-message mode.
                Ok(payload) if delivery.delivered() > self.route.retry.max_deliver => {
                    let verdict = self.decide(&message.payload, payload, &delivery).await;
                    self.settle(&message, &delivery, verdict, lease).await;
                }
                Ok(payload) => ready.push(Ready {
                    message,
                    delivery,
                    payload: Some(payload),
                    lease,
                }),
            }
        }
        ready
    }

    /// Commits the batch in one transaction and settles its messages;
    /// while the database cannot be used, the batch is held and retried
    /// whole. Returns why it failed otherwise, with its messages, for the
    /// fallback; `None` once each is settled.
    async fn commit_batch(
        self: &Arc<Self>,
        mut ready: Vec<Ready<H::Payload>>,
    ) -> Option<(BatchFailure, Vec<Ready<H::Payload>>)> {
        let mut outage = Outage::default();
        let failure = loop {
            match self.try_batch(&mut ready).await {
                Ok(fresh) => {
                    self.recorder.batch_committed(ready.len());
                    self.sizer.committed(ready.len());
                    for (item, fresh) in ready.into_iter().zip(fresh) {
                        let verdict = if fresh {
                            Verdict::Processed(None)
                        } else {
                            Verdict::Duplicate
                        };
                        self.settle(&item.message, &item.delivery, verdict, item.lease)
                            .await;
                    }
                    return None;
                }
                Err(BatchFailure::Infrastructure(error)) => {
                    let error = HandlerError::Infrastructure(error);
                    if !self.hold_for_database(&error, &mut outage).await {
                        for item in ready {
                            self.settle(
                                &item.message,
                                &item.delivery,
                                Verdict::Interrupted,
                                item.lease,
                            )
                            .await;
                        }
                        return None;
                    }
                }
                Err(failure) => break failure,
            }
        };
        Some((failure, ready))
    }

    /// One try of the batch's transaction ([`transact_batch`](Self::transact_batch)),
    /// under the handler timeout's watch. Returns, per message, whether it
    /// was fresh.
    async fn try_batch(
        self: &Arc<Self>,
        ready: &mut [Ready<H::Payload>],
    ) -> Result<Vec<bool>, BatchFailure> {
        let transacted = {
            let pipeline = Arc::clone(self);
            let deliveries: Vec<Delivery> =
                ready.iter().map(|item| item.delivery.clone()).collect();
            let payloads: Vec<Option<H::Payload>> =
                ready.iter_mut().map(|item| item.payload.take()).collect();
            // A batch handler is called once; any other once per fresh
            // message, in the one transaction.
            let calls = if H::BATCHES { 1 } else { ready.len() };
            self.watched(
                calls,
                async move {
                    let mut payloads = payloads;
                    let result = pipeline.transact_batch(&deliveries, &mut payloads).await;
                    (Some(payloads), result)
                },
                |limit| (None, Err(BatchFailure::CommitUnknown(no_answer(limit)))),
            )
            .await
        };
        // What the handlers did not take goes back for the fallback; a
        // batch left to finish on its own keeps its payloads, and the
        // fallback decodes them again.
        let (payloads, result) = transacted;
        if let Some(payloads) = payloads {
            for (item, payload) in ready.iter_mut().zip(payloads) {
                item.payload = payload;
            }
        }
        result
    }

    /// After a batch failed (`failure`) and was rolled back: its halves are
    /// tried again as batches, or each of its messages runs in a
    /// transaction of its own (see the module docs), so that a failure does
    /// not fail its neighbours.
    async fn fall_back(self: &Arc<Self>, failure: BatchFailure, mut ready: Vec<Ready<H::Payload>>) {
        if failure.splits() && ready.len() > 1 && self.decode_again(&mut ready) {
            tracing::warn!(%failure, size = ready.len(), "batch rolled back; trying its halves");
            let second = ready.split_off(ready.len() / 2);
            for half in [ready, second] {
                if half.len() == 1 {
                    self.one_per_transaction(half).await;
                } else if let Some((failure, half)) = self.commit_batch(half).await {
                    Box::pin(self.fall_back(failure, half)).await;
                }
            }
            return;
        }
        tracing::warn!(%failure, size = ready.len(), "batch rolled back; running its messages one per transaction");
        self.one_per_transaction(ready).await;
    }

    /// Decodes again the payloads the failed batch's handlers took, for its
    /// halves. False if one no longer decodes (then each message runs on
    /// its own, where that is decided).
    fn decode_again(&self, ready: &mut [Ready<H::Payload>]) -> bool {
        for item in ready.iter_mut().filter(|item| item.payload.is_none()) {
            match self.decode(&item.message.payload) {
                Ok(payload) => item.payload = Some(payload),
                Err(_) => return false,
            }
        }
        true
    }

    /// Runs each message in a transaction of its own, where it takes the
    /// normal retry and dead-letter path.
    async fn one_per_transaction(self: &Arc<Self>, ready: Vec<Ready<H::Payload>>) {
        for item in ready {
            // Each message settles, and its heartbeats stop, as soon as it is
            // decided, not when the whole fallback ends.
            let (message, delivery, payload) = (&item.message, &item.delivery, item.payload);
            let decided = async move {
                match payload {
                    Some(payload) => self.decide(&message.payload, payload, delivery).await,
                    None => match self.decode(&message.payload) {
                        Ok(payload) => self.decide(&message.payload, payload, delivery).await,
                        Err(error) => Verdict::Rejected(error),
                    },
                }
            };
            #[cfg(feature = "otel")]
            let decided = decided.instrument(self.span(delivery));
            let verdict = decided.await;
            self.settle(&item.message, &item.delivery, verdict, item.lease)
                .await;
        }
    }

    /// Claims the batch in one statement, runs the handler for each fresh
    /// message, and commits once. Returns, per message, whether it was fresh;
    /// each fresh message's payload is taken.
    ///
    /// As in per-message mode, neither BEGIN nor COMMIT is raced against a
    /// timer; the handler timeout covers each handler call alone (a batch
    /// handler's one call for the batch).
    async fn transact_batch(
        &self,
        deliveries: &[Delivery],
        payloads: &mut [Option<H::Payload>],
    ) -> Result<Vec<bool>, BatchFailure> {
        let before_handler = |error| match self.classify_before_handler(error) {
            HandlerError::Infrastructure(error) => BatchFailure::Infrastructure(error),
            other => BatchFailure::Handler(other),
        };
        let mut connection = self
            .connections
            .take(|waited| self.recorder.connection_waited(waited))
            .await
            .map_err(before_handler)?;
        let mut tx = transaction::begin(&mut connection, &self.begin, None)
            .await
            .map_err(before_handler)?;
        let keys: Vec<String> = deliveries
            .iter()
            .map(|delivery| self.claim_key(delivery))
            .collect();
        let mut unclaimed = claim::claim_many(&mut tx, self.handler_id, &keys)
            .await
            .map_err(before_handler)?;
        self.health.resume();
        // An id twice in one batch: only its first message is fresh.
        let fresh: Vec<bool> = keys.iter().map(|key| unclaimed.remove(key)).collect();
        if !fresh.contains(&true) {
            // Every message was processed before: nothing to commit.
            if transaction::rollback(tx).await {
                connection.keep();
            }
            return Ok(fresh);
        }
        let outcome = if H::BATCHES {
            let mut batch = Vec::new();
            let mut batch_deliveries = Vec::new();
            for ((delivery, payload), _) in deliveries
                .iter()
                .zip(payloads.iter_mut())
                .zip(&fresh)
                .filter(|(_, fresh)| **fresh)
            {
                batch.push(payload.take().expect("each payload is used once"));
                batch_deliveries.push(delivery.clone());
            }
            self.run_handler(self.handler.handle_batch(
                &mut tx,
                batch,
                &batch_deliveries,
                &self.state,
            ))
            .await
        } else {
            self.handle_each(&mut tx, &keys, deliveries, payloads, &fresh)
                .await
        };
        match outcome {
            Ok(()) => {}
            // The connection is closed on drop rather than waited on.
            Err(error @ (HandlerError::TimedOut(_) | HandlerError::Panicked(_))) => {
                return Err(BatchFailure::Handler(error));
            }
            Err(error) => {
                if transaction::rollback(tx).await {
                    connection.keep();
                }
                return Err(BatchFailure::Handler(error));
            }
        }
        let (ended, reusable) = transaction::finish(tx, &self.begin).await;
        if reusable {
            connection.keep();
        }
        match ended {
            Ended::Committed => Ok(fresh),
            Ended::NotCommitted(error) => Err(BatchFailure::NotCommitted(error)),
            Ended::Unknown(error) => {
                self.connections.forget_idle();
                Err(BatchFailure::CommitUnknown(error))
            }
        }
    }

    /// Runs the handler for each fresh message in turn, each under the
    /// handler timeout, and stores what they return with their claims, in
    /// one statement (none if they return nothing); stops at the first
    /// failure.
    async fn handle_each(
        &self,
        tx: &mut sqlx::PgTransaction<'_>,
        keys: &[String],
        deliveries: &[Delivery],
        payloads: &mut [Option<H::Payload>],
        fresh: &[bool],
    ) -> Result<(), HandlerError> {
        let mut stored_keys = Vec::new();
        let mut results = Vec::new();
        for (((key, delivery), payload), _) in keys
            .iter()
            .zip(deliveries)
            .zip(payloads.iter_mut())
            .zip(fresh)
            .filter(|(_, fresh)| **fresh)
        {
            let payload = payload.take().expect("each payload is used once");
            let call = self
                .handler
                .handle_and_encode(tx, payload, delivery, &self.state);
            // In its message's trace, so that what it queues carries that on.
            #[cfg(feature = "otel")]
            let call = call.instrument(self.span(delivery));
            let result = self.run_handler(call).await?;
            if let Some(result) = result {
                stored_keys.push(key.as_str());
                results.push(result);
            }
        }
        let results: Vec<&[u8]> = results.iter().map(|result| result.as_ref()).collect();
        crate::handler::results::store_many(tx, &stored_keys, &results).await
    }
}
