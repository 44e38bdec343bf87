use std::rc::Rc;

use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let account = Rc::new(cmd.account);
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    let _ = account;
    Ok(())
}

fn main() {}
