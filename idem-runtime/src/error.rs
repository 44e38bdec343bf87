//! Error types. Each says what happened to the message it concerns.

use crate::failure::ErrorClass;
use crate::message_id::InvalidMessageId;

/// Any error a handler body returns, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a handler did not finish. The runtime rolls the transaction back,
/// then retries, NAKs or dead-letters the message according to the error's
/// [`ErrorClass`] and the route's [`RetryPolicy`](crate::RetryPolicy).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// BEGIN or the claim statement failed (database unreachable, dedup table
    /// missing).
    #[error("claiming the message failed: {0}")]
    Claim(#[from] sqlx::Error),
    /// The handler body returned an error.
    #[error("the handler failed: {error}")]
    Handler {
        /// The error the body returned.
        error: BoxError,
        /// The class its type chose through [`Classify`](crate::Classify),
        /// if it implements it.
        class: Option<ErrorClass>,
    },
    /// The handler ran longer than the route's handler timeout.
    #[error("the handler did not finish within {0:?}")]
    TimedOut(std::time::Duration),
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
        }
    }

    /// Whether, and how, the failure is worth retrying.
    pub fn class(&self) -> ErrorClass {
        match self {
            HandlerError::Claim(error) => ErrorClass::of_sqlx(error),
            HandlerError::Handler {
                class: Some(class), ..
            } => *class,
            HandlerError::Handler { error, .. } => ErrorClass::of(&**error),
            HandlerError::TimedOut(_) => ErrorClass::Transient,
        }
    }
}

/// Why a message could not be handed to its handler at all. No retry can
/// change that, so the runtime dead-letters it on its first delivery.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RejectedMessage {
    /// The payload is not valid JSON for the handler's payload type.
    #[error("the payload does not decode: {0}")]
    Decode(#[from] serde_json::Error),
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
    /// The same durable consumer was bound twice in one router.
    #[error("the durable consumer `{0}` is bound twice; give each route its own consumer")]
    DuplicateRoute(String),
    /// Pulling messages failed and could not be resumed.
    #[error("pulling from consumer `{route}` failed: {source}")]
    Pull {
        /// The route (durable consumer name).
        route: String,
        /// The client's error.
        source: async_nats::Error,
    },
}
