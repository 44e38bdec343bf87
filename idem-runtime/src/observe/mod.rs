//! What idem tells its operators: per-route [`Stats`], [`metrics`] through
//! the `metrics` facade, the [`status`](crate::status) of consumers and dedup tables, and
//! trace context across services (`trace`, feature `otel`).

pub mod metrics;
pub(crate) mod recorder;
pub(crate) mod stats;
#[cfg(feature = "otel")]
pub mod trace;

pub use stats::Stats;
