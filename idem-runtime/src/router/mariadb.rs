//! Constructing and running a router on MariaDB (feature `mariadb`).

use std::future::Future;

use sqlx::{MySql, MySqlPool};

use super::Router;
use super::run::Beside;
use crate::error::Error;
use crate::tasks;

impl Router<(), MySql> {
    /// A router on MariaDB with no routes, whose handlers take no state.
    /// Its handlers take `tx: &mut sqlx::Transaction<'_, sqlx::MySql>`.
    ///
    /// ```no_run
    /// use idem_runtime::{Route, Router, idempotent};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Credit {
    ///     account: String,
    ///     amount: i64,
    /// }
    ///
    /// #[idempotent]
    /// async fn credit(
    ///     tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    ///     cmd: Credit,
    /// ) -> Result<(), sqlx::Error> {
    ///     sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
    ///         .bind(cmd.amount)
    ///         .bind(cmd.account)
    ///         .execute(&mut **tx)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// async fn run(nats: async_nats::Client, pool: sqlx::MySqlPool) -> Result<(), idem_runtime::Error> {
    ///     idem_runtime::schema::migrate(&pool).await?;
    ///     Router::mariadb()
    ///         .route(Route::new("LEDGER", "credit"), credit)
    ///         .run(nats, pool)
    ///         .await
    /// }
    /// ```
    pub fn mariadb() -> Self {
        Self::mariadb_with_state(())
    }
}

impl<S: Send + Sync + 'static> Router<S, MySql> {
    /// A router on MariaDB whose handlers take parts of `state` (see
    /// [`Router::with_state`]).
    pub fn mariadb_with_state(state: S) -> Self {
        Self::empty(state)
    }

    /// Runs until Ctrl-C or SIGTERM, then shuts down gracefully (see
    /// [`Router::run_until`]).
    pub async fn run(self, nats: async_nats::Client, pool: MySqlPool) -> Result<(), Error> {
        // Aborted when `run` returns, or when its future is dropped.
        let _listener = tasks::Owned(tasks::fire_on_os_signal(self.trigger.clone()));
        self.run_until(nats, pool, std::future::pending()).await
    }

    /// Runs until `shutdown` resolves, as [`Router::run_until`] does on
    /// PostgreSQL, with the router's outbox [relay](Router::relay) if it has one.
    ///
    /// `pool` is MariaDB 10.11 or newer, its tables InnoDB; start-up
    /// warns about `innodb_flush_log_at_trx_commit` other than 1, and
    /// refuses MySQL.
    pub async fn run_until(
        mut self,
        nats: async_nats::Client,
        pool: MySqlPool,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let beside = Beside::outbox(self.relay.take(), &nats, &pool);
        self.run_with(nats, pool, shutdown, beside).await
    }
}
