use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

struct Ledger;

impl Ledger {
    #[idempotent]
    async fn credit(
        &self,
        _tx: &mut sqlx::PgTransaction<'_>,
        cmd: Credit,
    ) -> Result<(), sqlx::Error> {
        let _ = cmd.account;
        Ok(())
    }
}

fn main() {}
