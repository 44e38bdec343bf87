use idem_runtime::idempotent;

struct Credit {
    account: i64,
}

#[idempotent]
async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd.account;
    Ok(())
}

fn main() {}
