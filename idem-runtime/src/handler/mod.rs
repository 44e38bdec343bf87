//! The contract between a handler and the runtime.

use std::future::Future;

use bytes::Bytes;
use sqlx::{Database, Postgres, Transaction};

use crate::codec::Decode;
use crate::error::HandlerError;

pub(crate) mod delivery;
pub(crate) mod expansion;
pub mod results;
pub(crate) mod state;

pub use crate::message_id::{InvalidMessageId, MAX_MESSAGE_ID_LEN, MessageId, MessageIdSource};
pub use delivery::Delivery;
pub use state::{FromBatch, FromDelivery, FromRef, Parameter, State};

/// A message handler the [`Router`](crate::Router) can run, with the
/// router's state `S`, in a transaction on the database `DB` (PostgreSQL,
/// the one database idem runs on so far: leave it out).
///
/// Write an `async fn` and put `#[idempotent]` on it; or implement this by
/// hand. Either way the claim is the runtime's job, on every path: it begins
/// the transaction, claims the message as its first statement, calls
/// [`handle`](Handler::handle) only if the claim is fresh (alone, or for
/// each fresh message of a batch), and commits only if the claim is still in
/// the transaction. What `handle` returns means the same in per-message and
/// batch mode: `Ok` commits (and acks), `Err` rolls back and retries,
/// holds or dead-letters the message by the error's class.
///
/// By hand it is as short as this:
///
/// ```
/// use idem_runtime::handler::Handler;
/// use idem_runtime::{Delivery, HandlerError, codec::Json};
///
/// #[derive(serde::Deserialize)]
/// struct Credit { account: i64, amount: i64 }
///
/// struct CreditAccounts;
///
/// impl Handler for CreditAccounts {
///     type Payload = Credit;
///     type Codec = Json;
///
///     fn name(&self) -> &'static str {
///         "credit-v1"
///     }
///
///     async fn handle(
///         &self,
///         tx: &mut sqlx::PgTransaction<'_>,
///         cmd: Credit,
///         _delivery: &Delivery,
///         _state: &(),
///     ) -> Result<(), HandlerError> {
///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///             .bind(cmd.amount)
///             .bind(cmd.account)
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
///
/// let router = idem_runtime::Router::new()
///     .route(idem_runtime::Route::new("LEDGER", "credit"), CreditAccounts);
/// # drop(router);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idem handler for a router with state `{S}` on `{DB}`",
    label = "not a handler for state `{S}` on `{DB}`",
    note = "write `#[idempotent] async fn my_handler(tx: &mut sqlx::PgTransaction<'_>, msg: T) -> Result<(), E>`, or implement `idem_runtime::Handler<{S}>`"
)]
pub trait Handler<S = (), DB: Database = Postgres>: Send + Sync + 'static {
    /// The decoded message.
    type Payload: Send + 'static;

    /// How the payload is decoded from the message's bytes:
    /// [`codec::Json`](crate::codec::Json) unless the handler chose another.
    type Codec: Decode<Self::Payload>;

    /// The name stored with each claim. Two handlers with the same name share
    /// dedup rows, and renaming a handler makes it reprocess old messages, so
    /// pin it (`#[idempotent(name = "...")]`).
    fn name(&self) -> &'static str;

    /// The explicit dedup key, computed from the payload and the delivery,
    /// if the handler has one (`#[idempotent(key = ...)]`). `None` falls back
    /// to the `Nats-Msg-Id` header, then to the stream position.
    fn message_key(&self, payload: &Self::Payload, delivery: &Delivery) -> Option<String> {
        let _ = (payload, delivery);
        None
    }

    /// Runs the handler for a message the runtime has already claimed in
    /// `tx`. Never end `tx` here: return, and the runtime commits.
    ///
    /// A handler that returns a value implements
    /// [`handle_and_encode`](Handler::handle_and_encode) too, which is what
    /// the runtime calls; its `handle` runs it and drops the value.
    fn handle(
        &self,
        tx: &mut Transaction<'_, DB>,
        payload: Self::Payload,
        delivery: &Delivery,
        state: &S,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Runs the handler like [`handle`](Handler::handle), and returns what it
    /// produced, encoded with its codec: the runtime stores the bytes with
    /// the claim, in the same transaction, and sends them as the reply to a
    /// request ([`ReplyRoute`](crate::ReplyRoute)); a duplicate of the
    /// request gets them again without running the handler. `None` stores
    /// nothing and costs nothing (the reply to a request is then empty).
    ///
    /// The runtime calls this, not `handle`, for every message it hands the
    /// handler alone. The default calls `handle` and stores nothing;
    /// `#[idempotent]` implements it for a fn that returns
    /// `Result<T, E>` with a `T` other than `()`. By hand:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use idem_runtime::handler::Handler;
    /// use idem_runtime::{Delivery, HandlerError, codec::{Encode, Json}};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Place { order: i64 }
    /// #[derive(serde::Serialize)]
    /// struct Receipt { order: i64, total: i64 }
    ///
    /// struct PlaceOrder;
    ///
    /// impl Handler for PlaceOrder {
    ///     type Payload = Place;
    ///     type Codec = Json;
    ///
    ///     fn name(&self) -> &'static str {
    ///         "orders.place.v1"
    ///     }
    ///
    ///     async fn handle(&self, tx: &mut sqlx::PgTransaction<'_>, cmd: Place,
    ///                     delivery: &Delivery, state: &()) -> Result<(), HandlerError> {
    ///         self.handle_and_encode(tx, cmd, delivery, state).await.map(drop)
    ///     }
    ///
    ///     async fn handle_and_encode(&self, tx: &mut sqlx::PgTransaction<'_>, cmd: Place,
    ///                                _delivery: &Delivery, _state: &())
    ///                                -> Result<Option<Bytes>, HandlerError> {
    ///         let total: i64 = sqlx::query_scalar("SELECT 42").fetch_one(&mut **tx).await?;
    ///         let receipt = Receipt { order: cmd.order, total };
    ///         Ok(Some(Json::encode(&receipt).map_err(HandlerError::handler)?))
    ///     }
    /// }
    /// ```
    fn handle_and_encode(
        &self,
        tx: &mut Transaction<'_, DB>,
        payload: Self::Payload,
        delivery: &Delivery,
        state: &S,
    ) -> impl Future<Output = Result<Option<Bytes>, HandlerError>> + Send
    where
        S: Sync,
    {
        async move {
            self.handle(tx, payload, delivery, state).await?;
            Ok(None)
        }
    }

    /// Whether, on a batch route ([`Route::batch`](crate::Route::batch)), the
    /// runtime hands the fresh messages of a batch to
    /// [`handle_batch`](Handler::handle_batch) in one call (`true`), or
    /// calls [`handle`](Handler::handle) for each in turn, each under the
    /// handler timeout (`false`, the default). `#[idempotent(batch)]` sets
    /// it.
    const BATCHES: bool = false;

    /// Whether the handler must have its transaction to itself (`true`), so
    /// that its routes run it one message per transaction even where they
    /// would batch ([`Route`](crate::Route)'s default, adaptive batching).
    /// `#[idempotent(per_message)]` sets it.
    ///
    /// Inside a batch, a handler shares its transaction with the messages
    /// before and after it in the batch: what it writes is visible to the
    /// next message's handler, its row locks are held until the batch
    /// commits, and `SET LOCAL`, `pg_advisory_xact_lock` and temporary
    /// tables `ON COMMIT DROP` last until then too. A handler that depends
    /// on any of these ending with its own message (one that sets a session
    /// variable for a trigger, takes an advisory lock to coordinate with
    /// another service, or waits for another transaction) declares it.
    /// Writes visible to the next message are not a reason: the batch runs
    /// its messages one after another, in an order per-message mode could
    /// also have committed them in.
    ///
    /// A route that asks for batches explicitly
    /// ([`Route::batch`](crate::Route::batch),
    /// [`Route::adaptive_batch`](crate::Route::adaptive_batch)) with such a
    /// handler is refused at start-up.
    const PER_MESSAGE: bool = false;

    /// Runs the handler once for all the fresh messages of a batch, claimed
    /// in `tx`: `payloads[i]` came in `deliveries[i]`. The runtime calls it
    /// only if [`BATCHES`](Handler::BATCHES) is `true`, never with an empty
    /// batch, and under the handler timeout as a whole. `Ok` commits the
    /// batch; `Err` rolls it back and runs each message again through
    /// [`handle`](Handler::handle), alone in its transaction, where it takes
    /// its own retry or dead-letter path. So `handle` must do for one
    /// message what this does for many.
    ///
    /// A batch handler stores no result: `#[idempotent(batch)]` refuses a fn
    /// that returns a value. The default calls `handle` for each message in
    /// turn (the runtime itself calls `handle_and_encode` for each, and
    /// stores what they return, unless [`BATCHES`](Handler::BATCHES) is
    /// set).
    fn handle_batch(
        &self,
        tx: &mut Transaction<'_, DB>,
        payloads: Vec<Self::Payload>,
        deliveries: &[Delivery],
        state: &S,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send
    where
        S: Sync,
    {
        async move {
            for (payload, delivery) in payloads.into_iter().zip(deliveries) {
                self.handle(tx, payload, delivery, state).await?;
            }
            Ok(())
        }
    }
}

/// What [`Router::route`](crate::Router::route) accepts: the name of an
/// `#[idempotent]` fn, or a value that implements [`Handler`]. (`M` tells
/// the two apart; it is never written.)
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idem handler for a router with state `{S}` on `{DB}`",
    label = "expected an `#[idempotent]` fn, or a value implementing `idem_runtime::Handler<{S}, {DB}>`",
    note = "write `#[idempotent] async fn my_handler(tx: &mut sqlx::PgTransaction<'_>, msg: T) -> Result<(), E>` and pass `my_handler`; a handler that takes `State<T>` needs a router whose state provides `T`: write `#[idempotent(state = {S})]` on it to see which part is missing; a handler's transaction must be on its router's database, `{DB}`"
)]
pub trait IntoHandler<S, M, DB: Database = Postgres> {
    /// The handler this turns into.
    type Handler: Handler<S, DB>;

    /// Builds the handler.
    fn into_handler(self) -> Self::Handler;
}

#[doc(hidden)]
#[derive(Debug)]
pub enum ViaConstructor {}

#[doc(hidden)]
#[derive(Debug)]
pub enum AsIs {}

/// `#[idempotent]` turns `fn credit` into a handler type `credit` plus a fn
/// `credit()` that returns it; passing `credit` hands the router that fn.
impl<F, H, S, DB: Database> IntoHandler<S, ViaConstructor, DB> for F
where
    F: FnOnce() -> H,
    H: Handler<S, DB>,
{
    type Handler = H;

    fn into_handler(self) -> H {
        self()
    }
}

/// A handler value, such as one implemented by hand.
impl<H, S, DB: Database> IntoHandler<S, AsIs, DB> for H
where
    H: Handler<S, DB>,
{
    type Handler = H;

    fn into_handler(self) -> H {
        self
    }
}
