//! What the checks, and the generator, read off a type as written: syntax
//! only, since a macro cannot resolve names. `&mut Tx` is a reference
//! whatever `Tx` is; `Vec<T>` is recognised by its last segment.

use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::{GenericArgument, PathArguments, Type, TypePath};

/// Whether `ty` is `&mut _` (`mutable`) or `&_` (not `mutable`).
pub(crate) fn is_reference(ty: &Type, mutable: bool) -> bool {
    match ty {
        Type::Reference(reference) => reference.mutability.is_some() == mutable,
        Type::Paren(paren) => is_reference(&paren.elem, mutable),
        Type::Group(group) => is_reference(&group.elem, mutable),
        _ => false,
    }
}

/// `T` of a type written `&mut T`.
pub(super) fn mut_referent(ty: &Type) -> Option<&Type> {
    match ty {
        Type::Reference(reference) if reference.mutability.is_some() => Some(&reference.elem),
        Type::Paren(paren) => mut_referent(&paren.elem),
        Type::Group(group) => mut_referent(&group.elem),
        _ => None,
    }
}

/// Whether `ty` is `&[_]`.
pub(super) fn is_slice_reference(ty: &Type) -> bool {
    match ty {
        Type::Reference(reference) => matches!(&*reference.elem, Type::Slice(_)),
        Type::Paren(paren) => is_slice_reference(&paren.elem),
        Type::Group(group) => is_slice_reference(&group.elem),
        _ => false,
    }
}

/// `T` of a type written `Vec<T>` (by any path).
pub(super) fn vec_element(ty: &Type) -> Option<&Type> {
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

pub(super) fn is_any_reference(ty: &Type) -> bool {
    is_reference(ty, true) || is_reference(ty, false)
}

/// What a handler's `Ok` carries, as its return type shows it.
#[derive(Clone, Copy)]
pub(crate) enum Value<'a> {
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
pub(super) fn value_of(ty: &Type) -> Value<'_> {
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
pub(super) fn error_type_span(ty: &Type) -> Span {
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
