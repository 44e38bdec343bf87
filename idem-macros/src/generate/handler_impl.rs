//! `impl Handler<S, DB> for credit`: for which router states and which
//! database, the payload and its codec, the batch and per-message flags, the
//! name, the message key, and `handle`.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote, quote_spanned};
use syn::Ident;
use syn::spanned::Spanned;

use super::{Context, handle, key, parameters, respan};
use crate::attr::Codec;

pub(super) fn handler_impl(cx: &Context<'_>) -> TokenStream {
    let krate = &cx.krate;
    let state = &cx.state;
    let db = &cx.db;
    let ident = &cx.handler.function.sig.ident;
    let cfgs = &cx.attrs.cfgs;

    // Any state (`impl<__S>`) that is shared across the runtime's tasks, or
    // only the one `state = ...` names.
    let state_param = cx.args.state.is_none().then(|| quote!(<__S>));
    let state_bound = cx
        .args
        .state
        .is_none()
        .then(|| quote!(__S: ::core::marker::Send + ::core::marker::Sync + 'static,));

    let payload_ty = cx.handler.payload_ty;
    let payload_type = quote_spanned! {payload_ty.span()=>
        type Payload = #payload_ty;
    };
    let codec = codec(cx);
    let codec_type = quote_spanned! {payload_ty.span()=>
        type Codec = #codec;
    };
    let batches = cx.handler.batch.then(|| {
        quote!(
            const BATCHES: bool = true;
        )
    });
    let per_message = cx.args.per_message.is_some().then(|| {
        quote!(
            const PER_MESSAGE: bool = true;
        )
    });
    let message_key = cx
        .args
        .key
        .as_ref()
        .map(|key| key::message_key(krate, cx.handler, key));
    let (arguments, bounds) = parameters::between(cx);
    let handle = handle::handle(cx, &arguments);

    quote! {
        #(#cfgs)*
        impl #state_param #krate::handler::Handler<#state, #db> for #ident
        where
            #state_bound
            #(#bounds,)*
        {
            #payload_type
            #codec_type
            #batches
            #per_message

            fn name(&self) -> &'static str {
                Self::NAME
            }

            #message_key

            // The runtime claims the message first and calls this only
            // when the claim is fresh.
            #handle
        }
    }
}

/// The codec's path: JSON, a builtin by its short name, or the user's type.
/// At the payload type, so that one the codec cannot decode is reported
/// there.
fn codec(cx: &Context<'_>) -> TokenStream {
    let krate = &cx.krate;
    let codec = match &cx.args.codec {
        None => quote!(#krate::codec::Json),
        Some(Codec::Builtin(short)) => {
            let (_, builtin) = Codec::BUILTIN
                .iter()
                .find(|(name, _)| short == name)
                .expect("the parser accepts only builtin names");
            let builtin = Ident::new(builtin, short.span());
            quote!(#krate::codec::#builtin)
        }
        Some(Codec::Path(path)) => path.to_token_stream(),
    };
    respan(&codec, cx.handler.payload_ty.span())
}
