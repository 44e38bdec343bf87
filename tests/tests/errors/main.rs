//! Errors and retries, against real servers: how a handler's failure is
//! classed and retried, so that it costs at most its own message, and every
//! message is applied once.
//!
//! - `classes`: failures dead-lettered at once or retried with backoff.
//! - `retries`: failures that clear on a retry, in process or on redelivery.

mod classes;
mod retries;
