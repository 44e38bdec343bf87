//! Retention and the expiry of claims, against real servers.
//!
//! - `floor`: the retention floor, refused or recorded at start-up.
//! - `expiry`: claims by generation, the purge beside live traffic, two
//!   purgers, the upgrade from version 1.
//! - `interrupted_expiry`: an expiry cut short at any point does not stop the
//!   purges after it.
//! - `longest_retention`: which retention the purge applies, and batch claims
//!   across rotations.
//! - `transition`: what a generation's transition waits for.

mod expiry;
mod floor;
mod interrupted_expiry;
mod longest_retention;
mod transition;

use std::time::Duration;

use idem_runtime::{Delivery, idempotent};
use idem_tests::scenario::{Deposit, record_effect};

/// Generations of a second; a transition is warned about after one.
const RETENTION: Duration = Duration::from_secs(2);

/// The handler of the tests whose messages flow while the purge runs.
#[idempotent(name = "flowing")]
async fn flowing(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "flowing", &d, delivery).await
}
