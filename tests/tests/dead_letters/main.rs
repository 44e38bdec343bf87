//! Dead letters and their replays, against real servers. Each test checks that
//! nothing is lost and nothing applied twice, and that the fault it injects
//! really happened. The README's "Failure handling" table points at them.
//!
//! - `storing`: dead letters stored whatever stands in the way.
//! - `replay`: replays applied once, by the right route.
//! - `undeliverable`: messages no handler can take.
//! - `ids`: the id a dead letter records.
//! - `replicas`: idem's own streams on a 3-node cluster.

mod ids;
mod replay;
mod replicas;
mod storing;
mod undeliverable;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idem_runtime::{BoxError, Delivery, Permanent, State, idempotent};
use idem_tests::scenario::*;

/// Whether `refuses` still refuses: the bug the operator fixes before a replay.
#[derive(Clone)]
struct Bug(Arc<AtomicBool>);

impl Bug {
    fn present() -> Bug {
        Bug(Arc::new(AtomicBool::new(true)))
    }

    fn fix(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), BoxError> {
        if self.0.load(Ordering::SeqCst) {
            return Err(Permanent::new("refused by a bug").into());
        }
        Ok(())
    }
}

#[idempotent(name = "refuses")]
async fn refuses(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bug): State<Bug>,
    d: Deposit,
) -> Result<(), BoxError> {
    bug.check()?;
    record_effect(tx, "refuses", &d, delivery).await?;
    Ok(())
}
