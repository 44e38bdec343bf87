//! `#[derive(FromRef)]`: each field of a state struct is a part a handler
//! can take with `State<T>`.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Error, Fields};

pub(crate) fn derive(input: TokenStream) -> TokenStream {
    match expand(input) {
        Ok(tokens) => tokens,
        Err(error) => error.into_compile_error(),
    }
}

fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let input: DeriveInput = syn::parse2(input)?;
    let Data::Struct(data) = &input.data else {
        return Err(Error::new_spanned(
            &input.ident,
            "`#[derive(FromRef)]` goes on a state struct with named fields",
        ));
    };
    let Fields::Named(fields) = &data.fields else {
        return Err(Error::new_spanned(
            &input.ident,
            "`#[derive(FromRef)]` goes on a state struct with named fields",
        ));
    };
    let state = &input.ident;
    let (impl_generics, type_generics, where_clause) = input.generics.split_for_impl();
    let impls = fields.named.iter().map(|field| {
        let name = &field.ident;
        let ty = &field.ty;
        quote! {
            impl #impl_generics ::idem_runtime::FromRef<#state #type_generics> for #ty #where_clause {
                fn from_ref(state: &#state #type_generics) -> Self {
                    ::core::clone::Clone::clone(&state.#name)
                }
            }
        }
    });
    Ok(quote!(#(#impls)*))
}
