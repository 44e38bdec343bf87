//! The suite on SQLite: a database file of the test's own, in WAL mode
//! with `synchronous = FULL`, as the guide asks.

use idem_runtime::Router;
use idem_tests::sqlite;
use idem_tests::{NatsServer, init_tracing};
use sqlx::SqlitePool;

use crate::bed::{Bed, EFFECTS};

/// The pool a router runs on.
pub type Pool = SqlitePool;

/// The transaction a handler takes.
pub type Tx<'c> = sqlx::Transaction<'c, sqlx::Sqlite>;

/// A statement that runs until something interrupts it (SQLite has no
/// sleep): an endless recursive count.
pub const RUNAWAY: &str =
    "WITH RECURSIVE forever(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM forever)
                           SELECT max(n) FROM forever";

/// A fresh file, migrated, with the business table.
pub async fn bed(prefix: &str) -> Bed<SqlitePool> {
    init_tracing();
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("idem.db");
    let pool = sqlite::pool(&path).await;
    idem_runtime::schema::migrate(&pool)
        .await
        .expect("idem migrations apply");
    sqlx::raw_sql(EFFECTS)
        .execute(&pool)
        .await
        .expect("the business table is made");
    let second_pool = sqlite::pool(&path).await;
    let nats_server = NatsServer::start().await;
    let nats = nats_server.client().await;
    Bed::new(
        Box::new((nats_server, dir)),
        nats,
        pool,
        second_pool,
        prefix,
    )
    .await
}

/// A router on SQLite.
pub fn router_with_state<S: Send + Sync + 'static>(state: S) -> Router<S, sqlx::Sqlite> {
    Router::sqlite_with_state(state)
}

/// Not observable: a writer waits for the write lock inside SQLite's busy
/// handler, which leaves no trace another connection can read.
pub async fn someone_waits_for_a_lock(_pool: &SqlitePool) -> Option<bool> {
    None
}

/// The suite's SQL as SQLite takes it: as written (`$n` placeholders).
pub fn sql(text: &'static str) -> &'static str {
    text
}
