use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

type LedgerResult<T> = Result<T, sqlx::Error>;

#[idempotent]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> LedgerResult<()> {
    let _ = cmd.account;
    Ok(())
}

fn main() {}
