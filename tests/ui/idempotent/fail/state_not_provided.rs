use idem_runtime::{Route, Router, State, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[derive(Clone)]
struct Fees(i64);

#[derive(Clone)]
struct App {
    name: String,
}

#[idempotent]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, fees.0);
    Ok(())
}

fn main() {
    let app = App { name: "ledger".into() };
    let _ = &app.name;
    let _router = Router::with_state(app).route(Route::new("LEDGER", "credit"), credit);
}
