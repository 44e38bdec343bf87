//! The pull loop: one long-lived pull per route, processed as slots free up.
//!
//! The pull (async-nats's `Consumer::stream`) keeps at most about
//! `concurrency × batch` messages requested ahead, re-requesting at half, and
//! sends idle heartbeats so that a dead server is noticed and the pull
//! re-issued after a reconnect. A message is taken off it only once a slot
//! is free, so what waits locally is bounded; one that waited past ack_wait
//! is redelivered, and its claim skips whichever copy comes second.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::ack;
use crate::handler::Handler;
use crate::pipeline::Pipeline;
use crate::shutdown::Signal;

/// How long to wait before pulling again after the server refused a pull.
const PULL_RETRY: Duration = Duration::from_millis(500);

/// How long one pull request lives on the server before it is renewed.
const PULL_EXPIRES: Duration = Duration::from_secs(10);

/// How often an idle server must say it is alive; two misses re-issue the
/// pull (after a server restart, say).
const PULL_HEARTBEAT: Duration = Duration::from_secs(2);

/// Pulls and processes messages until shutdown, then waits up to `grace` for
/// in-flight ones. Returns how many it had to abandon.
pub(crate) async fn pull_until_shutdown<H: Handler>(
    consumer: PullConsumer,
    pipeline: Arc<Pipeline<H>>,
    mut shutdown: Signal,
    grace: Duration,
) -> usize {
    let route = &pipeline.route;
    let slots = Arc::new(Semaphore::new(route.concurrency));
    let mut in_flight = JoinSet::new();
    let mut pull = None;
    'pulling: loop {
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
                        tracing::warn!(%error, route = route.durable, "pull request failed; retrying");
                        tokio::select! {
                            biased;
                            _ = shutdown.fired() => break 'pulling,
                            _ = tokio::time::sleep(PULL_RETRY) => continue 'pulling,
                        }
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
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        while let Some(finished) = in_flight.try_join_next() {
            report_panic(finished);
        }
        let first = tokio::select! {
            biased;
            _ = shutdown.fired() => break 'pulling,
            next = messages.next() => match next {
                Some(Ok(message)) => message,
                Some(Err(error)) => {
                    // Missed heartbeats, a reconnect, a server-side limit:
                    // the pull re-issues itself.
                    tracing::debug!(%error, route = route.durable, "pull interrupted");
                    continue 'pulling;
                }
                None => {
                    tracing::debug!(route = route.durable, "pull ended; opening a new one");
                    pull = None;
                    continue 'pulling;
                }
            },
        };
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

    // Fetched but not started: give them back at once, so another worker
    // takes them without waiting for ack_wait. Unsubscribe first (by
    // dropping the pull), so that the server cannot redeliver them into this
    // pull, and finds no interest left in it.
    let mut unstarted = Vec::new();
    if let Some(mut messages) = pull {
        while let Some(Some(next)) = messages.next().now_or_never() {
            if let Ok(message) = next {
                unstarted.push(message);
            }
        }
    }
    for message in &unstarted {
        ack::nak(message, Duration::ZERO).await;
    }
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

fn report_panic(finished: Result<(), tokio::task::JoinError>) {
    if let Err(error) = finished
        && error.is_panic()
    {
        // The transaction was dropped (rolled back) and the message never
        // acked: JetStream redelivers it after ack_wait.
        tracing::error!(%error, "a handler panicked; its message will be redelivered after ack_wait");
    }
}
