use idem_runtime::idempotent;
use serde::Deserialize;

mod handlers {
    use super::*;

    #[derive(Deserialize)]
    struct Credit {
        account: i64,
    }

    // The handler type is as visible as the fn, so its payload must be too.
    #[idempotent]
    pub async fn credit(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
        let _ = cmd.account;
        Ok(())
    }
}

fn main() {
    let _ = handlers::credit;
}
