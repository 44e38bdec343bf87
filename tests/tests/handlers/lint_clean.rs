//! The `#[idempotent]` expansion adds no warning of its own, even where every
//! lint is denied, `clippy::pedantic` included.
//!
//! This is an integration-test target, so `cargo clippy --all-targets -- -D
//! warnings` (which `scripts/test.sh` and CI run) compiles it with clippy and
//! the lints below; trybuild (`tests/ui`) runs only rustc and could not prove
//! this. Each handler is one shape of the macro's input: with and without
//! `name` and `key`, payload patterns, `&Delivery`, a connection instead of
//! a transaction, and different error types.
#![deny(
    warnings,
    clippy::all,
    clippy::pedantic,
    unused,
    rust_2018_idioms,
    unused_qualifications,
    unreachable_pub
)]

use idem_runtime::{
    Classify, Delivery, ErrorClass, Handler, ReplyRoute, Route, Router, idempotent,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
    account: i64,
    amount: i64,
}

/// A hand-written error type.
#[derive(Debug)]
struct LedgerError;

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ledger error")
    }
}

impl std::error::Error for LedgerError {}

/// A `thiserror` type that picks its own class.
#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("account {0} is closed")]
    Closed(i64),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Classify for TransferError {
    fn class(&self) -> ErrorClass {
        match self {
            TransferError::Closed(_) => ErrorClass::Permanent,
            TransferError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// A crate-local `Result` alias, as many applications have (the macro needs
/// it to be named `Result`).
mod ledger {
    pub(crate) type Result<T> = std::result::Result<T, super::LedgerError>;
}

/// Name, key from a field, `&Delivery`, a hand-written error.
#[idempotent(name = "credit-v1", key = cmd.transfer_id)]
async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    meta: &Delivery,
    cmd: Credit,
) -> Result<(), LedgerError> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await
        .map_err(|_| LedgerError)?;
    tracing::debug!(seq = meta.stream_sequence(), "credited");
    Ok(())
}

/// Name, key from a binding of a struct pattern, `sqlx::Error`.
#[idempotent(name = "debit-v1", key = account)]
async fn debit(
    tx: &mut sqlx::PgTransaction<'_>,
    Credit {
        account, amount, ..
    }: Credit,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = $2")
        .bind(amount)
        .bind(account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// No name, a computed key, a `mut` payload, a boxed error.
#[idempotent(key = format!("{}:{}", cmd.account, cmd.transfer_id))]
async fn audit(
    tx: &mut sqlx::PgTransaction<'_>,
    mut cmd: Credit,
) -> Result<(), idem_runtime::BoxError> {
    cmd.amount = cmd.amount.saturating_abs();
    sqlx::query("INSERT INTO audit (account, amount) VALUES ($1, $2)")
        .bind(cmd.account)
        .bind(cmd.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Neither name nor key, a wildcard payload, and no `.await` in the body.
#[idempotent]
async fn ignore(_tx: &mut sqlx::PgTransaction<'_>, _: Credit) -> Result<(), sqlx::Error> {
    Ok(())
}

/// A `Classify` error type, `&Delivery` and a key.
#[idempotent(name = "transfer-v1", key = cmd.transfer_id)]
async fn transfer(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), TransferError> {
    if cmd.account < 0 {
        return Err(TransferError::Closed(cmd.account));
    }
    sqlx::query("INSERT INTO transfers (id, delivered) VALUES ($1, $2)")
        .bind(&cmd.transfer_id)
        .bind(i64::try_from(delivery.delivered()).unwrap_or(i64::MAX))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A connection instead of a transaction, and a `Result` alias.
#[idempotent(name = "refund-v1")]
async fn refund(conn: &mut sqlx::PgConnection, cmd: Credit) -> ledger::Result<()> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount)
        .bind(cmd.account)
        .execute(conn)
        .await
        .map_err(|_| LedgerError)?;
    Ok(())
}

/// A receipt a handler returns, stored with its claim.
#[derive(serde::Serialize)]
struct Receipt {
    balance: i64,
}

/// A value, stored with the claim and sent as the reply to a request.
#[idempotent(name = "balance-v1")]
async fn balance(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<Receipt, sqlx::Error> {
    let balance = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(cmd.account)
        .fetch_one(&mut **tx)
        .await?;
    Ok(Receipt { balance })
}

/// A value through a `Result` alias, with the raw codec.
#[idempotent(name = "echo-v1", codec = raw)]
async fn echo(_tx: &mut sqlx::PgTransaction<'_>, text: String) -> ledger::Result<String> {
    Ok(text)
}

/// A public handler in a module, with a `String` error.
mod public {
    use serde::Deserialize;

    /// The payload of [`notify`].
    #[derive(Deserialize)]
    pub(crate) struct Notice {
        pub(crate) text: String,
    }

    /// Visible to the crate, like the fn as written.
    #[idem_runtime::idempotent(name = "notify-v1", key = notice.text)]
    pub(crate) async fn notify(
        _tx: &mut sqlx::PgTransaction<'_>,
        notice: Notice,
    ) -> Result<(), String> {
        if notice.text.is_empty() {
            return Err("empty notice".to_owned());
        }
        Ok(())
    }
}

fn sample() -> Credit {
    Credit {
        transfer_id: "t-1".to_owned(),
        account: 7,
        amount: 100,
    }
}

/// Each handler carries the name the macro was given, or its fn's name, and
/// the key its `key = ...` computes.
#[test]
fn handlers_have_their_names_and_keys() {
    assert_eq!(credit::NAME, "credit-v1");
    assert_eq!(debit::NAME, "debit-v1");
    assert_eq!(audit::NAME, "audit");
    assert_eq!(ignore::NAME, "ignore");
    assert_eq!(transfer::NAME, "transfer-v1");
    assert_eq!(refund::NAME, "refund-v1");
    assert_eq!(public::notify::NAME, "notify-v1");
    assert_eq!(Handler::<()>::name(&credit()), credit::NAME);
    assert_eq!(Handler::<()>::name(&public::notify()), "notify-v1");

    let delivery = Delivery::for_test("ledger.credit", "LEDGER", 1);
    assert_eq!(
        Handler::<()>::message_key(&credit(), &sample(), &delivery).as_deref(),
        Some("t-1")
    );
    assert_eq!(
        Handler::<()>::message_key(&debit(), &sample(), &delivery).as_deref(),
        Some("7")
    );
    assert_eq!(
        Handler::<()>::message_key(&audit(), &sample(), &delivery).as_deref(),
        Some("7:t-1")
    );
    assert_eq!(
        Handler::<()>::message_key(&ignore(), &sample(), &delivery),
        None
    );
    assert_eq!(
        Handler::<()>::message_key(&refund(), &sample(), &delivery),
        None
    );
    let notice = public::Notice {
        text: "hello".to_owned(),
    };
    assert_eq!(
        Handler::<()>::message_key(&public::notify(), &notice, &delivery).as_deref(),
        Some("hello")
    );
}

/// Every shape is a handler the router accepts.
#[test]
fn every_shape_routes() {
    let router = Router::new()
        .route(Route::new("LEDGER", "credit"), credit)
        .route(Route::new("LEDGER", "debit"), debit)
        .route(Route::new("LEDGER", "audit"), audit)
        .route(Route::new("LEDGER", "ignore"), ignore)
        .route(Route::new("LEDGER", "transfer"), transfer)
        .route(Route::new("LEDGER", "refund"), refund)
        .route(Route::new("LEDGER", "notify"), public::notify)
        .reply_route(ReplyRoute::new("ledger.balance"), balance)
        .reply_route(ReplyRoute::new("ledger.echo"), echo);
    let handle = router.handle();
    for durable in [
        "credit", "debit", "audit", "ignore", "transfer", "refund", "notify",
    ] {
        assert!(handle.stats(durable).is_some(), "route {durable}");
    }
    assert!(handle.stats("ledger.balance").is_some());
    assert!(handle.stats("ledger.echo").is_some());
}
