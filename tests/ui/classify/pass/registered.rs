//! `#[classify]` on an impl of `Classify`, the trait imported or named by
//! its path: the class is found inside another error's chain.

use idem_runtime::{BoxError, Classify, ErrorClass, classify};

#[derive(Debug, thiserror::Error)]
#[error("account {0} is closed")]
struct AccountClosed(i64);

#[classify]
impl Classify for AccountClosed {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the ledger is busy")]
struct Busy;

#[idem_runtime::classify]
impl idem_runtime::Classify for Busy {
    fn class(&self) -> ErrorClass {
        ErrorClass::RetryNow
    }
}

fn main() {
    let closed: BoxError = anyhow::Error::new(AccountClosed(7)).context("crediting").into();
    assert_eq!(ErrorClass::of(&*closed), ErrorClass::Permanent);
    let busy: BoxError = anyhow::Error::new(Busy).context("crediting").into();
    assert_eq!(ErrorClass::of(&*busy), ErrorClass::RetryNow);
}
