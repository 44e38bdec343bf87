//! Application state: the whole state, parts of it through `FromRef`, and
//! `&Delivery`, in any order between the transaction and the message.

use std::sync::Arc;

use idem_runtime::{Delivery, FromRef, Route, Router, State, idempotent};
use serde::Deserialize;

#[derive(Clone, FromRef)]
struct App {
    fees: Fees,
    config: Arc<Config>,
}

#[derive(Clone, Copy)]
struct Fees(i64);

struct Config {
    currency: &'static str,
}

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent(name = "credit-v1", key = format!("{}:{}", delivery.subject(), cmd.account))]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    delivery: &Delivery,
    State(config): State<Arc<Config>>,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (fees.0, config.currency, delivery.stream(), cmd.account);
    Ok(())
}

#[idempotent]
async fn whole(
    _tx: &mut sqlx::PgTransaction<'_>,
    State(app): State<App>,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (app.fees.0, cmd.account);
    Ok(())
}

// Takes no state: it runs under any router.
#[idempotent]
async fn stateless(_tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), sqlx::Error> {
    let _ = cmd.account;
    Ok(())
}

fn main() {
    let app = App {
        fees: Fees(1),
        config: Arc::new(Config { currency: "EUR" }),
    };
    let _router = Router::with_state(app)
        .route(Route::new("LEDGER", "credit"), credit)
        .route(Route::new("LEDGER", "whole"), whole)
        .route(Route::new("LEDGER", "stateless"), stateless);
    let _plain = Router::new().route(Route::new("LEDGER", "stateless"), stateless);
}
