//! The pull loop: one long-lived pull per route, processed as slots free up.
//!
//! The pull (`pull_stream.rs`) keeps at most about `concurrency × batch`
//! messages requested ahead (at most the consumer's `max_batch` a
//! request), re-requesting at half, asks again as soon as the client
//! reconnects or a new consumer leader is elected, and asks for idle
//! heartbeats so that a silent server is noticed: then, or on any other
//! error of the pull, it is closed and a new one opened. A message is taken
//! off it only once a slot is free, so what waits locally is bounded; one
//! that waited past ack_wait is redelivered, and its claim skips whichever
//! copy comes second. After a conflict, while the route runs one batch at
//! a time, what was fetched for several batches would wait unleased for
//! every batch before it: it is parked (leased) as it arrives instead.
//!
//! The pull is *closed*, never dropped: when the route pauses, at shutdown,
//! and after an error of the pull. It stops asking and collects what its
//! last requests deliver until the server has ended them all (or they are
//! past their expiry), so that nothing goes into an inbox no one reads (and
//! waits out ack_wait there). What an error's close collects is parked, and
//! started first.
//!
//! While the route is paused (its database cannot be used, see
//! `health.rs`), the pull is closed and nothing new is taken until the
//! database answers again. What it fetched but did not start is *parked*:
//! kept leased by heartbeats, and started first once the route resumes. It
//! is not handed back: a NAK makes the message's next delivery count as
//! one more, so that a database that failed now and then used up the
//! deliveries of messages that never ran, and dead-lettered them as
//! `exhausted`. Parked messages are handed back only at shutdown. Errors of
//! the pull itself (a deleted consumer, a stream error) are retried with a
//! growing pause, never in a tight loop.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::PullConsumer;
use futures_util::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::consume::ack;
use crate::consume::heartbeat::{Lease, Taken};
use crate::consume::pipeline::Pipeline;
use crate::consume::pull_stream::{PullError, PullSignals, PullStream};
use crate::handler::Handler;
use crate::route::Route;
use crate::store::backend::Backend;
use crate::tasks::Signal;

/// The first pause after the pull failed; it doubles with each failure in a
/// row, up to [`PULL_RETRY_MAX`].
const PULL_RETRY: Duration = Duration::from_millis(100);
const PULL_RETRY_MAX: Duration = Duration::from_secs(5);

/// Pulls and processes messages until shutdown, then waits up to `grace` for
/// in-flight ones. Returns how many it had to abandon.
pub(crate) async fn pull_until_shutdown<
    S: Send + Sync + 'static,
    H: Handler<S, DB>,
    DB: Backend,
>(
    consumer: PullConsumer,
    pipeline: Arc<Pipeline<H, S, DB>>,
    shutdown: Signal,
    grace: Duration,
) -> usize {
    let mut puller = Puller {
        parked: VecDeque::new(),
        pull: None,
        in_flight: JoinSet::new(),
        slots: Arc::new(Semaphore::new(pipeline.route.concurrency)),
        shutdown,
        failures: 0,
        signals: PullSignals::new(&pipeline.route),
        refresh_info: false,
        consumer: &consumer,
        pipeline: &pipeline,
    };
    loop {
        if let Err(Cut::Stop) = puller.turn().await {
            break;
        }
    }
    let Puller {
        pull,
        parked,
        in_flight,
        ..
    } = puller;
    // Both at once: the pull's last requests end while in-flight messages
    // finish.
    let ((), abandoned) = tokio::join!(
        give_back_unstarted(pull, parked, &pipeline.nats),
        drain(in_flight, &pipeline.route, grace),
    );
    abandoned
}

/// Why a turn of the pull loop ended before it started a message.
enum Cut {
    /// Start the next turn at once (the route was paused, the pull failed).
    Again,
    /// Shutdown: stop pulling.
    Stop,
}

/// The pull loop's state, from one turn to the next.
///
/// Fields drop in the order declared: should the loop be cancelled, the
/// parked messages' leases end and the pull goes before the tasks in
/// flight are aborted.
struct Puller<'a, H, S, DB: Backend> {
    /// Fetched, not started, and kept leased while the route was paused.
    parked: VecDeque<(Message, Lease)>,
    /// The open pull, if one is.
    pull: Option<PullStream>,
    in_flight: JoinSet<()>,
    /// One permit per message (or batch) being processed.
    slots: Arc<Semaphore>,
    shutdown: Signal,
    /// Failures of the pull in a row.
    failures: u32,
    /// The route's warnings and metrics about its pulls.
    signals: Arc<PullSignals>,
    /// Read the consumer's info again before the next pull opens: its
    /// request limits refused the last one.
    refresh_info: bool,
    consumer: &'a PullConsumer,
    pipeline: &'a Arc<Pipeline<H, S, DB>>,
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Puller<'_, H, S, DB> {
    /// One turn of the pull loop: sits out a pause, starts parked messages
    /// first, backs off after failures of the pull, opens it if it is not,
    /// and starts what it delivers, once a slot is free.
    async fn turn(&mut self) -> Result<(), Cut> {
        if self.pipeline.health.is_paused() {
            self.sit_out_pause().await?;
        }
        if !self.parked.is_empty() {
            return self.start_parked().await;
        }
        if self.failures > 0 {
            self.back_off().await?;
        }
        if self.pull.is_none() {
            self.pull = Some(self.open_pull().await?);
        }
        // A free slot first, so that a message is taken only when it can
        // start.
        let slot = self.free_slot().await?;
        let admitted = self.may_start().await?;
        if !self.parked.is_empty() {
            // Fetched while the route waited: those first.
            self.start_from_parked(slot, admitted);
            return Ok(());
        }
        let messages = self.pull.as_mut().expect("opened above");
        // What the pull asks for follows the batch size: messages fetched
        // ahead are not leased, and must not wait past ack_wait.
        messages.set_batch(request_size(self.pipeline));
        let first = tokio::select! {
            biased;
            _ = self.shutdown.fired() => return Err(Cut::Stop),
            _ = self.pipeline.health.paused() => return Err(Cut::Again),
            next = messages.next() => match next {
                Some(Ok(message)) => message,
                Some(Err(error)) => {
                    self.pull_failed(error).await;
                    return Err(Cut::Again);
                }
                None => {
                    self.pull_failed(PullError::Unsubscribed).await;
                    return Err(Cut::Again);
                }
            },
        };
        self.failures = 0;
        let (group, failed) = gather(first, messages, self.pipeline.sizer.next());
        // The route lets these start now, if it does: what conflicted while
        // this turn waited for messages ran before them, not beside them.
        let admitted = Instant::now();
        if self.pipeline.sizer.must_wait() {
            // Batches conflicted while this turn waited for messages, and
            // one runs: nothing may start beside it, so these wait, leased,
            // and start first once it ends (`start_parked`).
            drop(slot);
            for message in group {
                self.park(message);
            }
            self.park_arrived();
        } else {
            let group = group.into_iter().map(|message| (message, None)).collect();
            self.start(group, slot, admitted);
        }
        if let Some(error) = failed {
            self.pull_failed(error).await;
        }
        Ok(())
    }

    /// The pull failed (a silent server, a deleted consumer, limits that
    /// changed; a reconnect or a leader election is not an error: the pull
    /// asks again by itself). The failure is counted, so that the next pull
    /// opens after a pause; the pull is closed, so that none of its
    /// requests is left on the server where the connection allows; and what
    /// it delivered meanwhile is parked, kept leased, to start first.
    async fn pull_failed(&mut self, error: PullError) {
        let route = &self.pipeline.route;
        self.failures += 1;
        self.refresh_info |= error.needs_fresh_info();
        match &error {
            PullError::Ended(_) | PullError::Limits(_) => {
                tracing::warn!(%error, route = route.durable, "pull ended; opening a new one");
            }
            _ => {
                tracing::debug!(%error, route = route.durable, "pull interrupted; opening a new one")
            }
        }
        for message in close(self.pull.take()).await {
            self.park(message);
        }
    }

    /// Waits until the route may start something: after batches
    /// conflicted, nothing starts beside a running batch (see
    /// `consume/sizing.rs`). Returns when it was let start: a batch let
    /// start before the route ran alone is one of the batches that
    /// conflicted, not one that ran alone. (A turn that then waits for
    /// messages asks again once they come, and takes that time instead.)
    ///
    /// While it waits, what the pull fetched ahead (for several batches,
    /// before the route ran alone) is leased and parked as it arrives:
    /// left in the pull, it would wait unleased for every batch before it,
    /// and could outlive ack_wait.
    async fn may_start(&mut self) -> Result<Instant, Cut> {
        loop {
            let arrival = async {
                match self.pull.as_mut() {
                    Some(pull) => pull.arrival().await,
                    None => std::future::pending().await,
                }
            };
            let arrived = tokio::select! {
                biased;
                _ = self.shutdown.fired() => return Err(Cut::Stop),
                _ = self.pipeline.health.paused() => return Err(Cut::Again),
                () = self.pipeline.sizer.may_start() => return Ok(Instant::now()),
                arrived = arrival => arrived,
            };
            if let Some(message) = arrived {
                self.park(message);
            }
        }
    }

    /// While the route is paused: parks what the pull fetched and did not
    /// start (the pull is dropped), and takes nothing new until the
    /// database answers again. An attempt that gets past its claim resumes
    /// the route; once no attempt is left running (each may end without
    /// one: given up, or decided without a transaction), the loop asks the
    /// database itself, every [`PAUSE_PROBE`], so that a pause never
    /// outlives its cause.
    async fn sit_out_pause(&mut self) -> Result<(), Cut> {
        let pipeline = self.pipeline;
        let (route, health) = (&pipeline.route, &pipeline.health);
        for message in close(self.pull.take()).await {
            self.park(message);
        }
        tracing::warn!(
            route = route.durable,
            parked = self.parked.len(),
            "paused: the database cannot be used; messages fetched and not started are kept leased until it can"
        );
        let resumed = loop {
            let idle = self.in_flight.is_empty();
            tokio::select! {
                biased;
                _ = self.shutdown.fired() => break Err(Cut::Stop),
                _ = health.resumed() => break Ok(()),
                Some(finished) = self.in_flight.join_next(), if !idle => report_panic(finished),
                () = tokio::time::sleep(PAUSE_PROBE), if idle => {
                    let answered = tokio::select! {
                        biased;
                        _ = self.shutdown.fired() => break Err(Cut::Stop),
                        // Bounded: a connection the network dropped without
                        // a word would not answer before TCP gives up.
                        answered = tokio::time::timeout(PAUSE_PROBE * 5, pipeline.database_answers()) => answered.unwrap_or(false),
                    };
                    if answered {
                        tracing::info!(route = route.durable, "the database answers again, and no attempt was left to say so");
                        health.resume();
                    }
                }
            }
        };
        if resumed.is_ok() {
            tracing::info!(route = route.durable, "resumed");
        }
        resumed
    }

    /// Leases `message` and parks it, to start after what is parked already.
    fn park(&mut self, message: Message) {
        let lease = self.pipeline.heartbeats.lease(&message);
        self.parked.push_back((message, lease));
    }

    /// Waits for a free slot. Once the wait has lasted [`PARK_AFTER`] (the
    /// route's slots are all held by work that takes long: handlers that
    /// wait for a row, batches in fallback), what the pull fetched ahead is
    /// leased and parked as it arrives, to start first: left in the pull,
    /// it would wait unleased, and could outlive ack_wait and be handed to
    /// another worker, using up a delivery. Then reaps the tasks that have
    /// finished. Shutdown first: with both ready, an unbiased select could
    /// go on taking messages after shutdown.
    async fn free_slot(&mut self) -> Result<OwnedSemaphorePermit, Cut> {
        let acquire = self.slots.clone().acquire_owned();
        tokio::pin!(acquire);
        let patience = tokio::time::sleep(PARK_AFTER);
        tokio::pin!(patience);
        let mut parking = false;
        let slot = loop {
            let arrival = async {
                match self.pull.as_mut() {
                    Some(pull) if parking => pull.arrival().await,
                    _ => std::future::pending().await,
                }
            };
            let arrived = tokio::select! {
                biased;
                _ = self.shutdown.fired() => return Err(Cut::Stop),
                _ = self.pipeline.health.paused() => return Err(Cut::Again),
                slot = &mut acquire => break slot.expect("the slot semaphore is never closed"),
                () = &mut patience, if !parking => None,
                arrived = arrival => arrived,
            };
            parking = true;
            if let Some(message) = arrived {
                self.park(message);
            }
        };
        while let Some(finished) = self.in_flight.try_join_next() {
            report_panic(finished);
        }
        Ok(slot)
    }

    /// Leases and parks what the pull has received and the route has not
    /// taken (nothing if no pull is open), to start after what is parked
    /// already.
    fn park_arrived(&mut self) {
        let Some(pull) = self.pull.as_mut() else {
            return;
        };
        for message in pull.take_arrived() {
            self.park(message);
        }
    }

    /// Starts the parked messages (a batch of them at most), once a slot is
    /// free.
    async fn start_parked(&mut self) -> Result<(), Cut> {
        // The parked messages first, as slots free up.
        let slot = self.free_slot().await?;
        let admitted = self.may_start().await?;
        self.start_from_parked(slot, admitted);
        Ok(())
    }

    /// Starts a batch of the parked messages at most in `slot`.
    fn start_from_parked(&mut self, slot: OwnedSemaphorePermit, admitted: Instant) {
        let batch = self.pipeline.sizer.next();
        let mut group = Vec::with_capacity(batch);
        while group.len() < batch {
            // Its lease goes with it, and stays its lease until it is
            // settled: no gap in its heartbeats.
            let Some((message, lease)) = self.parked.pop_front() else {
                break;
            };
            group.push((message, Some(lease)));
        }
        self.start(group, slot, admitted);
    }

    /// After failures of the pull in a row, waits a pause that doubles with
    /// each, so that a pull that keeps failing is never retried in a tight
    /// loop.
    async fn back_off(&mut self) -> Result<(), Cut> {
        let pause = PULL_RETRY
            .saturating_mul(1 << (self.failures - 1).min(16))
            .min(PULL_RETRY_MAX);
        tokio::select! {
            biased;
            _ = self.shutdown.fired() => return Err(Cut::Stop),
            _ = tokio::time::sleep(pause) => {}
        }
        Ok(())
    }

    /// Opens the long-lived pull (see the module docs); a failure is
    /// counted, and the next turn tries again.
    async fn open_pull(&mut self) -> Result<PullStream, Cut> {
        let route = &self.pipeline.route;
        let info = if self.refresh_info {
            match self.consumer.get_info().await {
                Ok(info) => {
                    self.refresh_info = false;
                    info
                }
                Err(error) => {
                    self.failures += 1;
                    tracing::warn!(%error, route = route.durable, "reading the consumer's limits failed; retrying");
                    return Err(Cut::Again);
                }
            }
        } else {
            self.consumer.cached_info().clone()
        };
        let opened = PullStream::open(
            &info,
            &self.pipeline.nats,
            request_size(self.pipeline),
            self.signals.clone(),
        )
        .await;
        match opened {
            Ok(messages) => Ok(messages),
            Err(error) => {
                self.failures += 1;
                tracing::warn!(%error, route = route.durable, "pull request failed; retrying");
                Err(Cut::Again)
            }
        }
    }

    /// Spawns the processing of `group` in `slot`: one message alone, or a
    /// batch. On an adaptive route, a message that came alone runs alone.
    /// A parked message comes with its lease.
    fn start(&mut self, mut group: Vec<Taken>, slot: OwnedSemaphorePermit, admitted: Instant) {
        if group.len() == 1 && self.pipeline.sizer.runs_one_alone() {
            let (message, lease) = group.pop().expect("a group has its first message");
            self.in_flight
                .spawn(self.pipeline.clone().process(message, lease, slot));
        } else {
            let counted = self.pipeline.sizer.batch_started();
            self.in_flight.spawn(
                self.pipeline
                    .clone()
                    .process_batch(group, slot, admitted, counted),
            );
        }
    }
}

/// How many messages one pull request of `pipeline`'s route asks for: a
/// batch of the size the next one takes, for every slot that may run one
/// (fewer while conflicts limit the batches at once). An adaptive route
/// asks for more as its batches grow, rather than for its largest size from
/// the start: what it fetches ahead waits unleased, and must be taken
/// before ack_wait.
fn request_size<H, S, DB: Backend>(pipeline: &Pipeline<H, S, DB>) -> usize {
    let slots = match pipeline.sizer.batch_limit() {
        Some(limit) => limit.min(pipeline.route.concurrency),
        None => pipeline.route.concurrency,
    };
    slots * pipeline.sizer.next()
}

/// `first`, and whatever else has already arrived, up to `batch` messages:
/// it never waits to fill the batch. An error of the pull ends the group
/// and comes back with it, to be handled as the pull loop handles one (the
/// pull also keeps returning it).
fn gather(
    first: Message,
    messages: &mut PullStream,
    batch: usize,
) -> (Vec<Message>, Option<PullError>) {
    let mut group = vec![first];
    while group.len() < batch {
        match messages.next().now_or_never() {
            Some(Some(Ok(message))) => group.push(message),
            Some(Some(Err(error))) => return (group, Some(error)),
            _ => break,
        }
    }
    (group, None)
}

/// At shutdown, gives back what was fetched and not started: what the
/// pull holds, and the parked messages, whose leases end first.
async fn give_back_unstarted(
    pull: Option<PullStream>,
    parked: VecDeque<(Message, Lease)>,
    nats: &async_nats::Client,
) {
    let mut unstarted = close(pull).await;
    for (message, lease) in parked {
        // No heartbeat may follow its NAK.
        lease.end().await;
        unstarted.push(message);
    }
    hand_back(unstarted, nats).await;
}

/// Waits up to `grace` for the messages in flight, then cancels the rest
/// (JetStream redelivers them after ack_wait). Returns how many it
/// cancelled.
async fn drain(mut in_flight: JoinSet<()>, route: &Route, grace: Duration) -> usize {
    while let Some(finished) = in_flight.try_join_next() {
        report_panic(finished);
    }
    tracing::info!(
        route = route.durable,
        in_flight = in_flight.len(),
        "stopped pulling; finishing in-flight messages"
    );
    let drained = tokio::time::timeout(grace, async {
        while let Some(finished) = in_flight.join_next().await {
            report_panic(finished);
        }
    })
    .await;
    if drained.is_ok() {
        return 0;
    }
    let abandoned = in_flight.len();
    tracing::error!(
        route = route.durable,
        abandoned,
        ?grace,
        "in-flight messages outlived the shutdown grace period; cancelling them (JetStream redelivers them after ack_wait)"
    );
    cancel(in_flight, &route.durable).await;
    abandoned
}

/// Cancels the tasks of `in_flight` (of the route or reply subject `of`)
/// and waits for them to end, for [`CANCEL_BOUND`] at most: a task ends at
/// its next await once cancelled, and one whose handler blocks its thread
/// (a blocking call in async code) never gets there. Such tasks are left
/// behind with an error, rather than hold shutdown up without end.
pub(crate) async fn cancel(mut in_flight: JoinSet<()>, of: &str) {
    in_flight.abort_all();
    let cancelled = tokio::time::timeout(CANCEL_BOUND, async {
        while let Some(finished) = in_flight.join_next().await {
            report_panic(finished);
        }
    })
    .await;
    if cancelled.is_err() {
        tracing::error!(
            of,
            stuck = in_flight.len(),
            "in-flight work did not stop when cancelled: a handler blocks its thread (a blocking call in async code, never awaited); shutdown goes on without it. Its messages stay leased while it runs (a runtime dropped afterwards waits for its thread)"
        );
        in_flight.detach_all();
    }
}

/// How long cancelled tasks may take to end at shutdown.
const CANCEL_BOUND: Duration = Duration::from_secs(2);

/// How long a pull loop waits for a free slot before it leases what its
/// pull fetched ahead (see `Puller::free_slot`).
const PARK_AFTER: Duration = Duration::from_millis(500);

/// How often a paused route with no attempt running asks whether its
/// database answers again.
const PAUSE_PROBE: Duration = Duration::from_secs(1);

/// Closes `pull`, if one is open: what it fetched and did not start, once no
/// request of it is left on the server (see [`PullStream::close`]).
async fn close(pull: Option<PullStream>) -> Vec<Message> {
    match pull {
        Some(pull) => pull.close().await,
        None => Vec::new(),
    }
}

/// Gives back the messages fetched and not started at shutdown, at once, so
/// another worker takes them without waiting for ack_wait.
///
/// Not while NATS is away: a publish then waits for room in the client's
/// queue, which would hold shutdown up for as long as the outage lasts.
/// Such messages are redelivered after ack_wait instead. The NAKs are
/// bounded in time for the same reason.
async fn hand_back(unstarted: Vec<Message>, nats: &async_nats::Client) {
    if unstarted.is_empty() {
        return;
    }
    if nats.connection_state() != async_nats::connection::State::Connected {
        tracing::warn!(
            messages = unstarted.len(),
            "NATS is away: messages fetched and not started are redelivered after ack_wait"
        );
        return;
    }
    let naks = async {
        for message in &unstarted {
            ack::nak(message, Duration::ZERO).await;
        }
    };
    if tokio::time::timeout(HAND_BACK_BOUND, naks).await.is_err() {
        tracing::warn!(
            "handing messages back took too long; the rest are redelivered after ack_wait"
        );
    }
}

/// How long handing fetched messages back may take.
const HAND_BACK_BOUND: Duration = Duration::from_secs(2);

fn report_panic(finished: Result<(), tokio::task::JoinError>) {
    if let Err(error) = finished
        && error.is_panic()
    {
        // The transaction was dropped (rolled back) and the message never
        // acked: JetStream redelivers it after ack_wait.
        tracing::error!(%error, "a handler panicked; its message will be redelivered after ack_wait");
    }
}
