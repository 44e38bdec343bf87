//! Checks the annotated fn and the arguments, as far as syntax can tell.
//!
//! Every check reports at the node the user should change, and none stops
//! the others: they push onto one [`Errors`], so that one expansion reports
//! every problem at once. What only types can tell (whether the payload
//! decodes, a parameter is provided by the state, the error converts into
//! `BoxError`) is left to rustc, through bounds the generator places at the
//! user's spans.
//!
//! - [`HandlerFn::check`]: the fn's header and return type, here;
//! - [`params`]: the parameters (transaction, `&Delivery` or `State<T>`,
//!   message);
//! - [`args`]: the arguments that must agree with the signature (`codec`,
//!   `key`);
//! - [`types`]: what the checks read off a written type.

mod args;
mod params;
mod types;

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::{Error, GenericParam, ItemFn, PatType, ReturnType, Signature, Type};

pub(crate) use args::{check_codec, check_key};
use params::Params;
pub(crate) use types::{Value, is_reference};
use types::{error_type_span, value_of};

/// An `async fn` whose signature the handler can call.
pub(crate) struct HandlerFn<'a> {
    pub(crate) function: &'a ItemFn,
    /// The type behind the first parameter's `&mut`: the transaction (or
    /// the connection it derefs to), whose database the handler runs on.
    pub(crate) tx_ty: &'a Type,
    /// The parameters between the transaction and the message.
    pub(crate) between: Vec<&'a PatType>,
    /// The last parameter.
    pub(crate) payload: &'a PatType,
    /// The payload type: the last parameter's, or for a batch handler its
    /// element type (`T` of `Vec<T>`).
    pub(crate) payload_ty: &'a Type,
    /// Whether the fn takes the fresh messages of a batch together.
    pub(crate) batch: bool,
    /// The return type (there is one: its absence is an error).
    pub(crate) output: &'a Type,
    /// What its `Ok` carries, as far as the return type shows.
    pub(crate) value: Value<'a>,
    /// Where an error type that is not `Into<BoxError>` gets reported.
    pub(crate) error_type_span: Span,
    /// Where a body that is not `Send` gets reported.
    pub(crate) async_span: Span,
}

impl<'a> HandlerFn<'a> {
    /// Checks the signature as far as syntax allows, reporting every problem
    /// at the node to change. Type checks are left to rustc, at spans chosen
    /// in [`generate`](crate::generate).
    pub(crate) fn check(function: &'a ItemFn, batch: bool) -> syn::Result<Self> {
        let sig = &function.sig;
        let mut errors = Errors::default();

        check_header(sig, &mut errors);
        let params = Params::check(function, batch, &mut errors);
        let output = return_type(sig, &mut errors);

        let value = output.map_or(Value::Unit, value_of);
        if let (Value::Stored(value), true) = (value, batch) {
            errors.push(Error::new_spanned(
                value,
                "a batch handler (`#[idempotent(batch)]`) returns `Result<(), E>`: it stores no \
                 result. A handler that returns a value takes one message (remove `batch`); on a \
                 batch route, the value of each message is stored with its claim",
            ));
        }

        errors.finish()?;
        let (Some(asyncness), Some(params), Some(output)) = (sig.asyncness, params, output) else {
            unreachable!("every `None` above pushed an error");
        };
        Ok(HandlerFn {
            function,
            tx_ty: params.tx_ty,
            between: params.between,
            payload: params.payload,
            payload_ty: params.payload_ty,
            batch,
            output,
            value,
            error_type_span: error_type_span(output),
            async_span: asyncness.span,
        })
    }
}

/// The fn's header: `async`, neither `unsafe` nor `extern`, no generic
/// parameters and no `where` clause.
fn check_header(sig: &Signature, errors: &mut Errors) {
    let name = sig.ident.unraw();
    if sig.asyncness.is_none() {
        errors.push(Error::new_spanned(
            sig.fn_token,
            format!("an `#[idempotent]` handler must be async: write `async fn {name}`"),
        ));
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.push(Error::new_spanned(
            unsafety,
            "an `#[idempotent]` handler cannot be `unsafe`: remove `unsafe` and use an \
             `unsafe` block in the body",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(Error::new_spanned(
            abi,
            "an `#[idempotent]` handler is called by the runtime, not through an ABI: \
             remove the `extern`",
        ));
    }
    if !sig.generics.params.is_empty() {
        let only_lifetimes = sig
            .generics
            .params
            .iter()
            .all(|param| matches!(param, GenericParam::Lifetime(_)));
        errors.push(Error::new_spanned(
            &sig.generics,
            if only_lifetimes {
                "an `#[idempotent]` handler cannot declare lifetimes: \
                 write `'_` in the parameter types instead"
            } else {
                "an `#[idempotent]` handler cannot be generic: the runtime decodes each \
                 message into one concrete type, so write the concrete types instead"
            },
        ));
    }
    if let Some(where_clause) = &sig.generics.where_clause {
        errors.push(Error::new_spanned(
            where_clause,
            "an `#[idempotent]` handler cannot have a `where` clause: remove it",
        ));
    }
}

/// The return type; `None` after pushing an error if there is none.
fn return_type<'a>(sig: &'a Signature, errors: &mut Errors) -> Option<&'a Type> {
    match &sig.output {
        ReturnType::Type(_, ty) => Some(&**ty),
        ReturnType::Default => {
            errors.push(Error::new(
                sig.paren_token.span.close(),
                "an `#[idempotent]` handler returns a `Result` whose error converts into \
                 `idem_runtime::BoxError`: add `-> Result<(), MyError>` after the parameters",
            ));
            None
        }
    }
}

/// Collects errors so that one expansion reports all of them.
#[derive(Default)]
struct Errors(Option<Error>);

impl Errors {
    fn push(&mut self, error: Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests;
