//! Checks the annotated fn and generates its handler.
//!
//! Everything here works on `proc_macro2` so that it can be unit-tested; the
//! `proc_macro` entry point in `lib.rs` only converts.
//!
//! The macro stays small: it checks the signature's shape (what syntax can
//! tell), and generates a handler type whose `Handler::handle` calls the fn.
//! Types are checked by rustc, through the runtime's traits, at spans chosen
//! here so that errors point at the user's code: the payload's codec
//! (`Decode`), each parameter between the transaction and the message
//! (`FromDelivery`, or `&Delivery`), and the return type (`HandlerResult`,
//! whose error converts into `BoxError`).

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{
    Attribute, Error, Expr, FnArg, GenericArgument, GenericParam, Ident, Item, ItemFn, LitStr, Pat,
    PatType, PathArguments, ReturnType, Type, TypePath,
};

use crate::attr::{Args, Codec};

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
    let args = syn::parse2::<Args>(args);
    let batch = args.as_ref().is_ok_and(|args| args.batch.is_some());
    match (args, HandlerFn::check(&function, batch)) {
        (Ok(args), Ok(handler)) => {
            match check_codec(&args, &handler).and_then(|()| check_key(&args, &handler)) {
                Ok(()) => generate(&args, &handler),
                Err(error) => with_error(item, error),
            }
        }
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

/// A payload of raw bytes decoded as JSON is almost always a mistake.
fn check_codec(args: &Args, handler: &HandlerFn<'_>) -> syn::Result<()> {
    if args.codec.is_some() {
        return Ok(());
    }
    let bytes_type = match handler.payload_ty {
        Type::Path(path) => path.path.segments.last().is_some_and(|last| {
            last.ident == "Bytes"
                || (last.ident == "Vec"
                    && matches!(&last.arguments, PathArguments::AngleBracketed(args)
                        if args.args.len() == 1
                            && matches!(args.args.first(), Some(GenericArgument::Type(Type::Path(inner)))
                                if inner.path.is_ident("u8"))))
        }),
        _ => false,
    };
    if bytes_type {
        return Err(Error::new_spanned(
            handler.payload_ty,
            "this payload would be decoded as JSON (an array of numbers); to take the \
             message's bytes as they are, write `#[idempotent(codec = raw)]`, or \
             `codec = json` if JSON is meant",
        ));
    }
    Ok(())
}

/// `key = ...` is an expression over the message, or a closure over one
/// message (and its delivery); a batch handler's must be a closure, since
/// its message parameter is the whole batch.
fn check_key(args: &Args, handler: &HandlerFn<'_>) -> syn::Result<()> {
    match &args.key {
        Some(Expr::Closure(closure)) if !(1..=2).contains(&closure.inputs.len()) => {
            Err(Error::new_spanned(
                &closure.inputs,
                "a key closure takes the message, and optionally its delivery: \
                 write `key = |cmd| cmd.transfer_id` or `key = |cmd, delivery| ...`",
            ))
        }
        Some(key) if handler.batch && !matches!(key, Expr::Closure(_)) => Err(Error::new_spanned(
            key,
            "a batch handler's key is computed for each message of the batch: write it as a \
             closure over one message, such as `key = |cmd| cmd.transfer_id` \
             (`|cmd, delivery| ...` also sees its delivery)",
        )),
        _ => Ok(()),
    }
}

/// An `async fn` whose signature the handler can call.
struct HandlerFn<'a> {
    function: &'a ItemFn,
    /// The parameters between the transaction and the message.
    between: Vec<&'a PatType>,
    /// The last parameter.
    payload: &'a PatType,
    /// The payload type: the last parameter's, or for a batch handler its
    /// element type (`T` of `Vec<T>`).
    payload_ty: &'a Type,
    /// Whether the fn takes the fresh messages of a batch together.
    batch: bool,
    /// The return type (there is one: its absence is an error).
    output: &'a Type,
    /// What its `Ok` carries, as far as the return type shows.
    value: Value<'a>,
    /// Where an error type that is not `Into<BoxError>` gets reported.
    error_type_span: Span,
    /// Where a body that is not `Send` gets reported.
    async_span: Span,
}

impl<'a> HandlerFn<'a> {
    /// Checks the signature as far as syntax allows, reporting every problem
    /// at the node to change. Type checks are left to rustc, at spans chosen
    /// in [`generate`].
    fn check(function: &'a ItemFn, batch: bool) -> syn::Result<Self> {
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

        let params = Params::check(function, batch, &mut errors);
        let output = match &sig.output {
            ReturnType::Type(_, ty) => Some(&**ty),
            ReturnType::Default => {
                errors.push(Error::new(
                    sig.paren_token.span.close(),
                    "an `#[idempotent]` handler returns a `Result` whose error converts into \
                     `idem_runtime::BoxError`: add `-> Result<(), MyError>` after the parameters",
                ));
                None
            }
        };

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

/// The parameters: the transaction, any parameters the runtime fills
/// (`&Delivery`, `State<T>`), and the message, last, as a body is in axum.
struct Params<'a> {
    between: Vec<&'a PatType>,
    payload: &'a PatType,
    payload_ty: &'a Type,
}

impl<'a> Params<'a> {
    /// `None` after pushing at least one error.
    fn check(function: &'a ItemFn, batch: bool, errors: &mut Errors) -> Option<Self> {
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
        let (tx, between, payload) = match typed[..] {
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
                        "an `#[idempotent]` handler takes the message as its last parameter: \
                         write {SIGNATURE}"
                    ),
                ));
                return None;
            }
            [tx, ref between @ .., payload] => (tx, between.to_vec(), payload),
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
        // (A batch handler's message must be a `Vec`, which says it all.)
        if let (Type::Reference(reference), false) = (&*payload.ty, batch) {
            // The old order, `(tx, cmd: Credit, delivery: &Delivery)`?
            let by_value = between.iter().find(|param| !is_any_reference(&param.ty));
            match by_value {
                Some(message) if reference.mutability.is_none() => errors.push(Error::new_spanned(
                    message,
                    format!(
                        "an `#[idempotent]` handler takes the message last, after `&Delivery` \
                         and `State<T>` (as axum takes the body last): move `{}` to the end",
                        message.to_token_stream()
                    ),
                )),
                _ => errors.push(Error::new_spanned(
                    reference.and_token,
                    "an `#[idempotent]` handler owns the message it decodes: take it by value, \
                     without the `&`",
                )),
            }
            ok = false;
        }
        for param in &between {
            if is_reference(&param.ty, true) {
                errors.push(Error::new_spanned(
                    &param.ty,
                    "only the first parameter of an `#[idempotent]` handler is `&mut`: the \
                     ones between the transaction and the message are `&Delivery` or \
                     `State<T>`",
                ));
                ok = false;
            } else if is_reference(&param.ty, false) && is_slice_reference(&param.ty) != batch {
                errors.push(Error::new_spanned(
                    &param.ty,
                    if batch {
                        "a batch handler takes the deliveries of its messages, in their order: \
                         write `deliveries: &[Delivery]`"
                    } else {
                        "only a batch handler (`#[idempotent(batch)]`) takes `&[Delivery]`; \
                         this one takes its message's: write `delivery: &Delivery`"
                    },
                ));
                ok = false;
            }
        }
        let payload_ty = if batch {
            match vec_element(&payload.ty) {
                Some(element) => element,
                None => {
                    errors.push(Error::new_spanned(
                        &payload.ty,
                        "a batch handler (`#[idempotent(batch)]`) takes the fresh messages of a \
                         batch as a `Vec`: write `cmds: Vec<Credit>`",
                    ));
                    return None;
                }
            }
        } else {
            &*payload.ty
        };
        ok.then_some(Params {
            between,
            payload,
            payload_ty,
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

/// Whether `ty` is `&[_]`.
fn is_slice_reference(ty: &Type) -> bool {
    match ty {
        Type::Reference(reference) => matches!(&*reference.elem, Type::Slice(_)),
        Type::Paren(paren) => is_slice_reference(&paren.elem),
        Type::Group(group) => is_slice_reference(&group.elem),
        _ => false,
    }
}

/// `T` of a type written `Vec<T>` (by any path).
fn vec_element(ty: &Type) -> Option<&Type> {
    let Type::Path(TypePath { qself: None, path }) = ty else {
        return None;
    };
    let last = path.segments.last()?;
    match &last.arguments {
        PathArguments::AngleBracketed(args) if last.ident == "Vec" && args.args.len() == 1 => {
            match args.args.first()? {
                GenericArgument::Type(element) => Some(element),
                _ => None,
            }
        }
        _ => None,
    }
}

fn is_any_reference(ty: &Type) -> bool {
    is_reference(ty, true) || is_reference(ty, false)
}

/// What a handler's `Ok` carries, as its return type shows it.
#[derive(Clone, Copy)]
enum Value<'a> {
    /// `()`: nothing to store; the handler is generated as it always was.
    Unit,
    /// A value, stored with the claim: `T` of `Result<T, E>` or of an alias
    /// `MyResult<T>`.
    Stored(&'a Type),
    /// An alias without arguments (`Fallible`): its value must be `()`,
    /// checked by rustc, so that a value is never dropped unseen.
    Hidden,
}

/// The first type argument of the return type's last segment.
fn value_of(ty: &Type) -> Value<'_> {
    let value = match ty {
        Type::Path(TypePath { qself: None, path }) => {
            path.segments.last().and_then(|last| match &last.arguments {
                PathArguments::AngleBracketed(args) => args.args.first(),
                _ => None,
            })
        }
        Type::Paren(paren) => return value_of(&paren.elem),
        Type::Group(group) => return value_of(&group.elem),
        _ => None,
    };
    match value {
        Some(GenericArgument::Type(Type::Tuple(unit))) if unit.elems.is_empty() => Value::Unit,
        Some(GenericArgument::Type(value)) => Value::Stored(value),
        _ => Value::Hidden,
    }
}

/// The error type `E` of a return type written `Result<T, E>`, so that a
/// wrong one is reported on it; else the whole return type (an alias such as
/// `anyhow::Result<T>`).
fn error_type_span(ty: &Type) -> Span {
    let error_type = match ty {
        Type::Path(TypePath { qself: None, path }) => {
            path.segments.last().and_then(|last| match &last.arguments {
                PathArguments::AngleBracketed(args) if args.args.len() == 2 => args.args.last(),
                _ => None,
            })
        }
        _ => None,
    };
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

/// The handler struct, the fn that returns it, its `NAME` and `run`, a
/// `Debug` impl, and its `Handler` impl.
fn generate(args: &Args, handler: &HandlerFn<'_>) -> TokenStream {
    let krate = args
        .krate
        .as_ref()
        .map_or_else(|| quote!(::idem_runtime), ToTokens::to_token_stream);
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
    let debug_name = unraw.to_string();

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

    let payload_ty = handler.payload_ty;
    let payload_type = quote_spanned! {payload_ty.span()=>
        type Payload = #payload_ty;
    };
    let codec = match &args.codec {
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
    // At the payload type, so that one the codec cannot decode is reported
    // there.
    let codec = respan(&codec, payload_ty.span());
    let codec_type = quote_spanned! {payload_ty.span()=>
        type Codec = #codec;
    };
    let message_key = args
        .key
        .as_ref()
        .map(|key| message_key(&krate, handler, key));

    // The router state the impl is for: any (`__S`), or the one named by
    // `state = ...`, which checks every parameter against it right here.
    let (state_param, state) = match &args.state {
        None => (Some(quote!(<__S>)), quote!(__S)),
        Some(state) => (None, state.to_token_stream()),
    };
    let state_bound = args
        .state
        .is_none()
        .then(|| quote!(__S: ::core::marker::Send + ::core::marker::Sync + 'static,));

    // The parameters between the transaction and the message: a reference is
    // the delivery (a batch handler's: the deliveries); any other type the
    // runtime fills through `FromDelivery` (`FromBatch`), a bound the impl
    // states, so that a type the router's state cannot provide is reported
    // at the parameter. (A type that can never be a parameter is reported at
    // once: the bound's supertrait, `Parameter`, does not depend on the
    // state.)
    let mut bounds = Vec::new();
    let arguments: Vec<TokenStream> = handler
        .between
        .iter()
        .map(|param| {
            let ty = &param.ty;
            let krate = respan(&krate, ty.span());
            match (is_reference(ty, false), handler.batch) {
                (true, false) => quote_spanned! {ty.span()=> __idem_delivery},
                (true, true) => quote_spanned! {ty.span()=> __idem_deliveries},
                (false, false) => {
                    bounds.push(quote_spanned! {ty.span()=> #ty: #krate::FromDelivery<#state>});
                    quote_spanned! {ty.span()=>
                        #krate::FromDelivery::from_delivery(__idem_delivery, __idem_state)
                    }
                }
                (false, true) => {
                    bounds.push(quote_spanned! {ty.span()=> #ty: #krate::FromBatch<#state>});
                    quote_spanned! {ty.span()=>
                        #krate::FromBatch::from_batch(__idem_deliveries, __idem_state)
                    }
                }
            }
        })
        .collect();
    // Spanned at the user's return type and error type, so that a return
    // type that is not a `Result`, or an error that does not convert into
    // `BoxError`, is reported there, once.
    let output = handler.output;
    let output_krate = respan(&krate, output.span());
    let into_result = quote_spanned! {output.span()=>
        #output_krate::HandlerResult::into_result(__idem_result)
    };
    let error_krate = respan(&krate, handler.error_type_span);
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
            let value_krate = respan(&krate, value.span());
            quote_spanned! {value.span()=>
                ::core::result::Result::Ok(__idem_value) => {
                    #value_krate::__private::encode::<Self::Codec, _>(&__idem_value)
                }
            }
        }
    };
    let settle = quote_spanned! {output.span()=>
        match #into_result {
            #ok_arm
            #into_handler_error
        }
    };
    let batches = handler.batch.then(|| {
        quote!(
            const BATCHES: bool = true;
        )
    });
    // Spanned at the user's `async`, so that a body that is not `Send` is
    // reported on the handler rather than on the attribute. A batch handler
    // runs one message as a batch of one.
    let handle = if handler.batch {
        quote_spanned! {handler.async_span=>
            async fn handle(
                &self,
                __idem_tx: &mut #krate::__private::PgTransaction<'_>,
                __idem_payload: Self::Payload,
                __idem_delivery: &#krate::Delivery,
                __idem_state: &#state,
            ) -> ::core::result::Result<(), #krate::HandlerError> {
                <Self as #krate::Handler<#state>>::handle_batch(
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
                __idem_tx: &mut #krate::__private::PgTransaction<'_>,
                __idem_payloads: ::std::vec::Vec<Self::Payload>,
                __idem_deliveries: &[#krate::Delivery],
                __idem_state: &#state,
            ) -> ::core::result::Result<(), #krate::HandlerError> {
                let __idem_result = #ident::run(__idem_tx, #(#arguments,)* __idem_payloads).await;
                #settle
            }
        }
    } else if let Value::Stored(_) = handler.value {
        // The runtime calls `handle_and_encode`; `handle` keeps the trait's
        // meaning for anyone else who calls it.
        quote_spanned! {handler.async_span=>
            async fn handle(
                &self,
                __idem_tx: &mut #krate::__private::PgTransaction<'_>,
                __idem_payload: Self::Payload,
                __idem_delivery: &#krate::Delivery,
                __idem_state: &#state,
            ) -> ::core::result::Result<(), #krate::HandlerError> {
                <Self as #krate::Handler<#state>>::handle_and_encode(
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
                __idem_tx: &mut #krate::__private::PgTransaction<'_>,
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
    } else {
        quote_spanned! {handler.async_span=>
            #[allow(clippy::ignored_unit_patterns)]
            async fn handle(
                &self,
                __idem_tx: &mut #krate::__private::PgTransaction<'_>,
                __idem_payload: Self::Payload,
                __idem_delivery: &#krate::Delivery,
                __idem_state: &#state,
            ) -> ::core::result::Result<(), #krate::HandlerError> {
                let __idem_result = #ident::run(__idem_tx, #(#arguments,)* __idem_payload).await;
                #settle
            }
        }
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

        #(#cfgs)*
        impl #state_param #krate::Handler<#state> for #ident
        where
            #state_bound
            #(#bounds,)*
        {
            #payload_type
            #codec_type
            #batches

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

/// `tokens` with every span set to `span`, so that a path built once (the
/// crate's) reports errors where the user's code is.
fn respan(tokens: &TokenStream, span: Span) -> TokenStream {
    tokens
        .clone()
        .into_iter()
        .map(|mut token| {
            if let proc_macro2::TokenTree::Group(group) = &token {
                let mut respanned =
                    proc_macro2::Group::new(group.delimiter(), respan(&group.stream(), span));
                respanned.set_span(span);
                token = proc_macro2::TokenTree::Group(respanned);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

/// `fn message_key`: binds the payload pattern, and the delivery
/// parameter's (or the key closure's parameters), by reference, and
/// stringifies the key expression (the closure's body). `check_key` made
/// sure a closure has one or two parameters.
fn message_key(krate: &TokenStream, handler: &HandlerFn<'_>, key: &Expr) -> TokenStream {
    // `|cmd, delivery| body` binds its own names; a bare expression sees the
    // fn's.
    let (pattern, delivery, key) = match key {
        Expr::Closure(closure) => (
            closure.inputs[0].clone(),
            closure.inputs.get(1).cloned(),
            &*closure.body,
        ),
        key => (
            (*handler.payload.pat).clone(),
            handler
                .between
                .iter()
                .find(|param| is_reference(&param.ty, false))
                .map(|param| (*param.pat).clone()),
            key,
        ),
    };
    let pattern = bind_by_reference(pattern);
    let delivery = delivery
        .filter(|pattern| !matches!(pattern, Pat::Wild(_)))
        .map(|pattern| {
            let pattern = bind_by_reference(pattern);
            quote!(let #pattern = __idem_delivery;)
        });
    let to_string = quote_spanned! {key.span()=>
        #krate::__private::ToString::to_string(&(#key))
    };
    quote! {
        #[allow(unused_variables)]
        fn message_key(
            &self,
            __idem_payload: &Self::Payload,
            __idem_delivery: &#krate::Delivery,
        ) -> ::core::option::Option<::std::string::String> {
            let #pattern = __idem_payload;
            #delivery
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
                struct credit {}

                #[doc = " Returns the `credit` handler, for `Router::route`. The body as written is `credit::run`."]
                fn credit() -> credit {
                    credit {}
                }

                impl ::core::fmt::Debug for credit {
                    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                        f.write_str("credit")
                    }
                }

                impl credit {
                    /// The handler name stored with each claim in the dedup table.
                    pub const NAME: &'static str = "credit";

                    /// The handler body as written. The runtime runs it only after a fresh claim.
                    pub async fn run(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), E> {
                        apply(tx, cmd).await
                    }
                }

                impl<__S> ::idem_runtime::Handler<__S> for credit
                where
                    __S: ::core::marker::Send + ::core::marker::Sync + 'static,
                {
                    type Payload = Credit;
                    type Codec = ::idem_runtime::codec::Json;

                    fn name(&self) -> &'static str {
                        Self::NAME
                    }

                    #[allow(clippy::ignored_unit_patterns)]
                    async fn handle(
                        &self,
                        __idem_tx: &mut ::idem_runtime::__private::PgTransaction<'_>,
                        __idem_payload: Self::Payload,
                        __idem_delivery: &::idem_runtime::Delivery,
                        __idem_state: &__S,
                    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
                        let __idem_result = credit::run(__idem_tx, __idem_payload).await;
                        match ::idem_runtime::HandlerResult::into_result(__idem_result) {
                            ::core::result::Result::Ok(_) => ::core::result::Result::Ok(()),
                            ::core::result::Result::Err(__idem_error) => {
                                ::core::result::Result::Err(::idem_runtime::__private::handler_error!(__idem_error))
                            }
                        }
                    }
                }
            },
        );
    }

    #[test]
    fn name_key_state_delivery_and_attributes() {
        let expanded = expand(
            quote!(
                name = "credit-v1",
                key = format!("{}:{}", meta.subject(), cmd.transfer_id)
            ),
            quote! {
                /// Credits an account.
                #[cfg(feature = "ledger")]
                #[tracing::instrument(skip(tx))]
                pub(crate) async fn credit(
                    tx: &mut sqlx::PgTransaction<'_>,
                    State(fees): State<Fees>,
                    meta: &idem_runtime::Delivery,
                    cmd: Credit,
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
        assert_eq!(expanded.matches(&cfg).count(), 5, "{expanded}");
        assert_eq!(expanded.matches(&docs).count(), 1, "{expanded}");
        assert!(
            expanded.contains(&format!(
                "fresh claim.\"] {instrument} pub async fn run (tx"
            )),
            "{expanded}"
        );
        assert!(expanded.contains("pub const NAME : & 'static str = \"credit-v1\" ;"));
        assert!(
            expanded.contains("State < Fees > : :: idem_runtime :: FromDelivery < __S >"),
            "{expanded}"
        );
        assert!(
            expanded.contains(
                "credit :: run (__idem_tx , :: idem_runtime :: FromDelivery :: from_delivery \
                 (__idem_delivery , __idem_state) , __idem_delivery , __idem_payload) . await"
            ),
            "{expanded}"
        );

        let message_key = quote! {
            #[allow(unused_variables)]
            fn message_key(
                &self,
                __idem_payload: &Self::Payload,
                __idem_delivery: &::idem_runtime::Delivery,
            ) -> ::core::option::Option<::std::string::String> {
                let cmd = __idem_payload;
                let meta = __idem_delivery;
                ::core::option::Option::Some(
                    ::idem_runtime::__private::ToString::to_string(&(format!("{}:{}", meta.subject(), cmd.transfer_id)))
                )
            }
        };
        assert!(expanded.contains(&message_key.to_string()), "{expanded}");
    }

    #[test]
    fn codec_and_crate_arguments() {
        let expanded = expand(
            quote!(codec = raw, crate = ::my_idem),
            quote!(
                async fn h(tx: &mut Tx, bytes: Vec<u8>) -> Result<(), E> {}
            ),
        );
        assert!(
            expanded.contains("type Codec = :: my_idem :: codec :: Raw ;"),
            "{expanded}"
        );
        assert!(!expanded.contains("idem_runtime"), "{expanded}");
        let expanded = expand(
            quote!(codec = my::Cbor),
            quote!(
                async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
            ),
        );
        assert!(expanded.contains("type Codec = my :: Cbor ;"), "{expanded}");
    }

    #[test]
    fn a_bytes_payload_needs_a_codec() {
        for payload in [quote!(Vec<u8>), quote!(bytes::Bytes)] {
            assert!(
                error(
                    quote!(),
                    quote!(async fn h(tx: &mut Tx, m: #payload) -> Result<(), E> {})
                )
                .starts_with("this payload would be decoded as JSON"),
                "{payload}"
            );
        }
        let expanded = expand(
            quote!(codec = json),
            quote!(
                async fn h(tx: &mut Tx, m: Vec<u8>) -> Result<(), E> {}
            ),
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
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
    fn a_pattern_payload_and_any_tx_and_delivery_references() {
        let expanded = expand(
            quote!(key = account),
            quote! {
                async fn h(
                    _tx: &mut sqlx::PgConnection,
                    _: &Delivery,
                    Credit { account, .. }: Credit,
                ) -> Result<(), E> {}
            },
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
        assert!(expanded.contains("let Credit { account , .. } = __idem_payload ;"));
        assert!(
            !expanded.contains("= __idem_delivery ;"),
            "a `_` delivery binds nothing: {expanded}"
        );
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
            .starts_with("an `#[idempotent]` handler takes the message as its last parameter")
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
    fn rejects_a_payload_reference_and_the_message_before_the_delivery() {
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, m: &M) -> Result<(), E> {}
                )
            )
            .starts_with("an `#[idempotent]` handler owns the message")
        );
        assert_eq!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, cmd: Credit, d: &Delivery) -> Result<(), E> {}
                )
            ),
            "an `#[idempotent]` handler takes the message last, after `&Delivery` and \
             `State<T>` (as axum takes the body last): move `cmd : Credit` to the end"
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, d: &mut Delivery, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("only the first parameter of an `#[idempotent]` handler is `&mut`")
        );
    }

    #[test]
    fn takes_any_number_of_parameters_between_tx_and_message() {
        let expanded = expand(
            quote!(),
            quote!(
                async fn h(
                    tx: &mut Tx,
                    State(a): State<A>,
                    d: &Delivery,
                    State(b): State<B>,
                    m: M,
                ) -> Result<(), E> {
                }
            ),
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
        assert!(expanded.contains("State < A > : :: idem_runtime :: FromDelivery < __S >"));
        assert!(expanded.contains("State < B > : :: idem_runtime :: FromDelivery < __S >"));
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
    fn accepts_any_return_type_and_rejects_a_missing_one() {
        for output in [
            quote!(Result<(), E>),
            quote!(anyhow::Result<()>),
            quote!(::std::result::Result<(), E>),
            quote!(Fallible),
        ] {
            let expanded = expand(
                quote!(),
                quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
            );
            assert!(!expanded.contains("compile_error"), "{output}: {expanded}");
        }
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, m: M) {}
                )
            )
            .ends_with("add `-> Result<(), MyError>` after the parameters")
        );
    }

    #[test]
    fn a_batch_handler_takes_the_batch_and_runs_one_message_as_a_batch_of_one() {
        let expanded = expand(
            quote!(batch, key = |cmd| cmd.id),
            quote!(
                async fn credit_many(
                    tx: &mut Tx,
                    State(fees): State<Fees>,
                    deliveries: &[Delivery],
                    cmds: Vec<Credit>,
                ) -> Result<(), E> {
                }
            ),
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
        for expected in [
            "type Payload = Credit ;",
            "const BATCHES : bool = true ;",
            "State < Fees > : :: idem_runtime :: FromBatch < __S >",
            "< Self as :: idem_runtime :: Handler < __S >> :: handle_batch (self , __idem_tx , \
             :: std :: vec :: Vec :: from ([__idem_payload]) , :: core :: slice :: from_ref \
             (__idem_delivery) , __idem_state ,) . await",
            "credit_many :: run (__idem_tx , :: idem_runtime :: FromBatch :: from_batch \
             (__idem_deliveries , __idem_state) , __idem_deliveries , __idem_payloads) . await",
            "let cmd = __idem_payload ;",
        ] {
            assert!(expanded.contains(expected), "{expected}: {expanded}");
        }
        assert!(!expanded.contains("FromDelivery"), "{expanded}");
    }

    #[test]
    fn a_key_closure_binds_its_own_names() {
        let expanded = expand(
            quote!(key = |c, d| format!("{}:{}", d.subject(), c.id)),
            quote!(
                async fn h(tx: &mut Tx, delivery: &Delivery, cmd: M) -> Result<(), E> {}
            ),
        );
        assert!(!expanded.contains("compile_error"), "{expanded}");
        assert!(expanded.contains("let c = __idem_payload ; let d = __idem_delivery ;"));
        assert!(!expanded.contains("let cmd = __idem_payload"), "{expanded}");
        assert!(
            error(
                quote!(key = |a, b, c| a.id),
                quote!(
                    async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
                )
            )
            .starts_with("a key closure takes the message, and optionally its delivery")
        );
    }

    #[test]
    fn rejects_a_batch_handler_that_does_not_take_a_batch() {
        assert!(
            error(
                quote!(batch),
                quote!(
                    async fn h(tx: &mut Tx, m: Credit) -> Result<(), E> {}
                )
            )
            .starts_with("a batch handler (`#[idempotent(batch)]`) takes the fresh messages")
        );
        assert!(
            error(
                quote!(batch),
                quote!(
                    async fn h(tx: &mut Tx, d: &Delivery, m: Vec<M>) -> Result<(), E> {}
                )
            )
            .starts_with("a batch handler takes the deliveries of its messages")
        );
        assert!(
            error(
                quote!(),
                quote!(
                    async fn h(tx: &mut Tx, d: &[Delivery], m: M) -> Result<(), E> {}
                )
            )
            .starts_with("only a batch handler (`#[idempotent(batch)]`) takes `&[Delivery]`")
        );
        assert!(
            error(
                quote!(batch, key = cmds.id),
                quote!(
                    async fn h(tx: &mut Tx, cmds: Vec<M>) -> Result<(), E> {}
                )
            )
            .starts_with("a batch handler's key is computed for each message of the batch")
        );
    }

    #[test]
    fn a_handler_that_returns_a_value_encodes_it_and_a_unit_one_does_not() {
        for output in [quote!(Result<Receipt, E>), quote!(anyhow::Result<Receipt>)] {
            let expanded = expand(
                quote!(),
                quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
            );
            assert!(!expanded.contains("compile_error"), "{output}: {expanded}");
            for expected in [
                "async fn handle_and_encode",
                ":: idem_runtime :: __private :: encode :: < Self :: Codec , _ > (& __idem_value)",
                ". map (:: core :: mem :: drop)",
            ] {
                assert!(expanded.contains(expected), "{expected}: {expanded}");
            }
        }
        for output in [quote!(Result<(), E>), quote!(anyhow::Result<()>)] {
            let expanded = expand(
                quote!(),
                quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
            );
            assert!(
                !expanded.contains("handle_and_encode"),
                "{output}: {expanded}"
            );
            assert!(!expanded.contains("no_value"), "{output}: {expanded}");
        }
        let expanded = expand(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, m: M) -> Fallible {}
            ),
        );
        assert!(!expanded.contains("handle_and_encode"), "{expanded}");
        assert!(
            expanded.contains(":: idem_runtime :: __private :: no_value (__idem_value)"),
            "{expanded}"
        );
    }

    #[test]
    fn a_batch_handler_cannot_return_a_value() {
        assert!(
            error(
                quote!(batch, key = |c| c.id),
                quote!(
                    async fn h(tx: &mut Tx, m: Vec<M>) -> Result<Receipt, E> {}
                )
            )
            .starts_with("a batch handler (`#[idempotent(batch)]`) returns `Result<(), E>`")
        );
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
