//! One message's way through the runtime: resolve its id, decode it, claim
//! and handle it inside a transaction, commit, and only then ack; or retry,
//! hold, or dead-letter it.
//!
//! Every path ends in exactly one of: ack (committed, or found already
//! processed, or a replay of another handler's dead letter, which this
//! route never runs), NAK (retried later), or a stored dead letter followed
//! by TERM.
//! Two kinds of failure never use up a delivery, because the message is not
//! to blame: the database being unusable before the handler runs, and the
//! dead-letter stream being unavailable. Such a message is *held*: its
//! heartbeats keep it leased while it is retried with backoff, until it
//! succeeds or the router shuts down (then it is NAKed for another worker).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Message;
use bytes::Bytes;
use futures_util::FutureExt;
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

use crate::codec::Decode;
use crate::consume::ack;
use crate::consume::health::Health;
use crate::consume::heartbeat::{Heartbeats, Lease};
use crate::consume::sizing::BatchSizer;
use crate::dead_letter::{self, Failure};
use crate::error::class::ErrorClass;
use crate::error::{HandlerError, RejectedMessage};
use crate::handler::Handler;
use crate::handler::delivery::Delivery;
use crate::message_id::MessageId;
use crate::observe::recorder::{Event, Recorder};
use crate::observe::stats::Stats;
use crate::reply::Mode;
use crate::route::Route;
use crate::store::backend::{Backend, Claim, Ended};
use crate::store::connections::Connections;
use crate::store::transaction;
use crate::tasks::Signal;

/// Everything a route needs to process its messages.
pub(crate) struct Pipeline<H, S, DB: Backend> {
    pub(crate) route: Route,
    pub(crate) handler: H,
    pub(crate) state: Arc<S>,
    pub(crate) connections: Arc<Connections<DB>>,
    pub(crate) heartbeats: Heartbeats,
    pub(crate) nats: async_nats::Client,
    pub(crate) begin: DB::Begin,
    /// The handler's id in `idem_handlers`, stored with each claim.
    pub(crate) handler_id: i32,
    pub(crate) health: Health,
    /// Counts what happens to its messages, into its `Stats` and metrics.
    pub(crate) recorder: Recorder,
    /// How many messages its next batch takes (see `consume/sizing.rs`).
    pub(crate) sizer: Arc<BatchSizer>,
    pub(crate) shutdown: Signal,
    /// How it ends a message: acked on JetStream, or answered to a caller
    /// who waits (a request route, see `consume/reply.rs`: a duplicate then
    /// reads the stored result, while the database cannot be used a message
    /// is answered with an error after one more try instead of being held,
    /// and claims are keyed under the route's name rather than the
    /// handler's).
    pub(crate) mode: Mode,
    /// Rung after a transaction that queued outbox rows may have committed,
    /// so that this process's relays on the route's database publish them
    /// now (see `outbox/wake.rs`).
    pub(crate) outbox_bell: crate::outbox::Bell,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::fault::FaultHooks,
}

/// What the router gives every route it starts, JetStream route and request
/// route alike.
pub(crate) struct RouteContext<DB: Backend> {
    /// The handler's id in `idem_handlers`.
    pub(crate) handler_id: i32,
    pub(crate) nats: async_nats::Client,
    /// The router's connections, shared by all its routes and handed out
    /// in the order messages ask for them (see `store/connections.rs`).
    pub(crate) connections: Arc<Connections<DB>>,
    pub(crate) session: DB::Session,
    pub(crate) shutdown: Signal,
    /// How long shutdown waits for messages in flight.
    pub(crate) grace: Duration,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::fault::FaultHooks,
}

impl<H: Handler<S, DB>, S: Send + Sync + 'static, DB: Backend> Pipeline<H, S, DB> {
    /// The pipeline of `route`, which runs `handler` with `state`, counts
    /// into `stats` and ends its messages as `mode` says.
    pub(crate) fn new(
        route: Route,
        handler: H,
        state: Arc<S>,
        stats: Arc<Stats>,
        mode: Mode,
        context: &RouteContext<DB>,
    ) -> Self {
        // A request has no lease to keep.
        let heartbeat = match mode {
            Mode::Consume { .. } => route.heartbeat_interval(),
            Mode::Answer(_) => None,
        };
        let recorder = Recorder::new(&route.durable, stats);
        Pipeline {
            begin: DB::begin_for(route.handler_timeout, context.session),
            health: Health::new(recorder.clone()),
            recorder,
            sizer: Arc::new(if route.adaptive {
                BatchSizer::adaptive(route.batch_cap())
            } else {
                BatchSizer::fixed(route.batch)
            }),
            heartbeats: Heartbeats::start(context.nats.clone(), heartbeat),
            connections: context.connections.clone(),
            route,
            handler,
            state,
            nats: context.nats.clone(),
            handler_id: context.handler_id,
            shutdown: context.shutdown.clone(),
            mode,
            outbox_bell: crate::outbox::Bell::of(context.connections.pool()),
            #[cfg(feature = "fault-injection")]
            faults: context.faults.clone(),
        }
    }
}

/// How long the runtime waits for a transaction before it stops waiting
/// (see [`Pipeline::watched`]): the longest a transaction can take when
/// every part of it gets its answer ([`transaction::longest`], which the
/// retention floor counts too; a batch's handler calls share one handler
/// timeout), plus a margin; `None` without a handler timeout.
pub(crate) fn watchdog(handler_timeout: Option<Duration>) -> Option<Duration> {
    handler_timeout.map(|timeout| transaction::longest(timeout).saturating_add(WATCHDOG_MARGIN))
}

/// How much longer than its bounds allow the watchdog waits for a
/// transaction.
const WATCHDOG_MARGIN: Duration = Duration::from_secs(5);

/// How far the NATS server's clock and PostgreSQL's may disagree, for
/// [`Pipeline::first_claim_not_before`]: a generation sealed this much
/// before a message was stored is still probed for its claim.
pub(crate) const CLOCK_SKEW_ALLOWANCE: Duration = Duration::from_secs(5 * 60);

/// Given to the work [`Pipeline::watched`] watches, which calls
/// [`Held::now`] once it holds its connection: the watch starts then.
pub(crate) struct Held(Option<tokio::sync::oneshot::Sender<()>>);

impl Held {
    /// The work holds its connection: the watchdog's time starts.
    pub(crate) fn now(&mut self) {
        if let Some(held) = self.0.take() {
            let _ = held.send(());
        }
    }
}

/// How one delivery ended, before it is settled with JetStream.
pub(crate) enum Verdict {
    /// Committed: ack. With what the handler returned, encoded (`None`:
    /// nothing, or a batch, which does not report it).
    Processed(Option<Bytes>),
    /// Already processed: rolled back, ack.
    Duplicate,
    /// Already processed, on a route that answers: what the first attempt
    /// stored (`Some(None)`: nothing), or `None` if its claim has expired
    /// since it conflicted.
    Replayed(Option<Option<Bytes>>),
    /// The handler, or its COMMIT, failed (after any in-process retries):
    /// rolled back; NAK or dead-letter by the error's class.
    Failed(HandlerError),
    /// COMMIT's outcome is unknown (the connection failed): NAK, never ack.
    /// If it did commit, the redelivery finds the claim.
    CommitUnknown(sqlx::Error),
    /// Can never succeed: dead-letter.
    Rejected(RejectedMessage),
    /// Arrived past the delivery limit, and its claim shows no attempt ever
    /// committed: dead-letter without running.
    Exhausted,
    /// Held while the database could not be used, and the router is shutting
    /// down: NAK, so another worker takes it.
    Interrupted,
    /// Part of a batch that shutdown stopped before its handler ran (its
    /// claim taken back, or never made): NAK, so another worker takes it.
    Unstarted,
}

/// The message of a panic's payload.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// The error of a transaction the runtime stopped waiting for.
pub(crate) fn no_answer(limit: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer from the database for {limit:?}, longer than its bounds allow; the transaction is left to finish on its own"
        ),
    ))
}

/// Consecutive attempts that failed because the database could not be used.
#[derive(Default)]
pub(crate) struct Outage {
    failures: u64,
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Pipeline<H, S, DB> {
    /// Processes one message. `parked`: the lease it holds already, if it
    /// waited parked. `_slot` is the concurrency permit, released when the
    /// message is settled.
    pub(crate) async fn process(
        self: Arc<Self>,
        message: Message,
        parked: Option<Lease>,
        _slot: OwnedSemaphorePermit,
    ) {
        self.recorder.record(Event::Received);
        let _in_flight = self.recorder.in_flight(1);
        let Some(mut delivery) = self.delivery_of(&message).await else {
            return;
        };
        // (A parked lease held when either returns ends just after: after
        // its ACK, or for what is no JetStream delivery, where a heartbeat
        // changes nothing.)
        if self.skip_replay_for_another(&message, &delivery).await {
            return;
        }
        let lease = parked.unwrap_or_else(|| self.heartbeats.lease(&message));
        let span = self.span(&delivery);
        async {
            let verdict = match self.prepare(&message, &mut delivery) {
                Err(rejected) => Verdict::Rejected(rejected),
                Ok(payload) => self.decide(&message.payload, payload, &delivery).await,
            };
            self.settle(&message, &delivery, verdict, lease).await;
        }
        .instrument(span)
        .await;
    }

    pub(crate) fn span(&self, delivery: &Delivery) -> tracing::Span {
        let span = tracing::info_span!(
            "idem.message",
            handler = self.handler.name(),
            subject = %delivery.subject(),
            stream_seq = delivery.stream_sequence(),
            message_id = tracing::field::Empty,
            delivered = delivery.delivered(),
        );
        #[cfg(feature = "otel")]
        crate::observe::trace::continue_trace(&span, Some(delivery.headers()));
        span
    }

    /// The delivery metadata of `message`, or `None` after dead-lettering a
    /// message that has none: it is not a JetStream consumer delivery, so
    /// there is nothing to deduplicate it by or redeliver.
    pub(crate) async fn delivery_of(&self, message: &Message) -> Option<Delivery> {
        match Delivery::from_message(message) {
            Ok(delivery) => Some(delivery),
            Err(error) => {
                self.recorder.record(Event::Rejected);
                let text = format!(
                    "not a JetStream delivery ({error}): it cannot be deduplicated or redelivered"
                );
                self.dead_letter(message, None, Failure::NotADelivery, &text, Lease::none())
                    .await;
                None
            }
        }
    }

    /// Acks, without running the handler, a replay of a dead letter that
    /// another handler dead-lettered (`Idem-Replay-For` names it): the
    /// replay is for that handler alone (see the
    /// [`dead_letter`](crate::dead_letter#replays) docs), and this one may
    /// have applied the message already, under another id. Returns whether
    /// it did. Counted in [`Stats::replays_skipped`].
    pub(crate) async fn skip_replay_for_another(
        &self,
        message: &Message,
        delivery: &Delivery,
    ) -> bool {
        let Some(target) = delivery.headers().get(dead_letter::REPLAY_FOR) else {
            return false;
        };
        if target.as_str() == self.handler.name() {
            return false;
        }
        ack::ack(message, self.route.ack_mode).await;
        self.recorder.record(Event::ReplaySkipped);
        tracing::debug!(
            replay_for = target.as_str(),
            stream_seq = delivery.stream_sequence(),
            "a replay of another handler's dead letter; acked without running the handler"
        );
        true
    }

    /// Resolves the message id and decodes the payload, before BEGIN, so a
    /// poison message never takes a connection. The id the delivery carries
    /// (`Nats-Msg-Id`, else its stream position) is resolved first, so that
    /// the dead letter of a payload that does not decode keeps it; a
    /// handler's key replaces it once the payload decodes.
    pub(crate) fn prepare(
        &self,
        message: &Message,
        delivery: &mut Delivery,
    ) -> Result<H::Payload, RejectedMessage> {
        let carried = MessageId::of_delivery(
            delivery.headers(),
            delivery.stream(),
            delivery.stream_sequence(),
            delivery.stored_at(),
        );
        if let Ok(id) = &carried {
            delivery.set_message_id(id.clone());
        }
        let payload = self.decode(&message.payload)?;
        let resolved = match self.key_of(&payload, delivery)? {
            Some(key) => MessageId::from_key(key)?,
            None => carried?,
        };
        delivery.set_message_id(resolved);
        delivery.set_handler(self.handler.name());
        tracing::Span::current().record("message_id", delivery.message_id().as_str());
        #[cfg(feature = "fault-injection")]
        self.faults.saw_delivery(delivery);
        Ok(payload)
    }

    /// Decodes a payload with the handler's codec. A codec that panics is a
    /// payload that cannot be decoded, not a crash.
    pub(crate) fn decode(&self, payload: &Bytes) -> Result<H::Payload, RejectedMessage> {
        let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            <H::Codec as Decode<H::Payload>>::decode(payload)
        }))
        .unwrap_or_else(|panic| {
            Err(crate::codec::DecodeError::new(
                "the handler's codec",
                format!("it panicked: {}", panic_text(&*panic)),
            ))
        });
        Ok(decoded?)
    }

    /// The handler's key for a payload. A key expression that panics makes
    /// the message's id unusable, not the route crash.
    pub(crate) fn key_of(
        &self,
        payload: &H::Payload,
        delivery: &Delivery,
    ) -> Result<Option<String>, crate::message_id::InvalidMessageId> {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.handler.message_key(payload, delivery)
        }))
        .map_err(|panic| crate::message_id::InvalidMessageId::KeyPanicked(panic_text(&*panic)))
    }

    /// Runs a prepared message on its own, in its own transaction. `bytes`
    /// is its payload as it came, decoded again for a retry.
    pub(crate) async fn decide(
        self: &Arc<Self>,
        bytes: &Bytes,
        payload: H::Payload,
        delivery: &Delivery,
    ) -> Verdict {
        if delivery.delivered() > self.route.retry.max_deliver {
            return self.past_limit(delivery).await;
        }
        self.transact_with_retries(bytes, payload, delivery).await
    }

    /// A message past its delivery limit: ack it if an attempt committed,
    /// else dead-letter it. The check claims the message and rolls the claim
    /// back, so it waits for an attempt that is still running.
    async fn past_limit(self: &Arc<Self>, delivery: &Delivery) -> Verdict {
        match self.claim_committed(delivery, true).await {
            Some(true) => Verdict::Duplicate,
            Some(false) => Verdict::Exhausted,
            None => Verdict::Interrupted,
        }
    }

    /// Whether an attempt at `delivery`'s message committed its claim:
    /// claims it and rolls the claim back ([`claimed_elsewhere`]), so that
    /// it waits for an attempt whose transaction has not ended yet, and
    /// probes the generations the message's claim can be in. Under the
    /// watchdog. While the database cannot be used, holds if `hold` (else
    /// gives up); `None` when it gave up or the router is shutting down.
    ///
    /// [`claimed_elsewhere`]: Self::claimed_elsewhere
    async fn claim_committed(self: &Arc<Self>, delivery: &Delivery, hold: bool) -> Option<bool> {
        let mut outage = Outage::default();
        loop {
            let checked = {
                let pipeline = Arc::clone(self);
                let delivery = delivery.clone();
                // A claim and its rollback: no longer than a transaction's
                // bound.
                self.watched(
                    |held| async move { pipeline.claimed_elsewhere(&delivery, held).await },
                    |limit| Err(no_answer(limit)),
                )
                .await
            };
            match checked {
                Ok(committed) => return Some(committed),
                Err(error) => {
                    let error = HandlerError::Infrastructure(error);
                    if !hold || !self.hold_for_database(&error, &mut outage).await {
                        return None;
                    }
                }
            }
        }
    }

    async fn claimed_elsewhere(
        &self,
        delivery: &Delivery,
        mut held: Held,
    ) -> Result<bool, sqlx::Error> {
        let mut connection = self
            .connections
            .take(|waited| self.recorder.connection_waited(waited))
            .await?;
        held.now();
        let key = self.claim_key(delivery);
        let claim = self.claim(&key, delivery);
        let begun = DB::begin(&mut connection, &self.begin, Some(claim)).await;
        let duplicate = begun.as_ref().is_err_and(DB::is_duplicate_claim);
        if duplicate || begun.is_ok() {
            // The claim was answered: the database can be used. (Before
            // the ROLLBACK, which may fail: a route paused with no attempt
            // left to resume it would take nothing new.)
            self.health.resume();
        }
        let processed = if duplicate {
            drop(begun);
            DB::end_failed_claim(&mut connection).await?;
            true
        } else {
            // Fresh: no attempt committed it. Roll this claim back.
            if !DB::rollback(begun?).await {
                return Ok(false);
            }
            false
        };
        connection.keep();
        Ok(processed)
    }

    /// Waits for `work` (a whole transaction), but not forever: once it has
    /// held its connection longer than any server-side bound allows (the
    /// network is gone without a word: a partition, a frozen host, and TCP
    /// has not noticed), the runtime stops waiting and settles the message
    /// with `stuck`. The work is not cancelled then: it goes on in a task of
    /// its own until the connection answers or fails, or for as long again;
    /// after that it is dropped, which closes its connection (a
    /// [`Leased`](crate::store::connections::Leased)
    /// is never returned to the pool, so the hazard of a cancelled BEGIN or
    /// COMMIT, a pooled connection left inside a transaction, sqlx#4393,
    /// cannot arise). Meanwhile the server ends the orphaned transaction
    /// (`idle_in_transaction_session_timeout`), so the message's redelivery
    /// is decided by its claim as usual.
    ///
    /// The watch starts once `work` holds its connection (it says so with
    /// [`Held::now`]): the wait for a connection is bounded by the pool's
    /// acquire timeout, and a message that waits its turn behind others is
    /// not a database that stopped answering.
    pub(crate) async fn watched<T: Send + 'static, F>(
        &self,
        work: impl FnOnce(Held) -> F,
        stuck: impl FnOnce(Duration) -> T,
    ) -> T
    where
        F: Future<Output = T> + Send + 'static,
    {
        let Some(limit) = watchdog(self.route.handler_timeout) else {
            return work(Held(None)).await;
        };
        let (held, connection_held) = tokio::sync::oneshot::channel();
        let mut work = Box::pin(work(Held(Some(held))));
        tokio::select! {
            biased;
            done = &mut work => return done,
            // Held, or the work gave up its `Held` without a connection
            // (it is about to end).
            _ = connection_held => {}
        }
        tokio::select! {
            biased;
            done = &mut work => done,
            _ = tokio::time::sleep(limit) => {
                tracing::error!(
                    ?limit,
                    "the database has not answered a transaction for longer than its bounds allow; no longer waiting for it (it finishes on its own, or its connection is closed after as long again), and the message is settled as of unknown outcome"
                );
                self.recorder.record(Event::AbandonedTransaction);
                let bell = self.outbox_bell.clone();
                tokio::spawn(async move {
                    // Given as long again, then dropped. A connection that
                    // never answers (a silent partition: no RST, no FIN, and
                    // sqlx sets no TCP keepalive) would otherwise hold its
                    // turn and its place in the pool for good, and a few such
                    // would stop every route. Dropping is safe here, unlike a
                    // timer around BEGIN or COMMIT on a pooled connection:
                    // the work's connection is a `Leased`, closed on drop and
                    // never returned to the pool, and the message is settled
                    // already; its redelivery is decided by its claim.
                    if tokio::time::timeout(limit, work).await.is_err() {
                        tracing::warn!(
                            after = ?limit * 2,
                            "an abandoned transaction's connection still has not answered: it is closed, and its place in the pool is given back"
                        );
                    }
                    // If it committed after all, rows it queued go out now
                    // rather than at a relay's next poll.
                    bell.ring();
                });
                stuck(limit)
            }
        }
    }

    /// Runs the transaction; runs it again at once (a few times, with a
    /// short pause) when the failure is one a retry may clear; and holds the
    /// message while the database cannot be used at all (on a route that
    /// answers, tries once more at once, then gives up: its caller waits).
    pub(crate) async fn transact_with_retries(
        self: &Arc<Self>,
        bytes: &Bytes,
        payload: H::Payload,
        delivery: &Delivery,
    ) -> Verdict {
        let policy = &self.route.retry;
        let mut payload = Some(payload);
        let mut tries = 1;
        let mut outage = Outage::default();
        loop {
            let this_try = match payload.take() {
                Some(payload) => payload,
                // The handler took the last one; it decoded before, so it
                // decodes again.
                None => match self.decode(bytes) {
                    Ok(payload) => payload,
                    Err(error) => return Verdict::Rejected(error),
                },
            };
            let verdict = {
                let pipeline = Arc::clone(self);
                let delivery = delivery.clone();
                self.watched(
                    |held| async move { pipeline.transact(this_try, &delivery, held).await },
                    |limit| Verdict::CommitUnknown(no_answer(limit)),
                )
                .await
            };
            let verdict = match verdict {
                Verdict::Failed(
                    error @ (HandlerError::TimedOut(_) | HandlerError::Panicked(_)),
                ) => {
                    if self.claim_committed_by_handler(delivery).await {
                        Verdict::Failed(HandlerError::ClaimLost)
                    } else {
                        Verdict::Failed(error)
                    }
                }
                other => other,
            };
            let Verdict::Failed(error) = &verdict else {
                return verdict;
            };
            if error.is_infrastructure() {
                if self.mode.answers().is_some() && outage.failures > 0 {
                    self.recorder.record(Event::InfrastructureError);
                    return verdict;
                }
                if !self.hold_for_database(error, &mut outage).await {
                    return Verdict::Interrupted;
                }
                continue;
            }
            let retry_now = matches!(
                error.class(),
                ErrorClass::RetryNow | ErrorClass::RetryNowThenPermanent
            );
            if !retry_now || tries >= policy.in_process_attempts {
                return verdict;
            }
            self.recorder.record(Event::RetriedInProcess);
            tracing::info!(%error, attempt = tries, "retrying at once");
            tokio::time::sleep(policy.in_process_backoff * tries).await;
            tries += 1;
        }
    }

    /// After the handler timed out or panicked, its connection closed
    /// unasked: whether the message's claim committed all the same, which
    /// only a raw COMMIT in the handler can have done (the claim was fresh
    /// when it was made, and nothing else commits it). Then the handler's
    /// work is committed in part, and a retry would be acked as a
    /// duplicate: the message is failed as [`HandlerError::ClaimLost`]
    /// (dead-lettered) instead.
    ///
    /// Asked with [`claim_committed`](Self::claim_committed), which waits
    /// for the abandoned transaction to end (a COMMIT of the handler's may
    /// still be on its way) and probes the generations this message's
    /// claim can be in. While the database cannot be used, a JetStream
    /// message is held, and at shutdown, still unknown, the answer is
    /// "committed": it is kept as a dead letter rather than risk acking it
    /// undone. A request is answered at once, as on any database failure:
    /// the answer is "not committed", its failure stands.
    ///
    /// Another copy of the message (published again after the duplicate
    /// window) that waited on this claim, and committed its own once this
    /// transaction ended, looks the same: that message is applied once, and
    /// this copy is dead-lettered needlessly.
    async fn claim_committed_by_handler(self: &Arc<Self>, delivery: &Delivery) -> bool {
        let answers = self.mode.answers().is_some();
        match self.claim_committed(delivery, !answers).await {
            Some(true) => {
                tracing::error!(
                    "the handler committed its transaction itself (a raw COMMIT) and then failed: its claim is permanent, so the message is not retried; it is dead-lettered"
                );
                true
            }
            Some(false) => false,
            None if answers => false,
            None => {
                tracing::error!(
                    "shutting down before it could be told whether a failed handler committed its transaction itself: the message is dead-lettered rather than risk acking it undone"
                );
                true
            }
        }
    }

    /// Runs the handler in its own transaction: BEGIN, the claim, the
    /// handler, COMMIT (see [`transaction`]).
    async fn transact(&self, payload: H::Payload, delivery: &Delivery, mut held: Held) -> Verdict {
        let mut connection = match self
            .connections
            .take(|waited| self.recorder.connection_waited(waited))
            .await
        {
            Ok(connection) => connection,
            Err(error) => return self.before_handler(error),
        };
        held.now();
        let key = self.claim_key(delivery);
        let claim = self.claim(&key, delivery);
        let begun = DB::begin(&mut connection, &self.begin, Some(claim)).await;
        if begun.as_ref().is_err_and(DB::is_duplicate_claim) {
            drop(begun);
            self.health.resume();
            // Processed before. (If the ROLLBACK fails, the connection is
            // closed on drop.)
            let ended = DB::end_failed_claim(&mut connection).await;
            if self.mode.answers().is_none() {
                if ended.is_ok() {
                    connection.keep();
                }
                return Verdict::Duplicate;
            }
            // Its caller gets what the first attempt stored, read on the
            // same connection: the claim conflicted, so it has committed.
            let read = match ended {
                Ok(()) => DB::read_result(&mut connection, &key).await,
                Err(error) => Err(error),
            };
            return match read {
                Ok(stored) => {
                    connection.keep();
                    Verdict::Replayed(stored)
                }
                Err(error) => self.before_handler(error),
            };
        }
        // Consumed by `map_err`, so that nothing keeps the borrow of
        // `connection` once `tx` is gone.
        let mut tx = match begun.map_err(|error| self.before_handler(error)) {
            Ok(tx) => tx,
            Err(verdict) => return verdict,
        };
        self.health.resume();
        let deadline = self.handler_deadline();
        let outcome = self
            .run_handler_until(
                deadline,
                self.handler
                    .handle_and_encode(&mut tx, payload, delivery, &self.state),
            )
            .await;
        #[cfg(feature = "fault-injection")]
        let outcome = self
            .faults
            .apply_after_handler(std::slice::from_ref(delivery), outcome)
            .await;
        // A value goes into the claim's row before COMMIT, within the
        // handler's deadline; `()` costs nothing. A reply too large to send
        // is refused first (see `consume/reply.rs`).
        let outcome = match outcome {
            Ok(Some(result)) => match self.check_reply_size(&result) {
                Ok(()) => self
                    .within_deadline(deadline, DB::store_result(&mut tx, &key, &result))
                    .await
                    .map(|()| Some(result)),
                Err(error) => Err(error),
            },
            other => other,
        };
        match outcome {
            Ok(result) => {
                let (ended, reusable) = DB::finish(tx, &self.begin, &[key.as_str()]).await;
                if reusable {
                    connection.keep();
                }
                self.verdict_of(ended, result)
            }
            // The handler may have left a statement running: the connection
            // is closed (on drop) rather than waited on. The server cancels
            // the statement (statement_timeout, or its client gone).
            Err(error @ (HandlerError::TimedOut(_) | HandlerError::Panicked(_))) => {
                Verdict::Failed(error)
            }
            Err(error) => {
                // A handler that ended the transaction itself (a raw COMMIT)
                // and then failed has committed its claim with half its
                // work: a redelivery would be acked as a duplicate. Checked
                // only here, on the way to a rollback: one more round trip,
                // on a failure path.
                let lost = !DB::claims_still_pending(&mut tx, &[key.as_str()]).await;
                if DB::rollback(tx).await {
                    connection.keep();
                }
                Verdict::Failed(if lost { HandlerError::ClaimLost } else { error })
            }
        }
    }

    /// The key `delivery`'s message is claimed by: under the handler's
    /// name, or a request route's own name (see `consume/reply.rs`).
    pub(crate) fn claim_key(&self, delivery: &Delivery) -> String {
        let claims_under = self
            .mode
            .answers()
            .map_or(self.handler.name(), |answers| answers.claims_under.as_str());
        crate::store::claim::key(claims_under, delivery.message_id().as_str())
    }

    fn claim<'k>(&self, key: &'k str, delivery: &Delivery) -> Claim<'k> {
        Claim {
            handler_id: self.handler_id,
            key,
            since: self.first_claim_not_before(delivery),
        }
    }

    /// The earliest time an earlier claim of `delivery`'s message can have
    /// been made, if the runtime can bound it; the claim then skips the
    /// generations sealed before it, which cannot hold such a claim (see
    /// `CLAIM_SQL`).
    ///
    /// Every delivery of a stored message carries the time it was stored,
    /// and its first claim came after that. Another copy of the message was
    /// stored at most the route's declared copy spread before this one, or,
    /// for a replayed dead letter, at its `Idem-Original-Stored-At`. The
    /// NATS server's clock, which stamps messages, and PostgreSQL's, which
    /// seals generations, may disagree by up to [`CLOCK_SKEW_ALLOWANCE`].
    /// A message id taken from the handler's `key` expression may repeat
    /// between messages published at any time, so it is never bounded; nor
    /// is a request's, a message sourced from another stream, or a replay
    /// whose dead letter does not record its original's storage time.
    fn first_claim_not_before(&self, delivery: &Delivery) -> Option<time::OffsetDateTime> {
        first_claim_not_before(self.mode.copy_spread(), delivery)
    }

    /// The verdict on a transaction whose handlers all returned `Ok`, with
    /// what they returned.
    pub(crate) fn verdict_of(&self, ended: Ended, result: Option<Bytes>) -> Verdict {
        match ended {
            Ended::Committed => Verdict::Processed(result),
            Ended::NotCommitted(error) => Verdict::Failed(error),
            Ended::Unknown(error) => {
                self.connections.forget_idle();
                Verdict::CommitUnknown(error)
            }
        }
    }

    /// An attempt that failed before the handler ran: the database's fault
    /// (held), or this message's (its id cannot be stored, its claim waited
    /// past the statement timeout on another attempt), classed as usual.
    pub(crate) fn before_handler(&self, error: sqlx::Error) -> Verdict {
        Verdict::Failed(self.classify_before_handler(error))
    }

    pub(crate) fn classify_before_handler(&self, error: sqlx::Error) -> HandlerError {
        if crate::error::class::is_infrastructure(&error) {
            // A kept connection may have died (a restart): do not let the
            // retry take another one unchecked.
            self.connections.forget_idle();
            HandlerError::Infrastructure(error)
        } else {
            HandlerError::ClaimFailed(error)
        }
    }

    /// Runs a handler call under the route's handler timeout, which covers
    /// the handler alone, never BEGIN or COMMIT, and turns a panic into an
    /// error of this message alone.
    pub(crate) async fn run_handler<T>(
        &self,
        handled: impl Future<Output = Result<T, HandlerError>>,
    ) -> Result<T, HandlerError> {
        self.run_handler_until(self.handler_deadline(), handled)
            .await
    }

    /// When handler calls starting now must end: the route's handler
    /// timeout from now (`None`: no timeout). A batch's calls share one.
    pub(crate) fn handler_deadline(&self) -> Option<tokio::time::Instant> {
        self.route
            .handler_timeout
            .map(|timeout| tokio::time::Instant::now() + timeout)
    }

    /// Runs a handler call that must end by `deadline` (one handler timeout
    /// shared by the calls of a batch; see [`handler_deadline`](Self::handler_deadline)),
    /// as [`run_handler`](Self::run_handler) does.
    pub(crate) async fn run_handler_until<T>(
        &self,
        deadline: Option<tokio::time::Instant>,
        handled: impl Future<Output = Result<T, HandlerError>>,
    ) -> Result<T, HandlerError> {
        let _timer = self.recorder.handler_call();
        let guarded = AssertUnwindSafe(handled).catch_unwind();
        let caught = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, guarded).await {
                Ok(caught) => caught,
                Err(_) => {
                    return Err(HandlerError::TimedOut(
                        self.route.handler_timeout.unwrap_or_default(),
                    ));
                }
            },
            None => guarded.await,
        };
        caught.unwrap_or_else(|panic| Err(HandlerError::Panicked(panic_text(&*panic))))
    }

    /// Runs `step`, a statement of idem's own that follows the handler in
    /// its transaction (storing what it returned), within the handler's
    /// `deadline`: the handler timeout bounds the handler and its result
    /// together, so that a claiming transaction runs at most the claim's
    /// wait, one handler timeout and COMMIT
    /// ([`transaction::longest`]), as the retention floor and the watchdog
    /// count. Past the deadline it fails as a handler that timed out does:
    /// the connection is closed, and the server cancels the statement.
    pub(crate) async fn within_deadline<T>(
        &self,
        deadline: Option<tokio::time::Instant>,
        step: impl Future<Output = Result<T, HandlerError>>,
    ) -> Result<T, HandlerError> {
        match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, step)
                .await
                .unwrap_or_else(|_| {
                    Err(HandlerError::TimedOut(
                        self.route.handler_timeout.unwrap_or_default(),
                    ))
                }),
            None => step.await,
        }
    }

    /// The database could not be used for this message: counts it, and
    /// waits before the next try. The first such failure is retried at once
    /// (on a connection the pool checks); after that the route pauses and
    /// the message waits the retry policy's backoff, capped at 30 s.
    /// Returns `false` if the router is shutting down instead.
    pub(crate) async fn hold_for_database(
        &self,
        error: &HandlerError,
        outage: &mut Outage,
    ) -> bool {
        self.recorder.record(Event::InfrastructureError);
        outage.failures += 1;
        if outage.failures == 1 {
            tracing::warn!(%error, "the database could not be used; retrying at once on a checked connection");
            return true;
        }
        self.health.pause();
        let delay = self.route.retry.hold_delay(outage.failures - 1);
        tracing::warn!(
            %error,
            retry_in = ?delay,
            "the database could not be used; holding the message (no delivery is used up) and taking no new ones until it can"
        );
        self.wait_or_shutdown(delay).await
    }

    /// Whether the database answers now: a connection, at its turn, that
    /// answers a ping (kept for the next message).
    pub(crate) async fn database_answers(&self) -> bool {
        let answered = match self.connections.take(|_| {}).await {
            Ok(mut connection) => match sqlx::Connection::ping(&mut *connection).await {
                Ok(()) => {
                    connection.keep();
                    Ok(())
                }
                Err(error) => Err(error),
            },
            Err(error) => Err(error),
        };
        if let Err(error) = &answered {
            tracing::debug!(%error, "the database does not answer yet");
        }
        answered.is_ok()
    }

    /// Waits `delay`; `false` if the router starts shutting down first.
    pub(crate) async fn wait_or_shutdown(&self, delay: Duration) -> bool {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            biased;
            _ = shutdown.fired() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }

    /// Tells JetStream how the delivery ended. The lease ends (no heartbeat
    /// follows) before the ack, NAK or TERM.
    pub(crate) async fn settle(
        &self,
        message: &Message,
        delivery: &Delivery,
        verdict: Verdict,
        lease: Lease,
    ) {
        let retry = &self.route.retry;
        match verdict {
            Verdict::Processed(_) => {
                self.recorder.record(Event::Processed);
                #[cfg(feature = "fault-injection")]
                if self.faults.decide_after_commit(delivery)
                    == crate::fault::AfterCommit::DropWithoutAck
                {
                    // As if the process died right after its COMMIT: no
                    // relay is woken and nothing is acked.
                    tracing::warn!("fault injection: committed but not acking");
                    self.recorder.record(Event::DroppedByFault);
                    return;
                }
                // Committed: a relay of this process publishes what it queued.
                crate::outbox::after_commit(delivery, &self.outbox_bell);
                lease.end().await;
                ack::ack(message, self.route.ack_mode).await;
                self.recorder.acked_processed(delivery.stored_at());
                tracing::debug!("processed");
            }
            Verdict::Duplicate | Verdict::Replayed(_) => {
                // A redelivery whose earlier attempt committed: that attempt
                // may have queued outbox rows that no relay was woken for
                // (its COMMIT's outcome was unknown, or its process died
                // right after it). A look costs a relay one cycle.
                if delivery.delivered() > 1 {
                    self.outbox_bell.ring();
                }
                lease.end().await;
                ack::ack(message, self.route.ack_mode).await;
                self.recorder.record(Event::Duplicate);
                tracing::info!("already processed; acked without running the handler");
            }
            Verdict::Failed(error) => {
                self.recorder.record(Event::Failed);
                let class = error.class();
                let text = error.to_string();
                if matches!(
                    class,
                    ErrorClass::Permanent | ErrorClass::RetryNowThenPermanent
                ) {
                    self.dead_letter(message, Some(delivery), Failure::Permanent, &text, lease)
                        .await;
                } else if retry.exhausted(delivery.delivered()) {
                    self.dead_letter(message, Some(delivery), Failure::Exhausted, &text, lease)
                        .await;
                } else {
                    let delay = retry.nak_delay(delivery.delivered());
                    lease.end().await;
                    ack::nak(message, delay).await;
                    tracing::warn!(error = text, ?class, retry_in = ?delay, "handler failed; rolled back and NAKed for redelivery");
                }
            }
            Verdict::CommitUnknown(error) => {
                self.recorder.record(Event::CommitFailed);
                // It may have committed: what it queued may be there.
                crate::outbox::after_commit(delivery, &self.outbox_bell);
                let delay = retry.nak_delay(delivery.delivered());
                lease.end().await;
                ack::nak(message, delay).await;
                tracing::warn!(%error, "COMMIT failed with an unknown outcome; NAKed, and the claim decides the redelivery");
            }
            Verdict::Rejected(error) => {
                self.recorder.record(Event::Rejected);
                let failure = match error {
                    RejectedMessage::Decode(_) => Failure::Undecodable,
                    RejectedMessage::MessageId(_) => Failure::BadMessageId,
                };
                self.dead_letter(message, Some(delivery), failure, &error.to_string(), lease)
                    .await;
            }
            Verdict::Exhausted => {
                let text = format!(
                    "delivered {} times, past the limit of {}, and never processed: earlier attempts did not finish",
                    delivery.delivered(),
                    retry.max_deliver
                );
                self.dead_letter(message, Some(delivery), Failure::Exhausted, &text, lease)
                    .await;
            }
            Verdict::Interrupted => {
                lease.end().await;
                ack::nak(message, Duration::ZERO).await;
                tracing::info!(
                    "shutting down while the database could not be used; NAKed for another worker"
                );
            }
            Verdict::Unstarted => {
                lease.end().await;
                ack::nak(message, Duration::ZERO).await;
                tracing::debug!(
                    "shutting down before its handler ran in its batch; NAKed for another worker"
                );
            }
        }
    }

    /// Publishes a dead letter, then TERMs the original. A dead letter too
    /// big to be stored as it is, is stored with parts moved out (see
    /// `dead_letter/moved.rs`): a size is no outage. While the publish
    /// fails, the message is held (heartbeats keep it leased, no delivery is
    /// used up) and the publish retried with backoff; if the router shuts
    /// down first, it is NAKed instead. It is never TERMed without a stored
    /// dead letter.
    async fn dead_letter(
        &self,
        message: &Message,
        delivery: Option<&Delivery>,
        failure: Failure,
        error: &str,
        lease: Lease,
    ) {
        let subject = self.route.dead_letter_target();
        let handler = self.handler.name();
        let mut attempt = 0;
        loop {
            let published = match delivery {
                Some(delivery) => {
                    dead_letter::publish(
                        message,
                        delivery,
                        handler,
                        subject.clone(),
                        failure,
                        error,
                    )
                    .await
                }
                None => {
                    dead_letter::publish_stray(message, handler, subject.clone(), failure, error)
                        .await
                }
            };
            let publish_error = match published {
                Ok(()) => break,
                Err(publish_error) => publish_error,
            };
            self.recorder.record(Event::DeadLetterFailed);
            attempt += 1;
            let delay = self.route.retry.hold_delay(attempt);
            match &publish_error {
                dead_letter::StoreError::Unavailable(_) => tracing::error!(
                    %publish_error,
                    error,
                    retry_in = ?delay,
                    "publishing the dead letter failed; the message is held and the publish retried"
                ),
                // A limit no retry gets past: the route waits on it, and
                // says so each time, until the limit is raised.
                dead_letter::StoreError::TooBig { .. } => tracing::error!(
                    %publish_error,
                    error,
                    retry_in = ?delay,
                    "the dead letter cannot be stored in any form; the message is held, and its route waits, until the dead-letter stream takes it"
                ),
            }
            if !self.wait_or_shutdown(delay).await {
                lease.end().await;
                if delivery.is_some() {
                    ack::nak(message, Duration::ZERO).await;
                    tracing::warn!("shutting down before the dead letter was stored; NAKed");
                } else {
                    tracing::error!(
                        "shutting down before the dead letter of a message that is not a JetStream delivery was stored; it is lost"
                    );
                }
                return;
            }
        }
        lease.end().await;
        if delivery.is_some() {
            ack::term(message).await;
        }
        self.recorder.record(Event::DeadLettered(failure));
        tracing::error!(
            failure = failure.as_str(),
            error,
            dead_letter_subject = subject,
            "dead-lettered; replay it with idem_runtime::dead_letter::replay once fixed"
        );
    }
}

/// [`Pipeline::first_claim_not_before`] for a route whose declared copy
/// spread is `copy_spread`.
fn first_claim_not_before(
    copy_spread: Option<Duration>,
    delivery: &Delivery,
) -> Option<time::OffsetDateTime> {
    let spread = copy_spread?;
    if delivery.message_id().source() == crate::MessageIdSource::Key || delivery.stream().is_empty()
    {
        return None;
    }
    let headers = delivery.headers();
    // Copied in from another stream (a source), it was stored there
    // first, at a time this one does not record.
    if headers.get("Nats-Stream-Source").is_some() {
        return None;
    }
    let replayed_original = headers
        .get(crate::dead_letter::STORED_AT)
        .and_then(|at| crate::dead_letter::parse_time(at.as_str()));
    // A replay of a dead letter that does not record its original's
    // storage time (written by an older idem) can be a copy of a message
    // claimed any time before.
    if replayed_original.is_none() && headers.get(crate::dead_letter::REPLAYED_FROM).is_some() {
        return None;
    }
    let stored = replayed_original.map_or(delivery.stored_at(), |at| at.min(delivery.stored_at()));
    Some(stored - spread - CLOCK_SKEW_ALLOWANCE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_bounded_by_its_copy_s_storage_time_unless_that_can_mislead() {
        let spread = Some(Duration::from_secs(60));
        let allowance = Duration::from_secs(60) + CLOCK_SKEW_ALLOWANCE;
        let fresh =
            Delivery::for_test("orders.placed", "ORDERS", 7).with_header("Nats-Msg-Id", "o-7");
        assert_eq!(
            first_claim_not_before(spread, &fresh),
            Some(fresh.stored_at() - allowance)
        );
        assert_eq!(
            first_claim_not_before(None, &fresh),
            None,
            "no declared horizon"
        );

        let original = fresh.stored_at() - Duration::from_secs(86_400);
        let stamp = original
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
        let replay = fresh
            .clone()
            .with_header(crate::dead_letter::REPLAYED_FROM, "IDEM_DEAD_LETTERS:3")
            .with_header(crate::dead_letter::STORED_AT, &stamp);
        assert_eq!(
            first_claim_not_before(spread, &replay),
            Some(original - allowance),
            "a replay is bounded by its original's storage time"
        );
        let old_replay = fresh
            .clone()
            .with_header(crate::dead_letter::REPLAYED_FROM, "IDEM_DEAD_LETTERS:3");
        assert_eq!(
            first_claim_not_before(spread, &old_replay),
            None,
            "a replay that does not record its original's time"
        );
        let sourced = fresh.clone().with_header("Nats-Stream-Source", "EU 12");
        assert_eq!(first_claim_not_before(spread, &sourced), None, "sourced");
    }

    #[test]
    fn the_watchdog_waits_out_the_claim_the_handler_and_commit() {
        let timeout = Some(Duration::from_secs(10));
        // The claim, the handler (a batch's calls together), COMMIT, and
        // the margin.
        assert_eq!(watchdog(timeout), Some(Duration::from_secs(35)));
        assert_eq!(watchdog(None), None);
        assert_eq!(watchdog(Some(Duration::MAX)), Some(Duration::MAX));
    }
}
