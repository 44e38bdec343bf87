//! MariaDB's store (feature `mariadb`): [`Backend`] for [`sqlx::MySql`],
//! on MariaDB 10.11 or newer with InnoDB.
//!
//! - **The claim** is the transaction's first write, an INSERT on the
//!   claims' primary key: a racing redelivery waits on that key's lock,
//!   then finds the claim (`transaction.rs`).
//! - **The check before COMMIT** is a savepoint's RELEASE, in the same
//!   round trip as COMMIT; it fails once a handler has ended the transaction
//!   itself (`transaction.rs`).
//! - **The bounds** on a transaction are session settings:
//!   `max_statement_time`, which the server enforces on every statement,
//!   and `innodb_lock_wait_timeout`.
//! - **Expiry** deletes claims older than their handler's retention, in
//!   chunks (`tables.rs`): there are no generations.
//! - **Not here yet**: the outbox and its relay (a router on MariaDB runs
//!   none).
//!
//! MySQL is refused at start-up: the batch claim needs MariaDB's `INSERT
//! ... RETURNING`, and the bounds its `max_statement_time`. The guide's
//! MariaDB chapter says what differs from PostgreSQL, and why.

mod outbox;
mod tables;
mod transaction;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use sqlx::{MySql, Pool, Transaction};

use crate::error::{Error, HandlerError};
use crate::store::backend::{Backend, Claim, Ended};
use crate::store::connections::Leased;
use crate::store::purge::{Figures, PurgeReport};
use crate::store::reads::HandlerRow;

pub(crate) use tables::schema_version;
pub use transaction::{Begin, Session};

/// The server's settings a router reads at start-up (and `idem status`).
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) version: String,
    pub(crate) flush_log_at_trx_commit: i64,
    pub(crate) log_bin: i64,
    pub(crate) sync_binlog: i64,
}

impl Settings {
    pub(crate) async fn read(pool: &Pool<MySql>) -> Result<Settings, sqlx::Error> {
        let (version, flush_log_at_trx_commit, log_bin, sync_binlog) = sqlx::query_as(
            "SELECT VERSION(), CAST(@@innodb_flush_log_at_trx_commit AS SIGNED),
                    CAST(@@log_bin AS SIGNED), CAST(@@sync_binlog AS SIGNED)",
        )
        .fetch_one(pool)
        .await?;
        Ok(Settings {
            version,
            flush_log_at_trx_commit,
            log_bin,
            sync_binlog,
        })
    }

    /// Why a router must not run on this server, if it must not.
    fn refusal(&self) -> Option<String> {
        (!self.version.contains("MariaDB")).then(|| {
            format!(
                "the server is {}, not MariaDB: idem's MariaDB store needs MariaDB 10.11 or \
                 newer (INSERT ... RETURNING for a batch's claims, max_statement_time for the \
                 bounds); MySQL is not supported",
                self.version
            )
        })
    }

    /// Settings that can lose commits the server acknowledged, and so let
    /// an acked message's effect vanish.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.flush_log_at_trx_commit != 1 {
            warnings.push(format!(
                "innodb_flush_log_at_trx_commit is {}, not 1: a server crash can lose commits it \
                 acknowledged, and messages acked after them are then never applied",
                self.flush_log_at_trx_commit
            ));
        }
        if self.log_bin != 0 && self.sync_binlog != 1 {
            warnings.push(format!(
                "the binary log is on and sync_binlog is {}, not 1: after a server crash a \
                 replica can lack commits the primary kept",
                self.sync_binlog
            ));
        }
        warnings
    }
}

impl Backend for MySql {
    type Session = Session;
    type Begin = Begin;

    const SERVER_NAME: &'static str = "MariaDB";
    const LABEL: &'static str = "mariadb";

    async fn probe(pool: &Pool<Self>, warn: bool) -> Result<Session, sqlx::Error> {
        let settings = Settings::read(pool).await?;
        if let Some(refusal) = settings.refusal() {
            return Err(sqlx::Error::Configuration(refusal.into()));
        }
        if warn {
            for warning in settings.warnings() {
                tracing::warn!(version = %settings.version, "{warning}");
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

    async fn register_blockers(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        tables::long_transactions(pool).await
    }

    fn database(pool: &Pool<Self>) -> String {
        let options = pool.connect_options();
        let database = options.get_database().unwrap_or_default();
        match options.get_socket() {
            Some(socket) => format!("{}|{database}", socket.display()),
            None => format!("{}|{}|{database}", options.get_host(), options.get_port()),
        }
    }

    async fn migrate(pool: &Pool<Self>) -> Result<(), Error> {
        tables::migrate(pool).await
    }

    async fn verify_schema(pool: &Pool<Self>) -> Result<(), Error> {
        tables::verify(pool).await
    }

    fn begin_for(handler_timeout: Option<Duration>, _session: Session) -> Begin {
        Begin { handler_timeout }
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
        lock_wait: Option<Duration>,
    ) -> Result<Transaction<'c, Self>, sqlx::Error> {
        transaction::begin_batch(connection, begin, lock_wait).await
    }

    fn is_duplicate_claim(error: &sqlx::Error) -> bool {
        // ER_DUP_ENTRY, from the one INSERT `begin` runs: the claim's.
        crate::error::class::mariadb_number(error) == Some(1062)
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

    async fn finish(tx: Transaction<'_, Self>, _begin: &Begin, claimed: &[&str]) -> (Ended, bool) {
        transaction::finish(tx, claimed).await
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
        // Chunked deletes wait for no session's snapshot.
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
        for (key, result) in keys.iter().zip(results) {
            tables::store_result(tx, key, result).await?;
        }
        Ok(())
    }
}
