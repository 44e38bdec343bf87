//! Application state, and how a handler takes the part of it it needs.
//!
//! As in axum: give the router one state ([`Router::with_state`]), and let
//! each handler take what it needs with a [`State<T>`] parameter. `T` is
//! the whole state, or any part of it that implements [`FromRef`] for it
//! (`#[derive(FromRef)]` on the state implements it for every field).
//!
//! ```
//! use idem_runtime::{FromRef, Route, Router, State, idempotent};
//!
//! #[derive(Clone, FromRef)]
//! struct App {
//!     prices: Prices,
//!     http: HttpClient,
//! }
//!
//! #[derive(Clone)]
//! struct Prices(std::sync::Arc<std::collections::HashMap<String, i64>>);
//! #[derive(Clone)]
//! struct HttpClient;
//!
//! #[derive(serde::Deserialize)]
//! struct Order { sku: String, quantity: i64 }
//!
//! #[idempotent(name = "orders.place.v1")]
//! async fn place(
//!     tx: &mut sqlx::PgTransaction<'_>,
//!     State(prices): State<Prices>,
//!     order: Order,
//! ) -> Result<(), sqlx::Error> {
//!     let price = prices.0.get(&order.sku).copied().unwrap_or(0);
//!     sqlx::query("INSERT INTO orders (sku, total) VALUES ($1, $2)")
//!         .bind(&order.sku)
//!         .bind(price * order.quantity)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! let app = App { prices: Prices(Default::default()), http: HttpClient };
//! let router = Router::with_state(app).route(Route::new("ORDERS", "place"), place);
//! # drop(router);
//! ```
//!
//! [`Router::with_state`]: crate::Router::with_state

use crate::handler::delivery::Delivery;

/// The application state, or the part of it `T` names, as a handler
/// parameter: `State(prices): State<Prices>`.
#[derive(Debug, Clone, Copy, Default)]
pub struct State<T>(pub T);

/// Takes a part of the application state `S`: implemented for every
/// `T: Clone` as the whole state, and by `#[derive(FromRef)]` for each
/// field of a state struct.
#[diagnostic::on_unimplemented(
    message = "the router's state `{T}` does not provide `{Self}`",
    label = "`{Self}` is not part of `{T}`",
    note = "add a `{Self}` field to the state and `#[derive(FromRef)]` on it, or `impl FromRef<{T}> for {Self}`; pass the state with `Router::with_state`"
)]
pub trait FromRef<T> {
    /// The part of `input` this type stands for.
    fn from_ref(input: &T) -> Self;
}

impl<T: Clone> FromRef<T> for T {
    fn from_ref(input: &T) -> T {
        input.clone()
    }
}

/// A handler parameter the runtime fills from the delivery and the
/// router's state `S`: one that sits between the transaction and the
/// message, like [`State<T>`]. (`&Delivery` is passed as it is.)
///
/// Implement it, with [`Parameter`], for a parameter of your own (a tenant
/// read from a header, say).
#[diagnostic::on_unimplemented(
    message = "the router's state `{S}` cannot provide `{Self}`",
    label = "not provided by `{S}`",
    note = "a `State<T>` parameter needs `T: FromRef<{S}>`: a `T` field in the state with `#[derive(FromRef)]` on it, or `impl FromRef<{S}> for T`"
)]
pub trait FromDelivery<S>: Parameter + Sized {
    /// Makes the parameter for one delivery.
    fn from_delivery(delivery: &Delivery, state: &S) -> Self;
}

/// A type that can be a handler parameter between the transaction and the
/// message, whatever the router's state. A supertrait of [`FromDelivery`],
/// so that a type that can never be a parameter is reported where the
/// handler is written, not where a router uses it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be taken from a message",
    label = "not a handler parameter",
    note = "between the transaction and the message, a handler takes `State<T>` (a part of the router's state), `idem_runtime::outbox::Outbox` (a batch handler: `BatchOutbox`) or `&idem_runtime::Delivery` (a batch handler: `&[Delivery]`); the message itself comes last"
)]
pub trait Parameter {}

impl<T> Parameter for State<T> {}

/// A parameter of a batch handler (`#[idempotent(batch)]`) that the runtime
/// fills from the batch's deliveries and the router's state `S`, like
/// [`State<T>`]. (`&[Delivery]` is passed as it is.)
#[diagnostic::on_unimplemented(
    message = "the router's state `{S}` cannot provide `{Self}` to a batch handler",
    label = "not provided by `{S}`",
    note = "a `State<T>` parameter needs `T: FromRef<{S}>`: a `T` field in the state with `#[derive(FromRef)]` on it, or `impl FromRef<{S}> for T`",
    note = "a batch handler takes `idem_runtime::outbox::BatchOutbox`, not `Outbox`: one outbox per message of the batch"
)]
pub trait FromBatch<S>: Parameter + Sized {
    /// Makes the parameter for one batch.
    fn from_batch(deliveries: &[Delivery], state: &S) -> Self;
}

impl<S, T: FromRef<S>> FromBatch<S> for State<T> {
    fn from_batch(_: &[Delivery], state: &S) -> Self {
        State(T::from_ref(state))
    }
}

impl<S, T: FromRef<S>> FromDelivery<S> for State<T> {
    fn from_delivery(_: &Delivery, state: &S) -> Self {
        State(T::from_ref(state))
    }
}
