//! The transactional outbox against a real nats-server and PostgreSQL.
//!
//! - `drain`: a relay's overlapping cycles keep one relay's order, use two
//!   connections, and release their rows when dropped.
//! - `publishing`: what a handler queues is published once, in order, also
//!   across relay crashes and two relays.
//! - `relay_liveness`: the relay never stops, whatever its rows or NATS do.
//! - `wake`: what wakes a relay without the NOTIFY trigger: its router's
//!   commits (its own database's only), a redelivery found processed, or its
//!   adaptive poll; and when it LISTENs.

mod drain;
mod publishing;
mod relay_liveness;
mod wake;

use sqlx::PgPool;

/// Whether the outbox's NOTIFY trigger is enabled (migration 7 disables
/// it).
pub(crate) async fn notify_trigger_enabled(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger WHERE tgname = 'idem_outbox_notify'",
    )
    .fetch_one(pool)
    .await
    .expect("the trigger exists")
}
