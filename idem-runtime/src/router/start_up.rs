//! Start-up: what the routes need on the servers (the schema checked, the
//! streams, consumers and advisory watchers bound, the handlers registered,
//! the request routes subscribed), tried again while a server is away.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{self, PullConsumer, pull};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use sqlx::Pool;

use crate::consume::start::Source;
use crate::consume::undeliverable;
use crate::error::Error;
use crate::error::class::{is_lock_timeout, is_unreachable};
use crate::route::Route;
use crate::store::backend::Backend;

use super::Router;
/// What start-up made on the servers, in the order of the router's routes
/// and request routes.
pub(super) struct SetUp<DB: Backend> {
    pub(super) session: DB::Session,
    /// Per route: where its messages come from.
    pub(super) sources: Vec<Source>,
    pub(super) handler_ids: HashMap<String, i32>,
    /// Per request route: its subscription and queue group.
    pub(super) requests: Vec<(async_nats::Subscriber, String)>,
}

impl<S: Send + Sync + 'static, DB: Backend> Router<S, DB> {
    /// Sets up what the routes need on the servers ([`Router::set_up`]),
    /// trying again while a server cannot be reached, with a growing pause
    /// and a warning naming it, until it works or the router is shut down
    /// (`None`). Any other failure is returned at once.
    ///
    /// An attempt is never raced against the shutdown, so that no statement
    /// of it is cut off halfway; only the pause between attempts is.
    pub(super) async fn start_up(
        &self,
        pool: &Pool<DB>,
        js: &jetstream::Context,
        nats: &async_nats::Client,
        mut shutdown: std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Result<Option<SetUp<DB>>, Error> {
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
            crate::observe::metrics::start_up_retry(down.label::<DB>());
            let holders = if down == Unreachable::HandlersLocked {
                DB::register_blockers(pool).await.map_or_else(
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
                down.describe::<DB>()
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
        pool: &Pool<DB>,
        js: &jetstream::Context,
        nats: &async_nats::Client,
        warned: &mut bool,
    ) -> Result<SetUp<DB>, Error> {
        DB::verify_schema(pool).await?;
        let session = DB::probe(pool, !*warned).await?;
        *warned = true;
        let mut sources = Vec::with_capacity(self.routes.len());
        // idem's own streams follow the replicas of the routes' streams.
        let routes: Vec<&Route> = self.routes.iter().map(|route| route.route()).collect();
        let replicas = crate::dead_letter::Replicas::of(js, &routes).await;
        for route in &self.routes {
            crate::dead_letter::ensure_stream(js, route.route(), &replicas).await?;
            // Before the route pulls, so that nothing it gives up on from
            // now on is missed.
            let advisories = undeliverable::bind(js, route.route(), &replicas).await?;
            let bound = bind_consumer(js, route.route(), route.handler_name()).await?;
            sources.push(Source {
                consumer: bound.consumer,
                advisories,
                copy_spread: bound.copy_spread,
                per_message_for_retention: bound.per_message_for_retention,
                js: js.clone(),
            });
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
        let handler_ids = DB::register(pool, &registered).await?;
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
            sources,
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
    /// No connection to the database, or it is starting or stopping.
    Database,
    /// NATS is not connected, or JetStream does not answer.
    Nats,
    /// The database answers, but registering the handlers waited past its
    /// lock timeout for a lock on `idem_handlers` another session holds (a
    /// transaction left open after an `UPDATE` of it, say; on SQLite, the
    /// file's write lock).
    HandlersLocked,
}

impl Unreachable {
    /// Its label on [`crate::observe::metrics::STARTUP_RETRIES`]: the
    /// database's own ([`Backend::LABEL`]), or `nats`.
    pub(crate) fn label<DB: Backend>(self) -> &'static str {
        match self {
            Unreachable::Database | Unreachable::HandlersLocked => DB::LABEL,
            Unreachable::Nats => "nats",
        }
    }

    /// What its warning says: which server, and why.
    fn describe<DB: Backend>(self) -> String {
        match self {
            Unreachable::Database => format!("{} cannot be reached", DB::SERVER_NAME),
            Unreachable::Nats => "NATS (JetStream) does not answer".to_owned(),
            Unreachable::HandlersLocked => format!(
                "another session holds {} (a transaction left open?), so the handlers cannot be registered",
                DB::REGISTER_LOCK
            ),
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
        Error::Database(error) if is_lock_timeout(error) => {
            return Some(Unreachable::HandlersLocked);
        }
        Error::Database(error) => {
            return is_unreachable(error).then_some(Unreachable::Database);
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

/// Whether a JetStream error is a request that got no answer: a timeout,
/// no responders (JetStream not enabled yet), a request the client could
/// not make, or a consumer that is offline (its leader being elected).
fn jetstream_unanswered(source: &async_nats::Error) -> bool {
    use async_nats::jetstream::context::{
        ConsumerInfoError, CreateStreamError, CreateStreamErrorKind, GetStreamError,
        GetStreamErrorKind, RequestError, RequestErrorKind,
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
                | ConsumerInfoErrorKind::Offline
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

/// A route's durable consumer, bound.
struct BoundConsumer {
    consumer: PullConsumer,
    /// How far apart copies of one message can be stored, where the route
    /// declares it.
    copy_spread: Option<Duration>,
    /// Whether the route, batching by default, runs per message because
    /// its retention fits only the per-message floor.
    per_message_for_retention: bool,
}

/// Creates or updates the stream (if asked) and the durable consumer.
async fn bind_consumer(
    js: &jetstream::Context,
    route: &Route,
    handler: &str,
) -> Result<BoundConsumer, Error> {
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
    // route's dead letters to copy (see `dead_letter/`).
    let stream_config = &stream.cached_info().config;
    let (floor, per_message_for_retention) = route.judged_floor(stream_config)?;
    if per_message_for_retention {
        tracing::warn!(
            route = route.durable,
            per_message_floor = ?floor.value(),
            "the route's retention is below its floor with batches, so it runs one message per transaction (batching needs a longer retention; raise it, or shorten the handler timeout or the retry policy): {}",
            route.clone().adaptive_batch(route.batch).retention_floor(stream_config)
        );
    }
    let mut wanted = route.consumer_config();
    // And its handler and dead letters, for operators (see `status.rs`).
    wanted
        .metadata
        .extend(crate::route::metadata::consumer_metadata(
            route, handler, &floor,
        ));
    match stream.consumer_info(&route.durable).await {
        Ok(existing) => {
            // `get_or_create_consumer` would silently keep the old settings,
            // and creating it from the route's alone would silently
            // overwrite another deployment's.
            let differences = consumer_differences(&existing.config, &wanted);
            if !route.update_consumer && !differences.is_empty() {
                return Err(Error::ConsumerConflict {
                    route: route.durable.clone(),
                    differences: differences.join(", "),
                });
            }
            wanted = keep_operator_settings(&route.durable, &existing.config, wanted);
            if existing.paused {
                warn_paused(&route.durable, existing.pause_remaining);
            }
        }
        Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => {}
        // Not an answer about the consumer (a timeout, a leader election):
        // creating it now could reset what an operator set, or skip the
        // check above. Start-up tries again (see `is_transient`).
        Err(error) => return Err(jetstream_error(error.into())),
    }
    // Creates the consumer, or updates the settings the route manages (and,
    // with `update_consumer`, those that differed).
    let consumer = stream
        .create_consumer(wanted)
        .await
        .map_err(|e| jetstream_error(e.into()))?;
    Ok(BoundConsumer {
        consumer,
        copy_spread: floor.declared_copy_spread(),
        per_message_for_retention,
    })
}

/// Warns that the route's consumer is paused by an operator, for
/// `remaining`: JetStream delivers nothing to the route until then (the
/// router's poll warns again if it is paused later, and sets
/// `idem_consumer_paused_seconds`; `idem status` shows it).
pub(crate) fn warn_paused(route: &str, remaining: Option<Duration>) {
    tracing::warn!(
        route,
        remaining_s = remaining.map(|left| left.as_secs()),
        "the route's consumer is paused{}: JetStream delivers it nothing until the pause ends or an operator resumes it (`nats consumer resume`); the route keeps the pause and waits",
        remaining.map_or_else(String::new, |left| format!(
            " for another {}s",
            left.as_secs()
        ))
    );
}

/// `wanted` with the settings of the `existing` consumer that the route
/// leaves to operators: what one pull request may ask for (`max_batch`,
/// `max_bytes`, `max_expires`), how many may wait (`max_waiting`, which
/// JetStream does not let an update change), the description, the sampling
/// of acks, and any metadata of their own (the route writes its `idem.*`
/// keys afresh, and the server its `_nats.*`). Creating the consumer with
/// `wanted` as the route builds it would reset them to JetStream's defaults
/// at every start. Those kept that differ from the defaults are logged.
///
/// An operator's pause (`nats consumer pause`) is left as it is: the route
/// never sets `pause_until`, and JetStream keeps a pause through an update
/// that leaves it out (nats-server 2.15; the lifecycle test
/// `a_restart_keeps_an_operators_pause_and_says_so` holds it to that), so a
/// worker's restart does not undo a pause taken for maintenance. Start-up
/// warns about it ([`warn_paused`]).
///
/// Not kept, so that a restart sets them as the route needs them: the
/// inactivity threshold (a durable that JetStream deletes while every
/// worker is down would be created again from the start of the stream),
/// the replicas (0: the stream's, which an explicit count can stop
/// matching), memory storage (a memory consumer loses its state when the
/// server restarts; JetStream refuses to change it, so such a consumer is
/// refused: see [`consumer_differences`]), and the back-off, replay policy
/// and headers-only delivery.
fn keep_operator_settings(
    durable: &str,
    existing: &consumer::Config,
    mut wanted: pull::Config,
) -> pull::Config {
    wanted.description.clone_from(&existing.description);
    wanted.max_waiting = existing.max_waiting;
    wanted.max_batch = existing.max_batch;
    wanted.max_bytes = existing.max_bytes;
    wanted.max_expires = existing.max_expires;
    wanted.sample_frequency = existing.sample_frequency;
    for (key, value) in &existing.metadata {
        use crate::route::metadata::{PREFIX, SERVER_PREFIX};
        if !key.starts_with(PREFIX) && !key.starts_with(SERVER_PREFIX) {
            wanted
                .metadata
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
    }
    let defaults = pull::Config::default();
    let kept: Vec<String> = [
        ("max_batch", wanted.max_batch, defaults.max_batch),
        ("max_bytes", wanted.max_bytes, defaults.max_bytes),
        // JetStream's own default when none is given.
        ("max_waiting", wanted.max_waiting, 512),
    ]
    .into_iter()
    .filter(|(_, kept, default)| kept != default && *kept != 0)
    .map(|(name, kept, _)| format!("{name} {kept}"))
    .chain(
        (wanted.max_expires != defaults.max_expires)
            .then(|| format!("max_expires {:?}", wanted.max_expires)),
    )
    .collect();
    if !kept.is_empty() {
        tracing::info!(
            route = durable,
            "keeping the consumer's own limits: {} (the route's pull requests are capped by them; `idem status` shows a cap)",
            kept.join(", ")
        );
    }
    wanted
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
        "memory_storage",
        existing.memory_storage.to_string(),
        wanted.memory_storage.to_string(),
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

#[cfg(test)]
mod tests {
    use super::Unreachable;
    use crate::store::backend::Backend;

    /// `DB`'s label on the metric, its warning when it cannot be reached,
    /// and a word of its warning when registering is blocked.
    fn names<DB: Backend>(label: &str, unreachable: &str, locked: &str) {
        assert_eq!(Unreachable::Database.label::<DB>(), label);
        assert_eq!(Unreachable::HandlersLocked.label::<DB>(), label);
        assert_eq!(Unreachable::Nats.label::<DB>(), "nats");
        assert_eq!(Unreachable::Database.describe::<DB>(), unreachable);
        let blocked = Unreachable::HandlersLocked.describe::<DB>();
        assert!(blocked.contains(locked), "{blocked}");
    }

    /// Each database names itself in the warning and on the metric.
    #[test]
    fn start_up_names_the_routers_own_database() {
        names::<sqlx::Postgres>(
            "postgresql",
            "PostgreSQL cannot be reached",
            "a lock on idem_handlers",
        );
        #[cfg(feature = "mariadb")]
        names::<sqlx::MySql>(
            "mariadb",
            "MariaDB cannot be reached",
            "a lock on idem_handlers",
        );
        #[cfg(feature = "sqlite")]
        names::<sqlx::Sqlite>("sqlite", "SQLite cannot be reached", "SQLite's write lock");
    }
}
