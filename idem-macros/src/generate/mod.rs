//! Generates the handler for a checked fn, in named steps.
//!
//! For `#[idempotent] async fn credit(..)`, in the order emitted:
//!
//! 1. [`items`]: the struct `credit`, the fn `credit()` that returns it, its
//!    `Debug` impl, and `impl credit { NAME, run }`, where `run` is the body
//!    as written;
//! 2. [`handler_impl`]: `impl Handler<S, DB> for credit`, its payload and
//!    codec types, and `BATCHES` for a batch handler, with
//!    - [`database`]: `DB`, the database of the transaction the fn takes;
//!    - [`key`]: `fn message_key`, if `key = ...` is given;
//!    - [`parameters`]: what `run` gets for each parameter between the
//!      transaction and the message, and the bounds that check them;
//!    - [`handle`]: `fn handle`, plus `handle_batch` (the batch form) or
//!      `handle_and_encode` (a stored result);
//!    - [`result`]: what the fn's `Result` becomes inside them.
//!
//! Tokens the user wrote keep their spans, and tokens that rustc may report
//! on (a trait bound, a conversion) are spanned at the user's code, so that
//! a type error points at the parameter, the payload or the return type to
//! change rather than at the attribute.

mod database;
mod handle;
mod handler_impl;
mod items;
mod key;
mod parameters;
mod result;

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::Attribute;

use crate::attr::Args;
use crate::check::HandlerFn;

/// The handler struct, the fn that returns it, its `NAME` and `run`, a
/// `Debug` impl, and its `Handler` impl.
pub(crate) fn generate(args: &Args, handler: &HandlerFn<'_>) -> TokenStream {
    let cx = Context::new(args, handler);
    let items = items::items(&cx);
    let handler_impl = handler_impl::handler_impl(&cx);
    quote! {
        #items
        #handler_impl
    }
}

/// What every step reads: the arguments, the checked fn, and what is
/// derived from them once.
struct Context<'a> {
    args: &'a Args,
    handler: &'a HandlerFn<'a>,
    /// Where idem-runtime is: `::idem_runtime`, or `crate = ...`.
    krate: TokenStream,
    /// The router state the impl is for: any (`__S`), or the one named by
    /// `state = ...`, which checks every parameter against it right there.
    state: TokenStream,
    /// The database the impl is for: the one the fn's transaction is on,
    /// `DatabaseOf<T>` for `tx: &mut T`.
    db: TokenStream,
    /// The transaction the methods take: `&mut Transaction<'_, #db>`.
    transaction: TokenStream,
    /// The fn's attributes, by the items they go on.
    attrs: Attrs<'a>,
}

impl<'a> Context<'a> {
    fn new(args: &'a Args, handler: &'a HandlerFn<'a>) -> Self {
        let krate = args
            .krate
            .as_ref()
            .map_or_else(|| quote!(::idem_runtime), ToTokens::to_token_stream);
        let state = match &args.state {
            None => quote!(__S),
            Some(state) => state.to_token_stream(),
        };
        let database::Database { db, transaction } = database::database(&krate, handler.tx_ty);
        Context {
            args,
            handler,
            krate,
            state,
            db,
            transaction,
            attrs: Attrs::split(&handler.function.attrs),
        }
    }
}

/// The fn's attributes, split by the generated items they go on.
struct Attrs<'a> {
    /// `#[doc]`: they describe the handler, so they go on the struct.
    docs: Vec<&'a Attribute>,
    /// `#[cfg]`: on every generated item, to remove them all at once.
    cfgs: Vec<&'a Attribute>,
    /// Anything else (`#[tracing::instrument]`, `#[allow]`) was written for
    /// the fn, so it stays on `run`.
    fn_attrs: Vec<&'a Attribute>,
}

impl<'a> Attrs<'a> {
    fn split(attrs: &'a [Attribute]) -> Self {
        let (docs, rest): (Vec<&Attribute>, Vec<&Attribute>) =
            attrs.iter().partition(|attr| attr.path().is_ident("doc"));
        let (cfgs, fn_attrs): (Vec<&Attribute>, Vec<&Attribute>) = rest
            .into_iter()
            .partition(|attr| attr.path().is_ident("cfg"));
        Attrs {
            docs,
            cfgs,
            fn_attrs,
        }
    }
}

/// `tokens` with every span set to `span`, so that a path built once (the
/// crate's) reports errors where the user's code is.
fn respan(tokens: &TokenStream, span: Span) -> TokenStream {
    tokens
        .clone()
        .into_iter()
        .map(|mut token| {
            if let proc_macro2::TokenTree::Group(group) = &token {
                let mut respanned =
                    proc_macro2::Group::new(group.delimiter(), respan(&group.stream(), span));
                respanned.set_span(span);
                token = proc_macro2::TokenTree::Group(respanned);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

#[cfg(test)]
mod tests;
