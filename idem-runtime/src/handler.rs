//! The contract between `#[idempotent]` handlers and the runtime.

use std::future::Future;
use std::pin::Pin;

use serde::de::DeserializeOwned;
use sqlx::PgTransaction;

use crate::delivery::Delivery;
use crate::error::HandlerError;

/// The future a [`Handler`] returns.
pub type HandlerFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Outcome, HandlerError>> + Send + 'a>>;

/// What became of a message inside its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The claim was fresh and the body ran: commit, then ack.
    Processed,
    /// The claim found the message already processed: roll back, then ack.
    Duplicate,
}

/// A message handler the [`Router`](crate::Router) can run.
///
/// Write an `async fn` and put `#[idempotent]` on it rather than implementing
/// this by hand; the attribute generates an implementation whose first
/// statement claims the message.
///
/// ```
/// use idem_runtime::idempotent;
///
/// #[derive(serde::Deserialize)]
/// struct Credit { account: i64, amount: i64 }
///
/// #[idempotent(name = "credit-v1")]
/// async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(cmd.amount)
///         .bind(cmd.account)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The decoded message body (JSON, through serde).
    type Payload: DeserializeOwned + Send + 'static;

    /// The name stored with each claim. Two handlers with the same name share
    /// dedup rows, and renaming a handler makes it reprocess old messages, so
    /// production code should pin it with `#[idempotent(name = "...")]`.
    fn name(&self) -> &'static str;

    /// The explicit dedup key computed from the payload, if the handler has
    /// one (`#[idempotent(key = ...)]`). `None` falls back to the
    /// `Nats-Msg-Id` header, then to `<stream>:<sequence>`.
    fn message_key(&self, payload: &Self::Payload) -> Option<String> {
        let _ = payload;
        None
    }

    /// Runs the body, in `tx`, for a message the runtime has already claimed
    /// in `tx` (alone, or with the rest of its batch in one statement). The
    /// runtime begins `tx` and claims the message before, and commits (if
    /// the claim is still there) or rolls back after; a handler can neither
    /// skip nor repeat the claim. `#[idempotent]` generates it.
    fn run_claimed<'a, 'c>(
        &'a self,
        tx: &'a mut PgTransaction<'c>,
        payload: Self::Payload,
        delivery: &'a Delivery,
    ) -> HandlerFuture<'a>;
}

/// What [`Router::route`](crate::Router::route) accepts: the name of an
/// `#[idempotent]` fn.
///
/// `#[idempotent]` turns `fn credit` into a handler type `credit` plus a fn
/// `credit()` that returns it; passing `credit` hands the router that fn. A
/// hand-written [`Handler`] is passed as a closure: `|| MyHandler`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idem handler",
    label = "expected the name of a fn annotated with `#[idempotent]`",
    note = "write `#[idempotent] async fn my_handler(tx: &mut sqlx::PgTransaction<'_>, msg: T) -> Result<(), E>` and pass `my_handler`"
)]
pub trait IntoHandler {
    /// The handler this turns into.
    type Handler: Handler;

    /// Builds the handler.
    fn into_handler(self) -> Self::Handler;
}

impl<F, H> IntoHandler for F
where
    F: FnOnce() -> H,
    H: Handler,
{
    type Handler = H;

    fn into_handler(self) -> H {
        self()
    }
}
