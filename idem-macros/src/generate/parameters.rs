//! What `run` gets for each parameter between the transaction and the
//! message, and the bounds the `Handler` impl states for them.

use proc_macro2::TokenStream;
use quote::quote_spanned;
use syn::spanned::Spanned;

use super::{Context, respan};
use crate::check::is_reference;

/// The arguments, in order, and the bounds.
///
/// A reference is the delivery (a batch handler's: the deliveries); any
/// other type the runtime fills through `FromDelivery` (`FromBatch`), a
/// bound the impl states, so that a type the router's state cannot provide
/// is reported at the parameter. (A type that can never be a parameter is
/// reported at once: the bound's supertrait, `Parameter`, does not depend on
/// the state.)
pub(super) fn between(cx: &Context<'_>) -> (Vec<TokenStream>, Vec<TokenStream>) {
    let state = &cx.state;
    let mut bounds = Vec::new();
    let arguments: Vec<TokenStream> = cx
        .handler
        .between
        .iter()
        .map(|param| {
            let ty = &param.ty;
            let krate = respan(&cx.krate, ty.span());
            match (is_reference(ty, false), cx.handler.batch) {
                (true, false) => quote_spanned! {ty.span()=> __idem_delivery},
                (true, true) => quote_spanned! {ty.span()=> __idem_deliveries},
                (false, false) => {
                    bounds.push(
                        quote_spanned! {ty.span()=> #ty: #krate::handler::FromDelivery<#state>},
                    );
                    quote_spanned! {ty.span()=>
                        #krate::handler::FromDelivery::from_delivery(__idem_delivery, __idem_state)
                    }
                }
                (false, true) => {
                    bounds
                        .push(quote_spanned! {ty.span()=> #ty: #krate::handler::FromBatch<#state>});
                    quote_spanned! {ty.span()=>
                        #krate::handler::FromBatch::from_batch(__idem_deliveries, __idem_state)
                    }
                }
            }
        })
        .collect();
    (arguments, bounds)
}
