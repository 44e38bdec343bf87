//! What the retention floor and the purge report: the floor's computation,
//! term by term ([`RetentionFloor`]), its unbounded terms ([`Unbounded`]),
//! the start-up refusals' texts, and a purge that failed ([`PurgeFailure`]).
//!
//! Plain data and how it reads. It imports nothing else of idem, so that
//! [`Error`](crate::Error) can carry it without the error types depending on
//! the retention code that computes it.

use std::fmt;
use std::time::Duration;

/// A term of the retention floor that has no finite bound.
///
/// A route whose floor has one and that sets a retention is refused at
/// start-up, unless it accepts the term with
/// [`Route::accept_duplicates_after_retention`](crate::Route::accept_duplicates_after_retention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unbounded {
    /// The stream keeps messages forever (`max_age` 0), so a stored message
    /// can be redelivered or replayed (an ack floor reset, a consumer
    /// created again) at any time.
    StreamMaxAge,
    /// The route has no handler timeout, so a transaction can run, and
    /// commit its claim, any time after the claim was stamped.
    HandlerTimeout,
    /// The route declares no publisher-retry horizon, so a publisher may
    /// publish the message again at any time; after the stream's duplicate
    /// window that copy is stored and delivered anew.
    PublisherRetryHorizon,
}

impl Unbounded {
    /// How the term is written in code, for messages.
    fn path(self) -> &'static str {
        match self {
            Unbounded::StreamMaxAge => "Unbounded::StreamMaxAge",
            Unbounded::HandlerTimeout => "Unbounded::HandlerTimeout",
            Unbounded::PublisherRetryHorizon => "Unbounded::PublisherRetryHorizon",
        }
    }

    /// Why the term has no bound.
    fn why(self) -> &'static str {
        match self {
            Unbounded::StreamMaxAge => {
                "the stream keeps messages forever (max_age 0), so a stored message can be redelivered or replayed (an ack floor reset, a consumer created again) at any time"
            }
            Unbounded::HandlerTimeout => {
                "the route has no handler timeout, so a transaction can run, and commit its claim, any time after the claim was stamped"
            }
            Unbounded::PublisherRetryHorizon => {
                "the route declares no publisher-retry horizon, so a publisher may publish the message again at any time, stored as a new copy after the duplicate window"
            }
        }
    }

    /// The setting that bounds it.
    fn bound(self) -> &'static str {
        match self {
            Unbounded::StreamMaxAge => "give the stream a max_age",
            Unbounded::HandlerTimeout => "set `Route::handler_timeout`",
            Unbounded::PublisherRetryHorizon => {
                "declare how long publishers retry with `Route::publisher_retry_horizon`"
            }
        }
    }
}

/// What the floor is computed from: a route's settings and its stream's.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Inputs {
    pub(crate) ack_wait: Duration,
    /// The route's delivery limit.
    pub(crate) max_deliver: u64,
    /// JetStream's delivery limit for the consumer.
    pub(crate) server_max_deliver: u64,
    /// The NAK delays before jitter, after deliveries 1 to `max_deliver − 1`,
    /// as runs of equal delays: `(delay, how many)`.
    pub(crate) nak_delays: Vec<(Duration, u64)>,
    /// The jitter fraction: a NAK delay is up to `1 + jitter` times its base.
    pub(crate) jitter: f64,
    pub(crate) handler_timeout: Option<Duration>,
    /// Messages per transaction: 1 in per-message mode.
    pub(crate) batch: usize,
    /// The stream's `max_age`; zero keeps messages forever.
    pub(crate) max_age: Duration,
    pub(crate) duplicate_window: Duration,
    pub(crate) publisher_retry_horizon: Option<Duration>,
    /// Unbounded terms the route accepts.
    pub(crate) accepted: Vec<Unbounded>,
}

impl Inputs {
    /// Whether the route accepts the unbounded `term`.
    pub(crate) fn accepts(&self, term: Unbounded) -> bool {
        self.accepted.contains(&term)
    }
}

/// A term's value: a duration, none (unbounded), or not counted (an
/// unbounded term the route accepts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value {
    Bounded(Duration),
    Unbounded(Unbounded),
    Accepted(Unbounded),
}

impl Value {
    /// The duration it adds: an accepted term adds nothing.
    pub(crate) fn counted(self) -> Option<Duration> {
        match self {
            Value::Bounded(duration) => Some(duration),
            Value::Accepted(_) => Some(Duration::ZERO),
            Value::Unbounded(_) => None,
        }
    }
}

/// A route's retention floor and how it was computed: what
/// [`Route::retention_floor`](crate::Route::retention_floor) returns and the
/// start-up refusals show. Its `Display` is the computation, term by term,
/// on one line. See the [floor's docs](crate::retention::floor) for what each term covers.
#[derive(Debug, Clone, PartialEq)]
pub struct RetentionFloor {
    pub(crate) inputs: Inputs,
    /// The claiming transaction, `3 × handler_timeout`.
    pub(crate) transaction: Value,
    /// Deliveries that can follow the claiming one.
    pub(crate) redeliveries: u64,
    /// What each of them adds: `ack_wait`, plus a batch's claim wait in
    /// batch mode.
    pub(crate) per_redelivery: Option<Duration>,
    pub(crate) nak_total: Duration,
    pub(crate) nak_with_jitter: Duration,
    pub(crate) span: Option<Duration>,
    pub(crate) max_age: Value,
    pub(crate) copies: Value,
    pub(crate) floor: Option<Duration>,
    pub(crate) unbounded: Vec<Unbounded>,
    /// A reply route's floor (see [Reply routes](self#reply-routes)): the
    /// publisher-copies term is then the client-retry horizon, and the
    /// claiming transaction the retry's wait in the worker.
    pub(crate) requests: bool,
}

impl RetentionFloor {
    /// The floor: the shortest retention under which every duplicate finds
    /// its claim. `None` when a term has no bound and is not accepted (see
    /// [`unbounded`](Self::unbounded)).
    pub fn value(&self) -> Option<Duration> {
        self.floor
    }

    /// The terms without a bound that the route does not accept.
    pub fn unbounded(&self) -> &[Unbounded] {
        &self.unbounded
    }

    /// The part of the floor made of redeliveries of the copy that claimed
    /// the message, counted from its claim; `None` if unbounded.
    pub fn redelivery_span(&self) -> Option<Duration> {
        self.span
    }

    /// The publisher-copies term: how far apart copies of one message can be
    /// stored. Zero when it is not counted.
    pub(crate) fn copy_spread(&self) -> Duration {
        self.copies.counted().unwrap_or(Duration::ZERO)
    }

    /// How far apart copies of one message can be stored, if the route
    /// declared a publisher-retry horizon; `None` if it did not (the copies
    /// term is unbounded, or accepted), when copies may come at any time.
    pub(crate) fn declared_copy_spread(&self) -> Option<Duration> {
        match self.copies {
            Value::Bounded(spread) => Some(spread),
            Value::Unbounded(_) | Value::Accepted(_) => None,
        }
    }

    fn fmt_span(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inputs = &self.inputs;
        f.write_str("redeliveries after the claim: ")?;
        match self.transaction {
            Value::Bounded(transaction) => {
                let timeout = inputs.handler_timeout.unwrap_or_default();
                write!(
                    f,
                    "claiming transaction (claim wait, {}, COMMIT) 3 × handler_timeout {} = {}",
                    if inputs.batch > 1 {
                        "the batch's handler calls"
                    } else {
                        "1 handler call"
                    },
                    Human(timeout),
                    Human(transaction)
                )?;
            }
            Value::Accepted(_) => {
                f.write_str("claiming transaction: no handler timeout, accepted, counted 0")?
            }
            Value::Unbounded(_) => {
                f.write_str("claiming transaction: no handler timeout, unbounded")?
            }
        }
        match self.per_redelivery {
            Some(each) if inputs.batch > 1 => write!(
                f,
                " + {} later deliveries (max_deliver {} + 3 on the server, less the claiming one) × (ack_wait {} + a batch's claim wait) = {}",
                self.redeliveries,
                inputs.max_deliver,
                Human(inputs.ack_wait),
                Human(times(each, self.redeliveries))
            )?,
            Some(each) => write!(
                f,
                " + {} later deliveries (max_deliver {} + 3 on the server, less the claiming one) × ack_wait {} = {}",
                self.redeliveries,
                inputs.max_deliver,
                Human(inputs.ack_wait),
                Human(times(each, self.redeliveries))
            )?,
            None => write!(
                f,
                " + {} later deliveries × (ack_wait {} + a batch's claim wait, unbounded)",
                self.redeliveries,
                Human(inputs.ack_wait)
            )?,
        }
        if !inputs.nak_delays.is_empty() {
            write!(
                f,
                " + NAK backoff {} = {}",
                NakDelays(&inputs.nak_delays),
                Human(self.nak_total)
            )?;
            if inputs.jitter > 0.0 {
                write!(
                    f,
                    ", +{} % jitter = {}",
                    Percent(inputs.jitter),
                    Human(self.nak_with_jitter)
                )?;
            }
        }
        match self.span {
            Some(span) => write!(f, "; span {}", Human(span)),
            None => f.write_str("; span unbounded"),
        }
    }
}

impl RetentionFloor {
    /// A reply route's floor, term by term.
    fn fmt_requests(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let horizon = self.inputs.publisher_retry_horizon.unwrap_or_default();
        write!(
            f,
            "client retries: horizon {} (`ReplyRoute::client_retry_horizon`, from the client's first send) + the retry's wait in the worker, behind requests in flight: ",
            Human(horizon)
        )?;
        match self.transaction {
            Value::Bounded(transaction) => write!(
                f,
                "one transaction's longest run (claim wait, 1 handler call, COMMIT) 3 × handler_timeout {} = {}",
                Human(self.inputs.handler_timeout.unwrap_or_default()),
                Human(transaction)
            )?,
            Value::Accepted(_) => f.write_str("no handler timeout, accepted, counted 0")?,
            Value::Unbounded(_) => f.write_str("no handler timeout, unbounded")?,
        }
        match self.floor {
            Some(floor) => write!(
                f,
                "; floor = {} + {} = {}",
                Human(horizon),
                Human(self.span.unwrap_or_default()),
                Human(floor)
            ),
            None => f.write_str("; floor unbounded (Unbounded::HandlerTimeout)"),
        }
    }
}

impl fmt::Display for RetentionFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.requests {
            return self.fmt_requests(f);
        }
        let inputs = &self.inputs;
        self.fmt_span(f)?;
        match self.max_age {
            Value::Bounded(max_age) => write!(
                f,
                "; stream max_age {} (a stored copy can be redelivered or replayed until it ages out)",
                Human(max_age)
            )?,
            Value::Accepted(_) => f.write_str(
                "; stream max_age 0 (kept forever: replays at any time), accepted, not counted",
            )?,
            Value::Unbounded(_) => {
                f.write_str("; stream max_age 0 (kept forever: replays at any time), unbounded")?
            }
        }
        match (self.copies, inputs.publisher_retry_horizon) {
            (Value::Bounded(copies), Some(horizon)) if !copies.is_zero() => write!(
                f,
                "; publisher copies: horizon {} > duplicate_window {}, so a retry is stored as a new copy = {}",
                Human(horizon),
                Human(inputs.duplicate_window),
                Human(copies)
            )?,
            (_, Some(horizon)) => write!(
                f,
                "; publisher copies: horizon {} ≤ duplicate_window {}, so JetStream drops retries = 0",
                Human(horizon),
                Human(inputs.duplicate_window)
            )?,
            (Value::Accepted(_), None) => f.write_str(
                "; publisher copies: no publisher-retry horizon declared, accepted, counted 0",
            )?,
            (_, None) => {
                f.write_str("; publisher copies: no publisher-retry horizon declared, unbounded")?
            }
        }
        match self.floor {
            Some(floor) => {
                let copies = Human(self.copy_spread());
                let span = Human(self.span.unwrap_or_default());
                match self.max_age {
                    Value::Bounded(max_age) => write!(
                        f,
                        "; floor = {copies} + max({span}, {}) = {}",
                        Human(max_age),
                        Human(floor)
                    ),
                    _ => write!(f, "; floor = {copies} + {span} = {}", Human(floor)),
                }
            }
            None => {
                f.write_str("; floor unbounded (")?;
                for (n, term) in self.unbounded.iter().enumerate() {
                    if n > 0 {
                        f.write_str(", ")?;
                    }
                    f.write_str(term.path())?;
                }
                f.write_str(")")
            }
        }
    }
}

/// The message for [`Error::RetentionBelowFloor`](crate::Error::RetentionBelowFloor).
pub(crate) fn below_floor_message(
    route: &str,
    retention: Duration,
    floor: Duration,
    computation: &RetentionFloor,
) -> String {
    if computation.requests {
        return format!(
            "reply route `{route}` keeps its claims and stored replies for {} (`ReplyRoute::retention`, a day unless set), below its retention floor of {}: a client may still retry a request up to {} after its claim was made, and a retry that arrives after its claim is purged runs the request again. The floor: {computation}. Raise the retention to at least {}, declare a shorter client-retry horizon (`ReplyRoute::client_retry_horizon`) or handler timeout, or keep the claims forever (`ReplyRoute::keep_forever`)",
            Human(retention),
            Human(floor),
            Human(floor),
            Human(floor)
        );
    }
    format!(
        "route `{route}` keeps its claims for {} (`Route::retention`), below its retention floor of {}: a duplicate can still arrive up to {} after its message was processed, and one that arrives after its claim is purged is processed again. The floor: {computation}. Raise the retention to at least {}, or shorten what the floor is made of (the stream's max_age, the retry policy, the handler timeout, the publisher-retry horizon)",
        Human(retention),
        Human(floor),
        Human(floor),
        Human(floor)
    )
}

/// The message for [`Error::RetentionFloorUnbounded`](crate::Error::RetentionFloorUnbounded).
pub(crate) fn unbounded_message(
    route: &str,
    retention: Duration,
    unbounded: &[Unbounded],
    computation: &RetentionFloor,
) -> String {
    if computation.requests {
        return format!(
            "reply route `{route}` keeps its claims and stored replies for {} (`ReplyRoute::retention`, a day unless set), but its retention floor has no bound: the route has no handler timeout, so a retry can wait behind requests in flight for any time before its claim check. The floor: {computation}. Set `ReplyRoute::handler_timeout`, keep the claims forever (`ReplyRoute::keep_forever`), or accept that a retry arriving after the retention runs again: `ReplyRoute::accept_duplicates_after_retention(Unbounded::HandlerTimeout)`",
            Human(retention)
        );
    }
    let mut message = format!(
        "route `{route}` keeps its claims for {} (`Route::retention`), but its retention floor has no bound: ",
        Human(retention)
    );
    for (n, term) in unbounded.iter().enumerate() {
        if n > 0 {
            message.push_str("; and ");
        }
        message.push_str(term.why());
    }
    message.push_str(&format!(". The floor: {computation}. "));
    for (n, term) in unbounded.iter().enumerate() {
        if n > 0 {
            message.push_str("; ");
        }
        message.push_str(&format!(
            "{}, or accept that duplicates arriving after the retention are processed again: `Route::accept_duplicates_after_retention({})`",
            capitalized(term.bound(), n == 0),
            term.path()
        ));
    }
    message
}

fn capitalized(text: &str, first: bool) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(c) if first => c.to_uppercase().chain(chars).collect(),
        _ => text.to_owned(),
    }
}

/// A duration as a dead-letter header or consumer metadata value: seconds,
/// with a fraction if there is one (`604800s`, `0.25s`).
pub(crate) fn encode_duration(duration: Duration) -> String {
    let nanos = duration.subsec_nanos();
    if nanos == 0 {
        return format!("{}s", duration.as_secs());
    }
    let fraction = format!("{nanos:09}");
    format!("{}.{}s", duration.as_secs(), fraction.trim_end_matches('0'))
}

/// Reads what [`encode_duration`] wrote.
pub(crate) fn decode_duration(text: &str) -> Option<Duration> {
    let number = text.trim().strip_suffix('s')?;
    let (seconds, fraction) = number.split_once('.').unwrap_or((number, ""));
    if seconds.is_empty() || !seconds.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse::<u32>().ok()?
    };
    Some(Duration::new(seconds.parse().ok()?, nanos))
}

/// A duration for people: `7d`, `1h 23m`, `31m 13.2s`, `250ms`, `0`; rounded
/// up to the millisecond.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Human(pub(crate) Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == Duration::MAX {
            return f.write_str("forever");
        }
        let mut millis = self.0.as_millis();
        if !self.0.subsec_nanos().is_multiple_of(1_000_000) {
            millis += 1;
        }
        if millis == 0 {
            return f.write_str("0");
        }
        if millis < 1000 {
            return write!(f, "{millis}ms");
        }
        let days = millis / 86_400_000;
        let hours = millis / 3_600_000 % 24;
        let minutes = millis / 60_000 % 60;
        let seconds = millis / 1000 % 60;
        let rest = millis % 1000;
        let mut parts = Vec::new();
        if days > 0 {
            parts.push(format!("{days}d"));
        }
        if hours > 0 {
            parts.push(format!("{hours}h"));
        }
        if minutes > 0 {
            parts.push(format!("{minutes}m"));
        }
        if rest > 0 {
            let fraction = format!("{rest:03}");
            parts.push(format!("{seconds}.{}s", fraction.trim_end_matches('0')));
        } else if seconds > 0 {
            parts.push(format!("{seconds}s"));
        }
        f.write_str(&parts.join(" "))
    }
}

/// The NAK delays, a run of equal ones as `5m×3`; the middle left out when
/// there are many.
struct NakDelays<'a>(&'a [(Duration, u64)]);

impl fmt::Display for NakDelays<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let runs = self.0;
        let run = |(delay, count): &(Duration, u64)| {
            if *count == 1 {
                Human(*delay).to_string()
            } else {
                format!("{}×{count}", Human(*delay))
            }
        };
        let shown: Vec<String> = if runs.len() > 10 {
            runs[..4]
                .iter()
                .map(run)
                .chain(std::iter::once("…".to_owned()))
                .chain(runs[runs.len() - 2..].iter().map(run))
                .collect()
        } else {
            runs.iter().map(run).collect()
        };
        f.write_str(&shown.join("+"))
    }
}

/// A fraction as a percentage, without trailing zeros: `20`, `12.5`.
struct Percent(f64);

impl fmt::Display for Percent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format!("{:.2}", self.0 * 100.0);
        let text = text.trim_end_matches('0').trim_end_matches('.');
        f.write_str(text)
    }
}

/// A transaction that a purge waits for: one a transition still waits
/// for, or one holding a lock a purge's statement waited for until its
/// `lock_timeout`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Blocker {
    /// Its backend; `None` for a prepared transaction.
    pub pid: Option<i32>,
    /// The global id of a prepared transaction.
    pub prepared: Option<String>,
    /// The database it is connected to.
    pub database: Option<String>,
    /// Its session's `application_name`.
    pub application_name: Option<String>,
    /// `active`, `idle in transaction`, ...
    pub state: Option<String>,
    /// How long its transaction has run.
    pub transaction_age: Option<Duration>,
    /// How long ago its current or last query started.
    pub query_age: Option<Duration>,
    /// The start of that query's text.
    pub query: Option<String>,
    /// Why it is waited for.
    pub holds: Holds,
}

/// Why a purge waits for a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Holds {
    /// A write lock on the claims table: it has claimed, or is claiming.
    Claims,
    /// A snapshot that may predate the rotation: a claim it makes would
    /// see the state from before it.
    Snapshot,
    /// A lock on the claims table that a purge's statement waited for.
    Lock,
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.pid, &self.prepared) {
            (Some(pid), _) => write!(f, "pid {pid}")?,
            (None, Some(gid)) => write!(f, "prepared transaction `{gid}`")?,
            (None, None) => write!(f, "a transaction that has ended")?,
        }
        if let Some(database) = &self.database {
            write!(f, " in database `{database}`")?;
        }
        let mut details = Vec::new();
        if let Some(name) = self.application_name.as_deref().filter(|n| !n.is_empty()) {
            details.push(format!("application `{name}`"));
        }
        if let Some(state) = &self.state {
            details.push(state.clone());
        }
        if let Some(age) = self.transaction_age {
            details.push(format!("transaction {} old", seconds(age)));
        }
        if let Some(age) = self.query_age {
            let query = self
                .query
                .as_deref()
                .map(|q| format!(": `{}`", q.split_whitespace().collect::<Vec<_>>().join(" ")))
                .unwrap_or_default();
            details.push(format!("query started {} ago{query}", seconds(age)));
        }
        if !details.is_empty() {
            write!(f, " ({})", details.join(", "))?;
        }
        f.write_str(match self.holds {
            Holds::Claims => ": holds claims not yet committed",
            Holds::Snapshot => ": holds a snapshot that may predate the rotation",
            Holds::Lock => ": holds a lock on the claims table",
        })
    }
}

/// `12.3 s`.
pub(crate) fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// Why a [`purge`](crate::retention::expiry::purge) run failed. Nothing is lost: the next run resumes from
/// the step this one stopped at.
#[derive(Debug, thiserror::Error)]
#[error(
    "the claims purge failed while {step}: {source}{}; nothing is lost, and the next run resumes from this step",
    holders(lock_holders)
)]
#[non_exhaustive]
pub struct PurgeFailure {
    /// What it was doing (`detaching generation 12`).
    pub step: String,
    /// The database's error.
    #[source]
    pub source: sqlx::Error,
    /// For a lock timeout: the transactions, older than the timeout, that
    /// held locks on the claims table then.
    pub lock_holders: Vec<Blocker>,
}

fn holders(blockers: &[Blocker]) -> String {
    if blockers.is_empty() {
        return String::new();
    }
    let list: Vec<String> = blockers.iter().map(Blocker::to_string).collect();
    format!(" (it waited for: {})", list.join("; "))
}

impl Blocker {
    /// A transaction that ended between two reads.
    pub(crate) fn ended(pid: Option<i32>) -> Self {
        Blocker {
            pid,
            prepared: None,
            database: None,
            application_name: None,
            state: None,
            transaction_age: None,
            query_age: None,
            query: None,
            holds: Holds::Claims,
        }
    }
}

/// `duration × n`, or [`Duration::MAX`] if that is longer.
pub(crate) fn times(duration: Duration, n: u64) -> Duration {
    let nanos = duration.as_nanos().saturating_mul(u128::from(n));
    let seconds = nanos / 1_000_000_000;
    match u64::try_from(seconds) {
        Ok(seconds) => Duration::new(seconds, (nanos % 1_000_000_000) as u32),
        Err(_) => Duration::MAX,
    }
}
