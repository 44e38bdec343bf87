//! Checks the annotated fn and generates its handler.
//!
//! Everything here works on `proc_macro2` so that it can be unit-tested; the
//! `proc_macro` entry point in `lib.rs` only converts.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{
    Attribute, Error, FnArg, GenericArgument, GenericParam, Ident, Item, ItemFn, LitStr, Pat,
    PatType, PathArguments, ReturnType, Type, TypePath,
};

use crate::attr::Args;

/// Expands `#[idempotent(args)] item`.
///
/// On error the item is re-emitted unchanged next to the error, so that the
/// rest of the crate, and the IDE, still see the fn.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let function = match syn::parse2::<Item>(item.clone()) {
        Ok(Item::Fn(function)) => function,
        Ok(other) => {
            let error = Error::new(
                other.span(),
                "`#[idempotent]` goes on an `async fn` handler, such as \
                 `async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), MyError>`",
            );
            return with_error(item, error);
        }
        Err(error) => return with_error(item, error),
    };
    match (syn::parse2::<Args>(args), HandlerFn::check(&function)) {
        (Ok(args), Ok(handler)) => generate(&args, &handler),
        (Err(error), Ok(_)) | (Ok(_), Err(error)) => with_error(item, error),
        (Err(mut error), Err(more)) => {
            error.combine(more);
            with_error(item, error)
        }
    }
}

fn with_error(item: TokenStream, error: Error) -> TokenStream {
    let mut tokens = error.into_compile_error();
    tokens.extend(item);
    tokens
}

/// An `async fn` whose signature the handler can call.
struct HandlerFn<'a> {
    function: &'a ItemFn,
    /// The second parameter.
    payload: &'a PatType,
    /// Whether there is a third, `&Delivery`, parameter.
    takes_delivery: bool,
    /// Where an error type that is not `Into<BoxError>` gets reported.
    error_type_span: Span,
    /// Where a body that is not `Send` gets reported.
    async_span: Span,
}

impl<'a> HandlerFn<'a> {
    /// Checks the signature as far as syntax allows, reporting every problem
    /// at the node to change. Type checks (the payload decodes, the error
    /// converts) are left to rustc, at spans chosen in [`generate`].
    fn check(function: &'a ItemFn) -> syn::Result<Self> {
        let sig = &function.sig;
        let name = sig.ident.unraw();
        let mut errors = Errors::default();

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

        let params = Params::check(function, &mut errors);
        let error_type_span = match &sig.output {
            ReturnType::Type(_, ty) if is_result(ty) => Some(error_type_span(ty)),
            ReturnType::Type(_, ty) => {
                errors.push(Error::new_spanned(
                    ty,
                    "an `#[idempotent]` handler returns a `Result` whose error converts into \
                     `idem_runtime::BoxError`: write `-> Result<(), MyError>` (an alias must \
                     also be named `Result`)",
                ));
                None
            }
            ReturnType::Default => {
                errors.push(Error::new(
                    sig.paren_token.span.close(),
                    "an `#[idempotent]` handler returns a `Result` whose error converts into \
                     `idem_runtime::BoxError`: add `-> Result<(), MyError>` after the parameters",
                ));
                None
            }
        };

        errors.finish()?;
        let (Some(asyncness), Some(params), Some(error_type_span)) =
            (sig.asyncness, params, error_type_span)
        else {
            unreachable!("every `None` above pushed an error");
        };
        Ok(HandlerFn {
            function,
            payload: params.payload,
            takes_delivery: params.takes_delivery,
            error_type_span,
            async_span: asyncness.span,
        })
    }
}

/// The parameters: `(tx: &mut _, payload: P)` or `(tx: &mut _, payload: P, delivery: &_)`.
struct Params<'a> {
    payload: &'a PatType,
    takes_delivery: bool,
}

impl<'a> Params<'a> {
    /// `None` after pushing at least one error.
    fn check(function: &'a ItemFn, errors: &mut Errors) -> Option<Self> {
        let sig = &function.sig;
        let mut typed = Vec::with_capacity(sig.inputs.len());
        for input in &sig.inputs {
            match input {
                FnArg::Typed(param) => typed.push(param),
                FnArg::Receiver(receiver) => {
                    errors.push(Error::new_spanned(
                        receiver,
                        "an `#[idempotent]` handler is a free fn, not a method: remove `self` \
                         and move the fn out of the `impl` block",
                    ));
                    return None;
                }
            }
        }

        const SIGNATURE: &str = "`(tx: &mut sqlx::PgTransaction<'_>, cmd: MyMessage)`";
        let all_params = sig.paren_token.span.join();
        let (tx, payload, delivery) = match typed[..] {
            [] => {
                errors.push(Error::new(
                    all_params,
                    format!(
                        "an `#[idempotent]` handler takes the transaction and the message: \
                         write {SIGNATURE}"
                    ),
                ));
                return None;
            }
            [only] if !is_reference(&only.ty, true) => {
                errors.push(Error::new(
                    all_params,
                    format!(
                        "an `#[idempotent]` handler takes the transaction first, then the \
                         message: write {SIGNATURE}"
                    ),
                ));
                return None;
            }
            [_] => {
                errors.push(Error::new(
                    all_params,
                    format!(
                        "an `#[idempotent]` handler takes the message as its second parameter: \
                         write {SIGNATURE}"
                    ),
                ));
                return None;
            }
            [tx, payload] => (tx, payload, None),
            [tx, payload, delivery] => (tx, payload, Some(delivery)),
            [_, _, _, ref extra @ ..] => {
                errors.push(Error::new_spanned(
                    quote!(#(#extra),*),
                    "an `#[idempotent]` handler takes at most three parameters, the \
                     transaction, the message and `&idem_runtime::Delivery`: remove the rest",
                ));
                return None;
            }
        };

        let mut ok = true;
        if !is_reference(&tx.ty, true) {
            errors.push(Error::new_spanned(
                &tx.ty,
                "the first parameter of an `#[idempotent]` handler is the transaction the claim \
                 runs in: write `tx: &mut sqlx::PgTransaction<'_>`",
            ));
            ok = false;
        }
        if let Type::Reference(reference) = &*payload.ty {
            errors.push(Error::new_spanned(
                reference.and_token,
                "an `#[idempotent]` handler owns the message it decodes: take it by value, \
                 without the `&`",
            ));
            ok = false;
        }
        if let Some(delivery) = delivery
            && !is_reference(&delivery.ty, false)
        {
            errors.push(Error::new_spanned(
                &delivery.ty,
                "the third parameter of an `#[idempotent]` handler receives the delivery: \
                 write `delivery: &idem_runtime::Delivery`",
            ));
            ok = false;
        }
        ok.then_some(Params {
            payload,
            takes_delivery: delivery.is_some(),
        })
    }
}

/// Whether `ty` is `&mut _` (`mutable`) or `&_` (not `mutable`).
fn is_reference(ty: &Type, mutable: bool) -> bool {
    match ty {
        Type::Reference(reference) => reference.mutability.is_some() == mutable,
        Type::Paren(paren) => is_reference(&paren.elem, mutable),
        Type::Group(group) => is_reference(&group.elem, mutable),
        _ => false,
    }
}

/// Whether `ty` is a path ending in `Result`: `Result<(), E>`, `anyhow::Result<()>`.
fn is_result(ty: &Type) -> bool {
    result_path(ty).is_some()
}

fn result_path(ty: &Type) -> Option<&TypePath> {
    match ty {
        Type::Path(path) if path.qself.is_none() => path
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident == "Result")
            .then_some(path),
        Type::Paren(paren) => result_path(&paren.elem),
        Type::Group(group) => result_path(&group.elem),
        _ => None,
    }
}

/// The error type `E` of `Result<T, E>`, so a wrong one is reported on it, or
/// the whole return type for an alias such as `anyhow::Result<T>`.
fn error_type_span(ty: &Type) -> Span {
    let error_type = result_path(ty)
        .and_then(|path| path.path.segments.last())
        .and_then(|last| match &last.arguments {
            PathArguments::AngleBracketed(args) if args.args.len() == 2 => args.args.last(),
            _ => None,
        });
    match error_type {
        Some(GenericArgument::Type(error_type)) => error_type.span(),
        _ => ty.span(),
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

/// The handler struct, the fn that returns it, its `NAME` and `run`, and its
/// `Handler` impl.
fn generate(args: &Args, handler: &HandlerFn<'_>) -> TokenStream {
    let function = handler.function;
    let vis = &function.vis;
    let ident = &function.sig.ident;
    let body = &function.block;
    let unraw = ident.unraw();
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| LitStr::new(&unraw.to_string(), ident.span()));
    let constructor_doc = format!(
        " Returns the `{unraw}` handler, for `Router::route`. \
         The body as written is `{unraw}::run`."
    );

    // Docs describe the handler, so they go on the struct. `cfg` must remove
    // every generated item at once. Anything else (`#[tracing::instrument]`,
    // `#[allow]`) was written for the fn, so it stays on the fn.
    let (docs, rest): (Vec<&Attribute>, Vec<&Attribute>) = function
        .attrs
        .iter()
        .partition(|attr| attr.path().is_ident("doc"));
    let (cfgs, fn_attrs): (Vec<&Attribute>, Vec<&Attribute>) = rest
        .into_iter()
        .partition(|attr| attr.path().is_ident("cfg"));

    // The user's signature token for token, renamed, so that errors in the
    // body keep pointing at what the user wrote.
    let mut run_sig = function.sig.clone();
    run_sig.ident = Ident::new("run", ident.span());

    let payload_ty = &handler.payload.ty;
    let payload_type = quote_spanned! {payload_ty.span()=>
        type Payload = #payload_ty;
    };
    let message_key = args
        .key
        .as_ref()
        .map(|key| message_key(&handler.payload.pat, key));
    let delivery = handler.takes_delivery.then(|| quote!(, __idem_delivery));
    // `handler_error!` keeps the class the error type chose through
    // `idem_runtime::Classify`, if it implements it. Spanned at the user's
    // error type, so that one that does not convert
    // into `BoxError` is reported there, once. (`.map_err(HandlerError::handler)`
    // would report it twice, once on the whole call.)
    let into_handler_error = quote_spanned! {handler.error_type_span=>
        ::core::result::Result::Err(__idem_error) => {
            ::core::result::Result::Err(::idem_runtime::__private::handler_error!(__idem_error))
        }
    };
    let run = quote! {
        match #ident::run(__idem_tx, __idem_payload #delivery).await {
            ::core::result::Result::Ok(_) => {
                ::core::result::Result::Ok(::idem_runtime::Outcome::Processed)
            }
            #into_handler_error
        }
    };
    // Spanned at the user's `async`, so that a body that is not `Send` is
    // reported on the handler rather than on the attribute.
    let future = quote_spanned! {handler.async_span=>
        ::idem_runtime::__private::Box::pin(async move { #run })
    };

    // The struct has braces so that it lives in the type namespace only, and
    // the fn of the same name stays a value. A unit struct would also be a
    // value, and then every `let credit = ..` in scope, or a payload named
    // like its handler, would be read as a pattern matching the struct.
    // `Router::route` takes the fn through `IntoHandler`.
    quote! {
        #(#docs)*
        #(#cfgs)*
        #[allow(non_camel_case_types)]
        #[derive(
            ::core::clone::Clone,
            ::core::marker::Copy,
            ::core::fmt::Debug,
            ::core::default::Default,
        )]
        #vis struct #ident {}

        #(#cfgs)*
        #[doc = #constructor_doc]
        #vis fn #ident() -> #ident {
            #ident {}
        }

        #(#cfgs)*
        impl #ident {
            /// The handler name stored with each claim in the dedup table.
            pub const NAME: &'static str = #name;

            /// The handler body as written. The runtime runs it only after a fresh claim.
            #(#fn_attrs)*
            pub #run_sig #body
        }

        #(#cfgs)*
        impl ::idem_runtime::Handler for #ident {
            #payload_type

            fn name(&self) -> &'static str {
                Self::NAME
            }

            #message_key

            // The runtime claims the message first and calls this only
            // when the claim is fresh.
            fn run_claimed<'a, 'c>(
                &'a self,
                __idem_tx: &'a mut ::idem_runtime::__private::PgTransaction<'c>,
                __idem_payload: Self::Payload,
                __idem_delivery: &'a ::idem_runtime::Delivery,
            ) -> ::idem_runtime::HandlerFuture<'a> {
                #future
            }
        }
    }
}

/// `fn message_key`: binds the payload pattern by reference and stringifies
/// the key expression.
fn message_key(pattern: &Pat, key: &syn::Expr) -> TokenStream {
    let pattern = bind_by_reference(pattern.clone());
    let to_string = quote_spanned! {key.span()=>
        ::idem_runtime::__private::ToString::to_string(&(#key))
    };
    quote! {
        #[allow(unused_variables)]
        fn message_key(
            &self,
            __idem_payload: &Self::Payload,
        ) -> ::core::option::Option<::std::string::String> {
            let #pattern = __idem_payload;
            ::core::option::Option::Some(#to_string)
        }
    }
}

/// Removes `mut`, `ref` and `ref mut` from every binding, so that matching
/// the pattern against `&Payload` binds each name by reference. Keeping
/// them would be an error in edition 2024 (`mut` under a by-reference default
/// binding mode) and a move out of a borrow otherwise.
fn bind_by_reference(mut pattern: Pat) -> Pat {
    strip_binding_modes(&mut pattern);
    pattern
}

fn strip_binding_modes(pattern: &mut Pat) {
    match pattern {
        Pat::Ident(binding) => {
            binding.by_ref = None;
            binding.mutability = None;
            if let Some((_, subpattern)) = &mut binding.subpat {
                strip_binding_modes(subpattern);
            }
        }
        Pat::Or(or) => or.cases.iter_mut().for_each(strip_binding_modes),
        Pat::Paren(paren) => strip_binding_modes(&mut paren.pat),
        Pat::Reference(reference) => strip_binding_modes(&mut reference.pat),
        Pat::Slice(slice) => slice.elems.iter_mut().for_each(strip_binding_modes),
        Pat::Struct(structure) => structure
            .fields
            .iter_mut()
            .for_each(|field| strip_binding_modes(&mut field.pat)),
        Pat::Tuple(tuple) => tuple.elems.iter_mut().for_each(strip_binding_modes),
        Pat::TupleStruct(tuple) => tuple.elems.iter_mut().for_each(strip_binding_modes),
        Pat::Type(typed) => strip_binding_modes(&mut typed.pat),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(args: TokenStream, item: TokenStream) -> String {
        idempotent(args, item).to_string()
    }

    /// The compile errors of an expansion, in order.
    fn errors(args: TokenStream, item: TokenStream) -> Vec<String> {
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

    fn error(args: TokenStream, item: TokenStream) -> String {
        let errors = errors(args, item);
        assert_eq!(errors.len(), 1, "expected one error, got {errors:?}");
        errors.into_iter().next().unwrap()
    }

    fn assert_tokens_eq(actual: TokenStream, expected: TokenStream) {
        assert_eq!(actual.to_string(), expected.to_string());
    }

    #[test]
    fn expands_a_minimal_handler() {
        let expanded = idempotent(
            quote!(),
            quote! {
                async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), E> {
                    apply(tx, cmd).await
                }
            },
        );
        assert_tokens_eq(
            expanded,
            quote! {
                #[allow(non_camel_case_types)]
                #[derive(
                    ::core::clone::Clone,
                    ::core::marker::Copy,
                    ::core::fmt::Debug,
                    ::core::default::Default,
                )]
                struct credit {}

                #[doc = " Returns the `credit` handler, for `Router::route`. The body as written is `credit::run`."]
                fn credit() -> credit {
                    credit {}
                }

                impl credit {
                    /// The handler name stored with each claim in the dedup table.
                    pub const NAME: &'static str = "credit";

                    /// The handler body as written. The runtime runs it only after a fresh claim.
                    pub async fn run(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), E> {
                        apply(tx, cmd).await
                    }
                }

                impl ::idem_runtime::Handler for credit {
                    type Payload = Credit;

                    fn name(&self) -> &'static str {
                        Self::NAME
                    }

                    fn run_claimed<'a, 'c>(
                        &'a self,
                        __idem_tx: &'a mut ::idem_runtime::__private::PgTransaction<'c>,
                        __idem_payload: Self::Payload,
                        __idem_delivery: &'a ::idem_runtime::Delivery,
                    ) -> ::idem_runtime::HandlerFuture<'a> {
                        ::idem_runtime::__private::Box::pin(async move {
                            match credit::run(__idem_tx, __idem_payload).await {
                                ::core::result::Result::Ok(_) => {
                                    ::core::result::Result::Ok(::idem_runtime::Outcome::Processed)
                                }
                                ::core::result::Result::Err(__idem_error) => {
                                    ::core::result::Result::Err(::idem_runtime::__private::handler_error!(__idem_error))
                                }
                            }
                        })
                    }
                }
            },
        );
    }

    #[test]
    fn name_key_delivery_and_attributes() {
        let expanded = expand(
            quote!(name = "credit-v1", key = cmd.transfer_id),
            quote! {
                /// Credits an account.
                #[cfg(feature = "ledger")]
                #[tracing::instrument(skip(tx))]
                pub(crate) async fn credit(
                    tx: &mut sqlx::PgTransaction<'_>,
                    cmd: Credit,
                    meta: &idem_runtime::Delivery,
                ) -> Result<(), E> {
                    Ok(())
                }
            },
        );
        let cfg = quote!(#[cfg(feature = "ledger")]).to_string();
        let docs = quote!(#[doc = r" Credits an account."]).to_string();
        let instrument = quote!(#[tracing::instrument(skip(tx))]).to_string();

        assert!(expanded.starts_with(&format!("{docs} {cfg} # [allow (non_camel_case_types)]")));
        assert!(expanded.contains("pub (crate) struct credit { }"));
        assert!(expanded.contains("pub (crate) fn credit () -> credit { credit { } }"));
        assert_eq!(expanded.matches(&cfg).count(), 4, "{expanded}");
        assert_eq!(expanded.matches(&docs).count(), 1, "{expanded}");
        assert!(
            expanded.contains(&format!(
                "fresh claim.\"] {instrument} pub async fn run (tx"
            )),
            "{expanded}"
        );
        assert!(expanded.contains("pub const NAME : & 'static str = \"credit-v1\" ;"));
        assert!(
            expanded
                .contains("credit :: run (__idem_tx , __idem_payload , __idem_delivery) . await")
        );

        let message_key = quote! {
            #[allow(unused_variables)]
            fn message_key(
                &self,
                __idem_payload: &Self::Payload,
            ) -> ::core::option::Option<::std::string::String> {
                let cmd = __idem_payload;
                ::core::option::Option::Some(
                    ::idem_runtime::__private::ToString::to_string(&(cmd.transfer_id))
                )
            }
        };
        assert!(expanded.contains(&message_key.to_string()), "{expanded}");
    }

    #[test]
    fn the_default_name_is_the_unraw_fn_name() {
        let expanded = expand(
            quote!(),
            quote!(
                async fn r#move(tx: &mut Tx, m: M) -> Result<(), E> {}
            ),
        );
        assert!(expanded.contains("pub const NAME : & 'static str = \"move\" ;"));
        assert!(expanded.contains("struct r#move { }"));
        assert!(expanded.contains("Returns the `move` handler"));
    }

    #[test]
    fn no_message_key_without_key() {
        let expanded = expand(
            quote!(name = "n"),
            quote!(
                async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
            ),
        );
        assert!(!expanded.contains("message_key"));
    }

    #[test]
    fn the_key_pattern_binds_by_reference() {
        let pattern: Pat = syn::parse_quote! {
            Credit { ref mut a, b: mut c, d: ref e @ Some(mut f), g: (mut h, [ref i, ..]), .. }
        };
        let expected: Pat = syn::parse_quote! {
            Credit { a, b: c, d: e @ Some(f), g: (h, [i, ..]), .. }
        };
        let stripped = bind_by_reference(pattern);
        assert_tokens_eq(quote!(#stripped), quote!(#expected));
        let pattern = bind_by_reference(syn::parse_quote!(mut cmd));
        assert_tokens_eq(quote!(#pattern), quote!(cmd));
    }

    #[test]
    fn accepts_result_paths() {
        for output in [
            quote!(Result<(), E>),
            quote!(anyhow::Result<()>),
            quote!(::std::result::Result<(), E>),
            quote!(Result<()>),
        ] {
            let expanded = expand(
                quote!(),
                quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
            );
            assert!(!expanded.contains("compile_error"), "{output}: {expanded}");
        }
    }

    #[test]
    fn a_pattern_payload_and_any_tx_and_delivery_references() {
        let expanded = expand(
            quote!(key = account),
            quote! {
                async fn h(
                    _tx: &mut sqlx::PgConnection,
                    Credit { account, .. }: Credit,
                    _: &Delivery,
                ) -> Result<(), E> {}
            },
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
        assert!(expanded.contains("let Credit { account , .. } = __idem_payload ;"));
    }

    #[test]
    fn rejects_a_non_async_fn() {
        assert_eq!(
            error(
                quote!(),
                quote!(
                    fn credit(tx: &mut Tx, m: M) -> Result<(), E> {}
                )
            ),
            "an `#[idempotent]` handler must be async: write `async fn credit`"
        );
    }

    #[test]
    fn rejects_an_item_that_is_not_a_fn() {
        assert!(
            error(
                quote!(),
                quote!(
                    struct Credit;
                )
            )
            .starts_with("`#[idempotent]` goes on an `async fn` handler")
        );
    }

    #[test]
    fn rejects_missing_params() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h() -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler takes the transaction and the message")
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler takes the message as its second parameter")
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(m: M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler takes the transaction first")
        );
    }

    #[test]
    fn rejects_a_tx_that_is_not_a_mut_reference() {
        for tx in [quote!(Tx), quote!(&Tx), quote!(Box<Tx>)] {
            assert!(
                error(
                    quote!(),
                    quote!(async fn h(tx: #tx, m: M) -> Result<(), E> {})
                )
                .starts_with(
                    "the first parameter of an `#[idempotent]` handler is the transaction"
                )
            );
        }
    }

    #[test]
    fn rejects_a_payload_reference_and_a_delivery_that_is_not_a_reference() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, m: &M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler owns the message")
        );
        for delivery in [quote!(Delivery), quote!(&mut Delivery)] {
            assert!(
                error(
                    quote!(),
                    quote!(async fn h(tx: &mut Tx, m: M, d: #delivery) -> Result<(), E> {})
                )
                .starts_with(
                    "the third parameter of an `#[idempotent]` handler receives the delivery"
                )
            );
        }
    }

    #[test]
    fn rejects_more_than_three_params() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, m: M, d: &D, x: X, y: Y) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler takes at most three parameters")
        );
    }

    #[test]
    fn rejects_a_receiver() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(&self, tx: &mut Tx, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler is a free fn, not a method")
        );
    }

    #[test]
    fn rejects_generics_and_where_clauses() {
        assert_eq!(
            errors(
                quote!(),
                quote!(
                    async fn h<T>(tx: &mut Tx, m: T) -> Result<(), E>
                    where
                        T: Send,
                    {
                    }
                )
            ),
            [
                "an `#[idempotent]` handler cannot be generic: the runtime decodes each message \
                 into one concrete type, so write the concrete types instead",
                "an `#[idempotent]` handler cannot have a `where` clause: remove it",
            ]
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h<'c>(tx: &mut Tx<'c>, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler cannot declare lifetimes")
        );
    }

    #[test]
    fn rejects_unsafe_and_extern() {
        assert!(
            error(
                quote!(),
                quote!(
                    async unsafe fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler cannot be `unsafe`")
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async extern "C" fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler is called by the runtime, not through an ABI")
        );
    }

    #[test]
    fn rejects_a_missing_or_non_result_return_type() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, m: M) {}
                )
            )
            .ends_with("add `-> Result<(), MyError>` after the parameters")
        );
        for output in [
            quote!(()),
            quote!(Option<()>),
            quote!(impl Future),
            quote!(<T as Tr>::Result),
        ] {
            assert!(
                error(
                    quote!(),
                    quote!(async fn h(tx: &mut Tx, m: M) -> #output {})
                )
                .ends_with("(an alias must also be named `Result`)"),
                "{output}"
            );
        }
    }

    #[test]
    fn reports_every_problem_at_once() {
        assert_eq!(
            errors(
                quote!(retries = 3),
                quote!(
                    fn h(tx: Tx, m: M) {}
                )
            )
            .len(),
            4,
            "unknown argument, not async, tx not `&mut`, no return type"
        );
    }
}
