//! The `#[idempotent]` attribute of [`idem_runtime`](https://docs.rs/idem-runtime).
//!
//! Depend on `idem-runtime`, which re-exports the attribute as
//! `idem_runtime::idempotent`; the generated code names `::idem_runtime`, so
//! this crate cannot be used on its own. [`idempotent`] documents the
//! signature it accepts, its arguments, how the message id is chosen, why
//! production code pins `name = "..."`, and what it generates.

#![warn(missing_docs)]

mod attr;
mod check;
mod classify;
mod expand;
mod from_ref;
mod generate;

use proc_macro::TokenStream;

/// Turns an `async fn` into a message handler whose first statement claims
/// the message in the dedup table, so that a redelivered message never runs
/// the body twice.
///
/// ```
/// use idem_runtime::{Route, Router, idempotent};
///
/// #[derive(serde::Deserialize)]
/// pub struct Credit {
///     transfer_id: String,
///     account: i64,
///     amount: i64,
/// }
///
/// /// Credits an account once per transfer.
/// #[idempotent(name = "credit-v1", key = cmd.transfer_id)]
/// pub async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(cmd.amount)
///         .bind(cmd.account)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
///
/// let router = Router::new().route(Route::new("LEDGER", "credit"), credit);
/// assert_eq!(credit::NAME, "credit-v1");
/// # drop(router);
/// ```
///
/// # The signature
///
/// ```text
/// async fn NAME(tx: &mut sqlx::PgTransaction<'_>, [State<T> | &Delivery, ...] msg: Msg)
///     -> Result<T, E>
/// ```
///
/// (A batch handler, `#[idempotent(batch)]`, takes `&[Delivery]` and
/// `msgs: Vec<Msg>` instead; see [Batch handlers](#batch-handlers).)
///
/// - `tx` is the transaction the claim ran in. The runtime commits it after
///   the body returns `Ok` (if the claim is still the transaction's own),
///   then acks the message; on `Err` it rolls back and retries or
///   dead-letters. Its type says which database the handler runs on:
///   `&mut sqlx::Transaction<'_, DB>` runs on `DB`, and
///   `&mut sqlx::PgTransaction<'_>`, or `&mut sqlx::PgConnection` (which the
///   transaction derefs to), on PostgreSQL.
/// - Between the transaction and the message, in any order: `State<T>`, the
///   router's state or a part of it (`T: FromRef<S>`), and `&Delivery`, the
///   message's subject, headers, sequence, delivery count and id.
/// - `msg`, last, is the payload, decoded by the handler's codec (JSON, so
///   `serde::Deserialize`, unless `codec = ...` says otherwise). Any
///   irrefutable pattern works: `Credit { account, .. }: Credit`. `Msg` must
///   be at least as visible as the fn, because the handler names it as its
///   `Handler::Payload`.
/// - The return type is any `Result` whose error converts into
///   [`BoxError`], under any name: `Result<(), MyError>`,
///   `anyhow::Result<()>`, a crate's own `Result<T>` alias.
/// - Its value, if not `()`, is encoded with the handler's codec and stored
///   with the claim, in the same transaction; it is the reply on a
///   request/reply route, and a retried request gets it again without the
///   body running. The value's type must show in the return type
///   (`Result<Receipt, E>`, `anyhow::Result<Receipt>`): an alias that hides
///   it (`type Placed = Result<Receipt, E>`) is refused, so that no value is
///   dropped unseen. A batch handler returns `()`.
///
/// The fn may not be generic, take `self`, or be `unsafe`.
///
/// # Arguments
///
/// - `name = "..."`: the handler name stored with each claim. Defaults to
///   the fn's name. **Pin it in production code.** The name is half of the
///   dedup key, `(handler name, message id)`: renaming the fn would change the
///   name, and every message still in the stream's retention would be
///   processed again on redelivery or replay. Two handlers with the same name
///   share their dedup rows, so a message processed by one counts as processed
///   for the other. Give each handler a distinct, versioned name
///   (`"credit-v1"`), and change it only to reprocess on purpose.
/// - `key = <expr>`: the message id, computed from the payload. The
///   expression sees the payload pattern's bindings, and the `&Delivery`
///   parameter's, by reference, and its value is turned into a string with
///   `ToString`. It may also be a closure over one message, and optionally
///   its delivery, which binds its own names: `key = |cmd| cmd.transfer_id`,
///   `key = |cmd, delivery| ...` (a batch handler's key must be one).
/// - `codec = json | raw | protobuf | <path>`: how the payload is decoded
///   (JSON by default; `raw` for `Bytes`, `Vec<u8>` or `String`; `protobuf`
///   for a `prost::Message`; or a type implementing `codec::Decode`).
/// - `state = <type>`: implement the handler for this router state only, so
///   that a `State<T>` it cannot provide is reported at the parameter.
/// - `batch`: a batch handler; see below.
/// - `crate = <path>`: where idem-runtime is, if renamed or re-exported.
///
/// # Batch handlers
///
/// With `batch`, the fn takes the fresh messages of a batch together, so
/// that it can write them all with one statement, and the deliveries, if it
/// wants them, as a slice in the same order:
///
/// ```
/// use idem_runtime::{Delivery, Route, Router, idempotent};
///
/// #[derive(serde::Deserialize)]
/// pub struct Credit {
///     transfer_id: String,
///     account: i64,
///     amount: i64,
/// }
///
/// #[idempotent(name = "credit-many-v1", key = |cmd| cmd.transfer_id, batch)]
/// pub async fn credit_many(
///     tx: &mut sqlx::PgTransaction<'_>,
///     deliveries: &[Delivery],
///     cmds: Vec<Credit>,
/// ) -> Result<(), sqlx::Error> {
///     let accounts: Vec<i64> = cmds.iter().map(|cmd| cmd.account).collect();
///     let amounts: Vec<i64> = cmds.iter().map(|cmd| cmd.amount).collect();
///     // Summed per account first: two credits to one account may share a
///     // batch, and an UPDATE ... FROM changes a row once.
///     sqlx::query(
///         "UPDATE accounts SET balance = balance + c.amount
///          FROM (SELECT id, sum(amount) AS amount
///                  FROM unnest($1::int8[], $2::int8[]) AS m(id, amount) GROUP BY id) AS c
///          WHERE accounts.id = c.id",
///     )
///     .bind(&accounts)
///     .bind(&amounts)
///     .execute(&mut **tx)
///     .await?;
///     Ok(())
/// }
///
/// let router = Router::new().route(Route::new("LEDGER", "credit").batch(64), credit_many);
/// # drop(router);
/// ```
///
/// - The runtime claims the whole batch first, in one statement, and calls
///   the fn once with the messages that were fresh: never one processed
///   before, in this batch or any other, and never an empty batch.
/// - `Ok` commits the batch, claims and writes together. `Err`, a panic or
///   the handler timeout (which covers the one call) rolls the whole batch
///   back; then each message runs again alone, through the same fn as a
///   batch of one, and takes its own retry or dead-letter path. So the fn
///   must do for one message what it does for many; it must not fail a
///   whole batch for a message that would succeed alone, or every batch
///   with such a message costs a fallback.
/// - On a route without `Route::batch`, each message is a batch of one.
/// - Between the transaction and the messages: `State<T>` (through
///   `FromBatch`) and `&[Delivery]`; a `&Delivery` is refused.
///
/// # The message id
///
/// Each message is deduplicated by the first of:
///
/// 1. the `key = <expr>` of the handler, over the decoded payload;
/// 2. the `Nats-Msg-Id` header;
/// 3. `<stream>:<stream sequence>:<stored at>`, which is unique per stored
///    message but differs between two publishes of the same logical message.
///
/// An empty id, or one too long for the dedup table, is refused: the runtime
/// terminates the message rather than retry it.
///
/// # What it generates
///
/// A struct named like the fn, with the fn's visibility, that implements
/// `idem_runtime::handler::Handler<S, DB>` for every router state `S` that
/// provides its parameters, on the database `DB` of its transaction, and a
/// fn of the same name that returns it: pass `credit` to `Router::route`. The body stays callable, unchanged, as
/// `credit::run(tx, .., msg)`, for instance from a test that skips the
/// claim, and `credit::NAME` is the handler name. The guide (`idem_runtime::guide::writing_handlers`) shows a full
/// `cargo expand` of a handler.
///
/// The struct has braces so that `credit` as a value is the fn: a unit struct
/// would make every `let credit = ...` in scope, and a payload parameter
/// named like its handler, a pattern on the struct.
///
/// Doc comments go on the struct and `#[cfg]` on every generated item. Other
/// attributes stay on `run`; so `#[tracing::instrument]` names its span `run`
/// unless given `name = "..."`.
///
/// [`Delivery`]: https://docs.rs/idem-runtime/latest/idem_runtime/struct.Delivery.html
/// [`BoxError`]: https://docs.rs/idem-runtime/latest/idem_runtime/type.BoxError.html
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}

/// Registers a `Classify` implementation, so that its class is found
/// wherever the error sits in a handler's error chain: inside an
/// `anyhow::Error`, a `Box<dyn Error>`, or another error's `source()`.
///
/// ```
/// use idem_runtime::classify;
/// use idem_runtime::error::{Classify, ErrorClass};
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("account {0} is closed")]
/// struct AccountClosed(i64);
///
/// #[classify]
/// impl Classify for AccountClosed {
///     fn class(&self) -> ErrorClass {
///         ErrorClass::Permanent
///     }
/// }
/// ```
#[proc_macro_attribute]
pub fn classify(args: TokenStream, item: TokenStream) -> TokenStream {
    classify::classify(args.into(), item.into()).into()
}

/// Implements `idem_runtime::FromRef<State>` for the type of each field of a
/// state struct, so that a handler can take any field with `State<T>`. The
/// fields must be `Clone` (put what is costly to clone in an `Arc`).
///
/// ```
/// use idem_runtime::FromRef;
///
/// #[derive(Clone, FromRef)]
/// struct App {
///     config: std::sync::Arc<Config>,
///     http: HttpClient,
/// }
/// # struct Config;
/// # #[derive(Clone)] struct HttpClient;
/// ```
#[proc_macro_derive(FromRef)]
pub fn derive_from_ref(input: TokenStream) -> TokenStream {
    from_ref::derive(input.into()).into()
}
