//! The parameters: the transaction, any parameters the runtime fills
//! (`&Delivery`, `State<T>`), and the message, last, as a body is in axum.
//!
//! Each step pushes its own errors and says whether it passed, so that a
//! wrong transaction and a wrong message are reported together.

use quote::ToTokens;
use syn::{Error, FnArg, ItemFn, PatType, Signature, Type};

use super::Errors;
use super::types::{is_any_reference, is_reference, is_slice_reference, mut_referent, vec_element};

/// The parameters, split by their role.
pub(super) struct Params<'a> {
    /// The type behind the transaction's `&mut`.
    pub(super) tx_ty: &'a Type,
    pub(super) between: Vec<&'a PatType>,
    pub(super) payload: &'a PatType,
    pub(super) payload_ty: &'a Type,
}

impl<'a> Params<'a> {
    /// `None` after pushing at least one error.
    pub(super) fn check(function: &'a ItemFn, batch: bool, errors: &mut Errors) -> Option<Self> {
        let (tx, between, payload) = split(&function.sig, errors)?;
        let tx_ty = check_tx(tx, errors);
        let payload_ok = check_payload_by_value(payload, &between, batch, errors);
        let between_ok = check_between(&between, batch, errors);
        let payload_ty = payload_type(payload, batch, errors)?;
        let tx_ty = tx_ty?;
        (payload_ok && between_ok).then_some(Params {
            tx_ty,
            between,
            payload,
            payload_ty,
        })
    }
}

/// The transaction, the parameters between, and the message; `None` after
/// pushing an error if the fn takes `self` or fewer than two parameters.
fn split<'a>(
    sig: &'a Signature,
    errors: &mut Errors,
) -> Option<(&'a PatType, Vec<&'a PatType>, &'a PatType)> {
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
    match typed[..] {
        [] => {
            errors.push(Error::new(
                all_params,
                format!(
                    "an `#[idempotent]` handler takes the transaction and the message: \
                     write {SIGNATURE}"
                ),
            ));
            None
        }
        [only] if !is_reference(&only.ty, true) => {
            errors.push(Error::new(
                all_params,
                format!(
                    "an `#[idempotent]` handler takes the transaction first, then the \
                     message: write {SIGNATURE}"
                ),
            ));
            None
        }
        [_] => {
            errors.push(Error::new(
                all_params,
                format!(
                    "an `#[idempotent]` handler takes the message as its last parameter: \
                     write {SIGNATURE}"
                ),
            ));
            None
        }
        [tx, ref between @ .., payload] => Some((tx, between.to_vec(), payload)),
    }
}

/// The first parameter is a `&mut` (of the transaction, or the connection
/// it derefs to); the type behind it, or `None` after pushing an error.
///
/// Which types are transactions, and on which database, only rustc can
/// tell: the generator names the handler's database as
/// `DatabaseOf<the type>`, which reports any other type at this parameter.
fn check_tx<'a>(tx: &'a PatType, errors: &mut Errors) -> Option<&'a Type> {
    let tx_ty = mut_referent(&tx.ty);
    if tx_ty.is_none() {
        errors.push(Error::new_spanned(
            &tx.ty,
            "the first parameter of an `#[idempotent]` handler is the transaction the claim \
             runs in: write `tx: &mut sqlx::PgTransaction<'_>` (PostgreSQL), or \
             `tx: &mut sqlx::Transaction<'_, DB>` for another database",
        ));
    }
    tx_ty
}

/// The message is taken by value, and last.
fn check_payload_by_value(
    payload: &PatType,
    between: &[&PatType],
    batch: bool,
    errors: &mut Errors,
) -> bool {
    // (A batch handler's message must be a `Vec`, which says it all.)
    let (Type::Reference(reference), false) = (&*payload.ty, batch) else {
        return true;
    };
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
    false
}

/// The parameters between are `&Delivery` (`&[Delivery]` for a batch
/// handler) or types the runtime fills, never `&mut`.
fn check_between(between: &[&PatType], batch: bool, errors: &mut Errors) -> bool {
    let mut ok = true;
    for param in between {
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
    ok
}

/// The type the codec decodes: the message parameter's, or for a batch
/// handler the element of its `Vec` (`None` after pushing an error if it is
/// not one).
fn payload_type<'a>(payload: &'a PatType, batch: bool, errors: &mut Errors) -> Option<&'a Type> {
    if !batch {
        return Some(&*payload.ty);
    }
    let element = vec_element(&payload.ty);
    if element.is_none() {
        errors.push(Error::new_spanned(
            &payload.ty,
            "a batch handler (`#[idempotent(batch)]`) takes the fresh messages of a \
             batch as a `Vec`: write `cmds: Vec<Credit>`",
        ));
    }
    element
}
