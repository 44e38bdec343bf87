//! `#[classify]`: registers a `Classify` impl, so that the class is found
//! wherever the error sits in a chain.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Error, ItemImpl};

/// Expands `#[classify] impl Classify for T { .. }` into the impl itself plus
/// its registration.
pub(crate) fn classify(args: TokenStream, item: TokenStream) -> TokenStream {
    match expand(args, item.clone()) {
        Ok(tokens) => tokens,
        Err(error) => {
            let mut tokens = error.into_compile_error();
            tokens.extend(item);
            tokens
        }
    }
}

fn expand(args: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    if !args.is_empty() {
        return Err(Error::new_spanned(args, "`#[classify]` takes no arguments"));
    }
    let implementation: ItemImpl = syn::parse2(item).map_err(|error| {
        Error::new(
            error.span(),
            "`#[classify]` goes on an `impl Classify for MyError { .. }` block",
        )
    })?;
    let is_classify = implementation
        .trait_
        .as_ref()
        .and_then(|(_, path, _)| path.segments.last())
        .is_some_and(|last| last.ident == "Classify");
    if !is_classify {
        return Err(Error::new_spanned(
            &implementation.self_ty,
            "`#[classify]` goes on an `impl Classify for MyError { .. }` block",
        ));
    }
    if !implementation.generics.params.is_empty() {
        return Err(Error::new_spanned(
            &implementation.generics,
            "`#[classify]` registers one concrete error type: write an impl for each type \
             (a generic impl cannot be registered)",
        ));
    }
    let ty = &implementation.self_ty;
    Ok(quote! {
        #implementation

        ::idem_runtime::__private::inventory::submit! {
            ::idem_runtime::__private::Classifier::of::<#ty>()
        }
    })
}
