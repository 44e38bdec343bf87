//! What idem shows of itself, against real servers.
//!
//! - `metrics`: the example services' `/metrics` while real messages flow, and
//!   the failure counters against each route's `Stats`.
//! - `trace`: trace context across services (feature `otel`).

mod metrics;
mod trace;
