//! The first step of [`Router::run_until`]: what is refused, or warned
//! about, before any server is asked.

use std::collections::HashMap;

use sqlx::Pool;

use super::Router;
use crate::error::Error;
use crate::store::backend::Backend;

impl<S: Send + Sync + 'static, DB: Backend> Router<S, DB> {
    /// Refuses a router that could never keep its promise: a route that
    /// does not validate, two routes on one durable consumer, a handler name
    /// that is empty, holds a control character or is shared by two routes
    /// (they would share dedup rows), and reply routes whose names or
    /// subjects collide.
    pub(super) fn validate(&self) -> Result<(), Error> {
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
        // handler's (see `reply/`): it is the name, and the subject, that
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
        Ok(())
    }

    /// Warns when the pool has fewer connections than the routes can use at
    /// once: each message (or batch) in flight holds one, the relay up to four
    /// and the metrics poll one (the messages are left the rest: see
    /// `store/connections.rs`).
    pub(super) fn warn_if_the_pool_is_small(&self, pool: &Pool<DB>, relay_connections: usize) {
        let in_flight: usize = self
            .routes
            .iter()
            .map(|bound| bound.route().concurrency)
            .chain(self.replies.iter().map(|reply| reply.route().concurrency))
            .sum();
        // On SQLite the router's transactions take turns: one connection
        // serves them all.
        let in_flight = DB::WRITERS_AT_ONCE.map_or(in_flight, |writers| in_flight.min(writers));
        let poll_connections = super::poll::CONNECTIONS;
        let pool_size = pool.options().get_max_connections() as usize;
        if pool_size < in_flight + relay_connections + poll_connections {
            tracing::warn!(
                pool_size,
                in_flight,
                relay_connections,
                poll_connections,
                "the pool has fewer connections than the routes' messages (or batches) in flight (on SQLite: one transaction at a time) plus the outbox relay's and the metrics poll's (on SQLite: the purge's); messages wait for connections (served in the order they ask, across routes), and a wait past the pool's acquire timeout holds them as if the database were away"
            );
        }
    }
}
