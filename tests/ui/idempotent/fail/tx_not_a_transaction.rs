use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

// A pool is not a transaction: the claim and the body must share one.
#[idempotent]
async fn credit(pool: &mut sqlx::PgPool, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = (pool, cmd.account);
    Ok(())
}

fn main() {}
