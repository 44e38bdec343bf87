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
//! A failure inside the batch must not fail its neighbours. The batch is
//! rolled back, and then:
//!
//! - **A handler run per message failed:** its message is known. The
//!   messages before it (whose handlers succeeded) are tried again as a
//!   batch, the failed one runs alone in a transaction of its own, where it
//!   takes the normal retry and dead-letter path, and the messages after it
//!   are tried again as a batch. One bad message costs two batches and one
//!   single transaction; if the batch after it fails at its first message
//!   too (every message fails: a dependency is down), the rest run one per
//!   transaction, so that the handlers are not run again and again.
//! - **A conflict** (a deadlock or a serialization failure, in a handler's
//!   statement or at COMMIT): the messages run one per transaction. Tried
//!   again together, they would meet the same conflict.
//! - **A batch handler failed, or a COMMIT did not commit** (a handler
//!   swallowed an error): which message is to blame is not known, so the
//!   batch is *split*: each half is tried again as a batch, and a half that
//!   fails is split again, down to single messages. One bad message in a
//!   batch of `n` costs about `2 log2 n` batch transactions.
//! - **A handler timed out or panicked:** one transaction per message at
//!   once (each half would wait out its timeout again). A COMMIT with an
//!   unknown outcome does too: each message's own claim finds its row if
//!   the batch did commit.
//! - **The database cannot be used at all** (BEGIN or the claim fails): the
//!   batch is held and retried whole, as one message would be.
//!
//! The handler calls of a batch share one handler timeout, so that a batch
//! bounds its transaction as one message does (the retention floor and the
//! watchdog count that).
//!
//! **Shutdown** stops a batch between two handler calls. A batch taken
//! before shutdown runs its first message, as a message taken alone runs;
//! no later handler of the batch starts after shutdown. The messages whose
//! handlers ran commit; the claims of the others are taken back in the same
//! transaction, and those messages are handed back (NAKed) for another
//! worker, as fetched messages that never started are. So do the messages
//! of a failed batch not yet tried again.
//!
//! Every batch that committed, and every one that fell back, tells the
//! route's [`BatchSizer`](crate::consume::sizing::BatchSizer), which sizes an
//! adaptive route's next batches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::Message;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::consume::heartbeat::{Lease, Taken};
use crate::consume::pipeline::{Held, Outage, Pipeline, Verdict, no_answer};
use crate::consume::sizing::BatchInFlight;
use crate::error::HandlerError;
use crate::handler::Handler;
use crate::handler::delivery::Delivery;
use crate::observe::recorder::Event;
use crate::store::backend::{Backend, Ended};

/// How long a statement of an adaptive batch's transaction waits for a lock
/// before the batch gives up as in conflict (see
/// [`Backend::begin_batch`]): far above a row lock held by a
/// transaction that runs, far below PostgreSQL's `deadlock_timeout`.
const BATCH_LOCK_WAIT: Duration = Duration::from_millis(200);

/// [`Pipeline::committed_by_handler`]'s first pause between two questions,
/// doubled after each, up to [`COMMITTED_BY_HANDLER_PAUSE_MAX`].
const COMMITTED_BY_HANDLER_PAUSE: Duration = Duration::from_millis(20);

/// [`Pipeline::committed_by_handler`]'s longest pause between two questions.
const COMMITTED_BY_HANDLER_PAUSE_MAX: Duration = Duration::from_secs(1);

/// After this long still "in progress", [`Pipeline::committed_by_handler`]
/// warns.
const COMMITTED_BY_HANDLER_WARN: Duration = Duration::from_secs(10);

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
    #[error("the database could not be used: {0}")]
    Infrastructure(sqlx::Error),
    /// `at`: the batch's index of the message whose handler failed, when
    /// the handler runs per message (a batch handler's call covers them
    /// all).
    #[error("a handler failed: {error}")]
    Handler {
        error: HandlerError,
        at: Option<usize>,
    },
    #[error("the batch did not commit: {0}")]
    NotCommitted(HandlerError),
    #[error("COMMIT failed, outcome unknown: {0}")]
    CommitUnknown(sqlx::Error),
    /// The claims were no longer the batch's own when it was to end: a
    /// handler ended the transaction itself (a raw COMMIT), which committed
    /// every claim of the batch, handled or not.
    #[error("{}", HandlerError::ClaimLost)]
    ClaimLost,
    /// A handler timed out or panicked, and the batch's connection was
    /// closed without being asked whether its transaction (`xid`) is still
    /// the batch's: a handler may have ended it with a raw COMMIT first.
    /// Resolved by [`Pipeline::committed_by_handler`] into [`ClaimLost`]
    /// or [`Handler`], outside the watchdog.
    ///
    /// [`ClaimLost`]: BatchFailure::ClaimLost
    /// [`Handler`]: BatchFailure::Handler
    #[error("a handler failed: {error}")]
    Unresolved {
        error: HandlerError,
        at: Option<usize>,
        xid: String,
    },
    /// Not a failure: the claim found these messages (their indexes) claimed
    /// by transactions that committed. The batch rolled back before any
    /// handler ran, so that they are acked at once and the rest run
    /// without them.
    #[error("messages of the batch were processed before")]
    ProcessedBefore(Vec<usize>),
}

/// How a failed batch's messages are tried again (see the module docs).
enum Retry {
    /// Those before the failed one as a batch, it alone, those after as a
    /// batch.
    AroundFailed(usize),
    /// In halves, each as a batch.
    Halves,
    /// One per transaction.
    Alone,
}

impl BatchFailure {
    /// Whether the batch conflicted with another transaction (see
    /// [`HandlerError::is_conflict`]).
    fn is_conflict(&self) -> bool {
        match self {
            BatchFailure::Handler { error, .. } | BatchFailure::NotCommitted(error) => {
                error.is_conflict()
            }
            BatchFailure::Infrastructure(_)
            | BatchFailure::CommitUnknown(_)
            | BatchFailure::ClaimLost
            | BatchFailure::Unresolved { .. }
            | BatchFailure::ProcessedBefore(_) => false,
        }
    }

    fn retry(&self) -> Retry {
        match self {
            _ if self.is_conflict() => Retry::Alone,
            BatchFailure::Handler {
                error: HandlerError::TimedOut(_) | HandlerError::Panicked(_),
                ..
            } => Retry::Alone,
            BatchFailure::Handler { at: Some(at), .. } => Retry::AroundFailed(*at),
            BatchFailure::Handler { at: None, .. } | BatchFailure::NotCommitted(_) => Retry::Halves,
            BatchFailure::Infrastructure(_)
            | BatchFailure::CommitUnknown(_)
            | BatchFailure::ClaimLost
            | BatchFailure::Unresolved { .. }
            | BatchFailure::ProcessedBefore(_) => Retry::Alone,
        }
    }
}

/// What became of one message of a batch that committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Claimed and handled: committed.
    Processed,
    /// Claimed before, by another transaction that committed.
    Duplicate,
    /// Not handled: shutdown stopped the batch before its handler ran, and
    /// its claim was taken back.
    Unstarted,
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Pipeline<H, S, DB> {
    /// Processes a batch of messages, each with its lease if it waited
    /// parked. `_slot` is the concurrency permit; `admitted`, when the
    /// route let the batch start (see
    /// [`BatchSizer::conflicted`](crate::consume::sizing::BatchSizer::conflicted));
    /// `counted`, the batch's place among the route's batches in flight,
    /// given up when its messages fall back to one per transaction.
    pub(crate) async fn process_batch(
        self: Arc<Self>,
        messages: Vec<Taken>,
        _slot: OwnedSemaphorePermit,
        admitted: Instant,
        counted: BatchInFlight,
    ) {
        let span = tracing::info_span!(
            "idem.batch",
            handler = self.handler.name(),
            size = messages.len()
        );
        #[cfg(feature = "otel")]
        crate::observe::trace::link_each(
            &span,
            messages.iter().filter_map(|(m, _)| m.headers.as_ref()),
        );
        self.run_batch(messages, admitted, counted)
            .instrument(span)
            .await;
    }

    /// Runs a batch (see the module docs): its messages are made ready,
    /// those ready are committed in one transaction, and if that fails,
    /// each is run again in a transaction of its own.
    async fn run_batch(
        self: &Arc<Self>,
        messages: Vec<Taken>,
        admitted: Instant,
        counted: BatchInFlight,
    ) {
        let _in_flight = self.recorder.in_flight(messages.len());
        let ready = self.make_ready(messages).await;
        if ready.is_empty() {
            return;
        }
        let Some((failure, ready)) = self.commit_batch(ready).await else {
            return;
        };
        self.recorder.record(Event::BatchFallback);
        if failure.is_conflict() {
            self.sizer.conflicted(admitted);
        } else {
            self.sizer.fell_back();
        }
        self.fall_back(failure, ready, false, Some(counted)).await;
    }

    /// Decodes each message, resolves its id and leases it (a parked one
    /// keeps its lease). One that is not for the batch is settled on its
    /// own: not a delivery, a replay for another handler, rejected, or past
    /// its delivery limit. Every message of the batch is leased before any
    /// is decided on its own, which runs its handler.
    async fn make_ready(self: &Arc<Self>, messages: Vec<Taken>) -> Vec<Ready<H::Payload>> {
        let mut leased = Vec::with_capacity(messages.len());
        for (message, parked) in messages {
            self.recorder.record(Event::Received);
            // (A parked lease held when either skips the message ends just
            // after: after its ACK, or for what is no JetStream delivery,
            // where a heartbeat changes nothing.)
            let Some(mut delivery) = self.delivery_of(&message).await else {
                continue;
            };
            if self.skip_replay_for_another(&message, &delivery).await {
                continue;
            }
            let lease = parked.unwrap_or_else(|| self.heartbeats.lease(&message));
            let prepared = self.prepare(&message, &mut delivery);
            leased.push((message, delivery, prepared, lease));
        }
        let mut ready = Vec::with_capacity(leased.len());
        for (message, delivery, prepared, lease) in leased {
            match prepared {
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
                Ok(outcomes) => {
                    self.recorder.batch_committed(ready.len());
                    self.sizer.committed(ready.len());
                    for (item, outcome) in ready.into_iter().zip(outcomes) {
                        let verdict = match outcome {
                            Outcome::Processed => Verdict::Processed(None),
                            Outcome::Duplicate => Verdict::Duplicate,
                            Outcome::Unstarted => Verdict::Unstarted,
                        };
                        self.settle(&item.message, &item.delivery, verdict, item.lease)
                            .await;
                    }
                    return None;
                }
                Err(BatchFailure::ProcessedBefore(processed)) => {
                    // Acked at once, not held through the batch (and its
                    // fallback, should it fail): the retention floor counts
                    // a duplicate's claim wait, not a batch's transaction.
                    let mut rest = Vec::with_capacity(ready.len());
                    for (at, item) in ready.into_iter().enumerate() {
                        if processed.contains(&at) {
                            self.settle(
                                &item.message,
                                &item.delivery,
                                Verdict::Duplicate,
                                item.lease,
                            )
                            .await;
                        } else {
                            rest.push(item);
                        }
                    }
                    ready = rest;
                    if ready.is_empty() {
                        return None;
                    }
                }
                Err(BatchFailure::ClaimLost) => {
                    // Every claim of the batch committed with part of its
                    // work: none may be retried (it would be taken for
                    // processed). Each is failed for good, as one message
                    // alone would be.
                    for item in ready {
                        self.settle(
                            &item.message,
                            &item.delivery,
                            Verdict::Failed(HandlerError::ClaimLost),
                            item.lease,
                        )
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
                Err(failure) => {
                    if matches!(failure, BatchFailure::CommitUnknown(_)) {
                        // It may have committed: what its messages queued
                        // may be there, and their reruns then find them
                        // processed (settled as duplicates, with no ring).
                        for item in &ready {
                            crate::outbox::after_commit(&item.delivery, &self.outbox_bell);
                        }
                    }
                    break failure;
                }
            }
        };
        Some((failure, ready))
    }

    /// One try of the batch's transaction ([`transact_batch`](Self::transact_batch)),
    /// under the watchdog. Returns what became of each message.
    async fn try_batch(
        self: &Arc<Self>,
        ready: &mut [Ready<H::Payload>],
    ) -> Result<Vec<Outcome>, BatchFailure> {
        let transacted = {
            let pipeline = Arc::clone(self);
            let deliveries: Vec<Delivery> =
                ready.iter().map(|item| item.delivery.clone()).collect();
            let payloads: Vec<Option<H::Payload>> =
                ready.iter_mut().map(|item| item.payload.take()).collect();
            self.watched(
                |held| async move {
                    let mut payloads = payloads;
                    let result = pipeline
                        .transact_batch(&deliveries, &mut payloads, held)
                        .await;
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
        match result {
            // Asked here, not under the watchdog: it may wait for a
            // connection, or for the database to come back.
            Err(BatchFailure::Unresolved { error, at, xid }) => {
                if self.committed_by_handler(&xid).await {
                    Err(BatchFailure::ClaimLost)
                } else {
                    Err(BatchFailure::Handler { error, at })
                }
            }
            other => other,
        }
    }

    /// After a batch failed (`failure`) and was rolled back: its messages
    /// are tried again around the failed one, in halves, or one per
    /// transaction (see the module docs), so that a failure does not fail
    /// its neighbours. `failed_first` says that the batch this one was cut
    /// from failed at its first message too. `counted` is the batch's place
    /// among the route's batches in flight (the first failure's): messages
    /// that run one per transaction are no batch, and must not keep the
    /// route from starting one. (After a conflict the route runs one batch
    /// at a time; a batch whose messages then wait alone for a row another
    /// session holds would stop it for as long.)
    async fn fall_back(
        self: &Arc<Self>,
        failure: BatchFailure,
        mut ready: Vec<Ready<H::Payload>>,
        failed_first: bool,
        counted: Option<BatchInFlight>,
    ) {
        let retry = match failure.retry() {
            // Failed at its first message again: every message may fail.
            Retry::AroundFailed(0) if failed_first => Retry::Alone,
            retry => retry,
        };
        if matches!(retry, Retry::Alone) || ready.len() < 2 || !self.decode_again(&mut ready) {
            tracing::warn!(%failure, size = ready.len(), "batch rolled back; running its messages one per transaction");
            drop(counted);
            self.one_per_transaction(ready).await;
            return;
        }
        match retry {
            Retry::AroundFailed(at) => {
                tracing::warn!(%failure, size = ready.len(), at, "batch rolled back; running the failed message alone and the others in batches");
                let after = ready.split_off((at + 1).min(ready.len()));
                let failed = ready.split_off(at.min(ready.len()));
                self.batch_again(ready, false).await;
                self.one_per_transaction(failed).await;
                self.batch_again(after, at == 0).await;
            }
            _ => {
                tracing::warn!(%failure, size = ready.len(), "batch rolled back; trying its halves");
                let second = ready.split_off(ready.len() / 2);
                self.batch_again(ready, false).await;
                self.batch_again(second, false).await;
            }
        }
    }

    /// Part of a failed batch, tried again: as a batch (falling back again
    /// if it fails), or alone if it is one message.
    async fn batch_again(self: &Arc<Self>, part: Vec<Ready<H::Payload>>, failed_first: bool) {
        // After shutdown, handed back unstarted.
        if part.len() < 2 || self.shutdown.has_fired() {
            self.one_per_transaction(part).await;
        } else if let Some((failure, part)) = self.commit_batch(part).await {
            Box::pin(self.fall_back(failure, part, failed_first, None)).await;
        }
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
    /// normal retry and dead-letter path; once shutdown has fired, hands the
    /// rest back unstarted instead.
    async fn one_per_transaction(self: &Arc<Self>, ready: Vec<Ready<H::Payload>>) {
        for item in ready {
            if self.shutdown.has_fired() {
                self.settle(
                    &item.message,
                    &item.delivery,
                    Verdict::Unstarted,
                    item.lease,
                )
                .await;
                continue;
            }
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
    /// message, and commits once. Returns what became of each message; each
    /// handled message's payload is taken.
    ///
    /// As in per-message mode, neither BEGIN nor COMMIT is raced against a
    /// timer; one handler timeout covers the batch's handler calls together
    /// (a batch handler's one call).
    async fn transact_batch(
        &self,
        deliveries: &[Delivery],
        payloads: &mut [Option<H::Payload>],
        mut held: Held,
    ) -> Result<Vec<Outcome>, BatchFailure> {
        let before_handler = |error| match self.classify_before_handler(error) {
            HandlerError::Infrastructure(error) => BatchFailure::Infrastructure(error),
            other => BatchFailure::Handler {
                error: other,
                at: None,
            },
        };
        let mut connection = self
            .connections
            .take(|waited| self.recorder.connection_waited(waited))
            .await
            .map_err(before_handler)?;
        held.now();
        let lock_wait = self.sizer.bounds_lock_waits().then_some(BATCH_LOCK_WAIT);
        let mut tx = DB::begin_batch(&mut connection, &self.begin, lock_wait)
            .await
            .map_err(before_handler)?;
        let keys: Vec<String> = deliveries
            .iter()
            .map(|delivery| self.claim_key(delivery))
            .collect();
        let (mut unclaimed, xid) = DB::claim_many(&mut tx, self.handler_id, &keys)
            .await
            .map_err(before_handler)?;
        self.health.resume();
        // An id twice in one batch: only its first message is fresh.
        let fresh: Vec<bool> = keys.iter().map(|key| unclaimed.remove(key)).collect();
        let processed_before = processed_before(&keys, &fresh);
        if !processed_before.is_empty() && fresh.contains(&true) {
            // Acked first (see `commit_batch`); the rest claim again.
            if DB::rollback(tx).await {
                connection.keep();
            }
            return Err(BatchFailure::ProcessedBefore(processed_before));
        }
        if !fresh.contains(&true) {
            // Every message was processed before: nothing to commit.
            if DB::rollback(tx).await {
                connection.keep();
            }
            return Ok(outcomes(&keys, &fresh, keys.len()));
        }
        let handled = if H::BATCHES {
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
            let called = self
                .run_handler(self.handler.handle_batch(
                    &mut tx,
                    batch,
                    &batch_deliveries,
                    &self.state,
                ))
                .await;
            #[cfg(feature = "fault-injection")]
            let called = self
                .faults
                .apply_after_handler(&batch_deliveries, called)
                .await;
            called.map(|()| keys.len()).map_err(|error| (None, error))
        } else {
            self.handle_each(&mut tx, &keys, deliveries, payloads, &fresh)
                .await
        };
        let stopped_at = match handled {
            Ok(stopped_at) => stopped_at,
            // The connection is closed on drop rather than waited on; so
            // whether a handler committed the claims itself (a raw COMMIT,
            // as below) is asked on another connection.
            Err((at, error @ (HandlerError::TimedOut(_) | HandlerError::Panicked(_)))) => {
                return Err(BatchFailure::Unresolved { error, at, xid });
            }
            Err((at, error)) => {
                // A handler that ended the transaction itself (a raw COMMIT)
                // and then failed has committed every claim of the batch:
                // see `Pipeline::transact` for one message alone.
                let claimed: Vec<&str> = keys
                    .iter()
                    .zip(&fresh)
                    .filter(|(_, fresh)| **fresh)
                    .map(|(key, _)| key.as_str())
                    .collect();
                let lost = !DB::claims_still_pending(&mut tx, &claimed).await;
                if DB::rollback(tx).await {
                    connection.keep();
                }
                if lost {
                    return Err(BatchFailure::ClaimLost);
                }
                return Err(BatchFailure::Handler { error, at });
            }
        };
        let outcomes = outcomes(&keys, &fresh, stopped_at);
        let handled_any = outcomes.contains(&Outcome::Processed);
        let unstarted: Vec<&str> = keys
            .iter()
            .zip(&fresh)
            .skip(stopped_at)
            .filter(|(_, fresh)| **fresh)
            .map(|(key, _)| key.as_str())
            .collect();
        if !handled_any {
            // Shutdown came before the first handler: nothing to commit.
            if DB::rollback(tx).await {
                connection.keep();
            }
            return Ok(outcomes);
        }
        if !unstarted.is_empty() {
            tracing::info!(
                handled = stopped_at,
                unstarted = unstarted.len(),
                "shutting down: the batch commits the messages whose handlers ran and hands back the rest"
            );
            DB::unclaim(&mut tx, &unstarted)
                .await
                .map_err(|error| BatchFailure::Handler {
                    error: HandlerError::Handler {
                        error: Box::new(error),
                        class: None,
                        sqlstate: None,
                    },
                    at: None,
                })?;
        }
        let claimed: Vec<&str> = keys
            .iter()
            .zip(&fresh)
            .filter(|(_, fresh)| **fresh)
            .map(|(key, _)| key.as_str())
            .collect();
        let (ended, reusable) = DB::finish(tx, &self.begin, &claimed).await;
        if reusable {
            connection.keep();
        }
        match ended {
            Ended::Committed => Ok(outcomes),
            Ended::NotCommitted(HandlerError::ClaimLost) => Err(BatchFailure::ClaimLost),
            Ended::NotCommitted(error) => Err(BatchFailure::NotCommitted(error)),
            Ended::Unknown(error) => {
                self.connections.forget_idle();
                Err(BatchFailure::CommitUnknown(error))
            }
        }
    }

    /// After a handler of the batch timed out or panicked, its connection
    /// closed: whether the batch's transaction (`xid`) committed all the
    /// same, because a handler ended it itself with a raw COMMIT before it
    /// failed. Then every claim of the batch is permanent, the unhandled
    /// messages' too, and none may be retried (its rerun would be acked as
    /// processed): the batch is dead-lettered.
    ///
    /// Asked until the server has ended the transaction:
    /// once its connection is gone it can only abort, unless a COMMIT was
    /// already on its way, and it ends when the server sees the client gone
    /// (at once when idle, else when the statement running ends: at the
    /// handler timeout, or at the next client check). While the database
    /// cannot be used, the batch is held, as any message is, and at
    /// shutdown the answer is "committed": dead-lettered, the messages are
    /// kept rather than risk acking them undone. A transaction the server
    /// says still runs is asked about again at shutdown too, until it ends
    /// or the grace period does and the task is cut off: it has not
    /// committed, and can only abort now unless a COMMIT was on its way, so
    /// its messages are redelivered, and their claims decide. (Taking that
    /// answer for "committed" at once dead-lettered every message of the
    /// batch, those whose handlers never ran included, whenever a handler
    /// timed out or panicked moments before a deploy.)
    async fn committed_by_handler(self: &Arc<Self>, xid: &str) -> bool {
        let mut outage = Outage::default();
        let mut pause = COMMITTED_BY_HANDLER_PAUSE;
        let asked = tokio::time::Instant::now();
        let mut warned = false;
        loop {
            // Each question under the watchdog, so that a connection that
            // stops answering (a silent partition) does not hold the batch
            // until TCP gives up.
            let answer = {
                let pipeline = Arc::clone(self);
                let xid = xid.to_owned();
                self.watched(
                    |mut held| async move {
                        let mut connection = pipeline
                            .connections
                            .take(|waited| pipeline.recorder.connection_waited(waited))
                            .await?;
                        held.now();
                        let answer = DB::committed(&mut connection, &xid).await;
                        if answer.is_ok() {
                            connection.keep();
                        }
                        answer
                    },
                    |limit| Err(no_answer(limit)),
                )
                .await
            };
            match answer {
                Ok(Some(committed)) => {
                    self.health.resume();
                    if committed {
                        tracing::error!(
                            "a handler of the batch committed the transaction itself (a raw COMMIT) and then failed: every claim of the batch is permanent, so none of its messages is retried; each is dead-lettered"
                        );
                    }
                    return committed;
                }
                Ok(None) => {
                    if !warned && asked.elapsed() >= COMMITTED_BY_HANDLER_WARN {
                        warned = true;
                        tracing::warn!(
                            waited = ?asked.elapsed(),
                            "a failed batch's transaction is still running on the server (its handler timed out or panicked while a statement ran): its messages wait until the server ends it"
                        );
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(COMMITTED_BY_HANDLER_PAUSE_MAX);
                }
                Err(error) => {
                    let error = HandlerError::Infrastructure(error);
                    if !self.hold_for_database(&error, &mut outage).await {
                        break;
                    }
                }
            }
        }
        tracing::error!(
            "shutting down before the database could be asked whether a failed batch's transaction committed: its messages are dead-lettered rather than risk acking them undone"
        );
        true
    }

    /// Runs the handler for each fresh message in turn, all of them within
    /// one handler timeout, and stores what they return with their claims,
    /// in one statement (none if they return nothing). Stops at the first
    /// failure, returning the batch's index of its message; or before a
    /// handler call once shutdown has fired, returning the index of the
    /// first message not started (the batch's length if all were).
    async fn handle_each(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        keys: &[String],
        deliveries: &[Delivery],
        payloads: &mut [Option<H::Payload>],
        fresh: &[bool],
    ) -> Result<usize, (Option<usize>, HandlerError)> {
        let mut stored_keys = Vec::new();
        let mut results = Vec::new();
        // One handler timeout for the batch's calls together, so that a
        // batch bounds its transaction as one message does (the retention
        // floor and the watchdog count one): calls too slow to fit it in a
        // batch run one per transaction after the fallback.
        let deadline = self.handler_deadline();
        let mut stopped_at = keys.len();
        let first_fresh = fresh.iter().position(|fresh| *fresh).unwrap_or(0);
        for (at, (((key, delivery), payload), _)) in keys
            .iter()
            .zip(deliveries)
            .zip(payloads.iter_mut())
            .zip(fresh)
            .enumerate()
            .filter(|(_, (_, fresh))| **fresh)
        {
            // The first message was taken before shutdown, as a message
            // alone is: it runs. The later ones wait for no one.
            if at > first_fresh && self.shutdown.has_fired() {
                stopped_at = at;
                break;
            }
            let payload = payload.take().expect("each payload is used once");
            let call = self
                .handler
                .handle_and_encode(tx, payload, delivery, &self.state);
            // In its message's trace, so that what it queues carries that on.
            #[cfg(feature = "otel")]
            let call = call.instrument(self.span(delivery));
            let result = self.run_handler_until(deadline, call).await;
            #[cfg(feature = "fault-injection")]
            let result = self
                .faults
                .apply_after_handler(std::slice::from_ref(delivery), result)
                .await;
            let result = result.map_err(|error| (Some(at), error))?;
            if let Some(result) = result {
                stored_keys.push(key.as_str());
                results.push(result);
            }
        }
        let results: Vec<&[u8]> = results.iter().map(|result| result.as_ref()).collect();
        // Within the calls' deadline: the handler timeout bounds the calls
        // and their results together (see `Pipeline::within_deadline`).
        self.within_deadline(deadline, DB::store_results(tx, &stored_keys, &results))
            .await
            .map_err(|error| (None, error))?;
        Ok(stopped_at)
    }
}

/// The indexes of the messages whose claim another transaction made and
/// committed: not fresh, and not a second copy of a message this batch
/// claimed.
fn processed_before(keys: &[String], fresh: &[bool]) -> Vec<usize> {
    let claimed_here: std::collections::HashSet<&str> = keys
        .iter()
        .zip(fresh)
        .filter(|(_, fresh)| **fresh)
        .map(|(key, _)| key.as_str())
        .collect();
    keys.iter()
        .zip(fresh)
        .enumerate()
        .filter(|(_, (key, fresh))| !**fresh && !claimed_here.contains(key.as_str()))
        .map(|(at, _)| at)
        .collect()
}

/// What became of each message of a batch whose handlers ran up to (not
/// including) index `stopped_at`: a fresh message before it was processed,
/// one from it on was not started; a message claimed before is a
/// duplicate, unless this batch claimed it (its id came twice) and the
/// first copy was not started: then it was not either, since that claim is
/// taken back.
fn outcomes(keys: &[String], fresh: &[bool], stopped_at: usize) -> Vec<Outcome> {
    let mut claimed_here = std::collections::HashMap::new();
    keys.iter()
        .zip(fresh)
        .enumerate()
        .map(|(at, (key, fresh))| {
            if *fresh {
                let outcome = if at < stopped_at {
                    Outcome::Processed
                } else {
                    Outcome::Unstarted
                };
                claimed_here.insert(key.as_str(), outcome);
                outcome
            } else {
                match claimed_here.get(key.as_str()) {
                    Some(Outcome::Unstarted) => Outcome::Unstarted,
                    _ => Outcome::Duplicate,
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(keys: &[&str]) -> Vec<String> {
        keys.iter().map(|key| (*key).to_owned()).collect()
    }

    #[test]
    fn a_batch_run_to_its_end_processes_every_fresh_message() {
        let keys = keys(&["a", "b", "a", "c"]);
        let fresh = [true, false, false, true];
        assert_eq!(
            outcomes(&keys, &fresh, keys.len()),
            [
                Outcome::Processed,
                Outcome::Duplicate,
                Outcome::Duplicate,
                Outcome::Processed
            ]
        );
    }

    #[test]
    fn messages_claimed_by_others_are_told_from_copies_claimed_here() {
        let keys = keys(&["a", "b", "a", "c", "d"]);
        let fresh = [true, false, false, false, true];
        // "b" and "c" were claimed by other transactions; the second "a" is
        // a copy of a message this batch claimed.
        assert_eq!(processed_before(&keys, &fresh), [1, 3]);
        assert!(processed_before(&keys, &[true, true, false, true, true]).is_empty());
    }

    #[test]
    fn a_copy_of_a_message_not_started_is_not_started_either() {
        // "a" twice: its first copy comes after the stop, so its claim is
        // taken back, and the second copy must not be acked as a duplicate.
        let keys = keys(&["b", "a", "c", "a", "b"]);
        let fresh = [true, true, true, false, false];
        assert_eq!(
            outcomes(&keys, &fresh, 1),
            [
                Outcome::Processed,
                Outcome::Unstarted,
                Outcome::Unstarted,
                Outcome::Unstarted,
                Outcome::Duplicate
            ]
        );
    }
}
