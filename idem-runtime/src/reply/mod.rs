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
//!    id, exactly as a JetStream route does, under the route's **name**
//!    (below), and stores the handler's value with the claim
//!    ([`results`](crate::handler::results)); a value too large to be sent as a
//!    reply is refused there, before COMMIT;
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
//! # The route's name, and rolling deploys
//!
//! A request is claimed under the route's name
//! ([`ReplyRoute::name`], by default its subject), as
//! `reply:<name>` ([`ReplyRoute::dedup_name`]), not under its handler's
//! name, and the route subscribes in a queue group of that name. So two
//! versions of a handler answering one subject during a rolling deploy
//! (`orders.place.v1` and `orders.place.v2`) are one queue group, and each
//! request goes to one of them; and they share their claims, so a client's
//! retry that lands on the other version gets the first reply, and the
//! request runs once. (A JetStream route keys its claims by its handler's
//! name; a reply route's are apart from them.) At start-up the router
//! refuses two reply routes whose subjects overlap (a request to a subject
//! both match would run in both), and warns when the handler's own name
//! is registered in the database: an earlier idem keyed a reply route's
//! claims by it (see CHANGELOG.md).
//!
//! # Error replies
//!
//! A request that did not succeed gets a reply with two headers and an
//! empty payload:
//!
//! | header | value |
//! |---|---|
//! | `Idem-Error` | `retry`: nothing was committed (or, after a lost COMMIT, it may have been: a retry finds out), send the request again with the same id; `permanent`: the same request will fail the same way |
//! | `Idem-Reason` | a short class from [`reason`] (`handler-error`, say); with [`ReplyRoute::detailed_reasons`], the class, `: ` and what happened, one line, at most 1 KiB |
//!
//! The error's text, which may hold the handler's error chain (SQL,
//! account numbers), goes to the log either way, and to the requester only
//! on a route that asks for it.
//!
//! | what fails | `Idem-Error` | `Idem-Reason` |
//! |---|---|---|
//! | no message id: no `Nats-Msg-Id` header and no `key = ...` | `permanent` | `no-message-id` |
//! | an unusable id (empty, over 512 bytes, NUL or line break) | `permanent` | `bad-message-id` |
//! | the payload does not decode | `permanent` | `undecodable` |
//! | the handler returns a transient error | `retry` | `handler-error` |
//! | the handler returns a permanent error ([`Classify`](crate::Classify)) | `permanent` | `handler-error` |
//! | the handler times out | `retry` | `handler-timeout` |
//! | the handler panics | `retry` | `handler-panic` |
//! | a serialization failure, deadlock, or other retry-now error | tried again at once (3 tries in all), then `retry`; a unique violation that persists: `permanent` | `handler-error` (`commit-refused` if COMMIT refused it) |
//! | the value does not encode | `permanent` | `unencodable` |
//! | the encoded value is larger than the NATS server's `max_payload` | `permanent` | `reply-too-large` |
//! | the database cannot be used (no connection, BEGIN or the claim fails) | tried once more at once, then `retry` | `database-unavailable` |
//! | the claim itself fails (it waited past the statement timeout on an attempt still running, say) | by its SQLSTATE | `claim-failed` |
//! | COMMIT's outcome is unknown (the connection died during it) | `retry`: if it did commit, the retry gets the stored reply | `commit-unknown` |
//! | the handler ended the transaction itself (a raw COMMIT) | `permanent`: part of its work may be committed | `claim-lost` |
//! | the router is shutting down, and the request was not started | `retry` | `shutting-down` |
//! | processed before, and its stored reply is larger than `max_payload` (stored when it fitted) | `permanent`: it was committed, its reply cannot be sent | `reply-too-large` |
//! | processed before, and its claim expired in the instant the retry found it | `permanent` | `expired` |
//!
//! In every case but COMMIT unknown, the raw COMMIT and the last two,
//! nothing was committed. Unlike a JetStream message, a failed request is
//! not redelivered or dead-lettered: the client holds it, and decides
//! whether to send it again. A message published without a reply subject
//! is not a request: it is dropped, with a warning, and counted as
//! rejected.
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
//! # Retention
//!
//! A reply route keeps its claims, and the replies stored with them, for
//! a day ([`ReplyRoute::retention`]; [`ReplyRoute::keep_forever`] keeps
//! them forever), so that whoever may publish to the subject cannot grow
//! the table without bound. A retry within that gets the stored reply; a
//! retry after the claim expired is a new request: it **runs again**. At
//! start-up the router refuses a retention below the route's
//! [retention floor](crate::retention::floor#reply-routes): the
//! client-retry horizon ([`ReplyRoute::client_retry_horizon`], 1 h unless
//! declared) plus one transaction's longest run.
//!
//! # Shutdown
//!
//! On shutdown the route unsubscribes, answers the requests it had received
//! but not started with `Idem-Error: retry` (another worker of the queue
//! group takes the retry), and lets the requests in flight finish, commit
//! and reply, within the router's grace period.

use std::time::Duration;

use crate::error::Error;
use crate::error::retention::{RetentionFloor, Unbounded};
use crate::route::Route;
use crate::store::backend::Backend;

/// The header that says a reply is an error, and whether to retry.
pub const ERROR_HEADER: &str = "Idem-Error";

/// The header that says why a request failed: a class from [`reason`],
/// followed by `: ` and the error's text on a route with
/// [`ReplyRoute::detailed_reasons`].
pub const REASON_HEADER: &str = "Idem-Reason";

/// The classes an error reply's `Idem-Reason` starts with. Short and
/// fixed, so that a client can branch on them and a requester learns
/// nothing of the handler's internals; the error's text goes to the log
/// (and, on a route with [`ReplyRoute::detailed_reasons`], after the class).
pub mod reason {
    /// No `Nats-Msg-Id` header, and the handler has no `key = ...`.
    pub const NO_MESSAGE_ID: &str = "no-message-id";
    /// The message id is unusable (empty, too long, NUL or line break), or
    /// the handler's key expression panicked.
    pub const BAD_MESSAGE_ID: &str = "bad-message-id";
    /// The payload does not decode with the handler's codec.
    pub const UNDECODABLE: &str = "undecodable";
    /// The handler returned an error (`Idem-Error` says whether a retry
    /// may succeed), or ignored a failed statement.
    pub const HANDLER_ERROR: &str = "handler-error";
    /// The handler ran past its timeout.
    pub const HANDLER_TIMEOUT: &str = "handler-timeout";
    /// The handler panicked.
    pub const HANDLER_PANIC: &str = "handler-panic";
    /// The handler's value does not encode with its codec.
    pub const UNENCODABLE: &str = "unencodable";
    /// The encoded value is larger than the NATS server's `max_payload`:
    /// refused before COMMIT; or, for a reply stored when it still fitted,
    /// the request was processed and its reply cannot be sent.
    pub const REPLY_TOO_LARGE: &str = "reply-too-large";
    /// The database could not be used before the handler ran.
    pub const DATABASE_UNAVAILABLE: &str = "database-unavailable";
    /// The claim failed for a reason of this request's own.
    pub const CLAIM_FAILED: &str = "claim-failed";
    /// PostgreSQL refused the COMMIT: nothing was committed.
    pub const COMMIT_REFUSED: &str = "commit-refused";
    /// COMMIT's outcome is unknown; a retry finds out.
    pub const COMMIT_UNKNOWN: &str = "commit-unknown";
    /// The handler ended the transaction itself: part of its work may be
    /// committed.
    pub const CLAIM_LOST: &str = "claim-lost";
    /// The worker is shutting down and did not start the request.
    pub const SHUTTING_DOWN: &str = "shutting-down";
    /// Processed before, but its claim expired as the retry found it.
    pub const EXPIRED: &str = "expired";
    /// The request could not be processed now.
    pub const UNAVAILABLE: &str = "unavailable";
}

/// The longest `Idem-Reason`.
pub(crate) const MAX_REASON: usize = 1024;

/// How long answering the requests received but not started may take at
/// shutdown.
pub(crate) const HAND_BACK_BOUND: Duration = Duration::from_secs(2);

/// How long a reply route keeps its claims and stored replies unless it
/// sets a retention: a day.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// How long after its first send a client may send a request again, unless
/// the route declares otherwise: an hour.
pub const DEFAULT_CLIENT_RETRY_HORIZON: Duration = Duration::from_secs(3600);

/// What a reply route's claims are keyed under: this prefix and the
/// route's name.
pub(crate) const DEDUP_PREFIX: &str = "reply:";

/// One binding of a handler to core NATS requests on a subject: the
/// handler's value (or an error) is the reply, and a retried request (same
/// message id) gets the first reply without running the handler again.
///
/// | setting | default |
/// |---|---|
/// | [`name`](Self::name) | the subject: claims are keyed under `reply:<name>`, whatever the handler is called |
/// | [`queue_group`](Self::queue_group) | the route's name: every worker and every version of the handler share the requests |
/// | [`concurrency`](Self::concurrency) | 8 requests in flight per route in this process |
/// | [`handler_timeout`](Self::handler_timeout) | 30 s (the handler only; also bounds the transaction on the server, as on a [`Route`]) |
/// | [`retention`](Self::retention) | a day ([`DEFAULT_RETENTION`]), refused below the [retention floor](crate::retention::floor#reply-routes); [`keep_forever`](Self::keep_forever) for none |
/// | [`client_retry_horizon`](Self::client_retry_horizon) | an hour ([`DEFAULT_CLIENT_RETRY_HORIZON`]) |
/// | `Idem-Reason` | a short class ([`reason`]); [`detailed_reasons`](Self::detailed_reasons) adds the error's text |
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
    name: Option<String>,
    queue_group: Option<String>,
    pub(crate) concurrency: usize,
    handler_timeout: Option<Duration>,
    /// `None`: kept forever.
    pub(crate) retention: Option<Duration>,
    client_retry_horizon: Duration,
    accepted_unbounded: Vec<Unbounded>,
    pub(crate) detailed_reasons: bool,
}

impl ReplyRoute {
    /// Answers the requests sent to `subject` (wildcards allowed).
    pub fn new(subject: impl Into<String>) -> Self {
        Self {
            subject: subject.into(),
            name: None,
            queue_group: None,
            concurrency: 8,
            handler_timeout: Some(Duration::from_secs(30)),
            retention: Some(DEFAULT_RETENTION),
            client_retry_horizon: DEFAULT_CLIENT_RETRY_HORIZON,
            accepted_unbounded: Vec::new(),
            detailed_reasons: false,
        }
    }

    /// The route's name (default: its subject). Requests are claimed under
    /// it ([`dedup_name`](Self::dedup_name)), not under the handler's
    /// name, and the route subscribes in a queue group of that name: every
    /// version of the handler that answers the route shares one set of
    /// claims and one queue group, so a rolling deploy or a renamed handler
    /// runs each request once. Name the route to keep its claims when its
    /// subject changes. Every worker that answers the subject must use the
    /// same name: workers under two names are two queue groups with two
    /// sets of claims, and each request runs under both. Never give two
    /// routes one name.
    ///
    /// ```
    /// use idem_runtime::ReplyRoute;
    ///
    /// let route = ReplyRoute::new("orders.place.eu").name("orders.place");
    /// assert_eq!(route.dedup_name(), "reply:orders.place");
    /// assert_eq!(ReplyRoute::new("orders.place").dedup_name(), "reply:orders.place");
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The queue group the route subscribes in (default: the route's
    /// [name](Self::name)). Each request goes to one member of the group.
    /// Workers in different groups would each take every request: they
    /// share the claims, so it runs once, but every request costs a second
    /// transaction.
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
    /// reply); storing its reply with its claim counts within it. Default
    /// 30 s. As on a [`Route`], it also bounds each statement
    /// of the transaction on the server, and never races BEGIN or COMMIT.
    /// A retry that waits on the claim of an attempt still running waits at
    /// most this long too. It is part of the retention floor.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// Let a handler run as long as it likes. The retention floor then has
    /// no bound: keep the claims forever, or accept
    /// [`Unbounded::HandlerTimeout`].
    pub fn without_handler_timeout(mut self) -> Self {
        self.handler_timeout = None;
        self
    }

    /// Keeps this route's claims, and the replies stored with them, for at
    /// least `period` (default a day, [`DEFAULT_RETENTION`]); a retry after
    /// that runs the request again. Refused at start-up below the route's
    /// [retention floor](Self::retention_floor).
    pub fn retention(mut self, period: Duration) -> Self {
        self.retention = Some(period);
        self
    }

    /// Keeps this route's claims and stored replies forever: a retry at any
    /// time gets the first reply. The claims table then grows with every
    /// request id anyone sends, so restrict who may publish to the subject.
    pub fn keep_forever(mut self) -> Self {
        self.retention = None;
        self
    }

    /// How long after it first sends a request a client may send it again
    /// (default an hour, [`DEFAULT_CLIENT_RETRY_HORIZON`]): a promise of
    /// the route's clients that the [retention floor](Self::retention_floor)
    /// counts on. A retry sent later than that may find its claim expired,
    /// and then runs the request again.
    pub fn client_retry_horizon(mut self, horizon: Duration) -> Self {
        self.client_retry_horizon = horizon;
        self
    }

    /// Lets the route set a retention although `term` of its retention
    /// floor has no bound (on a reply route, only
    /// [`Unbounded::HandlerTimeout`] can be): the term counts 0, and a
    /// retry that arrives after the retention runs the request again.
    pub fn accept_duplicates_after_retention(mut self, term: Unbounded) -> Self {
        if !self.accepted_unbounded.contains(&term) {
            self.accepted_unbounded.push(term);
        }
        self
    }

    /// Sends the error's text in `Idem-Reason`, after its class
    /// (`handler-error: the handler failed: unknown account 7`). Off by
    /// default: the text may hold the handler's error chain (SQL, names,
    /// numbers), and any requester would read it. Turn it on for internal
    /// callers that log it; the log has it either way.
    pub fn detailed_reasons(mut self) -> Self {
        self.detailed_reasons = true;
        self
    }

    /// The subject the route answers.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The route's name: what [`name`](Self::name) set, else the subject.
    pub fn route_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.subject)
    }

    /// What the route's claims are keyed under: `reply:` and its name. Pass
    /// it as the handler to [`results::stored`](crate::handler::results::stored), or
    /// to `idem_key(name, message_id)` in SQL.
    pub fn dedup_name(&self) -> String {
        format!("{DEDUP_PREFIX}{}", self.route_name())
    }

    /// The route's retention floor: the shortest retention under which
    /// every retry its clients may send within their horizon finds its
    /// claim (see [Reply routes](crate::retention::floor#reply-routes)).
    /// The router refuses a retention below it at start-up.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::ReplyRoute;
    ///
    /// let route = ReplyRoute::new("orders.place")
    ///     .client_retry_horizon(Duration::from_secs(600))
    ///     .handler_timeout(Duration::from_secs(10));
    /// // 10 min + 3 × 10 s
    /// assert_eq!(route.retention_floor().value(), Some(Duration::from_secs(630)));
    /// ```
    pub fn retention_floor(&self) -> RetentionFloor {
        crate::retention::floor::for_requests(
            self.handler_timeout,
            self.client_retry_horizon,
            &self.accepted_unbounded,
        )
    }

    /// The queue group to subscribe in.
    pub(crate) fn group(&self) -> &str {
        self.queue_group.as_deref().unwrap_or(self.route_name())
    }

    /// The route as the pipeline runs it: no stream, no heartbeats, the
    /// handler timeout and the in-process retries of the default policy.
    pub(crate) fn as_route(&self) -> Route {
        let route = Route::new(String::new(), self.subject.clone());
        match self.handler_timeout {
            Some(timeout) => route.handler_timeout(timeout),
            None => route.without_handler_timeout(),
        }
    }

    /// Refuses settings that cannot work, and a retention below the
    /// route's floor.
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
        let unusable = |text: &str| {
            text.is_empty() || text.contains(|c: char| c.is_whitespace() || c.is_control())
        };
        if self.name.as_deref().is_some_and(unusable) {
            return refuse(
                "the route's name is empty or holds whitespace or a control character; it keys the route's claims and names its queue group".into(),
            );
        }
        if self.queue_group.as_deref().is_some_and(unusable) {
            return refuse("the queue group is empty or holds whitespace".into());
        }
        if self.concurrency == 0 {
            return refuse("concurrency must be at least 1".into());
        }
        if let Some(timeout) = self.handler_timeout
            && (timeout.is_zero() || timeout.as_millis() + 1000 > i32::MAX as u128)
        {
            return refuse(format!(
                "the handler timeout ({timeout:?}) must be between 1 ms and about 24.8 days (the bound idem sets on the database's statements is in milliseconds, a 32-bit integer); use `without_handler_timeout()` for none"
            ));
        }
        crate::retention::floor::judge(self.subject(), self.retention, self.retention_floor())?;
        Ok(())
    }
}

/// Whether some subject matches both subject patterns `a` and `b`
/// (`*` one token, `>` one or more at the end): two reply routes on such
/// subjects would both take that subject's requests.
pub(crate) fn subjects_overlap(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    for i in 0.. {
        match (a.get(i), b.get(i)) {
            (None, None) => return true,
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (Some(x), Some(y)) if x == y || *x == "*" || *y == "*" => {}
            _ => return false,
        }
    }
    unreachable!("the loop returns")
}

/// Warns if `handler`'s own name is registered in `idem_handlers` while
/// `route` keys its claims under its route name: an earlier idem keyed a
/// reply route's claims by the handler's name, so requests it answered are
/// not found by this version (a client's retry of one runs again), and
/// while one of its workers still answers the subject, in a queue group of
/// its own, every request runs in both. Nothing to do once the old
/// workers are stopped and no client retries a request older than the
/// upgrade; the row can then be deleted.
pub(crate) async fn warn_of_claims_under_handler_name<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    route: &ReplyRoute,
    handler: &str,
) {
    let registered = DB::registered_at(pool, handler).await;
    match registered {
        Ok(Some(at)) => tracing::warn!(
            subject = route.subject(),
            handler,
            claims_under = route.dedup_name(),
            last_registered = at,
            "the handler name `{handler}` is registered in idem_handlers (last at {at}): an earlier idem keyed this reply route's claims by it, this one keys them under `{}`. Requests answered under the old key are not found: a client's retry of one runs it again, and while a worker of the earlier version still answers `{}` every request runs in both. Stop the old workers before this version takes requests; once no client retries requests older than the upgrade, delete its kept claims and then the row (DELETE FROM idem_claims_kept WHERE handler_id = (SELECT id FROM idem_handlers WHERE name = '{handler}'); DELETE FROM idem_handlers WHERE name = '{handler}'), which ends this warning. (If a JetStream route elsewhere uses this handler name, this does not apply.)",
            route.dedup_name(),
            route.subject()
        ),
        Ok(None) => {}
        Err(error) => {
            tracing::debug!(%error, "could not look for claims under the handler's name")
        }
    }
}

/// How a pipeline ends a message: the one thing a JetStream route's
/// pipeline and a request route's do differently.
pub(crate) enum Mode {
    /// A JetStream route: the message is acked, NAKed or dead-lettered.
    /// `copy_spread` is how far apart copies of one message can be stored,
    /// where the route declares it (its publisher-retry horizon, see the
    /// retention floor): then a claim needs to probe only the generations
    /// that can hold an earlier claim of its message (see `Pipeline::claim`).
    /// `None`: copies may come at any time, and every claim probes them all.
    Consume {
        /// How far apart copies of one message can be stored.
        copy_spread: Option<Duration>,
    },
    /// A request route: a caller waits for each message's outcome.
    Answer(Answers),
}

impl Mode {
    /// What a request route's pipeline knows, if this is one.
    pub(crate) fn answers(&self) -> Option<&Answers> {
        match self {
            Mode::Consume { .. } => None,
            Mode::Answer(answers) => Some(answers),
        }
    }

    /// How far apart copies of one message can be stored (see
    /// [`Mode::Consume`]); a request is stored nowhere.
    pub(crate) fn copy_spread(&self) -> Option<Duration> {
        match self {
            Mode::Consume { copy_spread } => *copy_spread,
            Mode::Answer(_) => None,
        }
    }
}

/// What a request route's pipeline knows that a JetStream route's does
/// not: it answers a caller who waits (a duplicate reads the stored result,
/// and while the database cannot be used a request is answered with an
/// error after one more try instead of being held).
pub(crate) struct Answers {
    /// What the route's claims are keyed under ([`ReplyRoute::dedup_name`]).
    pub(crate) claims_under: String,
    /// Whether `Idem-Reason` carries the error's text after its class.
    pub(crate) detailed_reasons: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consume::reply::{Answer, one_line};
    use crate::error::ErrorClass;

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
            ReplyRoute::new("orders.place").name(""),
            ReplyRoute::new("orders.place").name("orders place"),
            ReplyRoute::new("orders.place").retention(Duration::from_secs(10)),
            ReplyRoute::new("orders.place").without_handler_timeout(),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        for good in [
            ReplyRoute::new("orders.place").keep_forever(),
            ReplyRoute::new("orders.place")
                .without_handler_timeout()
                .keep_forever(),
            ReplyRoute::new("orders.place")
                .without_handler_timeout()
                .accept_duplicates_after_retention(Unbounded::HandlerTimeout),
            ReplyRoute::new("orders.place")
                .client_retry_horizon(Duration::from_secs(2))
                .handler_timeout(Duration::from_secs(1))
                .retention(Duration::from_secs(5)),
        ] {
            good.validate()
                .unwrap_or_else(|error| panic!("{good:?}: {error}"));
        }
    }

    #[test]
    fn a_route_is_named_and_grouped_by_its_subject_unless_told() {
        let route = ReplyRoute::new("orders.place");
        assert_eq!(
            (
                route.route_name(),
                route.group(),
                route.dedup_name().as_str()
            ),
            ("orders.place", "orders.place", "reply:orders.place")
        );
        let named = ReplyRoute::new("orders.place.eu").name("orders.place");
        assert_eq!(
            (named.group(), named.dedup_name().as_str()),
            ("orders.place", "reply:orders.place")
        );
        let grouped = named.queue_group("eu-workers");
        assert_eq!(
            (grouped.group(), grouped.dedup_name().as_str()),
            ("eu-workers", "reply:orders.place")
        );
    }

    #[test]
    fn overlapping_subjects_are_told_apart() {
        for (a, b) in [
            ("orders.place", "orders.place"),
            ("orders.place", "orders.*"),
            ("orders.*.eu", "orders.place.*"),
            ("orders.>", "orders.place.eu"),
            ("orders.>", "orders.*"),
            (">", "orders"),
            ("*", "orders"),
        ] {
            assert!(subjects_overlap(a, b) && subjects_overlap(b, a), "{a} {b}");
        }
        for (a, b) in [
            ("orders.place", "orders.cancel"),
            ("orders.place", "orders.place.eu"),
            ("orders.>", "orders"),
            ("orders.*", "orders.place.eu"),
            ("orders.*.eu", "orders.place.us"),
            ("*", "orders.place"),
        ] {
            assert!(
                !subjects_overlap(a, b) && !subjects_overlap(b, a),
                "{a} {b}"
            );
        }
    }

    #[test]
    fn the_default_retention_is_above_the_default_floor() {
        let floor = ReplyRoute::new("orders.place").retention_floor();
        assert_eq!(floor.value(), Some(Duration::from_secs(3600 + 90)));
        assert!(floor.value().unwrap() < DEFAULT_RETENTION);
        assert_eq!(
            floor.to_string(),
            "client retries: horizon 1h (`ReplyRoute::client_retry_horizon`, from the client's first send) \
             + the retry's wait in the worker, behind requests in flight: one transaction's longest run \
             (claim wait, 1 handler call, COMMIT) 3 × handler_timeout 30s = 1m 30s; floor = 1h + 1m 30s = 1h 1m 30s"
        );
        let unbounded = ReplyRoute::new("orders.place")
            .without_handler_timeout()
            .retention_floor();
        assert_eq!(unbounded.value(), None);
        assert_eq!(unbounded.unbounded(), [Unbounded::HandlerTimeout]);
        let accepted = ReplyRoute::new("orders.place")
            .without_handler_timeout()
            .accept_duplicates_after_retention(Unbounded::HandlerTimeout)
            .retention_floor();
        assert_eq!(accepted.value(), Some(DEFAULT_CLIENT_RETRY_HORIZON));
    }

    #[test]
    fn only_permanent_classes_say_permanent() {
        for (class, retry) in [
            (ErrorClass::Transient, true),
            (ErrorClass::RetryNow, true),
            (ErrorClass::RetryNowThenPermanent, false),
            (ErrorClass::Permanent, false),
        ] {
            let Answer::Error { retry: said, .. } =
                Answer::error(class, reason::HANDLER_ERROR, "x")
            else {
                unreachable!()
            };
            assert_eq!(said, retry, "{class:?}");
        }
    }
}
