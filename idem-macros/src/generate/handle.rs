//! The `Handler` methods that call `run`, in one of three forms: `handle`
//! alone; the batch form, where `handle` runs one message as a batch of one
//! through `handle_batch`; or a stored result, where `handle` goes through
//! `handle_and_encode`, which the runtime calls.
//!
//! Each is spanned at the user's `async`, so that a body that is not `Send`
//! is reported on the handler rather than on the attribute. Each takes the
//! transaction as `&mut Transaction<'_, DatabaseOf<T>>`, spanned at the
//! user's `T` ([`super::database`]).

use proc_macro2::TokenStream;
use quote::quote_spanned;

use super::Context;
use super::result::into_handler_result;
use crate::check::Value;

/// The methods, given the arguments for the parameters between the
/// transaction and the message.
pub(super) fn handle(cx: &Context<'_>, arguments: &[TokenStream]) -> TokenStream {
    let settle = into_handler_result(cx);
    if cx.handler.batch {
        batch(cx, arguments, &settle)
    } else if let Value::Stored(_) = cx.handler.value {
        stored_result(cx, arguments, &settle)
    } else {
        plain(cx, arguments, &settle)
    }
}

/// `handle`, calling `run` with the message.
fn plain(cx: &Context<'_>, arguments: &[TokenStream], settle: &TokenStream) -> TokenStream {
    let Context {
        krate,
        state,
        transaction,
        ..
    } = cx;
    let ident = &cx.handler.function.sig.ident;
    quote_spanned! {cx.handler.async_span=>
        #[allow(clippy::ignored_unit_patterns)]
        async fn handle(
            &self,
            __idem_tx: #transaction,
            __idem_payload: Self::Payload,
            __idem_delivery: &#krate::Delivery,
            __idem_state: &#state,
        ) -> ::core::result::Result<(), #krate::HandlerError> {
            let __idem_result = #ident::run(__idem_tx, #(#arguments,)* __idem_payload).await;
            #settle
        }
    }
}

/// `handle_batch`, calling `run` with the fresh messages, and `handle`, which
/// runs one message as a batch of one.
fn batch(cx: &Context<'_>, arguments: &[TokenStream], settle: &TokenStream) -> TokenStream {
    let Context {
        krate,
        state,
        db,
        transaction,
        ..
    } = cx;
    let ident = &cx.handler.function.sig.ident;
    quote_spanned! {cx.handler.async_span=>
        async fn handle(
            &self,
            __idem_tx: #transaction,
            __idem_payload: Self::Payload,
            __idem_delivery: &#krate::Delivery,
            __idem_state: &#state,
        ) -> ::core::result::Result<(), #krate::HandlerError> {
            <Self as #krate::handler::Handler<#state, #db>>::handle_batch(
                self,
                __idem_tx,
                ::std::vec::Vec::from([__idem_payload]),
                ::core::slice::from_ref(__idem_delivery),
                __idem_state,
            )
            .await
        }

        #[allow(clippy::ignored_unit_patterns)]
        async fn handle_batch(
            &self,
            __idem_tx: #transaction,
            __idem_payloads: ::std::vec::Vec<Self::Payload>,
            __idem_deliveries: &[#krate::Delivery],
            __idem_state: &#state,
        ) -> ::core::result::Result<(), #krate::HandlerError> {
            let __idem_result = #ident::run(__idem_tx, #(#arguments,)* __idem_payloads).await;
            #settle
        }
    }
}

/// `handle_and_encode`, calling `run` and encoding its value. The runtime
/// calls it; `handle` keeps the trait's meaning for anyone else who calls
/// it.
fn stored_result(cx: &Context<'_>, arguments: &[TokenStream], settle: &TokenStream) -> TokenStream {
    let Context {
        krate,
        state,
        db,
        transaction,
        ..
    } = cx;
    let ident = &cx.handler.function.sig.ident;
    quote_spanned! {cx.handler.async_span=>
        async fn handle(
            &self,
            __idem_tx: #transaction,
            __idem_payload: Self::Payload,
            __idem_delivery: &#krate::Delivery,
            __idem_state: &#state,
        ) -> ::core::result::Result<(), #krate::HandlerError> {
            <Self as #krate::handler::Handler<#state, #db>>::handle_and_encode(
                self,
                __idem_tx,
                __idem_payload,
                __idem_delivery,
                __idem_state,
            )
            .await
            .map(::core::mem::drop)
        }

        async fn handle_and_encode(
            &self,
            __idem_tx: #transaction,
            __idem_payload: Self::Payload,
            __idem_delivery: &#krate::Delivery,
            __idem_state: &#state,
        ) -> ::core::result::Result<
            ::core::option::Option<#krate::codec::Bytes>,
            #krate::HandlerError,
        > {
            let __idem_result = #ident::run(__idem_tx, #(#arguments,)* __idem_payload).await;
            #settle
        }
    }
}
