//! The router: binds handlers to durable consumers and runs them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{self, PullConsumer, pull};
use sqlx::PgPool;
use tokio::task::JoinSet;

use crate::consume::health::Health;
use crate::consume::heartbeat::Heartbeats;
use crate::consume::pipeline::Pipeline;
use crate::consume::reply::{BindReply, BoundReply, Serve};
use crate::consume::undeliverable;
use crate::error::Error;
use crate::handler::{Handler, IntoHandler};
use crate::observe::stats::Stats;
use crate::outbox::{Relay, RelayStats};
use crate::reply::ReplyRoute;
use crate::route::Route;
use crate::store::schema;
use crate::store::transaction::Begin;
use crate::tasks::{self, Signal, Trigger};

mod poll;

/// Binds handlers to JetStream durable pull consumers.
///
/// `S` is the application state its handlers take parts of with
/// [`State<T>`](crate::State), as in axum: start with
/// [`Router::with_state`]; a router whose handlers take no state is
/// [`Router::new`], a `Router<()>`.
///
/// ```no_run
/// # use idem_runtime::{Route, Router, idempotent};
/// # #[derive(serde::Deserialize)] struct Credit {}
/// # #[idempotent] async fn credit(tx: &mut sqlx::PgTransaction<'_>, c: Credit) -> Result<(), sqlx::Error> { Ok(()) }
/// # async fn run(nats: async_nats::Client, pool: sqlx::PgPool) -> Result<(), idem_runtime::Error> {
/// Router::new()
///     .route(Route::new("LEDGER", "credit").filter_subject("ledger.credit"), credit)
///     .run(nats, pool) // until Ctrl-C or SIGTERM
///     .await
/// # }
/// ```
pub struct Router<S = ()> {
    state: Arc<S>,
    routes: Vec<Box<dyn Bind>>,
    /// The request/reply routes.
    replies: Vec<Box<dyn BindReply>>,
    stats: HashMap<String, Arc<Stats>>,
    trigger: Trigger,
    signal: Signal,
    grace: Duration,
    /// The outbox relay run beside the handlers, if any.
    relay: Option<Relay>,
    #[cfg(feature = "fault-injection")]
    faults: crate::fault::FaultHooks,
}

/// Reads a running router's counters and stops it.
#[derive(Debug, Clone)]
pub struct RouterHandle {
    stats: Arc<HashMap<String, Arc<Stats>>>,
    relay: Option<RelayStats>,
    trigger: Trigger,
}

impl RouterHandle {
    /// The counters of the route bound to durable consumer `durable`, or of
    /// the request route ([`ReplyRoute`]) on subject `durable`.
    pub fn stats(&self, durable: &str) -> Option<Arc<Stats>> {
        self.stats.get(durable).cloned()
    }

    /// The counters of the outbox relay run beside the router
    /// ([`Router::relay`]), with the outbox's lag: rows pending and the age
    /// of the oldest ([`RelayStats::lag`]). `None` without a relay.
    pub fn relay(&self) -> Option<RelayStats> {
        self.relay.clone()
    }

    /// Starts a graceful shutdown: stop pulling, finish and ack in-flight
    /// messages, then return from `run`.
    pub fn shutdown(&self) {
        self.trigger.fire();
    }
}

impl Default for Router {
    fn default() -> Self {
        Self::new()
    }
}

impl Router {
    /// A router with no routes, whose handlers take no state.
    pub fn new() -> Self {
        Self::with_state(())
    }
}

impl<S: Send + Sync + 'static> Router<S> {
    /// A router whose handlers take parts of `state` with
    /// [`State<T>`](crate::State) (through [`FromRef`](crate::FromRef)).
    ///
    /// ```
    /// use idem_runtime::{FromRef, Route, Router, State, idempotent};
    ///
    /// #[derive(Clone, FromRef)]
    /// struct App {
    ///     fee: Fee,
    /// }
    /// #[derive(Clone, Copy)]
    /// struct Fee(i64);
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Charge { account: i64 }
    ///
    /// #[idempotent(name = "charge-v1")]
    /// async fn charge(
    ///     tx: &mut sqlx::PgTransaction<'_>,
    ///     State(Fee(fee)): State<Fee>,
    ///     cmd: Charge,
    /// ) -> Result<(), sqlx::Error> {
    ///     sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = $2")
    ///         .bind(fee)
    ///         .bind(cmd.account)
    ///         .execute(&mut **tx)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// let router = Router::with_state(App { fee: Fee(5) })
    ///     .route(Route::new("BILLING", "charge"), charge);
    /// # drop(router);
    /// ```
    pub fn with_state(state: S) -> Self {
        let (trigger, signal) = tasks::channel();
        Self {
            state: Arc::new(state),
            routes: Vec::new(),
            replies: Vec::new(),
            stats: HashMap::new(),
            trigger,
            signal,
            grace: Duration::from_secs(30),
            relay: None,
            #[cfg(feature = "fault-injection")]
            faults: Default::default(),
        }
    }

    /// Runs `handler` for every message of `route`'s durable consumer:
    /// the name of an `#[idempotent]` fn, or a value that implements
    /// [`Handler<S>`](Handler).
    pub fn route<M>(mut self, route: Route, handler: impl IntoHandler<S, M>) -> Self {
        let handler = handler.into_handler();
        let stats = Arc::new(Stats::default());
        self.stats
            .entry(route.durable.clone())
            .or_insert_with(|| stats.clone());
        self.routes.push(Box::new(Bound {
            route,
            handler,
            stats,
            state: self.state.clone(),
        }));
        self
    }

    /// Runs `handler` for every partition's route of a partitioned consumer
    /// ([`Partitions::routes`](crate::route::partition::Partitions::routes)): the
    /// routes share the handler, and with it its dedup rows, as one
    /// consumer would. See [`crate::route::partition`].
    pub fn route_partitions<M>(
        mut self,
        routes: impl IntoIterator<Item = Route>,
        handler: impl IntoHandler<S, M> + Clone,
    ) -> Self {
        for route in routes {
            self = self.route(route, handler.clone());
        }
        self
    }

    /// Answers the core NATS requests sent to `route`'s subject with
    /// `handler`, effectively once per message id: the reply is the value
    /// the handler returned (encoded by its codec), and a retried request
    /// gets the first reply without running the handler again. Its claims
    /// are keyed under the route's name (default: its subject), not the
    /// handler's, so that versions of the handler share them. See
    /// [`ReplyRoute`] for the message id, the error replies, retention and
    /// shutdown.
    ///
    /// Its counters are under the route's subject in
    /// [`RouterHandle::stats`].
    pub fn reply_route<M>(mut self, route: ReplyRoute, handler: impl IntoHandler<S, M>) -> Self {
        let handler = handler.into_handler();
        let stats = Arc::new(Stats::default());
        self.stats
            .entry(route.subject.clone())
            .or_insert_with(|| stats.clone());
        self.replies.push(Box::new(BoundReply {
            route,
            handler,
            stats,
            state: self.state.clone(),
        }));
        self
    }

    /// How long shutdown waits for in-flight messages (default 30 s). Those
    /// still running then are cancelled: their connections are closed (a
    /// cancelled BEGIN or COMMIT could leave a connection inside a
    /// transaction, sqlx#4393), never returned to the pool, and the pool
    /// itself, which is the application's, stays open. Their messages are
    /// redelivered after ack_wait, and the claim keeps them to one effect.
    /// `run` returns within the grace period plus a few seconds; with a
    /// [relay](Router::relay), which then gets a grace period of its own to
    /// stop, within twice that.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Runs `relay` beside the handlers, so that the messages they queue in
    /// the [outbox](crate::outbox) are published. It starts once the routes
    /// are bound and stops after they have settled their last message at
    /// shutdown (finishing the cycle it is in), so what the last handlers
    /// queued goes out before `run` returns, unless NATS is away: then the
    /// rows stay in the outbox for the next start or another relay.
    ///
    /// Its counters and the outbox's lag are in [`RouterHandle::relay`].
    pub fn relay(mut self, relay: Relay) -> Self {
        self.relay = Some(relay);
        self
    }

    /// Installs fault-injection hooks (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn fault_hooks(mut self, faults: crate::fault::FaultHooks) -> Self {
        self.faults = faults;
        self
    }

    /// A handle to read counters and stop the router. Take it after adding
    /// the routes.
    pub fn handle(&self) -> RouterHandle {
        RouterHandle {
            stats: Arc::new(self.stats.clone()),
            relay: self.relay.as_ref().map(Relay::stats),
            trigger: self.trigger.clone(),
        }
    }

    /// Runs until Ctrl-C or SIGTERM, then shuts down gracefully.
    ///
    /// NATS or PostgreSQL may be down when it starts: it waits for them (see
    /// [`Router::run_until`]), provided the client and the pool can be made
    /// without them, with
    /// [`async_nats::ConnectOptions::retry_on_initial_connect`] and
    /// [`PgPoolOptions::connect_lazy`](sqlx::postgres::PgPoolOptions::connect_lazy):
    ///
    /// ```no_run
    /// # use idem_runtime::{Route, Router, idempotent};
    /// # #[derive(serde::Deserialize)] struct Credit {}
    /// # #[idempotent] async fn credit(tx: &mut sqlx::PgTransaction<'_>, c: Credit) -> Result<(), sqlx::Error> { Ok(()) }
    /// # async fn start() -> Result<(), Box<dyn std::error::Error>> {
    /// let nats = async_nats::ConnectOptions::new()
    ///     .retry_on_initial_connect() // a client at once, connected when the server is up
    ///     .connect("nats://127.0.0.1:4222")
    ///     .await?;
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .max_connections(20)
    ///     .connect_lazy("postgres://app@127.0.0.1/app")?; // connects on first use
    /// Router::new()
    ///     .route(Route::new("LEDGER", "credit"), credit)
    ///     .run(nats, pool)
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run(self, nats: async_nats::Client, pool: PgPool) -> Result<(), Error> {
        // Aborted when `run` returns, or when its future is dropped.
        let _listener = tasks::Owned(tasks::fire_on_os_signal(self.trigger.clone()));
        self.run_until(nats, pool, std::future::pending()).await
    }

    /// Runs until `shutdown` resolves (or [`RouterHandle::shutdown`] is
    /// called), then stops pulling, lets in-flight messages finish and ack,
    /// and returns.
    ///
    /// Start-up fails, before any message is taken, if a route is
    /// misconfigured, the dedup schema is missing, a stream is missing, a
    /// route's retention is below its [retention floor](crate::retention::floor)
    /// on its stream (a reply route's: below its client-retry horizon plus
    /// a transaction), or two reply routes' subjects overlap.
    ///
    /// If a server cannot be reached at start-up (no PostgreSQL, no NATS,
    /// JetStream not answering), start-up is tried again, with a pause that
    /// grows from 0.5 s to 30 s and a warning that names what is down, until
    /// it succeeds or the router is shut down (then `run_until` returns
    /// `Ok(())`). An attempt is never cut short, so a shutdown during one
    /// waits for it to fail: up to the pool's `acquire_timeout`, or the
    /// JetStream requests' timeout. See [`Router::run`] for a client and a
    /// pool that can be made while their servers are down.
    ///
    /// Dropping the returned future stops everything the router started:
    /// its routes' tasks, the purge and the metrics poll are aborted (their
    /// connections closed or checked by the pool), and the relay stops after
    /// the cycle it is in. Messages in flight are redelivered after
    /// ack_wait, as after a crash.
    pub async fn run_until(
        self,
        nats: async_nats::Client,
        pool: PgPool,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let mut durables = std::collections::HashSet::new();
        let mut handlers = HashMap::new();
        for bound in &self.routes {
            let route = bound.route();
            route.validate()?;
            if !durables.insert((route.stream.clone(), route.durable.clone())) {
                return Err(Error::DuplicateRoute(route.durable.clone()));
            }
            let name = bound.handler_name();
            if name.is_empty() || name.contains(|c: char| c.is_control()) {
                return Err(Error::Config {
                    route: route.durable.clone(),
                    reason: format!(
                        "the handler name {name:?} is empty or holds a control character; it is stored with every claim and sent in dead-letter headers"
                    ),
                });
            }
            // The partitions of one consumer share its handler, and with it
            // its dedup rows, as one consumer would.
            let partition_of = |durable: &str| {
                self.routes
                    .iter()
                    .find(|b| b.route().durable == durable)
                    .and_then(|b| b.route().partition_of.clone())
            };
            if let Some(other) = handlers.insert(name, route.durable.clone())
                && (route.partition_of.is_none() || partition_of(&other) != route.partition_of)
            {
                return Err(Error::Config {
                    route: route.durable.clone(),
                    reason: format!(
                        "the handler name `{name}` is also used by route `{other}`: two handlers with one name share dedup rows, so a message processed by one would be skipped by the other; give each a name of its own (`#[idempotent(name = ...)]`)"
                    ),
                });
            }
        }
        // A reply route's claims are keyed under its own name, not its
        // handler's (see reply.rs): it is the name, and the subject, that
        // must not be shared.
        for (n, reply) in self.replies.iter().enumerate() {
            let route = reply.route();
            route.validate()?;
            let subject = &route.subject;
            let name = reply.handler_name();
            if name.is_empty() || name.contains(|c: char| c.is_control()) {
                return Err(Error::Config {
                    route: subject.clone(),
                    reason: format!(
                        "the handler name {name:?} is empty or holds a control character; it is sent in logs and traces"
                    ),
                });
            }
            let claims_under = route.dedup_name();
            if let Some(other) = handlers.get(claims_under.as_str()) {
                return Err(Error::Config {
                    route: subject.clone(),
                    reason: format!(
                        "the reply route's claims are keyed under `{claims_under}`, the handler name of route `{other}`: they would share dedup rows; name the route (`ReplyRoute::name`) or the handler apart"
                    ),
                });
            }
            for earlier in self.replies[..n].iter().map(|earlier| earlier.route()) {
                if earlier.dedup_name() == claims_under {
                    return Err(Error::Config {
                        route: subject.clone(),
                        reason: format!(
                            "reply routes `{}` and `{subject}` are both named `{}`: they would share claims and a queue group; give each a name of its own (`ReplyRoute::name`)",
                            earlier.subject,
                            route.route_name()
                        ),
                    });
                }
                if crate::reply::subjects_overlap(&earlier.subject, subject) {
                    return Err(Error::Config {
                        route: subject.clone(),
                        reason: format!(
                            "its subject overlaps that of reply route `{}`: a request to a subject both match would be taken by both and run under two names; give the routes subjects that do not overlap",
                            earlier.subject
                        ),
                    });
                }
            }
        }
        let in_flight: usize = self
            .routes
            .iter()
            .map(|bound| bound.route().concurrency)
            .chain(self.replies.iter().map(|reply| reply.route().concurrency))
            .sum();
        // A relay holds its LISTEN connection and takes one per cycle in
        // each of its two lanes (fresh rows, failing rows due again).
        let relay_connections = if self.relay.is_some() { 3 } else { 0 };
        let pool_size = pool.options().get_max_connections() as usize;
        if pool_size < in_flight + relay_connections {
            tracing::warn!(
                pool_size,
                in_flight,
                relay_connections,
                "the pool has fewer connections than the routes' messages (or batches) in flight plus the outbox relay's; messages wait for connections, and a wait past the pool's acquire timeout holds them as if the database were away"
            );
        }
        let js = jetstream::new(nats.clone());
        crate::observe::metrics::describe();
        let mut shutdown = std::pin::pin!(shutdown);
        let Some(SetUp {
            session,
            consumers,
            handler_ids,
            requests,
        }) = self.start_up(&pool, &js, &nats, shutdown.as_mut()).await?
        else {
            tracing::info!("shut down during start-up, before any message was taken");
            return Ok(());
        };
        let bound: Vec<_> = self.routes.into_iter().zip(consumers).collect();
        // Claims of routes with a retention expire: the purge runs beside
        // the router (one at a time across all routers, see expiry.rs).
        let purging = bound
            .iter()
            .filter_map(|(route, _)| route.route().retention)
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
                        crate::retention::expiry::purge_interval(retention),
                        self.signal.clone(),
                    ),
                ))
            });
        let serving: Vec<_> = self.replies.into_iter().zip(requests).collect();
        // Each route may keep at most its share of the pool's connections
        // between messages (see connections.rs).
        let routes = bound.len() + serving.len();
        let share = (pool.options().get_max_connections() as usize / routes.max(1)).max(1);
        // The consumers' and the outbox's gauges, polled beside the routes;
        // the task ends by itself at shutdown.
        let polled = bound
            .iter()
            .map(|(route, (consumer, ..))| (route.route().durable.clone(), consumer.clone()));
        let _polling = tasks::Owned(tokio::spawn(poll::poll(
            polled.collect(),
            pool.clone(),
            self.signal.clone(),
        )));
        // Dropped with this future, the set aborts every route's task.
        let mut running = JoinSet::new();
        for (route, (consumer, advisories, copy_spread)) in bound {
            tracing::info!(
                route = route.route().durable,
                stream = route.route().stream,
                "route started"
            );
            let handler_id = handler_ids[route.handler_name()];
            running.spawn(route.start(Start {
                handler_id,
                consumer,
                advisories,
                copy_spread,
                js: js.clone(),
                nats: nats.clone(),
                pool: pool.clone(),
                keep_connections: share,
                session,
                shutdown: self.signal.clone(),
                grace: self.grace,
                #[cfg(feature = "fault-injection")]
                faults: self.faults.clone(),
            }));
        }

        for (reply, (requests, group)) in serving {
            let subject = reply.route().subject.clone();
            tracing::info!(subject, queue_group = group, "request route started");
            let handler_id = handler_ids[&reply.route().dedup_name()];
            running.spawn(reply.start(
                requests,
                Serve {
                    handler_id,
                    nats: nats.clone(),
                    pool: pool.clone(),
                    keep_connections: share,
                    session,
                    shutdown: self.signal.clone(),
                    grace: self.grace,
                    #[cfg(feature = "fault-injection")]
                    faults: self.faults.clone(),
                },
            ));
        }

        // Stopped only after the routes have settled (below), so that it
        // publishes what their last messages queued. Not aborted if this
        // future is dropped: the dropped sender stops it after its cycle,
        // which is never cut short (sqlx#4393).
        let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
        let relaying = self.relay.map(|relay| {
            tracing::info!("outbox relay started");
            tokio::spawn(relay.run_until(nats.clone(), pool.clone(), async {
                let _ = relay_stopped.await;
            }))
        });

        let mut stopped = self.signal.clone();
        let client_gone = tokio::select! {
            _ = shutdown.as_mut() => {
                self.trigger.fire();
                false
            }
            _ = stopped.fired() => false,
            _ = client_gone(&nats) => {
                tracing::error!("the NATS client's connection task is gone (async-nats stopped, e.g. on a header it cannot parse); stopping, so that the process can be restarted");
                self.trigger.fire();
                true
            }
        };
        // The purge stops by itself after the run it is in (it checks the
        // signal between runs); it is waited for last, within the grace
        // period counted from here.
        let shutdown_began = tokio::time::Instant::now();
        tracing::info!("shutting down: no new messages; waiting for in-flight ones");
        let mut abandoned = 0;
        while let Some(finished) = running.join_next().await {
            match finished {
                Ok(count) => abandoned += count,
                Err(error) => tracing::error!(%error, "a route task failed"),
            }
        }
        if abandoned > 0 {
            tracing::error!(
                abandoned,
                "messages were abandoned at shutdown; their connections were closed, and JetStream redelivers them after ack_wait"
            );
        }
        let _ = stop_relay.send(());
        if let Some(relaying) = relaying {
            // The relay checks for the stop between cycles, and a cycle in
            // progress runs to its COMMIT (never cut short: sqlx#4393). A
            // cycle can outlast the grace period (its database away, its
            // PubAcks timing out): then it is left to finish on its own,
            // not cancelled, and what it did not delete stays pending.
            match tokio::time::timeout(self.grace, relaying).await {
                Ok(Ok(Ok(()))) => tracing::info!("outbox relay stopped"),
                Ok(Ok(Err(error))) => {
                    tracing::error!(%error, "the outbox relay stopped; its rows stay pending for the next relay")
                }
                Ok(Err(error)) => tracing::error!(%error, "the outbox relay task failed"),
                Err(_) => tracing::warn!(
                    grace_ms = self.grace.as_millis() as u64,
                    "the outbox relay did not stop within the grace period; left to finish its cycle, its rows stay pending for the next relay"
                ),
            }
        }
        if let Some(mut purging) = purging {
            // Not cut short at once: a run cut short leaves its step for the
            // next run to resume, and this one may be about to finish it.
            // Past the grace period it is aborted (its own session: no
            // pooled connection is left halfway through a statement), and
            // the next purge resumes whatever step it has not finished.
            let left = self.grace.saturating_sub(shutdown_began.elapsed());
            match tokio::time::timeout(left, &mut purging.0).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::error!(%error, "the claims purge task failed"),
                Err(_) => tracing::warn!(
                    grace_ms = self.grace.as_millis() as u64,
                    "the claims purge did not finish its run within the grace period; it is stopped, and the next purge resumes whatever step it has not finished"
                ),
            }
        }
        // The final acks, and the NAKs of messages handed back, must reach the
        // server before `run` returns and the process exits. Not a database
        // call, so a bound here is safe; a server that is away cannot be
        // waited for.
        if tokio::time::timeout(FLUSH_BOUND, nats.flush())
            .await
            .is_err()
        {
            tracing::warn!(
                "could not flush the final acks to NATS; unacked messages are redelivered and deduplicated"
            );
        }
        tracing::info!("shut down");
        if client_gone {
            return Err(Error::NatsClientGone);
        }
        Ok(())
    }
}

/// What start-up made on the servers, in the order of the router's routes
/// and request routes.
struct SetUp {
    session: crate::store::transaction::Session,
    /// Per route: its consumer, its advisory watcher's consumer, and how far
    /// apart copies of one message can be stored.
    consumers: Vec<(PullConsumer, PullConsumer, Option<Duration>)>,
    handler_ids: HashMap<String, i32>,
    /// Per request route: its subscription and queue group.
    requests: Vec<(async_nats::Subscriber, String)>,
}

impl<S: Send + Sync + 'static> Router<S> {
    /// Sets up what the routes need on the servers ([`Router::set_up`]),
    /// trying again while a server cannot be reached, with a growing pause
    /// and a warning naming it, until it works or the router is shut down
    /// (`None`). Any other failure is returned at once.
    ///
    /// An attempt is never raced against the shutdown, so that no statement
    /// of it is cut off halfway; only the pause between attempts is.
    async fn start_up(
        &self,
        pool: &PgPool,
        js: &jetstream::Context,
        nats: &async_nats::Client,
        mut shutdown: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Result<Option<SetUp>, Error> {
        let mut stopped = self.signal.clone();
        let mut pause = START_UP_FIRST_PAUSE;
        // The durability warnings once, not at every attempt.
        let mut warned = false;
        loop {
            let error = match self.set_up(pool, js, nats, &mut warned).await {
                Ok(set_up) => return Ok(Some(set_up)),
                Err(error) => error,
            };
            let Some(down) = unreachable(&error, js).await else {
                return Err(error);
            };
            crate::observe::metrics::start_up_retry(down.label());
            let holders = if down == Unreachable::HandlersLocked {
                crate::store::claim::handlers_lock_holders(pool)
                    .await
                    .map_or_else(
                        |error| format!("(could not read them: {error})"),
                        |holders| holders.join("; "),
                    )
            } else {
                String::new()
            };
            tracing::warn!(
                %error,
                holders,
                retry_in_ms = pause.as_millis() as u64,
                "{} at start-up; the router takes no message until it can set up its routes, and tries again until then or until it is shut down",
                down.describe()
            );
            tokio::select! {
                _ = shutdown.as_mut() => {
                    self.trigger.fire();
                    return Ok(None);
                }
                _ = stopped.fired() => return Ok(None),
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(START_UP_MAX_PAUSE);
        }
    }

    /// One attempt at what start-up needs on the servers: the dedup schema,
    /// the sessions' settings, each route's dead-letter stream, advisory
    /// watcher and consumer, the handlers' registration, and the request
    /// routes' subscriptions. Every step can be repeated: a later attempt
    /// finds what an earlier one made. The sessions' durability is warned
    /// about unless `warned` (then set), before anything is written: with
    /// synchronous standbys that are all away, the first write waits.
    async fn set_up(
        &self,
        pool: &PgPool,
        js: &jetstream::Context,
        nats: &async_nats::Client,
        warned: &mut bool,
    ) -> Result<SetUp, Error> {
        schema::verify(pool).await?;
        let session = crate::store::transaction::Session::probe(pool, !*warned).await?;
        *warned = true;
        let mut consumers = Vec::with_capacity(self.routes.len());
        // idem's own streams follow the replicas of the routes' streams.
        let routes: Vec<&Route> = self.routes.iter().map(|route| route.route()).collect();
        let replicas = crate::dead_letter::Replicas::of(js, &routes).await;
        for route in &self.routes {
            crate::dead_letter::ensure_stream(js, route.route(), &replicas).await?;
            // Before the route pulls, so that nothing it gives up on from
            // now on is missed.
            let advisories = undeliverable::bind(js, route.route(), &replicas).await?;
            let (consumer, copy_spread) =
                bind_consumer(js, route.route(), route.handler_name()).await?;
            consumers.push((consumer, advisories, copy_spread));
        }
        // Registered only once every route is bound, which checks its
        // retention floor: a refused route's retention is never recorded
        // (the purge reads the handlers' retentions).
        let reply_names: Vec<String> = self
            .replies
            .iter()
            .map(|reply| reply.route().dedup_name())
            .collect();
        let registered: Vec<(&str, Option<Duration>)> = self
            .routes
            .iter()
            .map(|route| (route.handler_name(), route.route().retention))
            .chain(
                self.replies
                    .iter()
                    .zip(&reply_names)
                    .map(|(reply, name)| (name.as_str(), reply.route().retention)),
            )
            .collect();
        let handler_ids = crate::store::claim::register(pool, &registered).await?;
        // Subscribed once every route could be set up, so that no request
        // waits on a router that does not start.
        let mut requests = Vec::with_capacity(self.replies.len());
        for reply in &self.replies {
            let subject = reply.route().subject.clone();
            let group = reply.route().group().to_owned();
            // Not when a JetStream route of this router registered the name
            // itself.
            if !self
                .routes
                .iter()
                .any(|route| route.handler_name() == reply.handler_name())
            {
                crate::reply::warn_of_claims_under_handler_name(
                    pool,
                    reply.route(),
                    reply.handler_name(),
                )
                .await;
            }
            let subscription = nats
                .queue_subscribe(subject.clone(), group.clone())
                .await
                .map_err(|source| Error::Subscribe {
                    subject,
                    source: source.into(),
                })?;
            requests.push((subscription, group));
        }
        Ok(SetUp {
            session,
            consumers,
            handler_ids,
            requests,
        })
    }
}

/// The first pause between two start-up attempts; it doubles up to
/// [`START_UP_MAX_PAUSE`].
const START_UP_FIRST_PAUSE: Duration = Duration::from_millis(500);

/// The longest pause between two start-up attempts.
const START_UP_MAX_PAUSE: Duration = Duration::from_secs(30);

/// A server that start-up could not reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreachable {
    /// No connection to PostgreSQL, or it is starting or stopping.
    Postgres,
    /// NATS is not connected, or JetStream does not answer.
    Nats,
    /// PostgreSQL answers, but registering the handlers waited past its
    /// lock timeout for a lock on `idem_handlers` another session holds (a
    /// transaction left open after an `UPDATE` of it, say).
    HandlersLocked,
}

impl Unreachable {
    /// Its label on [`crate::observe::metrics::STARTUP_RETRIES`].
    pub(crate) fn label(self) -> &'static str {
        match self {
            Unreachable::Postgres | Unreachable::HandlersLocked => "postgresql",
            Unreachable::Nats => "nats",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Unreachable::Postgres => "PostgreSQL cannot be reached",
            Unreachable::Nats => "NATS (JetStream) does not answer",
            Unreachable::HandlersLocked => {
                "another session holds a lock on idem_handlers (a transaction left open?), so the handlers cannot be registered"
            }
        }
    }
}

/// Which server `error` says could not be reached, if it says so: then
/// retrying can help. A failure the servers answered (a missing stream or
/// schema, a consumer conflict, a refused setting) cannot, and is `None`.
///
/// A JetStream error that is not itself a timeout or a missing responder
/// counts as one if JetStream does not answer an account-info request now:
/// some errors (a dead-letter stream looked up by subject) do not keep
/// their cause.
async fn unreachable(error: &Error, js: &jetstream::Context) -> Option<Unreachable> {
    let nats_source = match error {
        Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
            return Some(Unreachable::HandlersLocked);
        }
        Error::Database(error) => {
            return database_unreachable(error).then_some(Unreachable::Postgres);
        }
        Error::JetStream { source, .. }
        | Error::StreamMissing { source, .. }
        | Error::Subscribe { source, .. } => Some(source),
        Error::DeadLetterStreamMissing { .. } => None,
        _ => return None,
    };
    if nats_source.is_some_and(jetstream_unanswered) || !jetstream_answers(js).await {
        return Some(Unreachable::Nats);
    }
    None
}

/// Whether a database error means the server cannot be reached (or is
/// starting up, or shutting down), rather than an answer to what was asked.
fn database_unreachable(error: &sqlx::Error) -> bool {
    match error {
        // The pool could not connect within its acquire timeout.
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // connection exception; too many connections; shutting down,
            // crashed, starting up
            code.starts_with("08") || matches!(&*code, "53300" | "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Whether a JetStream error is a request that got no answer: a timeout,
/// no responders (JetStream not enabled yet), or a request the client could
/// not make.
fn jetstream_unanswered(source: &async_nats::Error) -> bool {
    use async_nats::jetstream::context::{
        ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
        GetStreamError, GetStreamErrorKind, RequestError, RequestErrorKind,
    };
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    if let Some(error) = source.downcast_ref::<CreateStreamError>() {
        return matches!(
            error.kind(),
            CreateStreamErrorKind::TimedOut
                | CreateStreamErrorKind::JetStreamUnavailable
                | CreateStreamErrorKind::Response
        );
    }
    if let Some(error) = source.downcast_ref::<GetStreamError>() {
        return matches!(error.kind(), GetStreamErrorKind::Request);
    }
    if let Some(error) = source.downcast_ref::<RequestError>() {
        return matches!(
            error.kind(),
            RequestErrorKind::TimedOut | RequestErrorKind::NoResponders | RequestErrorKind::Other
        );
    }
    if let Some(error) = source.downcast_ref::<ConsumerInfoError>() {
        return matches!(
            error.kind(),
            ConsumerInfoErrorKind::TimedOut
                | ConsumerInfoErrorKind::NoResponders
                | ConsumerInfoErrorKind::Request
        );
    }
    if let Some(error) = source.downcast_ref::<ConsumerError>() {
        return matches!(
            error.kind(),
            ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request
        );
    }
    false
}

/// Whether JetStream answers now: an account-info request gets a reply,
/// even one that is an error of JetStream's own.
async fn jetstream_answers(js: &jetstream::Context) -> bool {
    use async_nats::jetstream::context::AccountErrorKind;
    match js.query_account().await {
        Ok(_) => true,
        Err(error) => matches!(error.kind(), AccountErrorKind::JetStream(_)),
    }
}

/// Resolves once the NATS client's connection task has stopped for good: a
/// flush cannot even be queued. (While it reconnects, a flush is queued and
/// waits; that is not gone.)
async fn client_gone(nats: &async_nats::Client) {
    let mut checks = tokio::time::interval(CLIENT_CHECK);
    loop {
        checks.tick().await;
        let flushed = tokio::time::timeout(CLIENT_CHECK, nats.flush()).await;
        if let Ok(Err(error)) = flushed
            && error.kind() == async_nats::client::FlushErrorKind::SendError
        {
            return;
        }
    }
}

/// How often the router checks that its NATS client still runs.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// How long `run` waits, at the end, for its final acks to reach NATS.
const FLUSH_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// Creates or updates the stream (if asked) and the durable consumer.
async fn bind_consumer(
    js: &jetstream::Context,
    route: &Route,
    handler: &str,
) -> Result<(PullConsumer, Option<Duration>), Error> {
    let jetstream_error = |source: async_nats::Error| Error::JetStream {
        route: route.durable.clone(),
        source,
    };
    let stream = match &route.create_stream {
        Some(config) => {
            js.create_or_update_stream(config.clone())
                .await
                .map_err(|e| jetstream_error(e.into()))?;
            js.get_stream(&route.stream)
                .await
                .map_err(|e| jetstream_error(e.into()))?
        }
        None => js
            .get_stream(&route.stream)
            .await
            .map_err(|source| Error::StreamMissing {
                stream: route.stream.clone(),
                source: source.into(),
            })?,
    };
    // A route whose retention does not cover its floor is refused before
    // its consumer is touched; the consumer records the retention, for the
    // route's dead letters to copy (see dead_letter.rs).
    let floor = crate::retention::floor::judge(
        &route.durable,
        route.retention,
        route.retention_floor(&stream.cached_info().config),
    )?;
    let mut wanted = route.consumer_config();
    // And its handler and dead letters, for operators (see status.rs).
    wanted
        .metadata
        .extend(crate::route::metadata::consumer_metadata(
            route, handler, &floor,
        ));
    if !route.update_consumer
        && let Ok(existing) = stream.consumer_info(&route.durable).await
    {
        // `get_or_create_consumer` would silently keep the old settings, and
        // `create_consumer` would silently overwrite another deployment's.
        let differences = consumer_differences(&existing.config, &wanted);
        if !differences.is_empty() {
            return Err(Error::ConsumerConflict {
                route: route.durable.clone(),
                differences: differences.join(", "),
            });
        }
    }
    // Creates the consumer, or (with `update_consumer`) updates it.
    let consumer = stream
        .create_consumer(wanted)
        .await
        .map_err(|e| jetstream_error(e.into()))?;
    Ok((consumer, floor.declared_copy_spread()))
}

/// The settings the route cares about that differ, as `field: existing -> wanted`.
fn consumer_differences(existing: &consumer::Config, wanted: &pull::Config) -> Vec<String> {
    let mut differences = Vec::new();
    let mut compare = |field: &str, existing: String, wanted: String| {
        if existing != wanted {
            differences.push(format!("{field}: {existing} -> {wanted}"));
        }
    };
    compare(
        "ack_policy",
        format!("{:?}", existing.ack_policy),
        format!("{:?}", wanted.ack_policy),
    );
    compare(
        "ack_wait",
        format!("{:?}", existing.ack_wait),
        format!("{:?}", wanted.ack_wait),
    );
    compare(
        "max_deliver",
        existing.max_deliver.to_string(),
        wanted.max_deliver.to_string(),
    );
    compare(
        "max_ack_pending",
        existing.max_ack_pending.to_string(),
        wanted.max_ack_pending.to_string(),
    );
    compare(
        "deliver_policy",
        format!("{:?}", existing.deliver_policy),
        format!("{:?}", wanted.deliver_policy),
    );
    let filters = |one: &str, many: &[String]| {
        let mut all: Vec<String> = many.to_vec();
        if !one.is_empty() {
            all.push(one.to_owned());
        }
        all.sort();
        format!("{all:?}")
    };
    compare(
        "filter_subjects",
        filters(&existing.filter_subject, &existing.filter_subjects),
        filters(&wanted.filter_subject, &wanted.filter_subjects),
    );
    differences
}

/// What a route needs to start.
struct Start {
    handler_id: i32,
    consumer: PullConsumer,
    advisories: PullConsumer,
    /// How far apart copies of one message can be stored, where the route
    /// declares it (see `Pipeline::copy_spread`).
    copy_spread: Option<Duration>,
    js: jetstream::Context,
    nats: async_nats::Client,
    pool: PgPool,
    keep_connections: usize,
    session: crate::store::transaction::Session,
    shutdown: Signal,
    grace: Duration,
    #[cfg(feature = "fault-injection")]
    faults: crate::fault::FaultHooks,
}

/// A route with its handler and state, type-erased so one router holds many
/// handlers.
trait Bind: Send + Sync {
    fn route(&self) -> &Route;
    fn handler_name(&self) -> &'static str;
    fn start(
        self: Box<Self>,
        start: Start,
    ) -> std::pin::Pin<Box<dyn Future<Output = usize> + Send>>;
}

struct Bound<H, S> {
    route: Route,
    handler: H,
    stats: Arc<Stats>,
    state: Arc<S>,
}

impl<S: Send + Sync + 'static, H: Handler<S>> Bind for Bound<H, S> {
    fn route(&self) -> &Route {
        &self.route
    }

    fn handler_name(&self) -> &'static str {
        self.handler.name()
    }

    fn start(
        self: Box<Self>,
        start: Start,
    ) -> std::pin::Pin<Box<dyn Future<Output = usize> + Send>> {
        start_route(self.route, self.handler, self.state, self.stats, start)
    }
}

/// Starts one route: its pipeline, its pull loop and its watcher of
/// messages JetStream gave up on.
fn start_route<S: Send + Sync + 'static, H: Handler<S>>(
    route: Route,
    handler: H,
    state: Arc<S>,
    stats: Arc<Stats>,
    start: Start,
) -> std::pin::Pin<Box<dyn Future<Output = usize> + Send>> {
    let begin = Begin::new(route.handler_timeout, start.session);
    let metrics = crate::observe::metrics::RouteMetrics::new(&route.durable);
    let heartbeats = Heartbeats::start(start.nats.clone(), route.heartbeat_interval());
    let pipeline = Arc::new(Pipeline {
        route,
        handler,
        state,
        connections: crate::store::connections::Connections::start(
            start.pool,
            start.keep_connections,
        ),
        heartbeats,
        nats: start.nats,
        begin,
        handler_id: start.handler_id,
        health: Health::new(),
        stats,
        metrics,
        shutdown: start.shutdown.clone(),
        answers: None,
        copy_spread: start.copy_spread,
        #[cfg(feature = "fault-injection")]
        faults: start.faults,
    });
    // Aborted when the route ends, or when its task is (the router's run
    // future dropped).
    let watcher = tasks::Owned(tokio::spawn(undeliverable::watch(
        pipeline.clone(),
        start.js,
        start.advisories,
    )));
    Box::pin(async move {
        let abandoned = crate::consume::pull::pull_until_shutdown(
            start.consumer,
            pipeline,
            start.shutdown,
            start.grace,
        )
        .await;
        drop(watcher);
        abandoned
    })
}
