//! The expansion: the user's fn, unchanged, inside a `#[test]` fn of the
//! same name that hands it a bed.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::ItemFn;
use syn::spanned::Spanned;

use crate::args::Args;

pub(crate) fn test(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        // Not a fn: syn's error, at the item.
        Err(error) => return error.into_compile_error(),
    };
    let checked = syn::parse2::<Args>(args).and_then(|args| check(&function).map(|()| args));
    match checked {
        Ok(args) => generate(&args, &function),
        // The fn stays, so that the IDE keeps working on it.
        Err(error) => {
            let error = error.into_compile_error();
            quote! { #error #item }
        }
    }
}

/// An `async fn` of one parameter, the bed.
fn check(function: &ItemFn) -> syn::Result<()> {
    let signature = &function.sig;
    if signature.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            signature.fn_token,
            "#[idem_test::test] needs an `async fn`",
        ));
    }
    if signature.inputs.len() != 1 {
        return Err(syn::Error::new_spanned(
            &signature.inputs,
            "#[idem_test::test] fn takes one parameter, the bed: `bed: idem_test::Bed`",
        ));
    }
    if !signature.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &signature.generics,
            "#[idem_test::test] fn cannot be generic",
        ));
    }
    Ok(())
}

fn generate(args: &Args, function: &ItemFn) -> TokenStream {
    let name = &function.sig.ident;
    let output = &function.sig.output;
    let attrs = &function.attrs;
    let vis = &function.vis;
    let setup = args.setup.as_ref().map(|path| {
        quote_spanned! {path.span()=>
            .setup(|__idem_pool| ::std::boxed::Box::pin(async move {
                ::idem_test::__private::SetupResult::into_setup_result(#path(&__idem_pool).await)
            }))
        }
    });
    let mut body = function.clone();
    body.attrs.clear();
    body.vis = syn::Visibility::Inherited;
    quote! {
        #[::core::prelude::v1::test]
        #(#attrs)*
        #vis fn #name() #output {
            #body
            ::idem_test::__private::run(
                ::idem_test::__private::Options::new() #setup,
                #name,
            )
        }
    }
}
