//! The pull loop: fetch only as many messages as there are free slots.
//!
//! A message fetched ahead of a free slot would age against ack_wait while it
//! waits locally, and could be redelivered elsewhere before it starts. So each
//! pull asks for exactly the number of idle slots, and waits for one to free
//! up before asking again.

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

/// How long past its expiry a pull may wait for the server's expiry reply.
const PULL_MARGIN: Duration = Duration::from_millis(500);

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
    loop {
        // Shutdown first: with a free slot ready too, an unbiased select
        // could go on pulling after shutdown.
        let first = tokio::select! {
            biased;
            _ = shutdown.fired() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        let mut free = vec![first];
        while let Ok(slot) = slots.clone().try_acquire_owned() {
            free.push(slot);
        }
        while let Some(finished) = in_flight.try_join_next() {
            report_panic(finished);
        }

        // In batch mode each free slot takes up to `batch` messages.
        let mut pull = match consumer
            .batch()
            .max_messages(free.len() * route.batch)
            .expires(route.pull_expires)
            .messages()
            .await
        {
            Ok(pull) => pull,
            Err(error) => {
                tracing::warn!(%error, route = route.durable, "pull request failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(PULL_RETRY) => continue,
                    _ = shutdown.fired() => break,
                }
            }
        };
        // A pull lasts `pull_expires`; the server's expiry reply ends it. If
        // the server restarted meanwhile that reply never comes, so the pull
        // is also bounded here, and shutdown never waits longer than this.
        let deadline = tokio::time::Instant::now() + route.pull_expires + PULL_MARGIN;
        loop {
            let next = match tokio::time::timeout_at(deadline, pull.next()).await {
                Ok(Some(next)) => next,
                Ok(None) => break,
                Err(_) => {
                    tracing::debug!(
                        route = route.durable,
                        "pull outlived its expiry; pulling again"
                    );
                    break;
                }
            };
            let first = match next {
                Ok(message) => message,
                Err(error) => {
                    tracing::debug!(%error, route = route.durable, "pull ended early");
                    break;
                }
            };
            if shutdown.is_fired() {
                // Fetched but not started: give it back at once, so another
                // worker takes it without waiting for ack_wait.
                ack::nak(&first, Duration::ZERO).await;
                continue;
            }
            // Whatever else has already arrived joins the batch; never wait
            // to fill it.
            let mut group = vec![first];
            while group.len() < route.batch {
                match pull.next().now_or_never() {
                    Some(Some(Ok(message))) => group.push(message),
                    _ => break,
                }
            }
            let slot = match free.pop() {
                Some(slot) => slot,
                // More groups than free slots (messages trickled in): wait
                // for one; a batch takes milliseconds.
                None => slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the slot semaphore is never closed"),
            };
            if route.batch == 1 {
                let message = group.pop().expect("a group has its first message");
                in_flight.spawn(pipeline.clone().process(message, slot));
            } else {
                in_flight.spawn(pipeline.clone().process_batch(group, slot));
            }
        }
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
