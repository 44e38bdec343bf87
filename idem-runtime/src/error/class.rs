//! Error classes: which failures are worth retrying.
//!
//! Every handler failure is **transient** (retry, with backoff, up to the
//! route's delivery limit, then dead-letter), **retry now** (again at once, in
//! process, a few times, then as transient), **retry now, then permanent**
//! (again at once a few times; if it persists, dead-letter) or **permanent**
//! (dead-letter at once: no retry can help). The class of an error is, in
//! order:
//!
//! 1. what its type says through [`Classify`], if the handler's error type
//!    implements it;
//! 2. what the first [`Permanent`], [`Transient`], [`sqlx::Error`] or
//!    registered [`Classify`] type (see [`classify`](crate::classify)) found
//!    along its `source()` chain says. The chain starts at the error itself,
//!    also inside an `anyhow::Error` or a `Box<dyn Error>`;
//! 3. otherwise, transient: when in doubt, retry, because a dead letter needs
//!    a person and a retry does not.
//!
//! `sqlx::Error`s are classed by what PostgreSQL said: serialization
//! failures (40001), deadlocks (40P01), lost or refused connections, pool
//! time-outs and server shutdowns are *retried now*; unique and foreign-key
//! violations (23505, 23503), which a check-then-write race under READ
//! COMMITTED raises and a retry clears, are *retried now, then permanent*;
//! other constraint violations, bad SQL and type errors (classes 22, 23, 42)
//! are permanent; anything else is transient.
//!
//! Failures before the handler runs (getting a connection, BEGIN, the claim)
//! are not classed at all: they are the database's, not the message's, so
//! the message is held and retried and no delivery is used up (see
//! [`HandlerError::Infrastructure`](crate::HandlerError::Infrastructure)).

use std::error::Error as StdError;
use std::fmt;

use crate::error::BoxError;

/// Whether a failure is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// Retry: NAK with backoff, up to the route's delivery limit, then
    /// dead-letter.
    Transient,
    /// Retry now, in the same process, a few times before NAKing: the
    /// database asked for it (serialization failure, deadlock) or the
    /// connection dropped.
    RetryNow,
    /// Retry now, in the same process, a few times; if it still fails,
    /// dead-letter without further deliveries. For failures a lost race
    /// explains and a retry clears, but that are a bug when they persist: a
    /// unique or foreign-key violation (23505, 23503), a statement whose
    /// error the handler ignored.
    RetryNowThenPermanent,
    /// Never retry: dead-letter on this delivery.
    Permanent,
}

impl ErrorClass {
    /// The class of a database error, by its SQLSTATE (PostgreSQL) or its
    /// extended result code (SQLite).
    pub fn of_sqlx(error: &sqlx::Error) -> ErrorClass {
        // MariaDB's SQLSTATEs are coarse (23000 for every integrity
        // violation): its error numbers tell first.
        match mariadb_number(error) {
            // ER_DUP_ENTRY, ER_ROW_IS_REFERENCED_2, ER_NO_REFERENCED_ROW_2:
            // a check-then-write race, which a retry clears
            Some(1062 | 1451 | 1452) => return ErrorClass::RetryNowThenPermanent,
            // the connection was killed, the server is shutting down
            Some(1927 | 1053) => return ErrorClass::RetryNow,
            _ => {}
        }
        match error {
            sqlx::Error::Database(db) => match db.code().as_deref() {
                // serialization_failure, deadlock_detected
                Some("40001" | "40P01") => ErrorClass::RetryNow,
                // admin_shutdown, crash_shutdown, cannot_connect_now,
                // connection exceptions
                Some("57P01" | "57P02" | "57P03") => ErrorClass::RetryNow,
                // invalid_sql_statement_name: a prepared statement the
                // session lost (`DEALLOCATE ALL`, a pooler that moved it);
                // the connection is closed, and another prepares it again
                Some("26000") => ErrorClass::RetryNow,
                Some(code) if code.starts_with("08") => ErrorClass::RetryNow,
                // unique_violation, foreign_key_violation: a check-then-write
                // race under READ COMMITTED, which a retry clears
                Some("23505" | "23503") => ErrorClass::RetryNowThenPermanent,
                // data exceptions, integrity violations, syntax or access
                // errors: the same statement fails the same way next time
                Some(code)
                    if code.starts_with("22")
                        || code.starts_with("23")
                        || code.starts_with("42") =>
                {
                    ErrorClass::Permanent
                }
                Some(code) => match sqlite_code(code) {
                    // SQLITE_BUSY, SQLITE_LOCKED and their extended codes:
                    // another connection held the lock past busy_timeout
                    Some(code) if matches!(code & 0xff, 5 | 6) => ErrorClass::RetryNow,
                    // a primary key, unique or foreign key violation: a
                    // check-then-write race, which a retry clears
                    Some(1555 | 2067 | 787) => ErrorClass::RetryNowThenPermanent,
                    // a trigger's RAISE: the application's own refusal,
                    // as PostgreSQL's raise_exception (P0001)
                    Some(1811) => ErrorClass::Transient,
                    // any other constraint (NOT NULL, CHECK...)
                    Some(code) if code & 0xff == 19 => ErrorClass::Permanent,
                    _ => ErrorClass::Transient,
                },
                None => ErrorClass::Transient,
            },
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_)
            | sqlx::Error::Tls(_) => ErrorClass::RetryNow,
            sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
            | sqlx::Error::TypeNotFound { .. }
            | sqlx::Error::Decode(_)
            | sqlx::Error::Encode(_) => ErrorClass::Permanent,
            _ => ErrorClass::Transient,
        }
    }

    /// The class of any error: the first [`Permanent`], [`Transient`],
    /// `sqlx::Error` or registered [`Classify`] type along its `source()`
    /// chain decides; otherwise [`ErrorClass::Transient`].
    pub fn of(error: &(dyn StdError + 'static)) -> ErrorClass {
        Self::found_in(error).unwrap_or(ErrorClass::Transient)
    }

    /// The class the first error along the chain that has one says, if any.
    pub(crate) fn found_in(error: &(dyn StdError + 'static)) -> Option<ErrorClass> {
        Findings::of(error).class
    }
}

/// What a handler error's chain says: its class, and the SQLSTATE of a
/// database error in it. Found before the error is boxed.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Findings {
    pub(crate) class: Option<ErrorClass>,
    pub(crate) sqlstate: Option<String>,
}

impl Findings {
    /// Walks the chain from `error`: the first error that has a class gives
    /// it; the first database error gives its SQLSTATE.
    pub(crate) fn of(error: &(dyn StdError + 'static)) -> Self {
        let mut findings = Findings::default();
        let mut next = Some(error);
        while let Some(error) = next {
            let sqlx_error = error.downcast_ref::<sqlx::Error>();
            if findings.sqlstate.is_none()
                && let Some(sqlx::Error::Database(db)) = sqlx_error
            {
                findings.sqlstate = db.code().map(|code| code.into_owned());
            }
            if findings.class.is_none() {
                findings.class = if error.is::<Permanent>() {
                    Some(ErrorClass::Permanent)
                } else if error.is::<Transient>() {
                    Some(ErrorClass::Transient)
                } else if let Some(sqlx_error) = sqlx_error {
                    Some(ErrorClass::of_sqlx(sqlx_error))
                } else {
                    inventory::iter::<Classifier>
                        .into_iter()
                        .find_map(|classifier| (classifier.class)(error))
                };
            }
            next = error.source();
        }
        findings
    }
}

/// Whether an error of BEGIN, the claim or getting a connection is the
/// database's (it cannot be used: unreachable, restarting, overloaded, a
/// standby, the dedup table or a permission missing), rather than the
/// message's. Such a failure holds the message instead of using up its
/// deliveries; any other (its id cannot be stored, its claim waited past
/// the statement timeout on a concurrent attempt) is classed as usual.
pub(crate) fn is_infrastructure(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // connection exception, insufficient resources, operator
            // intervention (shutdown), system error, invalid authorization,
            // invalid catalog (database), invalid schema, a read-only
            // (standby) transaction, and the objects idem needs
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("58")
                || code.starts_with("28")
                || matches!(
                    &*code,
                    "57P01"
                        | "57P02"
                        | "57P03"
                        | "3D000"
                        | "3F000"
                        | "25006"
                        | "42P01"
                        | "42501"
                        | "42883"
                        | "42703"
                )
                // SQLite: busy or locked (another connection holds the
                // lock past busy_timeout), read-only, an I/O error, a full
                // disk, a file that cannot be opened
                || sqlite_code(&code).is_some_and(|code| matches!(code & 0xff, 5 | 6 | 8 | 10 | 13 | 14))
        }) || mariadb_number(error).is_some_and(mariadb_infrastructure),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed
        | sqlx::Error::Configuration(_) => true,
        _ => false,
    }
}

/// A [`Classify`] type registered with `#[idem_runtime::classify]`, so that
/// its class is found wherever it sits in an error chain.
#[doc(hidden)]
pub struct Classifier {
    class: fn(&(dyn StdError + 'static)) -> Option<ErrorClass>,
}

impl Classifier {
    /// The entry for `T`.
    pub const fn of<T: Classify + StdError + 'static>() -> Self {
        Self {
            class: class_of::<T>,
        }
    }
}

fn class_of<T: Classify + StdError + 'static>(
    error: &(dyn StdError + 'static),
) -> Option<ErrorClass> {
    error.downcast_ref::<T>().map(Classify::class)
}

inventory::collect!(Classifier);

/// Lets an error type choose its own class.
///
/// ```
/// use idem_runtime::error::{Classify, ErrorClass};
///
/// #[derive(Debug, thiserror::Error)]
/// enum LedgerError {
///     #[error("account {0} does not exist")]
///     UnknownAccount(i64),
///     #[error(transparent)]
///     Database(#[from] sqlx::Error),
/// }
///
/// impl Classify for LedgerError {
///     fn class(&self) -> ErrorClass {
///         match self {
///             LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
///             LedgerError::Database(e) => ErrorClass::of_sqlx(e),
///         }
///     }
/// }
/// ```
///
/// A handler whose error type implements it is classified by it; the
/// `#[idempotent]` expansion picks the implementation up on its own. For the
/// class to be found also where the error is *wrapped* (in an
/// `anyhow::Error`, a `Box<dyn Error>`, or another error's `source()`), put
/// `#[idem_runtime::classify]` on the impl: it registers the type. (An
/// `#[error(transparent)]` wrapper hides the error it wraps from the chain:
/// implement `Classify` on the wrapper instead.)
///
/// ```
/// use idem_runtime::classify;
/// use idem_runtime::error::{Classify, ErrorClass};
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("account {0} is closed")]
/// struct AccountClosed(i64);
///
/// #[classify]
/// impl Classify for AccountClosed {
///     fn class(&self) -> ErrorClass {
///         ErrorClass::Permanent
///     }
/// }
///
/// let wrapped = anyhow::Error::new(AccountClosed(7)).context("crediting");
/// let boxed: idem_runtime::error::BoxError = wrapped.into();
/// # let _ = boxed;
/// ```
pub trait Classify {
    /// This error's class.
    fn class(&self) -> ErrorClass;
}

/// Marks an error as permanent: the message is dead-lettered without retry.
///
/// ```
/// # #[derive(serde::Deserialize)] struct Order { quantity: i64 }
/// use idem_runtime::error::BoxError;
/// use idem_runtime::{Permanent, idempotent};
///
/// #[idempotent]
/// async fn place(tx: &mut sqlx::PgTransaction<'_>, order: Order) -> Result<(), BoxError> {
///     if order.quantity <= 0 {
///         return Err(Permanent::new(format!("quantity {} is not positive", order.quantity)).into());
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct Permanent(BoxError);

/// Marks an error as transient: the message is retried with backoff.
#[derive(Debug)]
pub struct Transient(BoxError);

macro_rules! marker {
    ($name:ident) => {
        impl $name {
            /// Wraps `error`.
            pub fn new(error: impl Into<BoxError>) -> Self {
                Self(error.into())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl StdError for $name {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&*self.0)
            }
        }
    };
}
marker!(Permanent);
marker!(Transient);

/// Finds the class of a handler's error at the `#[idempotent]` expansion's
/// call site, where its type is concrete ("autoderef specialization"; the
/// first that applies wins):
///
/// 1. the type implements [`Classify`];
/// 2. it is an error: walk its chain, from itself;
/// 3. it derefs to one (`anyhow::Error`, `Box<dyn Error>`): walk the chain
///    from the error it holds, which boxing would hide;
/// 4. none: no class found (transient).
#[doc(hidden)]
pub mod specialize {
    use std::error::Error as StdError;

    use super::{Classify, Findings};

    pub struct ClassOf<'a, E>(pub &'a E);

    pub trait ByClassify {
        fn idem_class(&self) -> Findings;
    }

    impl<E: Classify> ByClassify for &&&ClassOf<'_, E> {
        fn idem_class(&self) -> Findings {
            Findings {
                class: Some(self.0.class()),
                sqlstate: None,
            }
        }
    }

    pub trait ByChain {
        fn idem_class(&self) -> Findings;
    }

    impl<E: StdError + 'static> ByChain for &&ClassOf<'_, E> {
        fn idem_class(&self) -> Findings {
            Findings::of(self.0)
        }
    }

    pub trait ByHeldError {
        fn idem_class(&self) -> Findings;
    }

    impl<E: AsRef<dyn StdError + Send + Sync + 'static>> ByHeldError for &ClassOf<'_, E> {
        fn idem_class(&self) -> Findings {
            Findings::of(self.0.as_ref())
        }
    }

    pub trait ByDefault {
        fn idem_class(&self) -> Findings;
    }

    impl<E> ByDefault for ClassOf<'_, E> {
        fn idem_class(&self) -> Findings {
            Findings::default()
        }
    }
}

/// Converts a handler body's error into a [`HandlerError`](crate::HandlerError),
/// keeping the class found by [`specialize`].
#[doc(hidden)]
#[macro_export]
macro_rules! __handler_error {
    ($error:expr) => {{
        #[allow(unused_imports)]
        use $crate::__private::specialize::{
            ByChain as _, ByClassify as _, ByDefault as _, ByHeldError as _,
        };
        let error = $error;
        let found = (&&&&$crate::__private::specialize::ClassOf(&error)).idem_class();
        $crate::HandlerError::found(error, found)
    }};
}

/// The claims table. Its errors are classed here: a unique-key refusal is
/// a duplicate, and a row with no partition a generation purged under a
/// claim. [`schema::CLAIMS_TABLE`](crate::schema::CLAIMS_TABLE) is this name.
pub(crate) const CLAIMS_TABLE: &str = "idem_claims";

/// Whether the claim found the message processed before: a unique key of
/// of a partition of the claims table refused it.
pub(crate) fn is_duplicate_claim(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("23505")
            && db.table().is_some_and(|table| table.starts_with(CLAIMS_TABLE)))
}

/// Whether the claim failed because the generation it inserted into had
/// no partition any more (`no partition of relation "idem_claims" found
/// for row`, 23514): a generation the purge detached under it. Seen once in
/// a benchmark run whose purge rotated and expired generations every
/// second; not reproduced since. A retry reads the generations again.
pub(crate) fn is_generation_gone(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("23514")
            && db.table().is_some_and(|table| table.starts_with(CLAIMS_TABLE)))
}

/// The SQLSTATE of a database error, if it is the server's answer.
fn sqlstate(error: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    match error {
        sqlx::Error::Database(db) => db.code(),
        _ => None,
    }
}

/// Whether the server refused a statement because the transaction had
/// aborted before it (25P02, in_failed_sql_transaction): a statement failed
/// and the handler ignored the error. The checked COMMIT reads it as
/// "nothing committed".
pub(crate) fn is_aborted_transaction(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some("25P02")
}

/// Whether the check before COMMIT found the claims gone from the
/// transaction (its division by zero, 22012: the handler ended the claiming
/// transaction itself; see `store/transaction.rs`).
pub(crate) fn is_claim_lost(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some("22012")
}

/// Whether a statement gave up waiting for a lock (PostgreSQL's 55P03,
/// lock_not_available: `lock_timeout`, or `NOWAIT`; SQLite's `SQLITE_BUSY`
/// past `busy_timeout`).
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    // MariaDB's ER_LOCK_WAIT_TIMEOUT: innodb_lock_wait_timeout ran out
    mariadb_number(error) == Some(1205)
        || sqlstate(error).is_some_and(|code| {
            // PostgreSQL's lock_not_available, or SQLite's SQLITE_BUSY (and its
            // extended codes) once busy_timeout ran out
            code == "55P03" || sqlite_code(&code).is_some_and(|code| code & 0xff == 5)
        })
}

/// Whether a lock wait timeout is found along `error`'s chain (see
/// [`is_lock_timeout`]).
pub(crate) fn lock_timeout_in(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error
            .downcast_ref::<sqlx::Error>()
            .is_some_and(is_lock_timeout)
        {
            return true;
        }
        next = error.source();
    }
    false
}

/// Whether MariaDB's error `number` says the database cannot be used (by
/// this user, now), rather than anything about the message: a table or
/// database missing, access or a command denied, a read-only server, too
/// many connections (the server's, or the user's `max_user_connections` or
/// hourly quotas), too many prepared statements.
fn mariadb_infrastructure(number: u16) -> bool {
    matches!(
        number,
        1146 | 1049 | 1044 | 1142 | 1227 | 1290 | 1792 | 1836 | 1040 | 1203 | 1226 | 1461
    )
}

/// MariaDB's error number, if `error` is MariaDB's (`None` without the
/// `mariadb` feature).
pub(crate) fn mariadb_number(error: &sqlx::Error) -> Option<u16> {
    #[cfg(feature = "mariadb")]
    if let sqlx::Error::Database(db) = error {
        return db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|db| db.number());
    }
    let _ = error;
    None
}

/// SQLite's extended result code, if `code` is one: a number of at most
/// four digits, never a SQLSTATE's five characters.
fn sqlite_code(code: &str) -> Option<i32> {
    (code.len() < 5).then(|| code.parse().ok()).flatten()
}

/// Whether a prepared statement the session should hold is missing (26000,
/// invalid_sql_statement_name: `DEALLOCATE ALL` in a handler, a pooler that
/// moved the session).
pub(crate) fn is_unprepared(error: &sqlx::Error) -> bool {
    sqlstate(error).as_deref() == Some("26000")
}

/// Whether a database error means the server cannot be reached (or is
/// starting up, or shutting down), rather than an answer to what was asked:
/// what start-up waits out.
pub(crate) fn is_unreachable(error: &sqlx::Error) -> bool {
    match error {
        // The pool could not connect within its acquire timeout.
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        // connection exception; too many connections; shutting down,
        // crashed, starting up; MariaDB's too many connections (the
        // server's, the user's) and shutdown
        _ => {
            sqlstate(error).is_some_and(|code| {
                code.starts_with("08") || matches!(&*code, "53300" | "57P01" | "57P02" | "57P03")
            }) || matches!(mariadb_number(error), Some(1040 | 1203 | 1226 | 1053))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapper(#[source] sqlx::Error);

    #[test]
    fn markers_and_sqlx_errors_are_found_along_the_source_chain() {
        let permanent: BoxError = Permanent::new("no").into();
        assert_eq!(ErrorClass::of(&*permanent), ErrorClass::Permanent);
        let transient: BoxError = Transient::new(Permanent::new("inner")).into();
        assert_eq!(ErrorClass::of(&*transient), ErrorClass::Transient);
        let pool = Wrapper(sqlx::Error::PoolTimedOut);
        assert_eq!(ErrorClass::of(&pool), ErrorClass::RetryNow);
        let other: BoxError = "something odd".into();
        assert_eq!(ErrorClass::of(&*other), ErrorClass::Transient);
    }

    #[derive(Debug, thiserror::Error)]
    #[error("classified")]
    struct Classified;

    impl Classify for Classified {
        fn class(&self) -> ErrorClass {
            ErrorClass::Permanent
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("plain")]
    struct Plain;

    #[test]
    fn the_expansion_finds_classify_only_where_it_is_implemented() {
        let classified = crate::__handler_error!(Classified);
        assert_eq!(classified.class(), ErrorClass::Permanent);
        let plain = crate::__handler_error!(Plain);
        assert_eq!(plain.class(), ErrorClass::Transient);
    }
}
