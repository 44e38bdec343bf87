//! One route's pull, on JetStream's wire protocol: an inbox of its own, pull
//! requests sent to it, and the books of what those requests still owe
//! (`pull_books.rs`).
//!
//! async-nats's `Consumer::stream` keeps its inbox to itself, so the only way
//! to stop it is to drop it, which unsubscribes while the server may still
//! hold a request of it. What the server then delivers goes into a dead
//! inbox: counted as delivered, seen by no one, and redelivered only after
//! ack_wait. This pull can be *closed* instead ([`PullStream::close`]): it
//! stops asking and reads on until every request it sent has ended, filled,
//! ended by the server's status (a `408` at its expiry follows whatever
//! that request delivered) or past its expiry, so that the caller gets
//! every message the server sent it and no request is left on the server.
//!
//! **One reply subject per request.** Request `n` is sent with the reply
//! subject `{inbox}.{n}`, and one wildcard subscription `{inbox}.*` reads
//! them all. The server keys what it knows of a waiting request by its reply
//! subject: the statuses it sends to it, the set of requests a new consumer
//! leader tells `409 Leadership Change`, and the `408` it holds back until
//! a replicated consumer's deliveries are stored. With one subject shared
//! by every request, a request that ended took the others' entry with it,
//! so a new leader told none of them, and the count of what was owed
//! drifted: too high, the pull stopped asking until its silence check; too
//! low, closing returned while a request was still open. Now each status
//! names its request, each request is credited with exactly what it
//! delivered, and a request the server never ends (it was filled, its
//! consumer leader died, or the server dropped it silently because its wait
//! list was full, which it does without a word when a request asks for
//! heartbeats) leaves the books by itself once its expiry and a margin
//! have passed.
//!
//! The requests are short ([`PULL_EXPIRES`]) so that closing is quick, and
//! renewed as they are used up or expire: at most about one request and a
//! half is owed at a time, as with `Consumer::stream`. Each is capped at the
//! consumer's `max_batch` (the server's `max_request_batch` limit, if the
//! consumer has none of its own), which the server would otherwise refuse
//! it for, every time.
//!
//! **Reconnects.** The pull notices a reconnect of the client (its
//! connection count moves) and asks again at once, on the same inbox,
//! which the client subscribes again. A restarted server has forgotten the
//! requests; one that was not restarted (a short blip, or a cluster whose
//! consumer leader is on another node) still delivers what they owe, into
//! the same subjects. So the requests open before a reconnect no longer
//! count as owed (the pull asks again at once), but they stay on the books
//! until they end or expire (closing still waits for them).
//!
//! **Refusals** that pass (no responders while a consumer elects its
//! leader, a full wait list) pause the next request, briefly after no
//! responders, so that the pull asks again soon after a new leader is
//! elected; a new leader's `409 Leadership Change` asks again at once. A
//! request that leaves the books at its expiry without a word, too few
//! messages having come for it to have been filled, was *lost*: dropped by
//! the server (a full wait list, a leader that died), and counts as a
//! refusal. A refusal that lasts is warned about, naming its cause, and
//! every refusal is counted (`idem_pull_requests_refused_total`). A refusal
//! that cannot pass (the consumer was deleted) is an error of the pull, and
//! so, as a backstop, is a server that says nothing (no message, heartbeat
//! or status) for longer than a request lives while one is owed: the
//! caller closes the pull and opens another.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer;
use async_nats::jetstream::consumer::pull::BatchConfig;
use async_nats::{Client, StatusCode, Subscriber};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::time::Instant;

use crate::consume::pull_books::{Books, EXPIRY_MARGIN, End};
use crate::observe::metrics;
use crate::route::Route;

/// How long one pull request lives on the server (less if the consumer's
/// `max_expires` is shorter). Closing the pull waits at most about this
/// long, so it is short; renewing it costs one small publish per route per
/// period when idle.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// How often the server must say it is alive while a request waits
/// (at most half of the request's expiry, which the server requires).
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);

/// How often an idle pull checks whether the client reconnected, and
/// whether a request has expired.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);

/// The first pause after the server turned a request away (a `409` such as
/// `Exceeded MaxWaiting`); it doubles with each one in a row, up to
/// [`REFUSED_PAUSE_MAX`].
const REFUSED_PAUSE: Duration = Duration::from_millis(100);
const REFUSED_PAUSE_MAX: Duration = Duration::from_secs(5);

/// The longest pause after no server answered a request (`503`): while a
/// consumer elects its leader, nobody answers, and the route takes no
/// message until it asks after the election. Asking costs one small
/// message, and this bounds how long after the election it waits.
const NO_RESPONDERS_PAUSE_MAX: Duration = Duration::from_millis(400);

/// Refusals in a row for this long are warned about: longer than a
/// consumer's ordinary leader election (4 to 9 s).
const REFUSED_WARNING: Duration = Duration::from_secs(10);

/// Why the pull cannot go on; the caller closes it and opens a new one.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum PullError {
    #[error("the server said nothing for {0:?} while pull requests were open")]
    Silent(Duration),
    #[error("the pull request could not be sent: {0}")]
    Request(Arc<async_nats::PublishError>),
    #[error("the server ended the pull: {0}")]
    Ended(String),
    #[error(
        "the server refused the pull request: {0} (the consumer's limits changed; they are read again)"
    )]
    Limits(String),
    #[error("the pull's subscription ended")]
    Unsubscribed,
}

impl From<async_nats::PublishError> for PullError {
    fn from(error: async_nats::PublishError) -> Self {
        PullError::Request(Arc::new(error))
    }
}

impl PullError {
    /// Whether the consumer's info must be read again before the next pull
    /// opens: its request limits changed since it was read.
    pub(crate) fn needs_fresh_info(&self) -> bool {
        matches!(self, PullError::Limits(_))
    }
}

/// Why the server turned a request away, as the metric's `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// `503`: no server answers for the consumer (no leader, or deleted).
    NoResponders,
    /// `409 Exceeded MaxWaiting`.
    MaxWaiting,
    /// `409 Exceeded MaxRequestBatch`: the request is capped and sent again.
    MaxRequestBatch,
    /// `409 Exceeded MaxRequestExpires` or `MaxRequestMaxBytes`.
    RequestLimits,
    /// `409 Leadership Change`: asked again of the new leader.
    LeadershipChange,
    /// `409 Consumer Deleted`, `Consumer is push based`.
    ConsumerGone,
    /// Past its expiry without a word, and too few messages came for it to
    /// have been filled: dropped by the server (a full wait list, which it
    /// does not report to a request with heartbeats; a leader that died).
    Lost,
    /// Anything else.
    Other,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Refusal::NoResponders => "no_responders",
            Refusal::MaxWaiting => "max_waiting",
            Refusal::MaxRequestBatch => "max_request_batch",
            Refusal::RequestLimits => "request_limits",
            Refusal::LeadershipChange => "leadership_change",
            Refusal::ConsumerGone => "consumer_gone",
            Refusal::Lost => "lost",
            Refusal::Other => "other",
        }
    }
}

/// What a route's pulls report, across every pull it opens: the warnings
/// said once, and the metrics.
pub(crate) struct PullSignals {
    route: String,
    /// What the cap warning tells the operator to lower, by how the route
    /// sizes its batches.
    lower: String,
    /// Whether the route's requests are capped now (the gauge's value).
    capped: AtomicBool,
    /// Whether the cap was warned about (once per route).
    cap_warned: AtomicBool,
}

impl PullSignals {
    /// The signals of `route`.
    pub(crate) fn new(route: &Route) -> Arc<Self> {
        let lower = match (route.batching_chosen, route.adaptive) {
            _ if route.batch_cap() == 1 => "the route's concurrency".to_owned(),
            (true, false) => "the route's concurrency or batch (`Route::batch`)".to_owned(),
            (true, true) => {
                "the route's concurrency or largest batch (`Route::adaptive_batch`)".to_owned()
            }
            // A route left at its defaults asks for concurrency x its
            // default largest batch.
            (false, _) => format!(
                "the route's concurrency, or give it a largest batch of its own \
                 (`Route::adaptive_batch`; at its defaults it takes up to {} messages a batch)",
                route.batch_cap()
            ),
        };
        Arc::new(PullSignals {
            route: route.durable.clone(),
            lower,
            capped: AtomicBool::new(false),
            cap_warned: AtomicBool::new(false),
        })
    }

    /// Sets the gauge when the cap starts or stops applying, and warns the
    /// first time it does.
    fn check_cap(&self, books: &Books) {
        let capped = books.capped();
        if self.capped.swap(capped, Ordering::Relaxed) != capped {
            metrics::pull_request_capped(&self.route, capped);
        }
        if capped && !self.cap_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                route = self.route,
                wanted = books.wanted(),
                max_batch = books.size(),
                "the route's pull requests would ask for {} messages (concurrency x batch), more than the \
                 consumer's max_batch of {} (its own, or the server's jetstream limit max_request_batch), \
                 which the server refuses: each request is capped at {}, so fewer messages are fetched \
                 ahead; raise the limit, or lower {}",
                books.wanted(),
                books.size(),
                books.size(),
                self.lower,
            );
        }
    }

    fn refused(&self, reason: Refusal) {
        metrics::pull_request_refused(&self.route, reason.as_str());
    }
}

/// Refusals in a row: since when, and whether they were warned about.
struct Refusals {
    since: Instant,
    count: u32,
    warned: bool,
}

/// One open pull: its inbox, and the books of its requests.
pub(crate) struct PullStream {
    client: Client,
    context: async_nats::jetstream::Context,
    subscriber: Subscriber,
    /// `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`.
    subject: String,
    /// `<stream>/<consumer>`, for the warnings.
    consumer: String,
    /// The inbox; request `n` replies to `{inbox}.{n}`.
    inbox: String,
    books: Books,
    /// How long each request lives on the server, and how often it must
    /// hear from it.
    expires: Duration,
    heartbeat: Duration,
    /// The last request body sent, and the size it asks for.
    body: (usize, Bytes),
    /// When the server last sent anything on this pull.
    last_heard: Instant,
    /// The client's connection count when last looked at.
    connects: u64,
    statistics: Arc<async_nats::Statistics>,
    /// No request before this, after the server turned one away.
    refused_until: Option<Instant>,
    refusals: Option<Refusals>,
    /// The error that ended the pull, returned by every later
    /// [`next`](Self::next).
    failed: Option<PullError>,
    signals: Arc<PullSignals>,
}

/// What one message on the inbox was.
enum Read {
    Message(Box<Message>),
    /// A heartbeat or the end of a request: nothing for the caller.
    Status,
    Fatal(PullError),
}

impl PullStream {
    /// Subscribes to a fresh inbox for the messages of the consumer
    /// described by `info`, asking for `batch` at a time (at most its
    /// `max_batch`). The first request goes out with the first
    /// [`next`](Self::next).
    pub(crate) async fn open(
        info: &consumer::Info,
        client: &Client,
        batch: usize,
        signals: Arc<PullSignals>,
    ) -> Result<Self, async_nats::SubscribeError> {
        // idem's JetStream context has the default API prefix
        // (`router/mod.rs`, `jetstream::new`).
        let subject = format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
            info.stream_name, info.name
        );
        let inbox = client.new_inbox();
        let subscriber = client.subscribe(format!("{inbox}.*")).await?;
        let cap = usize::try_from(info.config.max_batch).ok();
        let books = Books::new(batch, cap);
        signals.check_cap(&books);
        let expires = match info.config.max_expires {
            limit if limit.is_zero() => PULL_EXPIRES,
            limit => limit.min(PULL_EXPIRES),
        };
        let statistics = client.statistics();
        let now = Instant::now();
        Ok(PullStream {
            context: async_nats::jetstream::new(client.clone()),
            client: client.clone(),
            subscriber,
            subject,
            consumer: format!("{}/{}", info.stream_name, info.name),
            inbox,
            books,
            expires,
            heartbeat: PULL_HEARTBEAT.min(expires / 2),
            body: (0, Bytes::new()),
            last_heard: now,
            connects: statistics.connects.load(Ordering::Relaxed),
            statistics,
            refused_until: None,
            refusals: None,
            failed: None,
            signals,
        })
    }

    /// Sets the size of the requests sent from now on: `batch` messages, at
    /// least 1 and at most the consumer's `max_batch`. Requests already
    /// open keep their size. The pull asks again whenever what its requests
    /// owe falls to half a request, so after a smaller size it asks for
    /// nothing until the caller has taken what the larger requests still
    /// bring, and after a larger one it asks at once: what it keeps
    /// requested ahead is at most about one and a half times the size.
    pub(crate) fn set_batch(&mut self, batch: usize) {
        self.books.set_batch(batch);
        self.signals.check_cap(&self.books);
    }

    /// The next message, asking for more first when half a request or less
    /// is owed. An error: the pull is over, close it and open a new one
    /// (every later call returns the same error). Never `None`.
    ///
    /// Cancel-safe: a request is on the books only once it was handed to
    /// the client, and a message is taken off the inbox only when returned.
    pub(crate) async fn next(&mut self) -> Option<Result<Message, PullError>> {
        loop {
            if let Some(error) = &self.failed {
                return Some(Err(error.clone()));
            }
            self.notice_reconnect();
            let lost = self.books.expire(Instant::now());
            if lost > 0 {
                // Dropped by the server without a word: counted, and warned
                // about if it lasts, like a refusal.
                self.refused(Refusal::Lost, "ended without a word", REFUSED_PAUSE);
            }
            if let Err(error) = self.ask_if_low().await {
                return Some(Err(self.fail(error)));
            }
            // Longer than a request lives on the books: a request lost
            // without a word leaves them first, and is counted and warned
            // about as lost, while the pull goes on asking.
            let silence = self.expires + EXPIRY_MARGIN + self.heartbeat;
            let silent_at = self.last_heard + silence;
            // While the client is away, the reconnect is what to wait for.
            let expects_word = self.books.expects_word()
                && self.client.connection_state() == async_nats::connection::State::Connected;
            let refused_until = self.refused_until;
            let received = tokio::select! {
                biased;
                received = self.subscriber.next() => received,
                _ = tokio::time::sleep_until(silent_at), if expects_word => {
                    return Some(Err(self.fail(PullError::Silent(silence))));
                }
                _ = tokio::time::sleep(RECONNECT_CHECK) => continue,
                _ = sleep_until(refused_until) => {
                    self.refused_until = None;
                    continue;
                }
            };
            let Some(received) = received else {
                return Some(Err(self.fail(PullError::Unsubscribed)));
            };
            match self.read(received) {
                Read::Message(message) => return Some(Ok(*message)),
                Read::Status => continue,
                Read::Fatal(error) => return Some(Err(self.fail(error))),
            }
        }
    }

    /// What has arrived and was not taken yet, without asking for more or
    /// waiting: for a caller that cannot start it soon, to lease it. An
    /// error that arrives is kept for the next [`next`](Self::next).
    pub(crate) fn take_arrived(&mut self) -> Vec<Message> {
        let mut arrived = Vec::new();
        while self.failed.is_none()
            && let Some(Some(received)) = self.subscriber.next().now_or_never()
        {
            match self.read(received) {
                Read::Message(message) => arrived.push(*message),
                Read::Status => {}
                Read::Fatal(error) => {
                    self.fail(error);
                }
            }
        }
        arrived
    }

    /// Waits for what arrives next, without asking for more: for a caller
    /// that cannot start it soon, to lease it. `None` when a status came
    /// instead. An error is kept for the next [`next`](Self::next), and
    /// nothing arrives after it. Cancel-safe.
    pub(crate) async fn arrival(&mut self) -> Option<Message> {
        if self.failed.is_some() {
            return std::future::pending().await;
        }
        let Some(received) = self.subscriber.next().await else {
            self.fail(PullError::Unsubscribed);
            return None;
        };
        match self.read(received) {
            Read::Message(message) => Some(*message),
            Read::Status => None,
            Read::Fatal(error) => {
                self.fail(error);
                None
            }
        }
    }

    /// Stops asking, and reads on until every request sent has ended
    /// (filled, ended by the server's status, or past its expiry), so that
    /// nothing stays requested on the server. Returns every message that
    /// came, for the caller to start or hand back.
    ///
    /// Takes at most the last request's remaining life and a margin. Not
    /// while NATS is away: the statuses cannot come then, and what the server
    /// kept for a dead connection goes nowhere; such messages are redelivered
    /// after ack_wait.
    pub(crate) async fn close(mut self) -> Vec<Message> {
        let mut delivered = Vec::new();
        self.notice_reconnect();
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        let readable = !matches!(self.failed, Some(PullError::Unsubscribed));
        if connected && readable {
            self.read_until_ended(&mut delivered).await;
        }
        // What arrived and was not read yet (all of it, when NATS is away).
        while let Some(Some(received)) = self.subscriber.next().now_or_never() {
            if let Read::Message(message) = self.read(received) {
                delivered.push(*message);
            }
        }
        if !self.books.all_ended() {
            tracing::debug!(
                route = self.signals.route,
                open = self.books.open(),
                "closing the pull without reading its requests' ends (NATS is away, or its subscription ended): what they deliver is redelivered after ack_wait"
            );
            self.books.clear();
        }
        delivered
    }

    /// Reads the inbox until every request has ended, into `delivered`.
    async fn read_until_ended(&mut self, delivered: &mut Vec<Message>) {
        loop {
            self.books.expire(Instant::now());
            if self.books.all_ended() {
                return;
            }
            let Some(deadline) = self.books.next_expiry() else {
                return;
            };
            match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(received)) => {
                    if let Read::Message(message) = self.read(received) {
                        delivered.push(*message);
                    }
                }
                Ok(None) => return,
                // That request's expiry and margin passed: it leaves the
                // books at the top of the loop.
                Err(_) => {}
            }
        }
    }

    /// Keeps `error` for every later [`next`](Self::next).
    fn fail(&mut self, error: PullError) -> PullError {
        self.failed = Some(error.clone());
        error
    }

    /// After a reconnect, the requests open become stale (see the module
    /// docs) and a new one goes out at once. The client has subscribed the
    /// inbox again before it sends anything else.
    fn notice_reconnect(&mut self) {
        let connects = self.statistics.connects.load(Ordering::Relaxed);
        if connects != self.connects {
            tracing::debug!(
                route = self.signals.route,
                open = self.books.open(),
                "the NATS client reconnected; asking for messages again"
            );
            self.connects = connects;
            self.books.reconnected();
            self.refused_until = None;
            self.last_heard = Instant::now();
        }
    }

    /// Sends a request when half a request or less is owed, unless the
    /// server just turned one away or the client is not connected.
    async fn ask_if_low(&mut self) -> Result<(), PullError> {
        if !self.books.wants_more() {
            return Ok(());
        }
        if self
            .refused_until
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(());
        }
        if self.client.connection_state() != async_nats::connection::State::Connected {
            // Asked again once the reconnect is noticed.
            return Ok(());
        }
        let size = self.books.size();
        let body = self.body(size);
        let reply = format!("{}.{}", self.inbox, self.books.next_id());
        let owed_before = self.books.expects_word();
        self.client
            .publish_with_reply(self.subject.clone(), reply, body)
            .await?;
        let now = Instant::now();
        if !owed_before {
            // Silence counts from the first request owed.
            self.last_heard = now;
        }
        let id = self.books.sent(size, now, self.expires);
        tracing::trace!(route = self.signals.route, id, size, "pull request sent");
        Ok(())
    }

    /// The JSON body of a request for `size` messages.
    fn body(&mut self, size: usize) -> Bytes {
        if self.body.0 != size {
            let body = serde_json::to_vec(&BatchConfig {
                batch: size,
                expires: Some(self.expires),
                idle_heartbeat: self.heartbeat,
                ..BatchConfig::default()
            })
            .expect("a pull request serializes");
            self.body = (size, body.into());
        }
        self.body.1.clone()
    }

    /// Reads one message of the inbox: a message of the stream, or a status
    /// about the request its subject names (a heartbeat, or its end).
    fn read(&mut self, received: async_nats::Message) -> Read {
        self.last_heard = Instant::now();
        let status = received.status.unwrap_or(StatusCode::OK);
        if status == StatusCode::OK {
            self.books.message();
            self.answered();
            return Read::Message(Box::new(Message {
                message: received,
                context: self.context.clone(),
            }));
        }
        let Some(id) = received
            .subject
            .as_str()
            .strip_prefix(self.inbox.as_str())
            .and_then(|id| id.strip_prefix('.'))
            .and_then(|id| id.parse::<u64>().ok())
            .filter(|id| self.books.is_open(*id))
        else {
            // About a request no longer on the books: it expired here
            // first, or it is a new leader's notice for one long gone.
            return Read::Status;
        };
        tracing::trace!(route = self.signals.route, id, %status, description = ?received.description, "pull request status");
        match status {
            StatusCode::IDLE_HEARTBEAT => {
                self.answered();
                Read::Status
            }
            StatusCode::TIMEOUT | StatusCode::NOT_FOUND => {
                let end = left(&received).map_or(End::Unknown, End::Left);
                if let Some(request) = self.books.end(id, end) {
                    // A request normally ends at its expiry. One that ended
                    // long before (an interest that expired at once, say)
                    // would otherwise be asked again at once, in a loop.
                    let half_life = request.expires_at.checked_sub(self.expires / 2);
                    if half_life.is_some_and(|half_life| Instant::now() < half_life) {
                        self.refused_until = Some(Instant::now() + REFUSED_PAUSE);
                    }
                }
                Read::Status
            }
            StatusCode::REQUEST_TERMINATED => self.terminated(id, &received),
            StatusCode::NO_RESPONDERS => {
                // The request reached no server, so it waits nowhere.
                self.books.end(id, End::Refused);
                self.refused(
                    Refusal::NoResponders,
                    "no responders",
                    NO_RESPONDERS_PAUSE_MAX,
                );
                Read::Status
            }
            status => {
                self.books.end(id, End::Unknown);
                self.signals.refused(Refusal::Other);
                Read::Fatal(PullError::Ended(format!(
                    "{status} {}",
                    received.description.as_deref().unwrap_or_default()
                )))
            }
        }
    }

    /// A `409` that ended request `id`, or turned it away.
    fn terminated(&mut self, id: u64, received: &async_nats::Message) -> Read {
        let description = received.description.clone().unwrap_or_default();
        let left = left(received);
        if description == "Consumer Deleted" || description == "Consumer is push based" {
            self.books.end(id, left.map_or(End::Unknown, End::Left));
            self.signals.refused(Refusal::ConsumerGone);
            return Read::Fatal(PullError::Ended(description));
        }
        if let Some(cap) = description
            .strip_prefix("Exceeded MaxRequestBatch of ")
            .and_then(|cap| cap.trim().parse::<usize>().ok())
            .filter(|cap| *cap > 0)
        {
            // The consumer's max_batch is lower than when the pull opened:
            // capped, and asked again at once.
            self.books.end(id, End::Refused);
            self.signals.refused(Refusal::MaxRequestBatch);
            if cap < self.books.size() {
                self.books.set_cap(cap);
                self.signals.check_cap(&self.books);
                return Read::Status;
            }
            self.refused(Refusal::Other, &description, REFUSED_PAUSE_MAX);
            return Read::Status;
        }
        if description.starts_with("Exceeded MaxRequest") {
            self.books.end(id, End::Refused);
            self.signals.refused(Refusal::RequestLimits);
            return Read::Fatal(PullError::Limits(description));
        }
        if description == "Leadership Change" {
            // A new leader is elected: ask it at once.
            self.books.end(id, End::LeaderChanged);
            self.signals.refused(Refusal::LeadershipChange);
            self.refused_until = None;
            tracing::debug!(
                route = self.signals.route,
                "the consumer has a new leader; asking it for messages"
            );
            return Read::Status;
        }
        // Ended or turned away for a reason that passes (too many waiting
        // requests, a message over the request's size): ask again after a
        // pause.
        let (end, reason) = match left {
            Some(left) => (End::Left(left), Refusal::Other),
            None if description == "Exceeded MaxWaiting" => (End::Refused, Refusal::MaxWaiting),
            None => (End::Unknown, Refusal::Other),
        };
        self.books.end(id, end);
        self.refused(reason, &description, REFUSED_PAUSE_MAX);
        Read::Status
    }

    /// The server turned a request away for a reason that passes: counts
    /// it, pauses the next request (doubling with each in a row, up to
    /// `longest`), and warns once refusals have lasted
    /// [`REFUSED_WARNING`].
    fn refused(&mut self, reason: Refusal, description: &str, longest: Duration) {
        self.signals.refused(reason);
        let now = Instant::now();
        let refusals = self.refusals.get_or_insert(Refusals {
            since: now,
            count: 0,
            warned: false,
        });
        refusals.count += 1;
        let pause = REFUSED_PAUSE
            .saturating_mul(1 << (refusals.count - 1).min(16))
            .min(longest);
        self.refused_until = Some(now + pause);
        let lasted = now - refusals.since;
        tracing::debug!(route = self.signals.route, %description, ?pause, "the server turned a pull request away");
        if lasted >= REFUSED_WARNING && !refusals.warned {
            refusals.warned = true;
            let cause = match reason {
                Refusal::NoResponders => format!(
                    "no server answers for consumer {}: it has no leader (an election, or too few \
                     servers of its cluster are up) or it was deleted",
                    self.consumer
                ),
                Refusal::MaxWaiting => format!(
                    "consumer {} has too many pull requests waiting (its max_waiting): too many \
                     workers pull from it",
                    self.consumer
                ),
                Refusal::Lost => format!(
                    "the server drops them without a word: consumer {} has too many pull requests \
                     waiting (its max_waiting), or its leader is gone",
                    self.consumer
                ),
                _ => format!("consumer {}: {description}", self.consumer),
            };
            tracing::warn!(
                route = self.signals.route,
                refused = refusals.count,
                "the route takes no message: its pull requests have been turned away for {lasted:.1?}; {cause}"
            );
        }
    }

    /// The server serves the pull again (a message, or a heartbeat of a
    /// request that waits): the refusals in a row are over.
    fn answered(&mut self) {
        if let Some(refusals) = self.refusals.take()
            && refusals.warned
        {
            tracing::info!(
                route = self.signals.route,
                "the route's pull requests are served again, after {:.1?} of refusals",
                refusals.since.elapsed()
            );
        }
    }
}

/// What an ended request left undelivered, from its status's
/// `Nats-Pending-Messages`.
fn left(status: &async_nats::Message) -> Option<usize> {
    status
        .headers
        .as_ref()?
        .get("Nats-Pending-Messages")?
        .as_str()
        .parse()
        .ok()
}

/// Sleeps until `until`, or forever.
async fn sleep_until(until: Option<Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}
