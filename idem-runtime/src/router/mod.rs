//! The router: binds handlers to durable consumers and runs them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use sqlx::{PgPool, Pool, Postgres};

use crate::consume::reply::{BindReply, BoundReply};
use crate::consume::start::{Bind, Bound};
use crate::error::Error;
use crate::handler::{Handler, IntoHandler};
use crate::observe::stats::Stats;
use crate::outbox::{Relay, RelayStats};
use crate::reply::ReplyRoute;
use crate::route::Route;
use crate::store::backend::Backend;
use crate::tasks::{self, Signal, Trigger};

#[cfg(feature = "mariadb")]
mod mariadb;
mod poll;
mod run;
mod shutdown;
#[cfg(feature = "sqlite")]
mod sqlite;
mod start_up;
mod validate;

/// Binds handlers to JetStream durable pull consumers.
///
/// `S` is the application state its handlers take parts of with
/// [`State<T>`](crate::State), as in axum: start with
/// [`Router::with_state`]; a router whose handlers take no state is
/// [`Router::new`], a `Router<()>`.
///
/// `DB` is the database its handlers' transactions run on: PostgreSQL by
/// default, so leave it out; SQLite with the `sqlite` feature (a router
/// made by `Router::sqlite()`). A route's handler must run on its router's
/// database (the handler's first parameter decides), or the code does not
/// compile.
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
pub struct Router<S = (), DB: Backend = Postgres> {
    state: Arc<S>,
    routes: Vec<Box<dyn Bind<DB>>>,
    /// The request/reply routes.
    replies: Vec<Box<dyn BindReply<DB>>>,
    stats: HashMap<String, Arc<Stats>>,
    trigger: Trigger,
    signal: Signal,
    grace: Duration,
    /// The outbox relay run beside the handlers, if any.
    relay: Option<Relay>,
    #[cfg(feature = "fault-injection")]
    faults: crate::fault::FaultHooks,
}

/// Reads a running router's counters and stops it. Take it with
/// [`Router::handle`] before the router runs; it can be cloned into a
/// health endpoint, a signal handler or a test.
///
/// ```no_run
/// # use idem_runtime::{Route, Router, idempotent};
/// # #[derive(serde::Deserialize)] struct Credit {}
/// # #[idempotent] async fn credit(tx: &mut sqlx::PgTransaction<'_>, c: Credit) -> Result<(), sqlx::Error> { Ok(()) }
/// # async fn run(nats: async_nats::Client, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let router = Router::new().route(Route::new("LEDGER", "credit"), credit);
/// let handle = router.handle();
/// let running = tokio::spawn(router.run(nats, pool));
///
/// // Later: the route's counters, by its durable consumer's name...
/// let stats = handle.stats("credit").expect("a route on durable `credit`");
/// println!(
///     "{} processed, {} duplicates, {} dead-lettered",
///     stats.processed(),
///     stats.duplicates(),
///     stats.dead_lettered()
/// );
/// // ...and a graceful stop: in-flight messages finish and ack, then `run`
/// // returns.
/// handle.shutdown();
/// running.await??;
/// # Ok(())
/// # }
/// ```
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

/// Constructing and running a router on PostgreSQL.
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
        Self::empty(state)
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
    /// If a server cannot be reached at start-up (the database down, no NATS,
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
        mut self,
        nats: async_nats::Client,
        pool: PgPool,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let beside = run::Beside::outbox(self.relay.take(), &nats, &pool);
        self.run_with(nats, pool, shutdown, beside).await
    }
}

impl<S: Send + Sync + 'static, DB: Backend> Router<S, DB> {
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

    /// A router with no routes, on any database.
    fn empty(state: S) -> Self {
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

    /// [`Router::run_until`] on any database, with what the database runs
    /// beside the routes.
    async fn run_with(
        self,
        nats: async_nats::Client,
        pool: Pool<DB>,
        shutdown: impl Future<Output = ()> + Send,
        beside: run::Beside,
    ) -> Result<(), Error> {
        self.validate()?;
        self.warn_if_the_pool_is_small(&pool, beside.relay_connections);
        let js = jetstream::new(nats.clone());
        crate::observe::metrics::describe();
        let mut shutdown = std::pin::pin!(shutdown);
        let Some(set_up) = self.start_up(&pool, &js, &nats, shutdown.as_mut()).await? else {
            tracing::info!("shut down during start-up, before any message was taken");
            return Ok(());
        };
        let running = self.spawn(set_up, &nats, &pool, beside);
        let client_gone = running.until_shutdown(shutdown.as_mut(), &nats).await;
        running.shut_down(&nats).await;
        if client_gone {
            return Err(Error::NatsClientGone);
        }
        Ok(())
    }
}

/// Building a router, on any database its handlers run on.
impl<S: Send + Sync + 'static, DB: Backend> Router<S, DB> {
    /// Runs `handler` for every message of `route`'s durable consumer:
    /// the name of an `#[idempotent]` fn, or a value that implements
    /// [`Handler<S>`](crate::Handler).
    ///
    /// A route left at the default batching runs a handler that declares
    /// [`PER_MESSAGE`](crate::handler::Handler::PER_MESSAGE) one message per
    /// transaction, and a batch handler
    /// ([`BATCHES`](crate::handler::Handler::BATCHES)) in adaptive batches
    /// of up to [`DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER`](crate::route::DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER).
    pub fn route<M, I: IntoHandler<S, M, DB>>(mut self, route: Route, handler: I) -> Self {
        let route = route.for_handler(
            <I::Handler as Handler<S, DB>>::PER_MESSAGE,
            <I::Handler as Handler<S, DB>>::BATCHES,
        );
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
        handler: impl IntoHandler<S, M, DB> + Clone,
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
    pub fn reply_route<M>(
        mut self,
        route: ReplyRoute,
        handler: impl IntoHandler<S, M, DB>,
    ) -> Self {
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

    /// Installs fault-injection hooks (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn fault_hooks(mut self, faults: crate::fault::FaultHooks) -> Self {
        self.faults = faults;
        self
    }

    /// Passes every JetStream route bound so far through `tune`, which may
    /// change its settings (tests only: a test that provokes redeliveries
    /// shortens ack_wait, say). The durable and stream must stay as they
    /// are: the route's counters are kept under its durable.
    #[cfg(feature = "fault-injection")]
    pub fn tune_routes(mut self, mut tune: impl FnMut(Route) -> Route) -> Self {
        for bound in &mut self.routes {
            let route = bound.route_mut();
            let (durable, stream) = (route.durable.clone(), route.stream.clone());
            *route = tune(route.clone());
            assert!(
                route.durable == durable && route.stream == stream,
                "tune_routes changed the durable or stream of route `{durable}`"
            );
        }
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
}
