//! The database the handler runs on, read off its first parameter:
//! `DatabaseOf<T>` for `tx: &mut T`, which the runtime resolves
//! (`sqlx::Transaction<'_, DB>` is on `DB`, `sqlx::PgConnection` on
//! PostgreSQL). The macro cannot resolve names, so it leaves the answer, and
//! the error for a type that is no transaction, to rustc.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote_spanned};
use syn::visit_mut::{self, VisitMut};
use syn::{BoundLifetimes, Lifetime, Type, TypeReference};

use super::respan;

/// What the impl names the handler's database by.
pub(super) struct Database {
    /// `DatabaseOf<T>`, the `DB` of `Handler<S, DB>`.
    pub(super) db: TokenStream,
    /// `&mut Transaction<'_, DatabaseOf<T>>`, what the methods take.
    pub(super) transaction: TokenStream,
}

/// The database of `tx: &mut T`, spanned over `T`, so that a `T` the
/// runtime knows no database of is reported at the parameter. The header
/// and every method name it at that one span, where rustc reports the error
/// once (it repeats it at the fn's `async` and at the trait's method
/// signatures, which it checks with the database it could not find).
///
/// `T`'s lifetimes become `'static`: the database does not depend on them,
/// and the impl header has no lifetime to give them.
pub(super) fn database(krate: &TokenStream, tx_ty: &Type) -> Database {
    // The first and the last token's spans, which rustc joins into one over
    // the type, as `syn::Error::new_spanned` does.
    let mut tokens = tx_ty.to_token_stream().into_iter();
    let first = tokens
        .next()
        .map_or_else(Span::call_site, |token| token.span());
    let last = tokens.last().map_or(first, |token| token.span());

    let mut tx_ty = tx_ty.clone();
    StaticLifetimes.visit_type_mut(&mut tx_ty);
    let krate = respan(krate, first);
    let close = quote_spanned!(last=> >);
    let db = quote_spanned!(first=> #krate::__private::DatabaseOf<#tx_ty #close);
    let transaction = quote_spanned!(first=> &mut #krate::__private::Transaction<'_, #db #close);
    Database { db, transaction }
}

/// Makes every lifetime of a type `'static`: those written (`'_`, `'c`) and
/// those elided from a reference (`&T`).
struct StaticLifetimes;

impl VisitMut for StaticLifetimes {
    // `for<'a>` declares its lifetimes, which must stay names to parse.
    fn visit_bound_lifetimes_mut(&mut self, _: &mut BoundLifetimes) {}

    fn visit_lifetime_mut(&mut self, lifetime: &mut Lifetime) {
        *lifetime = static_lifetime(lifetime.span());
    }

    fn visit_type_reference_mut(&mut self, reference: &mut TypeReference) {
        if reference.lifetime.is_none() {
            reference.lifetime = Some(static_lifetime(reference.and_token.span));
        }
        visit_mut::visit_type_reference_mut(self, reference);
    }
}

fn static_lifetime(span: Span) -> Lifetime {
    Lifetime::new("'static", span)
}
