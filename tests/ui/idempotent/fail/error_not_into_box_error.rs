use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

/// Not a `std::error::Error`, so it does not convert into `BoxError`.
#[derive(Debug)]
enum LedgerError {
    Overdrawn,
}

#[idempotent]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), LedgerError> {
    if cmd.account < 0 {
        return Err(LedgerError::Overdrawn);
    }
    Ok(())
}

mod ledger {
    pub type Result<T> = std::result::Result<T, super::LedgerError>;
}

// Through an alias, the error is reported on the whole return type.
#[idempotent]
async fn debit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> ledger::Result<()> {
    if cmd.account < 0 {
        return Err(LedgerError::Overdrawn);
    }
    Ok(())
}

fn main() {}
