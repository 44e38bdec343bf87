//! SQLite's store (feature `sqlite`): [`Backend`] for [`sqlx::Sqlite`].
//!
//! - **The claim** is `BEGIN IMMEDIATE; INSERT ...; SAVEPOINT idem_claim`
//!   in one call, so that a racing redelivery waits on the write lock and
//!   then finds the claim (`transaction.rs`).
//! - **The check before COMMIT** is the savepoint's RELEASE, which fails
//!   once a handler has ended the transaction itself (`transaction.rs`).
//! - **The bound** on a transaction is a progress handler that interrupts
//!   its statements once it has run as long as one can: SQLite has no
//!   server to end them, and a statement left running would keep the
//!   write lock (`transaction.rs`).
//! - **Expiry** deletes claims older than their handler's retention, in
//!   chunks (`tables.rs`): there are no generations.
//! - **What operators read** besides the claims: its durability settings,
//!   whether its write lock can be taken (`settings.rs`; start-up warns by
//!   the same rule `idem status` shows).
//! - **Not here yet**: the outbox and its relay (a router on SQLite runs
//!   none), and naming who holds the write lock (SQLite does not say).
//!
//! One database file, on a local disk, shared by the processes of one
//! machine: SQLite's locks do not hold over a network filesystem, and a
//! router refuses a file on one (`filesystem.rs`). The
//! guide's SQLite chapter says what differs from PostgreSQL, and why.

mod filesystem;
mod outbox;
mod settings;
mod tables;
mod transaction;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use sqlx::{Pool, Sqlite, Transaction};

use crate::error::{Error, HandlerError};
use crate::store::backend::{Backend, Claim, Ended};
use crate::store::connections::Leased;
use crate::store::purge::{Figures, PurgeReport};
use crate::store::reads::HandlerRow;

pub(crate) use filesystem::Filesystem;
pub use settings::WriteLock;
pub(crate) use settings::{Settings, write_lock};
pub(crate) use tables::{router_settings, schema_version};
pub use transaction::{Begin, Session};

impl Backend for Sqlite {
    type Session = Session;
    type Begin = Begin;

    // One writer at a time: transactions waiting on each other in
    // SQLite's busy handler (which sleeps, up to 100 ms a time) ran at
    // 0.6x a consumer that writes one message at a time.
    const WRITERS_AT_ONCE: Option<usize> = Some(1);

    const SERVER_NAME: &'static str = "SQLite";
    const LABEL: &'static str = "sqlite";
    const REGISTER_LOCK: &'static str = "SQLite's write lock on the database file";

    async fn probe(pool: &Pool<Self>, warn: bool) -> Result<Session, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let settings = Settings::read(&mut connection).await?;
        if let Some(refusal) = settings.refusal() {
            return Err(sqlx::Error::Configuration(refusal.into()));
        }
        if warn {
            for warning in settings.warnings("this router's") {
                tracing::warn!(
                    journal_mode = %settings.journal_mode,
                    synchronous = %settings.synchronous_name(),
                    "{warning}"
                );
            }
        }
        Ok(Session)
    }

    async fn register(
        pool: &Pool<Self>,
        handlers: &[(&str, Option<Duration>)],
    ) -> Result<HashMap<String, i32>, sqlx::Error> {
        tables::register(pool, handlers).await
    }

    async fn register_blockers(_pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        // SQLite does not say which connection holds its lock.
        Ok(Vec::new())
    }

    fn database(pool: &Pool<Self>) -> String {
        pool.connect_options().get_filename().display().to_string()
    }

    async fn migrate(pool: &Pool<Self>) -> Result<(), Error> {
        tables::migrate(pool).await
    }

    async fn verify_schema(pool: &Pool<Self>) -> Result<(), Error> {
        tables::verify(pool).await
    }

    fn begin_for(handler_timeout: Option<Duration>, _session: Session) -> Begin {
        Begin {
            at_most: handler_timeout.map(crate::store::transaction::longest),
        }
    }

    async fn begin<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Begin,
        claim: Option<Claim<'_>>,
    ) -> Result<Transaction<'c, Self>, sqlx::Error> {
        transaction::begin(connection, begin, claim).await
    }

    async fn begin_batch<'c>(
        connection: &'c mut Leased<'_, Self>,
        begin: &Begin,
        _lock_wait: Option<Duration>,
    ) -> Result<Transaction<'c, Self>, sqlx::Error> {
        // One writer at a time: batches cannot deadlock each other.
        transaction::begin_batch(connection, begin).await
    }

    fn is_duplicate_claim(error: &sqlx::Error) -> bool {
        // SQLITE_CONSTRAINT_PRIMARYKEY on the claims' key.
        matches!(error, sqlx::Error::Database(db)
            if db.code().as_deref() == Some("1555") && db.message().contains("idem_claims.key"))
    }

    async fn end_failed_claim(connection: &mut Self::Connection) -> Result<(), sqlx::Error> {
        transaction::end_failed_claim(connection).await
    }

    async fn claim_many(
        tx: &mut Transaction<'_, Self>,
        handler_id: i32,
        keys: &[String],
    ) -> Result<(HashSet<String>, String), sqlx::Error> {
        transaction::claim_many(tx, handler_id, keys).await
    }

    async fn unclaim(tx: &mut Transaction<'_, Self>, keys: &[&str]) -> Result<(), sqlx::Error> {
        transaction::unclaim(tx, keys).await
    }

    async fn committed(
        connection: &mut Self::Connection,
        id: &str,
    ) -> Result<Option<bool>, sqlx::Error> {
        transaction::committed(connection, id).await
    }

    async fn claims_still_pending(tx: &mut Transaction<'_, Self>, keys: &[&str]) -> bool {
        transaction::claims_still_pending(tx, keys).await
    }

    async fn finish(tx: Transaction<'_, Self>, _begin: &Begin, _claimed: &[&str]) -> (Ended, bool) {
        // A transaction SQLite rolled back by itself, whose handler swallowed
        // the error and wrote on, committed those writes one by one: the
        // message is dead-lettered as `ClaimLost` either way (a retry would
        // apply them again), so the keys need not be read.
        transaction::finish(tx).await
    }

    async fn rollback(tx: Transaction<'_, Self>) -> bool {
        transaction::rollback(tx).await
    }

    async fn purge(pool: &Pool<Self>) -> Result<PurgeReport, Error> {
        tables::purge(pool).await
    }

    async fn purge_holder(
        _pool: &Pool<Self>,
        _slack: Duration,
    ) -> Result<Option<String>, sqlx::Error> {
        Ok(None)
    }

    async fn expiry_figures(pool: &Pool<Self>) -> Result<Figures, sqlx::Error> {
        tables::figures(pool).await
    }

    async fn handlers(pool: &Pool<Self>) -> Result<Vec<HandlerRow>, sqlx::Error> {
        tables::handlers(pool).await
    }

    async fn claim_row(
        pool: &Pool<Self>,
        key: &str,
    ) -> Result<Option<(f64, f64, i32, bool)>, sqlx::Error> {
        tables::claim(pool, key).await
    }

    async fn handler_names(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        tables::handler_names(pool).await
    }

    async fn registered_at(pool: &Pool<Self>, name: &str) -> Result<Option<String>, sqlx::Error> {
        tables::registered_at(pool, name).await
    }

    async fn read_result(
        connection: &mut Self::Connection,
        key: &str,
    ) -> Result<Option<Option<Bytes>>, sqlx::Error> {
        tables::read_result(connection, key).await
    }

    async fn store_result(
        tx: &mut Transaction<'_, Self>,
        key: &str,
        result: &Bytes,
    ) -> Result<(), HandlerError> {
        tables::store_result(tx, key, result).await
    }

    async fn store_results(
        tx: &mut Transaction<'_, Self>,
        keys: &[&str],
        results: &[&[u8]],
    ) -> Result<(), HandlerError> {
        // In process: one statement per result costs no round trip.
        for (key, result) in keys.iter().zip(results) {
            tables::store_result(tx, key, result).await?;
        }
        Ok(())
    }
}
