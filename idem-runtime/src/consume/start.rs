//! Starting a JetStream route: a route bound to its handler and state
//! (type-erased, so that one router holds many), and what it starts with:
//! its pipeline, its pull loop and its watcher of messages JetStream gave
//! up on.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;

use crate::consume::pipeline::{Pipeline, RouteContext};
use crate::consume::undeliverable;
use crate::handler::Handler;
use crate::observe::stats::Stats;
use crate::reply::Mode;
use crate::route::Route;
use crate::store::backend::Backend;
use crate::tasks;

/// Where a JetStream route's messages come from, made by start-up.
pub(crate) struct Source {
    pub(crate) consumer: PullConsumer,
    /// The consumer of its advisories: messages JetStream gave up on.
    pub(crate) advisories: PullConsumer,
    /// How far apart copies of one message can be stored, where the route
    /// declares it (see [`Mode::Consume`]).
    pub(crate) copy_spread: Option<Duration>,
    /// Whether the route, batching by default, runs per message because its
    /// retention fits only that floor (see `router/start_up.rs`).
    pub(crate) per_message_for_retention: bool,
    pub(crate) js: jetstream::Context,
}

/// A route with its handler and state, type-erased so one router holds many
/// handlers.
pub(crate) trait Bind<DB: Backend>: Send + Sync {
    fn route(&self) -> &Route;
    #[cfg(feature = "fault-injection")]
    fn route_mut(&mut self) -> &mut Route;
    fn handler_name(&self) -> &'static str;
    fn start(
        self: Box<Self>,
        context: RouteContext<DB>,
        source: Source,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>>;
}

pub(crate) struct Bound<H, S> {
    pub(crate) route: Route,
    pub(crate) handler: H,
    pub(crate) stats: Arc<Stats>,
    pub(crate) state: Arc<S>,
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Bind<DB> for Bound<H, S> {
    fn route(&self) -> &Route {
        &self.route
    }

    #[cfg(feature = "fault-injection")]
    fn route_mut(&mut self) -> &mut Route {
        &mut self.route
    }

    fn handler_name(&self) -> &'static str {
        self.handler.name()
    }

    fn start(
        self: Box<Self>,
        context: RouteContext<DB>,
        source: Source,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>> {
        start_route(*self, context, source)
    }
}

/// Starts one route: its pipeline, its pull loop and its watcher of
/// messages JetStream gave up on.
fn start_route<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend>(
    bound: Bound<H, S>,
    context: RouteContext<DB>,
    source: Source,
) -> Pin<Box<dyn Future<Output = usize> + Send>> {
    let mode = Mode::Consume {
        copy_spread: source.copy_spread,
    };
    let route = if source.per_message_for_retention {
        bound.route.defaulted_to_per_message()
    } else {
        bound.route
    };
    let pipeline = Arc::new(Pipeline::new(
        route,
        bound.handler,
        bound.state,
        bound.stats,
        mode,
        &context,
    ));
    // Aborted when the route ends, or when its task is (the router's run
    // future dropped).
    let watcher = tasks::Owned(tokio::spawn(undeliverable::watch(
        pipeline.clone(),
        source.js,
        source.advisories,
    )));
    Box::pin(async move {
        let abandoned = crate::consume::pull::pull_until_shutdown(
            source.consumer,
            pipeline,
            context.shutdown,
            context.grace,
        )
        .await;
        drop(watcher);
        abandoned
    })
}
