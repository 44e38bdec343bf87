//! A router's start and end, against real servers.
//!
//! - `startup`: starting while a server is down or a row is held,
//!   configuration errors, migrations.
//! - `refusals`: what start-up refuses, and why.
//! - `shutdown`: graceful shutdown, SIGTERM, and a dropped `run` future.

mod refusals;
mod shutdown;
mod startup;

use idem_runtime::{Delivery, idempotent};
use idem_tests::scenario::*;

/// The handler of the start and end tests, under a versioned name.
#[idempotent(name = "lifecycle.deposit.v1")]
async fn deposit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "lifecycle.deposit.v1", &d, delivery).await
}

/// The one deposit these tests publish.
fn one() -> Deposit {
    Deposit {
        account: "a".into(),
        amount: 1,
    }
}
