//! What idem asks of a database, as one trait: [`Backend`], implemented
//! for PostgreSQL (below, over the other modules of `store/`).
//!
//! Steps 2 and 3 of "Toward more databases" in ARCHITECTURE.md. The message
//! path (`consume/`), a router's start-up, run and purge, and the reads
//! behind `status`, `schema` and `handler::results::stored` are generic over
//! `DB: Backend`. None of them calls a function of `store::transaction`,
//! `store::claim`, `store::results`, `store::reads` or `store::migrations`
//! directly. The outbox and its relay have a trait of their own,
//! `store::outbox::OutboxStore`, which a router runs beside its routes
//! (`router/run.rs`, `Beside`); what is each database's own are the entry
//! points `Router::run` and `Router::run_until`.
//!
//! The trait is written for the databases issue 22 names, not only for
//! PostgreSQL. What its shape owes to the other two:
//!
//! - **How a route begins and commits is the database's own** ([`Backend::Begin`],
//!   built once per route from what start-up found, [`Backend::Session`]).
//!   PostgreSQL's is prepared statements, the bounds as transaction-local
//!   settings and a checked COMMIT that compares transaction ids. SQLite's
//!   would be `BEGIN IMMEDIATE` and a savepoint taken with the claim, whose
//!   `RELEASE` fails if a handler ended the transaction itself; MariaDB's
//!   the same savepoint, with `innodb_lock_wait_timeout` and
//!   `max_statement_time` as the bounds.
//! - **A duplicate is an error of the claim's statement**, told by the
//!   database's own code ([`Backend::is_duplicate_claim`]: PostgreSQL's
//!   23505 on the claims' key, SQLite's 1555, MariaDB's 1062), after which
//!   [`Backend::end_failed_claim`] makes the connection clean. Only
//!   PostgreSQL aborts the whole transaction on that error; the others keep
//!   it open, and end it the same way.
//! - **A batch's transaction has an identity another connection can ask
//!   about** (from [`Backend::claim_many`], asked by [`Backend::committed`]), for a
//!   batch whose connection was given up while a handler ran. PostgreSQL
//!   asks `pg_xact_status`; a database that cannot tell answers "committed"
//!   (dead-letter rather than risk acking undone work).
//! - **Expiry is one call** ([`Backend::purge`]), because its protocol is
//!   the database's own: PostgreSQL's generations as partitions, detached
//!   once no snapshot can still see them; elsewhere, deletes by
//!   generation in chunks. What a purge held back by another session
//!   reports is a description ([`Backend::purge_holder`]).
//!
//! A route's connections ([`Connections`](crate::store::connections::Connections),
//! each in use a [`Leased`]) are generic over the database already, with
//! PostgreSQL as the default.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use sqlx::{Pool, Postgres, Transaction};

use crate::error::{Error, HandlerError};
use crate::store::connections::Leased;
use crate::store::purge::{Figures, PurgeReport};
use crate::store::reads::HandlerRow;
pub(crate) use crate::store::transaction::{Claim, Ended};

/// Everything idem's message path and a router's start-up ask of a
/// database (see the module docs). Implemented on sqlx's database types, so
/// that the type a handler's transaction names (`sqlx::Transaction<'_,
/// DB>`) chooses its store.
pub trait Backend: sqlx::Database {
    /// What a router finds out about the server's sessions at start-up,
    /// which decides how its routes begin and commit.
    type Session: Copy + Send + Sync + std::fmt::Debug + 'static;
    /// How a route begins and commits its transactions: built once per
    /// route, by [`Backend::begin_for`].
    type Begin: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// At most this many of a router's transactions run at once (`None`:
    /// as many as its pool allows). A database that runs one writer at a
    /// time says 1: more would only wait for its lock, each in the
    /// database's own busy wait.
    const WRITERS_AT_ONCE: Option<usize> = None;

    /// The database's name in warnings: "PostgreSQL", "SQLite", "MariaDB"
    /// (sqlx's own `NAME` says "MySQL" for the last).
    const SERVER_NAME: &'static str;

    /// The database's value of the `server` label on
    /// [`STARTUP_RETRIES`](crate::metrics::STARTUP_RETRIES) ("postgresql").
    const LABEL: &'static str;

    /// What a [`Backend::register`] that timed out on a lock waited for, in
    /// start-up's warning: "a lock on idem_handlers", or SQLite's write lock.
    const REGISTER_LOCK: &'static str = "a lock on idem_handlers";

    // A router's start-up.

    /// Asks the server what [`Backend::Session`] holds, and warns, if
    /// `warn`, about settings that can lose acked commits.
    fn probe(
        pool: &Pool<Self>,
        warn: bool,
    ) -> impl Future<Output = Result<Self::Session, sqlx::Error>> + Send;

    /// Registers `handlers` (name, retention: `None` keeps claims forever)
    /// and returns the id each claim of a handler stores. Bounded: a lock
    /// held elsewhere fails it rather than hang start-up.
    fn register(
        pool: &Pool<Self>,
        handlers: &[(&str, Option<Duration>)],
    ) -> impl Future<Output = Result<HashMap<String, i32>, sqlx::Error>> + Send;

    /// The sessions holding what a [`Backend::register`] that timed out on
    /// a lock waited for, each described for a warning; empty if none is
    /// found.
    fn register_blockers(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send;

    /// Which database `pool` connects to, as a key equal for every pool
    /// to the same database (the relays of one database share a wake-up).
    fn database(pool: &Pool<Self>) -> String;

    /// Creates or upgrades idem's tables (see [`schema`](crate::schema)).
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), Error>> + Send;

    /// Checks that the schema is applied and current, so that a worker
    /// refuses to start rather than fail every message.
    fn verify_schema(pool: &Pool<Self>) -> impl Future<Output = Result<(), Error>> + Send;

    // A message's transaction.

    /// How a route with `handler_timeout` begins and commits, given what
    /// start-up found. Without a handler timeout its transactions have no
    /// bounds.
    fn begin_for(handler_timeout: Option<Duration>, session: Self::Session) -> Self::Begin;

    /// Begins a transaction on `connection`, and makes `claim` in it if
    /// given: one round trip. A message processed before fails here, with
    /// an error [`Backend::is_duplicate_claim`] tells; then
    /// [`Backend::end_failed_claim`] makes the connection clean.
    fn begin<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Self::Begin,
        claim: Option<Claim<'_>>,
    ) -> impl Future<Output = Result<Transaction<'c, Self>, sqlx::Error>> + Send;

    /// Begins a batch's transaction, whose claim is
    /// [`Backend::claim_many`]. With `lock_wait`, a statement that waits
    /// longer than that for a lock fails, so that batches that would
    /// deadlock give up at once.
    fn begin_batch<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Self::Begin,
        lock_wait: Option<Duration>,
    ) -> impl Future<Output = Result<Transaction<'c, Self>, sqlx::Error>> + Send;

    /// Whether `error`, from [`Backend::begin`], says that the message's
    /// claim was made and committed before: the message was processed.
    fn is_duplicate_claim(error: &sqlx::Error) -> bool;

    /// Ends the transaction a failed claim left behind, which sqlx never
    /// counted as begun.
    fn end_failed_claim(
        connection: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Claims `keys` for the handler with id `handler_id`, in one
    /// statement that never fails on a key claimed before. Returns the keys
    /// this transaction claimed, and the transaction's identity as text,
    /// which [`Backend::committed`] asks about from another connection
    /// (PostgreSQL's is its `xid8`).
    fn claim_many(
        tx: &mut Transaction<'_, Self>,
        handler_id: i32,
        keys: &[String],
    ) -> impl Future<Output = Result<(HashSet<String>, String), sqlx::Error>> + Send;

    /// Takes back the claims this transaction made on `keys`, so that they
    /// commit with the rest as if never made.
    fn unclaim(
        tx: &mut Transaction<'_, Self>,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// What became of transaction `id`, asked on another connection:
    /// `Some(true)` once it committed, `Some(false)` once it aborted, `None`
    /// while it runs.
    fn committed(
        connection: &mut Self::Connection,
        id: &str,
    ) -> impl Future<Output = Result<Option<bool>, sqlx::Error>> + Send;

    /// Whether the claims on `keys` are still `tx`'s own and uncommitted:
    /// asked on the way to a rollback after a handler failed, so that a
    /// handler that committed its claim itself is not taken for one that
    /// never ran.
    fn claims_still_pending(
        tx: &mut Transaction<'_, Self>,
        keys: &[&str],
    ) -> impl Future<Output = bool> + Send;

    /// Commits `tx`, checked (nothing commits if the transaction is no
    /// longer the one that claimed, or if the database had given up on it),
    /// or rolls back what is left. Also says whether the connection ended
    /// in a known, clean state and may be kept. `claimed` are the keys `tx`
    /// claimed: a database that cannot tell from the transaction itself
    /// reads them to tell a claim the handler committed (`ClaimLost`) from
    /// one the database rolled back (`Aborted`).
    fn finish(
        tx: Transaction<'_, Self>,
        begin: &Self::Begin,
        claimed: &[&str],
    ) -> impl Future<Output = (Ended, bool)> + Send;

    /// Rolls back; says whether the connection is known to be clean.
    fn rollback(tx: Transaction<'_, Self>) -> impl Future<Output = bool> + Send;

    // Expiry (see `retention::expiry`).

    /// Runs the expiry once (see [`purge`](crate::store::purge::purge)):
    /// safe from any number of processes at once, all but one skip.
    fn purge(pool: &Pool<Self>) -> impl Future<Output = Result<PurgeReport, Error>> + Send;

    /// The session holding the purge back, if it sends nothing or has been
    /// in one state for longer than `slack` (one that is working is not
    /// named), described for a warning.
    fn purge_holder(
        pool: &Pool<Self>,
        slack: Duration,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    // What operators read (see `status`).

    /// Every registered handler with its claims: name, retention (seconds),
    /// claims, the oldest claim's time and age (seconds).
    fn handlers(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<HandlerRow>, sqlx::Error>> + Send;

    /// The committed claim on `key`, if any: when it was made (Unix
    /// seconds), its age (seconds), its generation, and whether a result
    /// is stored with it.
    fn claim_row(
        pool: &Pool<Self>,
        key: &str,
    ) -> impl Future<Output = Result<Option<(f64, f64, i32, bool)>, sqlx::Error>> + Send;

    /// The names of the registered handlers, sorted.
    fn handler_names(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send;

    /// When `name` was last registered, as the database writes the time
    /// (`None` if it never was).
    fn registered_at(
        pool: &Pool<Self>,
        name: &str,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    /// Where expiry stands, in one cheap read (for the metrics and the
    /// warnings of a purge held back): see `retention::status`.
    fn expiry_figures(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Figures, sqlx::Error>> + Send;

    // Stored results (see `handler::results`).

    /// What the committed claim on `key` stored: `None` if there is no
    /// claim, `Some(None)` for a claim without a result.
    fn read_result(
        connection: &mut Self::Connection,
        key: &str,
    ) -> impl Future<Output = Result<Option<Option<Bytes>>, sqlx::Error>> + Send;

    /// Stores `result` with the claim on `key`, which `tx` made.
    fn store_result(
        tx: &mut Transaction<'_, Self>,
        key: &str,
        result: &Bytes,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Stores the results of a batch's messages with their claims, in one
    /// statement (none for no keys).
    fn store_results(
        tx: &mut Transaction<'_, Self>,
        keys: &[&str],
        results: &[&[u8]],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// PostgreSQL: the other modules of `store/` say how, each at its item.
impl Backend for Postgres {
    type Session = crate::store::transaction::Session;
    type Begin = crate::store::transaction::Begin;

    const SERVER_NAME: &'static str = "PostgreSQL";
    const LABEL: &'static str = "postgresql";

    async fn probe(pool: &Pool<Self>, warn: bool) -> Result<Self::Session, sqlx::Error> {
        crate::store::transaction::Session::probe(pool, warn).await
    }

    async fn register(
        pool: &Pool<Self>,
        handlers: &[(&str, Option<Duration>)],
    ) -> Result<HashMap<String, i32>, sqlx::Error> {
        crate::store::claim::register(pool, handlers).await
    }

    async fn register_blockers(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        crate::store::claim::handlers_lock_holders(pool).await
    }

    fn database(pool: &Pool<Self>) -> String {
        let options = pool.connect_options();
        let database = options
            .get_database()
            .unwrap_or_else(|| options.get_username());
        match options.get_socket() {
            Some(socket) => format!("{}|{}|{database}", socket.display(), options.get_port()),
            None => format!("{}|{}|{database}", options.get_host(), options.get_port()),
        }
    }

    async fn migrate(pool: &Pool<Self>) -> Result<(), Error> {
        crate::store::migrations::migrate(pool, None).await
    }

    async fn verify_schema(pool: &Pool<Self>) -> Result<(), Error> {
        crate::store::migrations::verify(pool).await
    }

    fn begin_for(handler_timeout: Option<Duration>, session: Self::Session) -> Self::Begin {
        crate::store::transaction::Begin::new(handler_timeout, session)
    }

    async fn begin<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Self::Begin,
        claim: Option<Claim<'_>>,
    ) -> Result<Transaction<'c, Self>, sqlx::Error> {
        crate::store::transaction::begin(connection, begin, claim).await
    }

    async fn begin_batch<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Self::Begin,
        lock_wait: Option<Duration>,
    ) -> Result<Transaction<'c, Self>, sqlx::Error> {
        crate::store::transaction::begin_batch(connection, begin, lock_wait).await
    }

    fn is_duplicate_claim(error: &sqlx::Error) -> bool {
        crate::error::class::is_duplicate_claim(error)
    }

    async fn end_failed_claim(connection: &mut Self::Connection) -> Result<(), sqlx::Error> {
        crate::store::transaction::end_failed_claim(connection).await
    }

    async fn claim_many(
        tx: &mut Transaction<'_, Self>,
        handler_id: i32,
        keys: &[String],
    ) -> Result<(HashSet<String>, String), sqlx::Error> {
        crate::store::claim::claim_many(tx, handler_id, keys).await
    }

    async fn unclaim(tx: &mut Transaction<'_, Self>, keys: &[&str]) -> Result<(), sqlx::Error> {
        crate::store::claim::unclaim(tx, keys).await
    }

    async fn committed(
        connection: &mut Self::Connection,
        id: &str,
    ) -> Result<Option<bool>, sqlx::Error> {
        crate::store::claim::committed(connection, id).await
    }

    async fn claims_still_pending(tx: &mut Transaction<'_, Self>, _keys: &[&str]) -> bool {
        // The transaction id recorded with the claim tells, without the keys.
        crate::store::transaction::claims_still_pending(tx).await
    }

    async fn finish(
        tx: Transaction<'_, Self>,
        begin: &Self::Begin,
        _claimed: &[&str],
    ) -> (Ended, bool) {
        // The transaction id recorded with the claim tells, without the keys.
        crate::store::transaction::finish(tx, begin).await
    }

    async fn rollback(tx: Transaction<'_, Self>) -> bool {
        crate::store::transaction::rollback(tx).await
    }

    async fn purge(pool: &Pool<Self>) -> Result<PurgeReport, Error> {
        crate::store::purge::purge(pool).await
    }

    async fn purge_holder(
        pool: &Pool<Self>,
        slack: Duration,
    ) -> Result<Option<String>, sqlx::Error> {
        crate::store::purge::idle_lock_holder(pool, slack).await
    }

    async fn expiry_figures(pool: &Pool<Self>) -> Result<Figures, sqlx::Error> {
        crate::store::purge::figures(pool).await
    }

    async fn handlers(pool: &Pool<Self>) -> Result<Vec<HandlerRow>, sqlx::Error> {
        crate::store::reads::handlers(pool).await
    }

    async fn claim_row(
        pool: &Pool<Self>,
        key: &str,
    ) -> Result<Option<(f64, f64, i32, bool)>, sqlx::Error> {
        crate::store::reads::claim(pool, key).await
    }

    async fn handler_names(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        crate::store::reads::handler_names(pool).await
    }

    async fn registered_at(pool: &Pool<Self>, name: &str) -> Result<Option<String>, sqlx::Error> {
        crate::store::reads::registered_at(pool, name).await
    }

    async fn read_result(
        connection: &mut Self::Connection,
        key: &str,
    ) -> Result<Option<Option<Bytes>>, sqlx::Error> {
        crate::store::results::read(connection, key).await
    }

    async fn store_result(
        tx: &mut Transaction<'_, Self>,
        key: &str,
        result: &Bytes,
    ) -> Result<(), HandlerError> {
        crate::store::results::store(tx, key, result).await
    }

    async fn store_results(
        tx: &mut Transaction<'_, Self>,
        keys: &[&str],
        results: &[&[u8]],
    ) -> Result<(), HandlerError> {
        crate::store::results::store_many(tx, keys, results).await
    }
}
