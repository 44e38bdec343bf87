//! The gauges a router polls: each route's consumer (pending and
//! ack-pending messages) and the database's own (PostgreSQL's: the
//! outbox's lag).

use std::future::Future;
use std::pin::Pin;

use async_nats::jetstream::consumer::PullConsumer;

use crate::observe::metrics::{
    CONSUMER_ACK_PENDING, CONSUMER_PAUSED, CONSUMER_PENDING, POLL_INTERVAL, ROUTE_LABEL,
};
use crate::tasks::Signal;

/// One poll of a database's own gauges (PostgreSQL's: the outbox's lag).
pub(super) type PollBeside =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The pool connections the poll uses at once: one, for the outbox's lag.
pub(super) const CONNECTIONS: usize = 1;

/// Reads each route's consumer info and the database's own gauges every
/// [`POLL_INTERVAL`] until shutdown, into the gauges. A read that fails
/// leaves its gauges as they were (and is logged at debug): the next poll
/// tries again. Shutdown is checked between polls only, so that a query is
/// not cut off halfway; a router whose run future is dropped aborts the
/// task (the pool checks a connection it gets back that way).
pub(crate) async fn poll(
    consumers: Vec<(String, PullConsumer)>,
    beside: Option<PollBeside>,
    mut shutdown: Signal,
) {
    let mut consumers: Vec<_> = consumers
        .into_iter()
        .map(|(route, consumer)| Polled {
            pending: metrics::gauge!(CONSUMER_PENDING, ROUTE_LABEL => route.clone()),
            ack_pending: metrics::gauge!(CONSUMER_ACK_PENDING, ROUTE_LABEL => route.clone()),
            paused: metrics::gauge!(CONSUMER_PAUSED, ROUTE_LABEL => route.clone()),
            // Start-up warned about a pause it found.
            warned_for: paused_until(consumer.cached_info()),
            was_paused: consumer.cached_info().paused,
            route,
            consumer,
        })
        .collect();
    loop {
        for polled in &mut consumers {
            match polled.consumer.get_info().await {
                Ok(info) => polled.record(&info),
                Err(error) => tracing::debug!(%error, "consumer info unreadable for metrics"),
            }
        }
        if let Some(beside) = &beside {
            beside().await;
        }
        tokio::select! {
            biased;
            _ = shutdown.fired() => return,
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
}

/// One route's consumer, its gauges, and the pause it was last warned
/// about.
struct Polled {
    route: String,
    consumer: PullConsumer,
    pending: metrics::Gauge,
    ack_pending: metrics::Gauge,
    paused: metrics::Gauge,
    /// The end of the last pause warned about: a pause is known by its end
    /// (`pause_until`), so that one taken, lifted and taken again between
    /// two polls is warned about too.
    warned_for: Option<time::OffsetDateTime>,
    /// Whether it was paused at the last poll.
    was_paused: bool,
}

impl Polled {
    /// Sets the gauges from `info`; warns once about each pause an operator
    /// takes (start-up warned about one it found), and says when the route
    /// is no longer paused.
    fn record(&mut self, info: &async_nats::jetstream::consumer::Info) {
        self.pending.set(info.num_pending as f64);
        self.ack_pending.set(info.num_ack_pending as f64);
        let remaining = info.pause_remaining.filter(|_| info.paused);
        self.paused
            .set(remaining.map_or(0.0, |left| left.as_secs_f64()));
        match paused_until(info) {
            Some(until) if self.warned_for != Some(until) => {
                crate::router::start_up::warn_paused(&self.route, remaining);
                self.warned_for = Some(until);
            }
            None if self.was_paused => tracing::info!(
                route = self.route,
                "the route's consumer is no longer paused: JetStream delivers to it again"
            ),
            _ => {}
        }
        self.was_paused = info.paused;
    }
}

/// When the consumer's pause ends, if it is paused.
fn paused_until(info: &async_nats::jetstream::consumer::Info) -> Option<time::OffsetDateTime> {
    info.config.pause_until.filter(|_| info.paused)
}
