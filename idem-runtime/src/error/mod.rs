//! Error types. Each says what happened to the message it concerns.

use crate::message_id::InvalidMessageId;

pub(crate) mod class;
pub(crate) mod retention;

pub use class::{Classify, ErrorClass, Permanent, Transient};

/// Any error a handler body returns, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a message's transaction did not commit. The runtime rolls the
/// transaction back, then retries, NAKs or dead-letters the message
/// according to the error's [`ErrorClass`] and the route's
/// [`RetryPolicy`](crate::RetryPolicy); an [`Infrastructure`] error holds the
/// message instead.
///
/// [`Infrastructure`]: HandlerError::Infrastructure
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// The database could not be used before the handler ran: no connection,
    /// BEGIN failed, or the claim failed (the dedup table is missing, a
    /// permission was revoked, the server is restarting). The message is not
    /// to blame: it is held, with heartbeats, and retried with backoff; the
    /// route stops taking new messages until the database answers again. No
    /// delivery is used up and nothing is dead-lettered.
    #[error("the database could not be used before the handler ran: {}", describe_sqlx(.0))]
    Infrastructure(sqlx::Error),
    /// BEGIN or the claim failed for a reason of this message's own: its id
    /// cannot be stored (a character the database's encoding lacks), or its
    /// claim waited past the statement timeout on a concurrent attempt.
    /// Classed by its SQLSTATE.
    #[error("claiming the message failed: {}", describe_sqlx(.0))]
    ClaimFailed(sqlx::Error),
    /// The handler body returned an error.
    #[error("the handler failed: {}", describe_with(&**.error, .sqlstate.as_deref()))]
    Handler {
        /// The error the body returned.
        error: BoxError,
        /// Its class, if one was found before it was boxed (its type's
        /// [`Classify`], or one along its chain).
        class: Option<ErrorClass>,
        /// The SQLSTATE of a database error found along its chain before it
        /// was boxed (boxing an `anyhow::Error` hides its root).
        sqlstate: Option<String>,
    },
    /// The handler ran longer than the route's handler timeout.
    #[error("the handler did not finish within {0:?}")]
    TimedOut(std::time::Duration),
    /// The handler panicked. Its transaction is dropped (rolled back) and the
    /// message retried with backoff like a transient failure.
    #[error("the handler panicked: {0}")]
    Panicked(String),
    /// The handler returned `Ok`, but the database had aborted its
    /// transaction: a statement failed and the handler ignored the error
    /// (PostgreSQL aborts the transaction on any error; SQLite and MariaDB
    /// roll it back whole on some, such as a deadlock). A COMMIT would
    /// have rolled everything back, the claim included, while reporting
    /// success; idem never acks such a message. Retried now a few times (a
    /// lost race may explain it), then dead-lettered.
    #[error(
        "the handler returned Ok, but the database had aborted its transaction: a statement failed and the handler ignored the error, so nothing was committed; propagate the error with `?`, or run a statement that may fail in a savepoint (`tx.begin()`) or with ON CONFLICT"
    )]
    Aborted,
    /// The claim was no longer this transaction's when it was to end: the
    /// handler ended the transaction itself (a raw `COMMIT` or `ROLLBACK`),
    /// so some of its work may be committed and some not. Never acked as
    /// processed: dead-lettered at once, for a person to look at.
    #[error(
        "the claim was no longer this transaction's when it was to end: the handler ended the transaction itself (a raw COMMIT or ROLLBACK), so part of its work may be committed; check the message's effects before a replay, and never end `tx` in a handler: return, and idem commits"
    )]
    ClaimLost,
    /// PostgreSQL refused the COMMIT (a deferred constraint, a serialization
    /// failure): nothing was committed. Classed by its SQLSTATE, like an
    /// error of the handler's own statements.
    #[error("COMMIT failed, nothing was committed: {}", describe_sqlx(.0))]
    CommitRefused(sqlx::Error),
}

impl HandlerError {
    /// Wraps an error returned by a handler body; its class is found along
    /// its `source()` chain (see [`ErrorClass::of`]).
    pub fn handler(error: impl Into<BoxError>) -> Self {
        Self::classified(error, None)
    }

    /// Wraps an error returned by a handler body, with the class its type
    /// chose, if any.
    pub fn classified(error: impl Into<BoxError>, class: Option<ErrorClass>) -> Self {
        HandlerError::Handler {
            error: error.into(),
            class,
            sqlstate: None,
        }
    }

    /// What `#[idempotent]` expansions build: an error with what was found
    /// along its chain before it was boxed.
    #[doc(hidden)]
    pub fn found(error: impl Into<BoxError>, findings: crate::error::class::Findings) -> Self {
        HandlerError::Handler {
            error: error.into(),
            class: findings.class,
            sqlstate: findings.sqlstate,
        }
    }

    /// Whether, and how, the failure is worth retrying. An
    /// [`Infrastructure`](HandlerError::Infrastructure) error has no class of
    /// its own (it is held, not retried by class); this reports it as
    /// [`ErrorClass::Transient`].
    pub fn class(&self) -> ErrorClass {
        match self {
            HandlerError::Infrastructure(_)
            | HandlerError::TimedOut(_)
            | HandlerError::Panicked(_) => ErrorClass::Transient,
            HandlerError::Handler {
                class: Some(class), ..
            } => *class,
            HandlerError::Handler { error, .. } => ErrorClass::of(&**error),
            HandlerError::Aborted => ErrorClass::RetryNowThenPermanent,
            HandlerError::ClaimLost => ErrorClass::Permanent,
            // The claim found no partition for a generation the purge was
            // rotating or expiring under it: the next try reads the
            // generations again.
            HandlerError::ClaimFailed(error) if class::is_generation_gone(error) => {
                ErrorClass::RetryNow
            }
            HandlerError::CommitRefused(error) | HandlerError::ClaimFailed(error) => {
                ErrorClass::of_sqlx(error)
            }
        }
    }

    /// Whether it is a conflict with a concurrent transaction: a deadlock
    /// (40P01), a serialization failure (40001), or a lock waited for past
    /// `lock_timeout` (55P03, which a batch's transaction sets low; see
    /// `store::transaction::begin_batch`), found in the handler's error, in
    /// a failed claim or in a refused COMMIT. Retrying the same messages in
    /// a batch again would meet the same conflict.
    pub(crate) fn is_conflict(&self) -> bool {
        let sqlstate = match self {
            HandlerError::Handler {
                sqlstate: Some(code),
                ..
            } => Some(code.clone()),
            HandlerError::Handler { error, .. } => class::Findings::of(&**error).sqlstate,
            HandlerError::CommitRefused(error) | HandlerError::ClaimFailed(error) => {
                class::Findings::of(error).sqlstate
            }
            _ => None,
        };
        matches!(sqlstate.as_deref(), Some("40001" | "40P01" | "55P03"))
            || match self {
                // MariaDB's lock wait timeout has no SQLSTATE of its own
                // (HY000): its number is read along the chain.
                HandlerError::Handler { error, .. } => class::lock_timeout_in(&**error),
                HandlerError::CommitRefused(error) | HandlerError::ClaimFailed(error) => {
                    class::lock_timeout_in(error)
                }
                _ => false,
            }
    }

    /// Whether the database, not the message, is to blame: see
    /// [`HandlerError::Infrastructure`].
    pub fn is_infrastructure(&self) -> bool {
        matches!(self, HandlerError::Infrastructure(_))
    }
}

/// A database error from the handler's own statements, classed by its
/// SQLSTATE ([`ErrorClass::of_sqlx`]), so that `?` works in a handler
/// written by hand.
impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        let class = ErrorClass::of_sqlx(&error);
        HandlerError::classified(error, Some(class))
    }
}

impl From<crate::error::class::Permanent> for HandlerError {
    fn from(error: crate::error::class::Permanent) -> Self {
        HandlerError::classified(error, Some(ErrorClass::Permanent))
    }
}

impl From<crate::error::class::Transient> for HandlerError {
    fn from(error: crate::error::class::Transient) -> Self {
        HandlerError::classified(error, Some(ErrorClass::Transient))
    }
}

impl From<BoxError> for HandlerError {
    fn from(error: BoxError) -> Self {
        HandlerError::handler(error)
    }
}

/// What an `#[idempotent]` handler may return: a `Result` whose error
/// converts into [`BoxError`], under any name (`anyhow::Result<()>`, a
/// crate's own `Result<T>` alias).
#[diagnostic::on_unimplemented(
    message = "an `#[idempotent]` handler returns a `Result`, not `{Self}`",
    label = "not a `Result<T, E>`",
    note = "return `Result<(), E>` (or an alias such as `anyhow::Result<()>`) whose error converts into `idem_runtime::BoxError`"
)]
pub trait HandlerResult {
    /// What `Ok` carries: `()`, or a value the runtime stores with the
    /// claim (see [`results`](crate::handler::results)).
    type Output;
    /// What `Err` carries.
    type Error;
    /// The result as a `Result`.
    fn into_result(self) -> Result<Self::Output, Self::Error>;
}

impl<T, E> HandlerResult for Result<T, E> {
    type Output = T;
    type Error = E;

    fn into_result(self) -> Result<T, E> {
        self
    }
}

/// [`describe`], with a SQLSTATE found before the error was boxed.
fn describe_with(error: &(dyn std::error::Error + 'static), sqlstate: Option<&str>) -> String {
    let text = describe(error);
    match sqlstate {
        Some(code) if !text.contains("SQLSTATE") => format!("{text} (SQLSTATE {code})"),
        _ => text,
    }
}

/// An error and its sources, one line, with the SQLSTATE of a database
/// error: what a dead letter's `Idem-Error` and the logs show.
pub(crate) fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    let mut sqlstate = error.downcast_ref::<sqlx::Error>().and_then(sqlstate_of);
    while let Some(source) = next {
        let source_text = source.to_string();
        if !text.contains(&source_text) {
            text.push_str(": ");
            text.push_str(&source_text);
        }
        sqlstate = sqlstate.or_else(|| source.downcast_ref::<sqlx::Error>().and_then(sqlstate_of));
        next = source.source();
    }
    if let Some(code) = sqlstate {
        text.push_str(&format!(" (SQLSTATE {code})"));
    }
    text
}

fn describe_sqlx(error: &sqlx::Error) -> String {
    describe(error)
}

fn sqlstate_of(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// Why a message could not be handed to its handler at all. No retry can
/// change that, so the runtime dead-letters it on its first delivery.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RejectedMessage {
    /// The payload does not decode with the handler's codec.
    #[error(transparent)]
    Decode(#[from] crate::codec::DecodeError),
    /// The message id is unusable.
    #[error(transparent)]
    MessageId(#[from] InvalidMessageId),
}

/// Why the runtime could not start or keep running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The dedup schema is not installed, or is older than this runtime.
    #[error(
        "the idem dedup schema is missing or out of date in this database (expected migration {expected}, found {found:?}); call `idem_runtime::schema::migrate(&pool)` at start-up"
    )]
    SchemaMissing {
        /// The latest migration this runtime ships.
        expected: i64,
        /// The latest one applied, if any.
        found: Option<i64>,
    },
    /// Applying the embedded migrations failed.
    #[error("applying the idem migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A database call at start-up failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A step of the claims purge failed; the next run resumes from it.
    #[error(transparent)]
    Purge(#[from] crate::error::retention::PurgeFailure),
    /// The JetStream stream is missing and no stream config was given.
    #[error(
        "JetStream stream `{stream}` does not exist; create it, or pass its config with `Route::create_stream`: {source}"
    )]
    StreamMissing {
        /// The stream name.
        stream: String,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// Creating or updating a stream or consumer failed.
    #[error("setting up JetStream for route `{route}` failed: {source}")]
    JetStream {
        /// The route (durable consumer name).
        route: String,
        /// The server's answer.
        source: async_nats::Error,
    },
    /// A route's settings are invalid or unsafe.
    #[error("route `{route}` is misconfigured: {reason}")]
    Config {
        /// The route (durable consumer name).
        route: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The durable consumer exists with settings that differ from the
    /// route's.
    #[error(
        "durable consumer `{route}` exists with different settings ({differences}); delete it, align the route, or call `Route::update_consumer()` to overwrite it"
    )]
    ConsumerConflict {
        /// The route (durable consumer name).
        route: String,
        /// Which settings differ, as `field: existing -> wanted`.
        differences: String,
    },
    /// No stream stores the route's dead-letter subject.
    #[error(
        "no JetStream stream stores dead-letter subject `{subject}` of route `{route}`; create one, or leave the route on the default dead-letter stream"
    )]
    DeadLetterStreamMissing {
        /// The route (durable consumer name).
        route: String,
        /// The dead-letter subject.
        subject: String,
    },
    /// Subscribing to a request route's subject failed.
    #[error("subscribing to request subject `{subject}` failed: {source}")]
    Subscribe {
        /// The request subject.
        subject: String,
        /// The client's error.
        source: async_nats::Error,
    },
    /// The same durable consumer was bound twice in one router.
    #[error("the durable consumer `{0}` is bound twice; give each route its own consumer")]
    DuplicateRoute(String),
    /// The NATS client stopped for good while the router ran (async-nats
    /// panics on some malformed headers, such as a value with a bare CR):
    /// restart the process. The message that caused it is redelivered to the
    /// next worker, and dead-lettered as `undeliverable` once JetStream gives
    /// up on it.
    #[error(
        "the NATS client's connection task stopped for good (async-nats can stop on a malformed header); restart the process: JetStream dead-letters the message after its deliveries run out"
    )]
    NatsClientGone,
    /// A stream that captures the dead-letter subject would not keep them.
    #[error(
        "the stream `{stream}` that stores dead-letter subject `{subject}` of route `{route}` has {retention} retention, which may drop a dead letter no consumer reads; use limits retention"
    )]
    DeadLetterStreamRetention {
        /// The route (durable consumer name).
        route: String,
        /// The dead-letter subject.
        subject: String,
        /// The stream that captures it.
        stream: String,
        /// Its retention policy.
        retention: String,
    },
    /// The route's retention is shorter than its retention floor: a
    /// duplicate could arrive after its claim is purged, and be processed
    /// again. See [`retention_floor`](crate::retention::floor).
    #[error("{}", crate::error::retention::below_floor_message(.route, *.retention, *.floor, .computation))]
    RetentionBelowFloor {
        /// The route (durable consumer name).
        route: String,
        /// Its retention (`Route::retention`).
        retention: std::time::Duration,
        /// Its retention floor.
        floor: std::time::Duration,
        /// How the floor was computed, term by term.
        computation: Box<crate::error::retention::RetentionFloor>,
    },
    /// The route sets a retention, but its retention floor has a term with
    /// no bound that it does not accept
    /// ([`Route::accept_duplicates_after_retention`](crate::Route::accept_duplicates_after_retention)).
    #[error("{}", crate::error::retention::unbounded_message(.route, *.retention, .unbounded, .computation))]
    RetentionFloorUnbounded {
        /// The route (durable consumer name).
        route: String,
        /// Its retention (`Route::retention`).
        retention: std::time::Duration,
        /// The terms without a bound.
        unbounded: Vec<crate::error::retention::Unbounded>,
        /// How the floor was computed, term by term.
        computation: Box<crate::error::retention::RetentionFloor>,
    },
    /// Pulling messages failed and could not be resumed.
    #[error("pulling from consumer `{route}` failed: {source}")]
    Pull {
        /// The route (durable consumer name).
        route: String,
        /// The client's error.
        source: async_nats::Error,
    },
}

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// The handler failed with a permanent error.
    Permanent,
    /// The handler kept failing until the route's delivery limit.
    Exhausted,
    /// The payload does not decode.
    Undecodable,
    /// The message id is empty or too long.
    BadMessageId,
    /// JetStream stopped redelivering it (its deliveries ran out without an
    /// ack: the workers that took it died, or a header that is not UTF-8
    /// made the client drop the connection each time).
    Undeliverable,
    /// It reached the route without JetStream delivery metadata, so it can be
    /// neither deduplicated nor redelivered.
    NotADelivery,
}

impl Failure {
    /// The `Idem-Failure` header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Permanent => "permanent",
            Failure::Exhausted => "exhausted",
            Failure::Undecodable => "undecodable",
            Failure::BadMessageId => "bad-message-id",
            Failure::Undeliverable => "undeliverable",
            Failure::NotADelivery => "not-a-jetstream-delivery",
        }
    }
}
