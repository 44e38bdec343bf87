//! The pull loop: one long-lived pull per route, processed as slots free up.
//!
//! The pull (async-nats's `Consumer::stream`) keeps at most about
//! `concurrency × batch` messages requested ahead, re-requesting at half, and
//! asks for idle heartbeats so that a dead server is noticed: on a missed
//! heartbeat or any other error of the pull, it is dropped and a new one
//! opened. A message is taken off it only once a slot
//! is free, so what waits locally is bounded; one that waited past ack_wait
//! is redelivered, and its claim skips whichever copy comes second.
//!
//! While the route is paused (its database cannot be used, see
//! `health.rs`), the pull is dropped and nothing new is taken until the
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
use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::PullConsumer;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::consume::ack;
use crate::consume::heartbeat::Lease;
use crate::consume::pipeline::Pipeline;
use crate::handler::Handler;
use crate::tasks::Signal;

/// The first pause after the pull failed; it doubles with each failure in a
/// row, up to [`PULL_RETRY_MAX`].
const PULL_RETRY: Duration = Duration::from_millis(100);
const PULL_RETRY_MAX: Duration = Duration::from_secs(5);

/// How long one pull request lives on the server before it is renewed.
const PULL_EXPIRES: Duration = Duration::from_secs(10);

/// How often an idle server must say it is alive; two misses re-issue the
/// pull (after a server restart, say).
const PULL_HEARTBEAT: Duration = Duration::from_secs(2);

/// Pulls and processes messages until shutdown, then waits up to `grace` for
/// in-flight ones. Returns how many it had to abandon.
pub(crate) async fn pull_until_shutdown<S: Send + Sync + 'static, H: Handler<S>>(
    consumer: PullConsumer,
    pipeline: Arc<Pipeline<H, S>>,
    mut shutdown: Signal,
    grace: Duration,
) -> usize {
    let route = &pipeline.route;
    let health = &pipeline.health;
    let slots = Arc::new(Semaphore::new(route.concurrency));
    let mut in_flight = JoinSet::new();
    let mut pull = None;
    let mut parked: VecDeque<(Message, Lease)> = VecDeque::new();
    let mut failures = 0u32;
    'pulling: loop {
        if health.is_paused() {
            // Park what was fetched and not started, and take nothing new
            // until the database answers again.
            for message in unstarted(pull.take()) {
                let lease = pipeline.heartbeats.lease(&message);
                parked.push_back((message, lease));
            }
            tracing::warn!(
                route = route.durable,
                parked = parked.len(),
                "paused: the database cannot be used; messages fetched and not started are kept leased until it can"
            );
            tokio::select! {
                biased;
                _ = shutdown.fired() => break 'pulling,
                _ = health.resumed() => {}
            }
            tracing::info!(route = route.durable, "resumed");
        }
        if !parked.is_empty() {
            // The parked messages first, as slots free up.
            let slot = tokio::select! {
                biased;
                _ = shutdown.fired() => break 'pulling,
                _ = health.paused() => continue 'pulling,
                slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
            };
            while let Some(finished) = in_flight.try_join_next() {
                report_panic(finished);
            }
            let mut group = Vec::with_capacity(route.batch);
            while group.len() < route.batch {
                // Its own lease takes over once it starts; a heartbeat of
                // this one in between is harmless (it is not settled).
                let Some((message, _lease)) = parked.pop_front() else {
                    break;
                };
                group.push(message);
            }
            if route.batch == 1 {
                let message = group.pop().expect("a group has its first message");
                in_flight.spawn(pipeline.clone().process(message, slot));
            } else {
                in_flight.spawn(pipeline.clone().process_batch(group, slot));
            }
            continue 'pulling;
        }
        if failures > 0 {
            let pause = PULL_RETRY
                .saturating_mul(1 << (failures - 1).min(16))
                .min(PULL_RETRY_MAX);
            tokio::select! {
                biased;
                _ = shutdown.fired() => break 'pulling,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        let messages = match &mut pull {
            Some(messages) => messages,
            None => {
                let opened = consumer
                    .stream()
                    .max_messages_per_batch(route.concurrency * route.batch)
                    .expires(PULL_EXPIRES)
                    .heartbeat(PULL_HEARTBEAT)
                    .messages()
                    .await;
                match opened {
                    Ok(messages) => pull.insert(messages),
                    Err(error) => {
                        failures += 1;
                        tracing::warn!(%error, route = route.durable, "pull request failed; retrying");
                        continue 'pulling;
                    }
                }
            }
        };
        // A free slot first, so that a message is taken only when it can
        // start. Shutdown first: with both ready, an unbiased select could go
        // on taking messages after shutdown.
        let slot = tokio::select! {
            biased;
            _ = shutdown.fired() => break 'pulling,
            _ = health.paused() => continue 'pulling,
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        while let Some(finished) = in_flight.try_join_next() {
            report_panic(finished);
        }
        let first = tokio::select! {
            biased;
            _ = shutdown.fired() => break 'pulling,
            _ = health.paused() => continue 'pulling,
            next = messages.next() => match next {
                Some(Ok(message)) => message,
                Some(Err(error)) => {
                    // Missed idle heartbeats, a reconnect, a server-side
                    // limit: open a new pull. Keeping this one can stall it
                    // (after a reconnect the server may still count a pull
                    // request of the dead connection, while the client
                    // waits for deliveries that went into it) until the
                    // request expires.
                    failures += 1;
                    tracing::debug!(%error, route = route.durable, "pull interrupted; opening a new one");
                    pull = None;
                    continue 'pulling;
                }
                None => {
                    failures += 1;
                    tracing::debug!(route = route.durable, "pull ended; opening a new one");
                    pull = None;
                    continue 'pulling;
                }
            },
        };
        failures = 0;
        // Whatever else has already arrived joins the batch; never wait to
        // fill it.
        let mut group = vec![first];
        while group.len() < route.batch {
            match messages.next().now_or_never() {
                Some(Some(Ok(message))) => group.push(message),
                _ => break,
            }
        }
        if route.batch == 1 {
            let message = group.pop().expect("a group has its first message");
            in_flight.spawn(pipeline.clone().process(message, slot));
        } else {
            in_flight.spawn(pipeline.clone().process_batch(group, slot));
        }
    }

    let mut unstarted = unstarted(pull);
    for (message, lease) in parked {
        // No heartbeat may follow its NAK.
        lease.end().await;
        unstarted.push(message);
    }
    hand_back(unstarted, &pipeline.nats).await;
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
    in_flight.shutdown().await;
    abandoned
}

/// What `pull` fetched and did not start; the pull is dropped (unsubscribing),
/// so that the server cannot deliver more into it.
fn unstarted(
    pull: Option<impl futures_util::Stream<Item = Result<Message, impl std::fmt::Debug>> + Unpin>,
) -> Vec<Message> {
    let mut unstarted = Vec::new();
    if let Some(mut messages) = pull {
        while let Some(Some(next)) = messages.next().now_or_never() {
            if let Ok(message) = next {
                unstarted.push(message);
            }
        }
    }
    unstarted
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
