//! The items around the `Handler` impl: the struct `credit`, the fn
//! `credit()` that returns it, its `Debug` impl, and `impl credit` with
//! `NAME` and `run`, the body as written.

use proc_macro2::TokenStream;
use quote::quote;
use syn::ext::IdentExt;
use syn::{Ident, LitStr};

use super::{Attrs, Context};

pub(super) fn items(cx: &Context<'_>) -> TokenStream {
    let function = cx.handler.function;
    let vis = &function.vis;
    let ident = &function.sig.ident;
    let body = &function.block;
    let unraw = ident.unraw();
    let name = cx
        .args
        .name
        .clone()
        .unwrap_or_else(|| LitStr::new(&unraw.to_string(), ident.span()));
    let constructor_doc = format!(
        " Returns the `{unraw}` handler, for `Router::route`. \
         The body as written is `{unraw}::run`."
    );
    let debug_name = unraw.to_string();
    let Attrs {
        docs,
        cfgs,
        fn_attrs,
    } = &cx.attrs;

    // The user's signature token for token, renamed, so that errors in the
    // body keep pointing at what the user wrote.
    let mut run_sig = function.sig.clone();
    run_sig.ident = Ident::new("run", ident.span());

    // The struct has braces so that it lives in the type namespace only, and
    // the fn of the same name stays a value. A unit struct would also be a
    // value, and then every `let credit = ..` in scope, or a payload named
    // like its handler, would be read as a pattern matching the struct.
    // `Router::route` takes the fn through `IntoHandler`.
    quote! {
        #(#docs)*
        #(#cfgs)*
        #[allow(non_camel_case_types)]
        #vis struct #ident {}

        #(#cfgs)*
        #[doc = #constructor_doc]
        #vis fn #ident() -> #ident {
            #ident {}
        }

        #(#cfgs)*
        impl ::core::fmt::Debug for #ident {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(#debug_name)
            }
        }

        #(#cfgs)*
        impl #ident {
            /// The handler name stored with each claim in the dedup table.
            pub const NAME: &'static str = #name;

            /// The handler body as written. The runtime runs it only after a fresh claim.
            #(#fn_attrs)*
            pub #run_sig #body
        }
    }
}
