//! Request/reply routes: a handler answers core NATS requests, effectively
//! once per message id.
//!
//! A [`ReplyRoute`] subscribes to a subject in a queue group (so that many
//! workers share the requests), and for each request:
//!
//! 1. resolves its message id: the handler's `key = ...` if it has one, else
//!    the request's `Nats-Msg-Id` header, which is then **required**;
//! 2. decodes the payload with the handler's codec;
//! 3. runs the handler in a transaction whose first statement claims the
//!    id, exactly as a JetStream route does, and stores the handler's value
//!    with the claim ([`results`](crate::results));
//! 4. **after COMMIT**, replies with the value, encoded by the codec (an
//!    empty payload for a handler that returns `()`).
//!
//! A retry of the request with the same id, from a client that never got
//! the reply, finds the claim: it is not run again, and gets the stored
//! value, byte for byte. A retry that arrives while the first attempt still
//! runs waits on the claim's unique key; once the first commits, it
//! conflicts, reads the stored value and replies with it; if the first rolls
//! back, the retry runs the handler itself.
//!
//! # Error replies
//!
//! A request that did not succeed gets a reply with two headers and an
//! empty payload:
//!
//! | header | value |
//! |---|---|
//! | `Idem-Error` | `retry`: nothing was committed (or, after a lost COMMIT, it may have been: a retry finds out), send the request again with the same id; `permanent`: the same request will fail the same way |
//! | `Idem-Reason` | what happened, one line, at most 1 KiB |
//!
//! | what fails | `Idem-Error` |
//! |---|---|
//! | no message id: no `Nats-Msg-Id` header and no `key = ...` | `permanent` |
//! | an unusable id (empty, over 512 bytes, NUL or line break) | `permanent` |
//! | the payload does not decode | `permanent` |
//! | the handler returns a transient error, times out, or panics | `retry` |
//! | the handler returns a permanent error ([`Classify`](crate::Classify)) | `permanent` |
//! | a serialization failure, deadlock, or other retry-now error | tried again at once (3 tries in all), then `retry`; a unique violation that persists: `permanent` |
//! | the value does not encode | `permanent` |
//! | the database cannot be used (no connection, BEGIN or the claim fails) | tried once more at once, then `retry` |
//! | COMMIT's outcome is unknown (the connection died during it) | `retry`: if it did commit, the retry gets the stored reply |
//! | the handler ended the transaction itself (a raw COMMIT) | `permanent`: part of its work may be committed |
//! | the router is shutting down, and the request was not started | `retry` |
//! | processed before, but its claim (and result) expired since | `permanent` |
//!
//! In every case but the last three, nothing was committed. Unlike a
//! JetStream message, a failed request is not redelivered or dead-lettered:
//! the client holds it, and decides whether to send it again. A message
//! published without a reply subject is not a request: it is dropped, with
//! a warning, and counted as rejected.
//!
//! The message id decides which reply a request gets: a request that
//! reuses another's id gets that request's stored reply, whatever its own
//! payload, and the body does not run. So give every logical request an id
//! of its own (a UUID made by the client, kept across its retries), and
//! restrict who may publish to the subject (NATS permissions) if replies
//! must not be readable by whoever guesses an id. A claim stored without a
//! result (made while the handler still returned `()`) replies empty.
//!
//! A reply is a core NATS publish, at most once: a reply lost on the way
//! (or a worker that dies between COMMIT and the reply) leaves the client
//! without an answer, and its retry with the same id gets the stored one.
//!
//! # Shutdown
//!
//! On shutdown the route unsubscribes, answers the requests it had received
//! but not started with `Idem-Error: retry` (another worker of the queue
//! group takes the retry), and lets the requests in flight finish, commit
//! and reply, within the router's grace period.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::delivery::Delivery;
use crate::error::{Error, HandlerError, RejectedMessage};
use crate::failure::ErrorClass;
use crate::handler::Handler;
use crate::health::Health;
use crate::heartbeat::Heartbeats;
use crate::message_id::{InvalidMessageId, MessageId};
use crate::pipeline::{Pipeline, Verdict};
use crate::route::Route;
use crate::shutdown::Signal;
use crate::stats::Stats;
use crate::transaction::Begin;

/// The header that says a reply is an error, and whether to retry.
pub const ERROR_HEADER: &str = "Idem-Error";

/// The header that says why a request failed.
pub const REASON_HEADER: &str = "Idem-Reason";

/// The longest `Idem-Reason`.
const MAX_REASON: usize = 1024;

/// How long answering the requests received but not started may take at
/// shutdown.
const HAND_BACK_BOUND: Duration = Duration::from_secs(2);

/// One binding of a handler to core NATS requests on a subject: the
/// handler's value (or an error) is the reply, and a retried request (same
/// message id) gets the first reply without running the handler again.
///
/// | setting | default |
/// |---|---|
/// | queue group | the handler's name: the workers running the handler share the requests |
/// | `concurrency` | 8 requests in flight per route in this process |
/// | `handler_timeout` | 30 s (the handler only; also bounds the transaction on the server, as on a [`Route`]) |
/// | retention | the claims (and results) are kept forever |
///
/// ```no_run
/// use idem_runtime::{ReplyRoute, Router, idempotent};
///
/// #[derive(serde::Deserialize)]
/// struct Place { order: i64, amount: i64 }
///
/// #[derive(serde::Serialize)]
/// struct Receipt { order: i64, charged: i64 }
///
/// #[idempotent(name = "orders.place.v1")]
/// async fn place(tx: &mut sqlx::PgTransaction<'_>, cmd: Place) -> Result<Receipt, sqlx::Error> {
///     sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
///         .bind(cmd.order)
///         .bind(cmd.amount)
///         .execute(&mut **tx)
///         .await?;
///     Ok(Receipt { order: cmd.order, charged: cmd.amount })
/// }
///
/// # async fn run(nats: async_nats::Client, pool: sqlx::PgPool) -> Result<(), idem_runtime::Error> {
/// Router::new()
///     .reply_route(ReplyRoute::new("orders.place"), place)
///     .run(nats, pool)
///     .await
/// # }
/// ```
///
/// A client sends each request with a `Nats-Msg-Id` and, when it gets no
/// reply (a timeout) or `Idem-Error: retry`, sends it again with the same
/// id:
///
/// ```no_run
/// # async fn call(nats: async_nats::Client) -> Result<(), async_nats::Error> {
/// let mut headers = async_nats::HeaderMap::new();
/// headers.insert("Nats-Msg-Id", "order-7");
/// let reply = nats
///     .request_with_headers("orders.place", headers, r#"{"order":7,"amount":40}"#.into())
///     .await?;
/// match reply.headers.as_ref().and_then(|h| h.get("Idem-Error")) {
///     None => println!("placed: {}", String::from_utf8_lossy(&reply.payload)),
///     Some(retry) => println!("failed ({retry}): {:?}", reply.headers),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ReplyRoute {
    pub(crate) subject: String,
    queue_group: Option<String>,
    pub(crate) concurrency: usize,
    handler_timeout: Option<Duration>,
    pub(crate) retention: Option<Duration>,
}

impl ReplyRoute {
    /// Answers the requests sent to `subject` (wildcards allowed).
    pub fn new(subject: impl Into<String>) -> Self {
        Self {
            subject: subject.into(),
            queue_group: None,
            concurrency: 8,
            handler_timeout: Some(Duration::from_secs(30)),
            retention: None,
        }
    }

    /// The queue group the route subscribes in (default: the handler's
    /// name). Each request goes to one member of the group.
    pub fn queue_group(mut self, group: impl Into<String>) -> Self {
        self.queue_group = Some(group.into());
        self
    }

    /// The most requests this process handles at once for this route; each
    /// holds a pooled connection while it runs. Further requests wait in the
    /// subscription.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Fail a handler that runs longer than `timeout` (a `retry` error
    /// reply). Default 30 s. As on a [`Route`], it also bounds each statement
    /// of the transaction on the server, and never races BEGIN or COMMIT.
    /// A retry that waits on the claim of an attempt still running waits at
    /// most this long too.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// Let a handler run as long as it likes.
    pub fn without_handler_timeout(mut self) -> Self {
        self.handler_timeout = None;
        self
    }

    /// Keeps this route's claims, and the results stored with them, for at
    /// least `period`; a retry after that runs the handler again. Without
    /// it, they are kept forever.
    pub fn retention(mut self, period: Duration) -> Self {
        self.retention = Some(period);
        self
    }

    /// The subject the route answers.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The queue group to subscribe in, for the handler named `handler`.
    pub(crate) fn group(&self, handler: &str) -> String {
        self.queue_group
            .clone()
            .unwrap_or_else(|| handler.to_owned())
    }

    /// The route as the pipeline runs it: no stream, no heartbeats, the
    /// handler timeout and the in-process retries of the default policy.
    fn as_route(&self) -> Route {
        let route = Route::new(String::new(), self.subject.clone());
        match self.handler_timeout {
            Some(timeout) => route.handler_timeout(timeout),
            None => route.without_handler_timeout(),
        }
    }

    /// Refuses settings that cannot work.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let refuse = |reason: String| {
            Err(Error::Config {
                route: self.subject.clone(),
                reason,
            })
        };
        if self.subject.is_empty() || self.subject.contains(char::is_whitespace) {
            return refuse(format!(
                "the request subject {:?} is empty or holds whitespace",
                self.subject
            ));
        }
        if self
            .queue_group
            .as_ref()
            .is_some_and(|group| group.is_empty() || group.contains(char::is_whitespace))
        {
            return refuse("the queue group is empty or holds whitespace".into());
        }
        if self.concurrency == 0 {
            return refuse("concurrency must be at least 1".into());
        }
        if let Some(timeout) = self.handler_timeout
            && (timeout.is_zero() || timeout.as_millis() + 1000 > i32::MAX as u128)
        {
            return refuse(format!(
                "the handler timeout ({timeout:?}) must be between 1 ms and about 24.8 days (PostgreSQL's statement_timeout); use `without_handler_timeout()` for none"
            ));
        }
        Ok(())
    }
}

/// What a request route needs to start.
pub(crate) struct Serve {
    pub(crate) handler_id: i32,
    pub(crate) nats: async_nats::Client,
    pub(crate) pool: sqlx::PgPool,
    pub(crate) keep_connections: usize,
    pub(crate) session: crate::transaction::Session,
    pub(crate) shutdown: Signal,
    pub(crate) grace: Duration,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: crate::fault::FaultHooks,
}

/// A request route with its handler and state, type-erased so that one
/// router holds many.
pub(crate) trait BindReply: Send + Sync {
    fn route(&self) -> &ReplyRoute;
    fn handler_name(&self) -> &'static str;
    /// Serves the requests of `requests` until shutdown; returns how many it
    /// had to abandon.
    fn start(
        self: Box<Self>,
        requests: async_nats::Subscriber,
        serve: Serve,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>>;
}

pub(crate) struct BoundReply<H, S> {
    pub(crate) route: ReplyRoute,
    pub(crate) handler: H,
    pub(crate) stats: Arc<Stats>,
    pub(crate) state: Arc<S>,
}

impl<S: Send + Sync + 'static, H: Handler<S>> BindReply for BoundReply<H, S> {
    fn route(&self) -> &ReplyRoute {
        &self.route
    }

    fn handler_name(&self) -> &'static str {
        self.handler.name()
    }

    fn start(
        self: Box<Self>,
        requests: async_nats::Subscriber,
        serve: Serve,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>> {
        let route = self.route.as_route();
        let pipeline = Arc::new(Pipeline {
            begin: Begin::new(route.handler_timeout, serve.session),
            route,
            handler: self.handler,
            state: self.state,
            connections: crate::connections::Connections::start(serve.pool, serve.keep_connections),
            // A request has no lease to keep.
            heartbeats: Heartbeats::start(serve.nats.clone(), None),
            nats: serve.nats,
            handler_id: serve.handler_id,
            health: Health::new(),
            stats: self.stats,
            metrics: crate::metrics::RouteMetrics::new(&self.route.subject),
            shutdown: serve.shutdown.clone(),
            answers: true,
            copy_spread: None,
            #[cfg(feature = "fault-injection")]
            faults: serve.faults,
        });
        Box::pin(serve_until_shutdown(
            requests,
            pipeline,
            self.route.concurrency,
            serve.shutdown,
            serve.grace,
        ))
    }
}

/// Answers requests until shutdown, then waits up to `grace` for those in
/// flight. Returns how many it had to abandon.
async fn serve_until_shutdown<S: Send + Sync + 'static, H: Handler<S>>(
    mut requests: async_nats::Subscriber,
    pipeline: Arc<Pipeline<H, S>>,
    concurrency: usize,
    mut shutdown: Signal,
    grace: Duration,
) -> usize {
    let subject = pipeline.route.durable.clone();
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut in_flight = JoinSet::new();
    loop {
        // A free slot first, so that a request is taken only when it can
        // start; shutdown first, so that none is taken after it.
        let slot = tokio::select! {
            biased;
            _ = shutdown.fired() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        while in_flight.try_join_next().is_some() {}
        let request = tokio::select! {
            biased;
            _ = shutdown.fired() => break,
            next = requests.next() => match next {
                Some(request) => request,
                None => {
                    tracing::error!(subject, "the request subscription ended; this route takes no more requests");
                    shutdown.fired().await;
                    break;
                }
            },
        };
        in_flight.spawn(pipeline.clone().answer(request, slot));
    }

    // Stop taking requests, and tell those received but not started to try
    // again (another worker of the group takes them).
    let _ = requests.unsubscribe().await;
    let mut unstarted = Vec::new();
    while let Some(Some(request)) = requests.next().now_or_never() {
        unstarted.push(request);
    }
    if !unstarted.is_empty() {
        let answers = async {
            for request in &unstarted {
                if let Some(reply) = &request.reply {
                    pipeline
                        .reply(
                            reply,
                            Answer::error(
                                ErrorClass::Transient,
                                "the worker is shutting down and did not start the request; nothing was committed: send it again",
                            ),
                        )
                        .await;
                }
            }
        };
        if tokio::time::timeout(HAND_BACK_BOUND, answers)
            .await
            .is_err()
        {
            tracing::warn!(
                subject,
                "answering unstarted requests at shutdown took too long; their clients time out and retry"
            );
        }
    }
    tracing::info!(
        subject,
        in_flight = in_flight.len(),
        "stopped taking requests; finishing in-flight ones"
    );
    let drained = tokio::time::timeout(grace, async {
        while in_flight.join_next().await.is_some() {}
    })
    .await;
    if drained.is_ok() {
        return 0;
    }
    let abandoned = in_flight.len();
    tracing::error!(
        subject,
        abandoned,
        ?grace,
        "in-flight requests outlived the shutdown grace period; cancelling them (their clients get no reply; a retry finds the claim of any that committed)"
    );
    in_flight.shutdown().await;
    abandoned
}

/// A reply: the stored value, or an error.
enum Answer {
    Value(Bytes),
    Error { retry: bool, reason: String },
}

impl Answer {
    /// An error reply for a failure of class `class`: `retry` unless the
    /// same request would fail the same way.
    fn error(class: ErrorClass, reason: impl Into<String>) -> Self {
        let retry = !matches!(
            class,
            ErrorClass::Permanent | ErrorClass::RetryNowThenPermanent
        );
        Answer::Error {
            retry,
            reason: reason.into(),
        }
    }
}

impl<S: Send + Sync + 'static, H: Handler<S>> Pipeline<H, S> {
    /// Answers one request. `_slot` is the concurrency permit.
    async fn answer(self: Arc<Self>, request: async_nats::Message, _slot: OwnedSemaphorePermit) {
        Stats::bump(&self.stats.received);
        self.metrics.received();
        let _in_flight = self.metrics.in_flight(1);
        let Some(reply) = request.reply.clone() else {
            Stats::bump(&self.stats.rejected);
            self.metrics.rejected();
            tracing::warn!(
                subject = %request.subject,
                "a message without a reply subject is not a request; dropped"
            );
            return;
        };
        let span = tracing::info_span!(
            "idem.request",
            handler = self.handler.name(),
            subject = %request.subject,
            message_id = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        crate::trace::continue_trace(&span, request.headers.as_ref());
        async {
            let answer = match self.prepare_request(&request) {
                Err(rejected) => {
                    Stats::bump(&self.stats.rejected);
                    self.metrics.rejected();
                    tracing::warn!(error = %rejected, "request rejected");
                    Answer::error(ErrorClass::Permanent, rejected.to_string())
                }
                Ok((payload, delivery)) => {
                    let verdict = self
                        .transact_with_retries(&request.payload, payload, &delivery)
                        .await;
                    #[cfg(feature = "fault-injection")]
                    if matches!(verdict, Verdict::Processed(_))
                        && self.faults.decide_after_commit(&delivery)
                            == crate::fault::AfterCommit::DropWithoutAck
                    {
                        tracing::warn!("fault injection: committed but not replying");
                        Stats::bump(&self.stats.processed);
                        self.metrics.processed();
                        Stats::bump(&self.stats.dropped_by_fault);
                        return;
                    }
                    self.answer_of(verdict)
                }
            };
            self.reply(&reply, answer).await;
        }
        .instrument(span)
        .await;
    }

    /// The request's payload and delivery, with its message id: the
    /// handler's key, else its `Nats-Msg-Id` (there is no stream position to
    /// fall back on).
    fn prepare_request(
        &self,
        request: &async_nats::Message,
    ) -> Result<(H::Payload, Delivery), RejectedMessage> {
        let headers = request.headers.clone().unwrap_or_default();
        let carried = match headers.get_last(NATS_MESSAGE_ID) {
            Some(id) => MessageId::from_header(id.as_str().to_owned()),
            None => Err(InvalidMessageId::Missing),
        };
        let payload = self.decode(&request.payload)?;
        // The key sees the delivery with the carried id, if there is one,
        // as on a JetStream route.
        let placeholder = carried.clone().unwrap_or_else(|_| MessageId::none());
        let mut delivery = Delivery::for_request(request.subject.as_str(), headers, placeholder);
        let id = match self.key_of(&payload, &delivery)? {
            Some(key) => MessageId::from_key(key)?,
            None => carried?,
        };
        tracing::Span::current().record("message_id", id.as_str());
        delivery.set_message_id(id);
        delivery.set_handler(self.handler.name());
        Ok((payload, delivery))
    }

    /// The reply a request's verdict earns.
    fn answer_of(&self, verdict: Verdict) -> Answer {
        let stats = &self.stats;
        match verdict {
            Verdict::Processed(result) => {
                Stats::bump(&stats.processed);
                self.metrics.processed();
                tracing::debug!("processed; replying");
                Answer::Value(result.unwrap_or_default())
            }
            Verdict::Replayed(Some(result)) => {
                Stats::bump(&stats.duplicates);
                self.metrics.duplicate();
                tracing::info!("processed before; replying with the stored result");
                Answer::Value(result.unwrap_or_default())
            }
            Verdict::Replayed(None) => {
                Stats::bump(&stats.duplicates);
                self.metrics.duplicate();
                tracing::warn!("processed before, but its claim has expired since");
                Answer::error(
                    ErrorClass::Permanent,
                    "the request was processed before, but its claim and stored result have expired (retention); sending it again would run it again",
                )
            }
            Verdict::Failed(error) => {
                Stats::bump(&stats.failed);
                self.metrics.failed();
                let class = error.class();
                tracing::warn!(%error, ?class, "request failed; rolled back");
                Answer::error(class, error.to_string())
            }
            Verdict::CommitUnknown(error) => {
                Stats::bump(&stats.commit_failed);
                self.metrics.commit_unknown();
                tracing::warn!(%error, "COMMIT failed with an unknown outcome");
                Answer::error(
                    ErrorClass::Transient,
                    format!(
                        "COMMIT's outcome is unknown ({}); send the request again with the same id: if it committed, the reply is the stored one",
                        HandlerError::Infrastructure(error)
                    ),
                )
            }
            Verdict::Rejected(error) => {
                Stats::bump(&stats.rejected);
                self.metrics.rejected();
                Answer::error(ErrorClass::Permanent, error.to_string())
            }
            // A request is delivered once (never past a limit), and is
            // answered, not held, while the database is away.
            Verdict::Duplicate | Verdict::Exhausted | Verdict::Interrupted => {
                Stats::bump(&stats.failed);
                self.metrics.failed();
                Answer::error(
                    ErrorClass::Transient,
                    "the request could not be processed now; send it again",
                )
            }
        }
    }

    /// Publishes `answer` to `reply`. At most once: a reply lost on the way
    /// is recovered by the client's retry.
    async fn reply(&self, reply: &async_nats::Subject, answer: Answer) {
        let published = match answer {
            Answer::Value(value) => self.nats.publish(reply.clone(), value).await,
            Answer::Error { retry, reason } => {
                let mut headers = HeaderMap::new();
                headers.insert(ERROR_HEADER, if retry { "retry" } else { "permanent" });
                headers.insert(REASON_HEADER, one_line(&reason).as_str());
                self.nats
                    .publish_with_headers(reply.clone(), headers, Bytes::new())
                    .await
            }
        };
        if let Err(error) = published {
            tracing::warn!(%error, "the reply could not be sent; the client's retry gets the stored one");
        }
    }
}

/// `text` on one line, at most [`MAX_REASON`] bytes, for a header.
fn one_line(text: &str) -> String {
    let mut line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_fit_one_header_line() {
        assert_eq!(one_line("a\nb\r\tc"), "a b  c");
        let long = "é".repeat(MAX_REASON);
        let line = one_line(&long);
        assert!(line.len() <= MAX_REASON && line.chars().all(|c| c == 'é'));
    }

    #[test]
    fn request_route_settings_are_checked() {
        ReplyRoute::new("orders.place").validate().unwrap();
        for bad in [
            ReplyRoute::new(""),
            ReplyRoute::new("orders place"),
            ReplyRoute::new("orders.place").concurrency(0),
            ReplyRoute::new("orders.place").queue_group(""),
            ReplyRoute::new("orders.place").handler_timeout(Duration::ZERO),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_permanent_classes_say_permanent() {
        for (class, retry) in [
            (ErrorClass::Transient, true),
            (ErrorClass::RetryNow, true),
            (ErrorClass::RetryNowThenPermanent, false),
            (ErrorClass::Permanent, false),
        ] {
            let Answer::Error { retry: said, .. } = Answer::error(class, "x") else {
                unreachable!()
            };
            assert_eq!(said, retry, "{class:?}");
        }
    }
}
