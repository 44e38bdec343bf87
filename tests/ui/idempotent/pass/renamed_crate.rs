//! `crate = ...` for a renamed or re-exported idem-runtime.

mod platform {
    pub use idem_runtime as idem;
}

use platform::idem;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idem::idempotent(crate = platform::idem)]
async fn credit(
    _tx: &mut idem::sqlx::PgTransaction<'_>,
    delivery: &idem::Delivery,
    cmd: Credit,
) -> Result<(), idem::sqlx::Error> {
    let _ = (cmd.account, delivery.delivered());
    Ok(())
}

fn main() {
    let _router = idem::Router::new().route(idem::Route::new("S", "credit"), credit);
}
