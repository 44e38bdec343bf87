//! What the `#[idempotent]` expansion calls to store or refuse a handler's
//! value (reached through `idem_runtime::__private`, not a public API).

use bytes::Bytes;

use crate::codec::Encode;
use crate::error::{ErrorClass, HandlerError};

/// Encodes a handler's value with its codec, for storing. A value that does
/// not encode will not encode on a retry either: a permanent failure, and
/// the transaction is rolled back.
pub fn encode<C: Encode<T>, T>(value: &T) -> Result<Option<Bytes>, HandlerError> {
    C::encode(value)
        .map(Some)
        .map_err(|error| HandlerError::classified(error, Some(ErrorClass::Permanent)))
}

/// What `#[idempotent]` asks of a value it cannot see in the return type
/// (an alias such as `type Fallible = Result<(), E>`): that it is `()`.
#[diagnostic::on_unimplemented(
    message = "this handler returns `{Self}` through a type alias, so idem cannot see that it returns a value",
    label = "the alias hides the value type `{Self}`",
    note = "write the value type in the return type, `Result<{Self}, E>` or `MyResult<{Self}>`, so that idem stores it with the claim"
)]
pub trait NoValue {}

impl NoValue for () {}

/// Checks that a handler whose return type hides its value returns `()`.
pub fn no_value<T: NoValue>(_: T) {}
