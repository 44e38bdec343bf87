//! `#[idempotent]` from end to end: parse the fn and the arguments, check
//! them ([`crate::check`]), and generate the handler ([`crate::generate`]).
//!
//! Everything here works on `proc_macro2` so that it can be unit-tested; the
//! `proc_macro` entry point in `lib.rs` only converts.
//!
//! The macro stays small: it checks the signature's shape (what syntax can
//! tell), and generates a handler type whose `Handler::handle` calls the fn.
//! Types are checked by rustc, through the runtime's traits, at spans chosen
//! by the generator so that errors point at the user's code: the
//! transaction's database (`OnDatabase`), the payload's codec (`Decode`),
//! each parameter between the transaction and the message (`FromDelivery`,
//! or `&Delivery`), and the return type (`HandlerResult`, whose error
//! converts into `BoxError`).

use proc_macro2::TokenStream;
use syn::spanned::Spanned;
use syn::{Error, Item};

use crate::attr::Args;
use crate::check::{HandlerFn, check_codec, check_key};
use crate::generate::generate;

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

#[cfg(test)]
pub(crate) mod test_util;
