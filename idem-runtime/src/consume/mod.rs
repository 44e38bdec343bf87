//! The path of one message through the runtime (private).

pub(crate) mod ack;
pub(crate) mod batch;
pub(crate) mod health;
pub(crate) mod heartbeat;
pub(crate) mod pipeline;
pub(crate) mod pull;
pub(crate) mod reply;
pub(crate) mod start;
pub(crate) mod undeliverable;
