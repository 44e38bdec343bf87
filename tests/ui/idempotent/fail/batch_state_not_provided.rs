use idem_runtime::{State, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    amount: i64,
}

#[derive(Clone)]
struct Fees(i64);

#[derive(Clone)]
struct App;

#[idempotent(batch, state = App)]
async fn credit_many(
    _tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmds: Vec<Credit>,
) -> Result<(), sqlx::Error> {
    let _ = (fees.0, cmds.len());
    Ok(())
}

fn main() {}
