//! The gauges a router polls: each route's consumer (pending and
//! ack-pending messages) and the outbox's lag.

use async_nats::jetstream::consumer::PullConsumer;
use sqlx::PgPool;

use crate::observe::metrics::{CONSUMER_ACK_PENDING, CONSUMER_PENDING, POLL_INTERVAL, ROUTE_LABEL};
use crate::tasks::Signal;

/// The pool connections the poll uses at once: one, for the outbox's lag.
pub(super) const CONNECTIONS: usize = 1;

/// Reads each route's consumer info and the outbox's lag every
/// [`POLL_INTERVAL`] until shutdown, into the gauges. A read that fails
/// leaves its gauges as they were (and is logged at debug): the next poll
/// tries again. Shutdown is checked between polls only, so that a query is
/// not cut off halfway; a router whose run future is dropped aborts the
/// task (the pool checks a connection it gets back that way).
pub(crate) async fn poll(
    consumers: Vec<(String, PullConsumer)>,
    pool: PgPool,
    mut shutdown: Signal,
) {
    let consumers: Vec<_> = consumers
        .into_iter()
        .map(|(route, consumer)| {
            let pending = metrics::gauge!(CONSUMER_PENDING, ROUTE_LABEL => route.clone());
            let ack_pending = metrics::gauge!(CONSUMER_ACK_PENDING, ROUTE_LABEL => route);
            (consumer, pending, ack_pending)
        })
        .collect();
    loop {
        for (consumer, pending, ack_pending) in &consumers {
            match consumer.get_info().await {
                Ok(info) => {
                    pending.set(info.num_pending as f64);
                    ack_pending.set(info.num_ack_pending as f64);
                }
                Err(error) => tracing::debug!(%error, "consumer info unreadable for metrics"),
            }
        }
        match crate::outbox::lag(&pool).await {
            Ok(lag) => crate::outbox::record_lag_gauges(&lag),
            Err(error) => tracing::debug!(%error, "outbox lag unreadable for metrics"),
        }
        tokio::select! {
            biased;
            _ = shutdown.fired() => return,
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
}
