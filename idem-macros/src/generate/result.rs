//! What the fn's `Result` becomes inside `handle`: `Ok(())`, or the value
//! encoded with the codec (a stored result), and on `Err` a
//! `HandlerError`.

use proc_macro2::TokenStream;
use quote::quote_spanned;
use syn::spanned::Spanned;

use super::{Context, respan};
use crate::check::Value;

/// `match HandlerResult::into_result(__idem_result) { .. }`.
///
/// Spanned at the user's return type and error type, so that a return type
/// that is not a `Result`, or an error that does not convert into
/// `BoxError`, is reported there, once.
pub(super) fn into_handler_result(cx: &Context<'_>) -> TokenStream {
    let handler = cx.handler;
    let output = handler.output;
    let output_krate = respan(&cx.krate, output.span());
    let into_result = quote_spanned! {output.span()=>
        #output_krate::error::HandlerResult::into_result(__idem_result)
    };
    let error_krate = respan(&cx.krate, handler.error_type_span);
    let into_handler_error = quote_spanned! {handler.error_type_span=>
        ::core::result::Result::Err(__idem_error) => {
            ::core::result::Result::Err(#error_krate::__private::handler_error!(__idem_error))
        }
    };
    // What `Ok` becomes: `()` for `handle`, or the value encoded with the
    // codec (at the value's type, so that one the codec cannot encode is
    // reported there) for `handle_and_encode`.
    let ok_arm = match handler.value {
        Value::Unit => quote_spanned! {output.span()=>
            ::core::result::Result::Ok(_) => ::core::result::Result::Ok(()),
        },
        Value::Hidden => quote_spanned! {output.span()=>
            ::core::result::Result::Ok(__idem_value) => {
                #output_krate::__private::no_value(__idem_value);
                ::core::result::Result::Ok(())
            }
        },
        Value::Stored(value) => {
            let value_krate = respan(&cx.krate, value.span());
            quote_spanned! {value.span()=>
                ::core::result::Result::Ok(__idem_value) => {
                    #value_krate::__private::encode::<Self::Codec, _>(&__idem_value)
                }
            }
        }
    };
    quote_spanned! {output.span()=>
        match #into_result {
            #ok_arm
            #into_handler_error
        }
    }
}
