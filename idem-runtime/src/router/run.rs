//! Running: every part of the router spawned once start-up is done.

use std::time::Duration;

use sqlx::Pool;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

use crate::outbox::{Relay, RelayError};
use crate::store::backend::Backend;
use crate::store::outbox::OutboxStore;

use super::Router;
use super::poll::PollBeside;
use super::start_up::SetUp;
use crate::consume::pipeline::RouteContext;
use crate::store::connections::Connections;
use crate::tasks::{self, Signal, Trigger};

/// What a router runs once started: its routes' tasks, the purge, the
/// metrics poll and the relay; stopped in that order by
/// [`Running::shut_down`].
pub(super) struct Running {
    pub(super) routes: JoinSet<usize>,
    pub(super) purging: Option<tasks::Owned<()>>,
    pub(super) _polling: tasks::Owned<()>,
    pub(super) stop_relay: oneshot::Sender<()>,
    pub(super) relaying: Option<JoinHandle<Result<(), RelayError>>>,
    pub(super) trigger: Trigger,
    pub(super) signal: Signal,
    pub(super) grace: Duration,
}

/// What a database runs beside a router's routes. PostgreSQL's: the
/// outbox's relay, if the router has one, and the outbox's lag, read at
/// every metrics poll. Made by the entry point of the router's database
/// (`Router::run_until` for PostgreSQL), so that the rest of a router's run
/// is the same on every database.
pub(super) struct Beside {
    /// The pool connections the relay may hold.
    pub(super) relay_connections: usize,
    /// Starts the relay; it stops once the receiver fires.
    relay: Option<StartRelay>,
    /// Reads what the poll records beside the consumers' gauges.
    pub(super) poll: Option<PollBeside>,
}

/// Starts a relay that stops once the receiver fires.
type StartRelay =
    Box<dyn FnOnce(oneshot::Receiver<()>) -> JoinHandle<Result<(), RelayError>> + Send>;

impl Beside {
    /// `relay` (if any) on `pool`, and the outbox's lag.
    pub(super) fn outbox<DB: OutboxStore>(
        relay: Option<Relay>,
        nats: &async_nats::Client,
        pool: &Pool<DB>,
    ) -> Self {
        let relay_connections = if relay.is_some() {
            DB::RELAY_CONNECTIONS
        } else {
            0
        };
        let relay = relay.map(|relay| {
            let (nats, pool) = (nats.clone(), pool.clone());
            Box::new(move |stopped: oneshot::Receiver<()>| {
                tokio::spawn(relay.run_until(nats, pool, async {
                    let _ = stopped.await;
                }))
            }) as StartRelay
        });
        let pool = pool.clone();
        let poll: PollBeside = Box::new(move || {
            let pool = pool.clone();
            Box::pin(async move {
                match crate::outbox::lag(&pool).await {
                    Ok(lag) => crate::outbox::record_lag_gauges(&lag),
                    Err(error) => tracing::debug!(%error, "outbox lag unreadable for metrics"),
                }
            })
        });
        Beside {
            relay_connections,
            relay,
            poll: Some(poll),
        }
    }
}

impl<S: Send + Sync + 'static, DB: Backend> Router<S, DB> {
    /// Spawns the purge (if a route keeps claims for a while), the metrics
    /// poll, every route and what the database runs beside them (`beside`:
    /// PostgreSQL's relay).
    pub(super) fn spawn(
        self,
        set_up: SetUp<DB>,
        nats: &async_nats::Client,
        pool: &Pool<DB>,
        beside: Beside,
    ) -> Running {
        let SetUp {
            session,
            sources,
            handler_ids,
            requests,
        } = set_up;
        let purging = self.spawn_purge(pool);
        // One set of connections for every route, handed out in the order
        // messages ask for them (see `store/connections.rs`): as many as
        // the pool has, less what the relay and the metrics poll use, so
        // that messages that keep the pool busy never starve those.
        let reserved = beside.relay_connections + super::poll::CONNECTIONS;
        let pool_size = pool.options().get_max_connections() as usize;
        let turns = pool_size.saturating_sub(reserved);
        let turns = DB::WRITERS_AT_ONCE.map_or(turns, |writers| turns.min(writers));
        let connections = Connections::start(pool.clone(), turns);
        let bound: Vec<_> = self.routes.into_iter().zip(sources).collect();
        let serving: Vec<_> = self.replies.into_iter().zip(requests).collect();
        // The consumers' and the outbox's gauges, polled beside the routes;
        // the task ends by itself at shutdown.
        let polled = bound
            .iter()
            .map(|(route, source)| (route.route().durable.clone(), source.consumer.clone()));
        let _polling = tasks::Owned(tokio::spawn(super::poll::poll(
            polled.collect(),
            beside.poll,
            self.signal.clone(),
        )));
        let context = |handler_id| RouteContext {
            handler_id,
            nats: nats.clone(),
            connections: connections.clone(),
            session,
            shutdown: self.signal.clone(),
            grace: self.grace,
            #[cfg(feature = "fault-injection")]
            faults: self.faults.clone(),
        };
        // Dropped with this future, the set aborts every route's task.
        let mut running = JoinSet::new();
        for (route, source) in bound {
            tracing::info!(
                route = route.route().durable,
                stream = route.route().stream,
                "route started"
            );
            let context = context(handler_ids[route.handler_name()]);
            running.spawn(route.start(context, source));
        }
        for (reply, (requests, group)) in serving {
            let subject = reply.route().subject.clone();
            tracing::info!(subject, queue_group = group, "request route started");
            let handler_id = handler_ids[&reply.route().dedup_name()];
            running.spawn(reply.start(requests, context(handler_id)));
        }

        let (stop_relay, relaying) = spawn_relay(beside.relay);
        Running {
            routes: running,
            purging,
            _polling,
            stop_relay,
            relaying,
            trigger: self.trigger,
            signal: self.signal,
            grace: self.grace,
        }
    }

    /// Claims of routes with a retention expire: the purge runs beside the
    /// router (one at a time across all routers, see `store/purge.rs`),
    /// for the longest retention any route asks for.
    fn spawn_purge(&self, pool: &Pool<DB>) -> Option<tasks::Owned<()>> {
        self.routes
            .iter()
            .filter_map(|route| route.route().retention)
            .chain(
                self.replies
                    .iter()
                    .filter_map(|reply| reply.route().retention),
            )
            .max()
            .map(|retention| {
                tasks::Owned(tokio::spawn(
                    crate::retention::background::run_in_background(
                        pool.clone(),
                        crate::store::purge::purge_interval(retention),
                        self.signal.clone(),
                    ),
                ))
            })
    }
}

/// Spawns the relay, if there is one, with the sender that stops it. It is
/// stopped only after the routes have settled ([`Running::shut_down`]), so
/// that it publishes what their last messages queued. Not aborted if the
/// router's future is dropped: the dropped sender stops it after its
/// cycle, which is never cut short (sqlx#4393).
fn spawn_relay(
    relay: Option<StartRelay>,
) -> (
    oneshot::Sender<()>,
    Option<JoinHandle<Result<(), RelayError>>>,
) {
    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let relaying = relay.map(|start| {
        tracing::info!("outbox relay started");
        start(relay_stopped)
    });
    (stop_relay, relaying)
}
