//! A handler written by hand, without the macro, with state.

use idem_runtime::{Delivery, Handler, HandlerError, Route, Router, codec::Json};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
    amount: i64,
}

#[derive(Clone)]
struct Limits {
    max: i64,
}

struct CreditAccounts;

impl Handler<Limits> for CreditAccounts {
    type Payload = Credit;
    type Codec = Json;

    fn name(&self) -> &'static str {
        "credit-v1"
    }

    async fn handle(
        &self,
        tx: &mut sqlx::PgTransaction<'_>,
        cmd: Credit,
        _delivery: &Delivery,
        limits: &Limits,
    ) -> Result<(), HandlerError> {
        if cmd.amount > limits.max {
            return Err(idem_runtime::Permanent::new("over the limit").into());
        }
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(cmd.amount)
            .bind(cmd.account)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

fn main() {
    let _router =
        Router::with_state(Limits { max: 100 }).route(Route::new("S", "credit"), CreditAccounts);
}
