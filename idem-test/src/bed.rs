//! The test bed: servers of the test's own, a database with idem's schema,
//! and clients on both.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::Router;
use sqlx::PgPool;

use crate::harness::{NatsServer, Postgres};
use crate::run::Run;

/// A nats-server with JetStream and a PostgreSQL database for one test,
/// with idem's schema installed. Everything it started stops when it is
/// dropped, also when the test panics.
///
/// By default both servers are processes of the test's own, on loopback
/// with random ports and temp dirs (`sync_interval: always` for
/// nats-server, so that a crash loses no acknowledged message). With
/// `NATS_URL` or `DATABASE_URL` set, that server is used instead: each
/// test still gets a database of its own (created and dropped), but tests
/// share the NATS server, so their streams need names of their own
/// ([`Bed::unique_name`]), and the faults that restart a server cannot run.
///
/// Start it with [`#[idem_test::test]`](crate::test), or by hand:
///
/// ```no_run
/// # async fn demo() {
/// let bed = idem_test::Bed::start().await;
/// sqlx::raw_sql("CREATE TABLE ledger (transfer_id text, amount bigint)")
///     .execute(&bed.pool())
///     .await
///     .unwrap();
/// # }
/// ```
pub struct Bed {
    // Clients first: they close before the servers stop.
    pool: PgPool,
    nats: async_nats::Client,
    nats_url: String,
    database_url: String,
    servers: tokio::sync::Mutex<Servers>,
}

pub(crate) struct Servers {
    pub(crate) nats: NatsServer,
    pub(crate) postgres: Postgres,
}

impl Bed {
    /// Starts both servers (or connects to `NATS_URL` / `DATABASE_URL`),
    /// installs idem's schema ([`idem_runtime::schema::migrate`]), and
    /// installs a `tracing` subscriber for the test's output (filtered by
    /// `RUST_LOG`, default `warn`) unless one is installed.
    ///
    /// # Panics
    ///
    /// If a server cannot be started or reached. The message says what to
    /// install, or which variable to set, and shows the end of the
    /// server's log.
    pub async fn start() -> Bed {
        crate::harness::init_tracing();
        let (nats, postgres) = tokio::join!(NatsServer::start(), Postgres::start());
        let pool = postgres.pool().await;
        idem_runtime::schema::migrate(&pool)
            .await
            .unwrap_or_else(|e| panic!("idem-test: cannot install idem's schema: {e}"));
        let client = nats.client().await;
        Bed {
            pool,
            nats: client,
            nats_url: nats.url().to_owned(),
            database_url: postgres.url().to_owned(),
            servers: tokio::sync::Mutex::new(Servers { nats, postgres }),
        }
    }

    /// Runs `setup` on the test's database: your migrations, reference
    /// data. What `#[idem_test::test(setup = ...)]` calls first.
    ///
    /// # Panics
    ///
    /// If `setup` returns an error; the message shows it.
    ///
    /// ```no_run
    /// async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    ///     sqlx::raw_sql("CREATE TABLE ledger (transfer_id text, amount bigint)")
    ///         .execute(pool)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// # async fn demo() {
    /// let bed = idem_test::Bed::start().await;
    /// bed.setup(migrate).await;
    /// # }
    /// ```
    pub async fn setup<F, E>(&self, setup: F)
    where
        F: AsyncFnOnce(&PgPool) -> Result<(), E>,
        E: std::fmt::Debug,
    {
        if let Err(error) = setup(&self.pool).await {
            panic!("idem-test: the test's setup failed: {error:?}");
        }
    }

    /// A pool on the test's database (up to 10 connections), straight to
    /// the server: for your set-up and your own reads. The routers of a
    /// [`Run`] get pools of their own.
    pub fn pool(&self) -> PgPool {
        self.pool.clone()
    }

    /// A NATS client of the bed's.
    pub fn nats(&self) -> async_nats::Client {
        self.nats.clone()
    }

    /// A JetStream context on [`Bed::nats`].
    pub fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.nats.clone())
    }

    /// The NATS server's URL.
    pub fn nats_url(&self) -> &str {
        &self.nats_url
    }

    /// The test database's URL.
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// `prefix` made unique, e.g. `LEDGER_3_5f2c9a1b`: a stream name no
    /// other test uses, for tests that share a `NATS_URL` server.
    ///
    /// ```no_run
    /// # async fn demo(bed: idem_test::Bed) {
    /// let stream = bed.unique_name("LEDGER");
    /// assert!(stream.starts_with("LEDGER_"));
    /// # }
    /// ```
    pub fn unique_name(&self, prefix: &str) -> String {
        crate::harness::unique_name(prefix)
    }

    /// A run of `router`, the one your service builds: add what to
    /// publish and which faults to inject, then
    /// [`until_settled`](Run::until_settled).
    ///
    /// ```no_run
    /// # use idem_runtime::{Route, Router, idempotent};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Credit { id: u32 }
    /// # #[idempotent(name = "credit.v1", key = c.id)]
    /// # async fn credit(tx: &mut sqlx::PgTransaction<'_>, c: Credit) -> Result<(), sqlx::Error> { Ok(()) }
    /// # async fn demo(bed: idem_test::Bed) {
    /// use idem_test::Faults;
    ///
    /// let router = Router::new().route(Route::new("LEDGER", "credit"), credit);
    /// bed.run(router)
    ///     .publish_json("ledger.credit", (0..100).map(|id| Credit { id }))
    ///     .with_faults(Faults::all())
    ///     .until_settled()
    ///     .await
    ///     .assert_claims("credit.v1", 100);
    /// # }
    /// ```
    pub fn run<S: Send + Sync + 'static>(&self, router: Router<S>) -> Run<'_> {
        Run::new(self).router(router)
    }

    /// A transaction on the test's database, for calling a handler's body
    /// without servers (`my_handler::run(&mut tx, ...)`, see
    /// [`unit`](crate::unit)). Dropped, it rolls back.
    ///
    /// ```no_run
    /// # async fn demo(bed: idem_test::Bed) {
    /// let mut tx = bed.transaction().await;
    /// sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    /// # }
    /// ```
    pub async fn transaction(&self) -> sqlx::PgTransaction<'static> {
        self.pool
            .begin()
            .await
            .unwrap_or_else(|e| panic!("idem-test: cannot begin a transaction: {e}"))
    }

    /// Runs `f` with the servers, for a fault that restarts one.
    pub(crate) async fn with_servers<T>(&self, f: impl AsyncFnOnce(&mut Servers) -> T) -> T {
        let mut servers = self.servers.lock().await;
        f(&mut servers).await
    }

    /// A pool for a router: through `url` (the proxy), sized for a
    /// service's routes, with a short acquire timeout so that a restart
    /// shows as errors rather than a stall.
    pub(crate) fn router_pool(url: &str) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(12)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy(url)
            .unwrap_or_else(|e| panic!("idem-test: bad database URL {url}: {e}"))
    }
}

/// Runs `future` to completion on a thread and runtime of its own: what the
/// synchronous assertions use, so they work under any runtime flavour.
pub(crate) fn block_on<F>(future: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("idem-test: a runtime for an assertion")
            .block_on(future)
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
