//! What the `#[idempotent]` expansion names to find a handler's database,
//! and calls to store or refuse its value (reached through
//! `idem_runtime::__private`, not a public API).

use bytes::Bytes;
use sqlx::Database;

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

/// The database a handler's first parameter runs on: `#[idempotent]`
/// implements `Handler<S, DatabaseOf<T>>` for a fn whose first parameter is
/// `&mut T`, with `T`'s lifetimes made `'static` (they do not change the
/// database). So the handler's database is the one its transaction is on,
/// and a type that is on none is reported at the parameter.
///
/// ```
/// use idem_runtime::__private::DatabaseOf;
///
/// let _: DatabaseOf<sqlx::PgTransaction<'static>> = sqlx::Postgres;
/// let _: DatabaseOf<sqlx::PgConnection> = sqlx::Postgres;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a transaction idem can run a handler in",
    label = "the first parameter is the transaction the message is claimed in",
    note = "write `tx: &mut sqlx::PgTransaction<'_>` (PostgreSQL) or `tx: &mut sqlx::Transaction<'_, DB>`"
)]
pub trait OnDatabase {
    /// The database the handler's transaction is on.
    type Database: Database;
}

impl<DB: Database> OnDatabase for sqlx::Transaction<'_, DB> {
    type Database = DB;
}

/// A transaction derefs to its connection, so a handler may take that.
impl OnDatabase for sqlx::PgConnection {
    type Database = sqlx::Postgres;
}

#[cfg(feature = "sqlite")]
impl OnDatabase for sqlx::SqliteConnection {
    type Database = sqlx::Sqlite;
}

#[cfg(feature = "mariadb")]
impl OnDatabase for sqlx::MySqlConnection {
    type Database = sqlx::MySql;
}

/// The database of a handler whose first parameter is `&mut T`.
pub type DatabaseOf<T> = <T as OnDatabase>::Database;
