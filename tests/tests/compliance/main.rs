//! The compliance suite: idem's promise, tested the same way on every
//! database it supports (issue 22). The suite is written once
//! ([`suite::compliance_suite!`]) and expanded for each store
//! (`stores/<store>.rs`: how its server or file is started, its pool and
//! transaction types, its router, and the two things that cannot be said
//! in portable SQL: a statement that never ends, and whether a session
//! waits on a lock). Its tests are `<store>::<test>`,
//! `<store>::{per_message,batched,adaptive}::<test>` for those run in each
//! batching mode, and `<store>::outbox::<test>` for the outbox's
//! ([`outbox::outbox_suite!`]).
//!
//! Every test runs a real nats-server and a real database (a PostgreSQL
//! or MariaDB server of its own, or a SQLite file in WAL mode with
//! `synchronous = FULL`), and asserts effects = inputs with no duplicates,
//! or that what was not applied was dead-lettered, besides its own
//! invariant.
//!
//! # What is not in the suite, and why
//!
//! | Not here | Because | Where instead |
//! |---|---|---|
//! | An ambiguous COMMIT (the connection cut while COMMIT is in flight) | Injected differently: PostgreSQL's proxy reads its protocol to cut at COMMIT; MariaDB's test pauses a protocol-blind proxy from the handler, so that the COMMIT runs and its answer is held, then resets the connection. SQLite is a library in the worker's process, so its COMMIT has no connection to lose; it returns, or the process dies (the crash tests) | `commit_ack/ambiguous.rs`, `mariadb/` |
//! | Expiry | The stores expire differently: PostgreSQL drops generations of partitions, SQLite and MariaDB delete claims past their retention | `retention/`, `sqlite/`, `mariadb/` |
//! | Database restarts and outages | A SQLite file cannot go away and come back as a server does; MariaDB's restart is not written yet | `outages/` |
//! | Scale-out across processes and the chaos suite's kill mode | A process's kills are another harness: the chaos suite's on PostgreSQL, and one kill run written once (`idem_tests::kill_run`) for SQLite and MariaDB, each with a worker binary of its own | `chaos/`, `cluster.rs`, `sqlite/kills.rs`, `mariadb/kills.rs` |
//! | `ROLLBACK TO` idem's savepoint, a trigger's `RAISE(ROLLBACK)`, a write lock held at start-up | Ways SQLite alone ends or blocks a transaction | `sqlite/` |
//! | A deadlock's victim that swallowed the error, the session settings a route sets and their restoring, the locks a handler takes that outlive a transaction | MariaDB's own | `mariadb/` |
//! | A swallowed error, a deferred constraint, a lost claim in a batch | PostgreSQL's aborted-transaction and COMMIT-time behaviours | `commit_ack/commit_check.rs` |

mod bed;
mod outbox;
mod stores;
mod suite;

/// The suite on PostgreSQL.
mod postgres {
    crate::suite::compliance_suite!(postgres);
    crate::outbox::outbox_suite!();
}

/// The suite on MariaDB.
mod mariadb {
    crate::suite::compliance_suite!(mariadb);
    crate::outbox::outbox_suite!();
}

/// The suite on SQLite.
mod sqlite {
    crate::suite::compliance_suite!(sqlite);
    crate::outbox::outbox_suite!();
}
