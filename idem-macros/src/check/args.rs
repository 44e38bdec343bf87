//! The arguments that must agree with the signature: `codec` with the
//! payload type, `key` with the batch form. They run after the signature's
//! own checks passed, since they read what those found.

use syn::{Error, Expr, GenericArgument, PathArguments, Type};

use super::HandlerFn;
use crate::attr::Args;

/// A payload of raw bytes decoded as JSON is almost always a mistake.
pub(crate) fn check_codec(args: &Args, handler: &HandlerFn<'_>) -> syn::Result<()> {
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
pub(crate) fn check_key(args: &Args, handler: &HandlerFn<'_>) -> syn::Result<()> {
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
