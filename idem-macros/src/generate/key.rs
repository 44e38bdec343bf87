//! `fn message_key`, for `key = ...`: the message id computed from the
//! payload (and the delivery), which the runtime prefers to `Nats-Msg-Id`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Expr, Pat};

use crate::check::{HandlerFn, is_reference};

/// `fn message_key`: binds the payload pattern, and the delivery
/// parameter's (or the key closure's parameters), by reference, and
/// stringifies the key expression (the closure's body). `check_key` made
/// sure a closure has one or two parameters.
pub(super) fn message_key(krate: &TokenStream, handler: &HandlerFn<'_>, key: &Expr) -> TokenStream {
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
pub(super) fn bind_by_reference(mut pattern: Pat) -> Pat {
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
