//! Batch mode against real servers: one claim statement and one COMMIT per
//! batch, each message still applied exactly once and a failing message never
//! failing its neighbours; and batch handlers (`#[idempotent(batch)]`), which
//! take the fresh messages of a batch in one call.
//!
//! - `mode`: batch routes with per-message handlers, and the fallback.
//! - `adaptive`: adaptive batching, and the fallback that splits a batch.
//! - `handlers`: batch handlers.
//! - `per_message`: handlers that must have their transaction to themselves.

mod adaptive;
mod handlers;
mod mode;
mod per_message;
