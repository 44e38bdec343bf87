//! Helpers for the unit tests of `#[idempotent]` (in `check/tests.rs` and
//! `generate/tests.rs`): run the whole expansion, and read back its text or
//! its errors.

use proc_macro2::TokenStream;
use syn::LitStr;

use super::idempotent;

/// The expansion, as text.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> String {
    idempotent(args, item).to_string()
}

/// The compile errors of an expansion, in order.
pub(crate) fn errors(args: TokenStream, item: TokenStream) -> Vec<String> {
    let expanded = idempotent(args, item.clone());
    let mut errors = Vec::new();
    let mut tokens = expanded.clone().into_iter().peekable();
    while let Some(token) = tokens.next() {
        if let proc_macro2::TokenTree::Ident(ident) = &token
            && ident == "compile_error"
        {
            tokens.next(); // `!`
            if let Some(proc_macro2::TokenTree::Group(group)) = tokens.next() {
                let message: LitStr = syn::parse2(group.stream()).unwrap();
                errors.push(message.value());
            }
        }
    }
    // The fn is re-emitted as written, after the errors.
    assert!(
        expanded.to_string().ends_with(&item.to_string()),
        "the fn was not re-emitted unchanged: {expanded}"
    );
    errors
}

/// The one compile error of an expansion.
pub(crate) fn error(args: TokenStream, item: TokenStream) -> String {
    let errors = errors(args, item);
    assert_eq!(errors.len(), 1, "expected one error, got {errors:?}");
    errors.into_iter().next().unwrap()
}

pub(crate) fn assert_tokens_eq(actual: TokenStream, expected: TokenStream) {
    assert_eq!(actual.to_string(), expected.to_string());
}
