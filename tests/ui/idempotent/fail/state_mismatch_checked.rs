use idem_runtime::{State, idempotent};
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

// `state = App` checks the parameters against the router's state where the
// handler is written, as axum's `debug_handler` does.
#[idempotent(state = App)]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), sqlx::Error> {
    let _ = (cmd.account, fees.0);
    Ok(())
}

fn main() {}
