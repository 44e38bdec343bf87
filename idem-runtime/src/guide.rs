//! The guide: how to write, run and operate a service on idem.
//!
//! Each chapter is a page of its own, and every Rust example in it is
//! compiled as a doctest, so none of them can drift from the code. Read them
//! in this order:
//!
//! 1. [Writing handlers](writing_handlers): the `#[idempotent]` fn, its
//!    parameters and return type, codecs, the message id, routes and their
//!    settings, sizing the pool, and what the runtime does with each message.
//! 2. [Errors and retries](errors_and_retries): error classes, the
//!    [`RetryPolicy`](crate::RetryPolicy) and each of its settings, held
//!    messages, and how the policy feeds the retention floor.
//! 3. [Batch](batch): batch mode and batch handlers.
//! 4. [Request/reply](request_reply): stored results and reply routes.
//! 5. [Outbox](outbox): messages a transaction publishes if, and only if, it
//!    commits.
//! 6. [Retention](retention): how claims are stored, how long they live, the
//!    purge and its cadence, and the retention floor.
//! 7. [Failure handling](failure_handling): what idem does on every path,
//!    each with the test that proves it; dead letters; durability.
//! 8. [Running at scale](running_at_scale): many workers, a JetStream
//!    cluster, per-key ordering, and what scaling costs.
//! 9. [Operating](operating): counters, the `idem` command, metrics, the
//!    dashboard and tracing across services.
//! 10. [Performance](performance): what idem costs against hand-written
//!     consumers, and the benchmark results.
//! 11. *SQLite* (feature `sqlite`, `guide::sqlite`): handlers on a SQLite
//!     file, and what differs from PostgreSQL.
//!
//! *Testing your handlers*, how to prove your own handlers exactly-once
//! under the faults that break them, is the guide of the `idem-test` crate,
//! the kit it describes (a dev-dependency).

#[doc = include_str!("../docs/guide/writing-handlers.md")]
pub mod writing_handlers {}

#[doc = include_str!("../docs/guide/errors-and-retries.md")]
pub mod errors_and_retries {}

#[doc = include_str!("../docs/guide/batch.md")]
pub mod batch {}

#[doc = include_str!("../docs/guide/request-reply.md")]
pub mod request_reply {}

#[doc = include_str!("../docs/guide/outbox.md")]
pub mod outbox {}

#[doc = include_str!("../docs/guide/retention.md")]
pub mod retention {}

#[doc = include_str!("../docs/guide/failure-handling.md")]
pub mod failure_handling {}

#[doc = include_str!("../docs/guide/running-at-scale.md")]
pub mod running_at_scale {}

#[doc = include_str!("../docs/guide/operating.md")]
pub mod operating {}

#[doc = include_str!("../docs/guide/performance.md")]
pub mod performance {}

#[cfg(feature = "sqlite")]
#[doc = include_str!("../docs/guide/sqlite.md")]
pub mod sqlite {}

#[cfg(feature = "mariadb")]
#[doc = include_str!("../docs/guide/mariadb.md")]
pub mod mariadb {}
