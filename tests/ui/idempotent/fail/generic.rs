use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
async fn credit<M>(_tx: &mut sqlx::PgTransaction<'_>, cmd: M) -> Result<(), sqlx::Error>
where
    M: Into<Credit>,
{
    let _ = cmd.into().account;
    Ok(())
}

fn main() {}
