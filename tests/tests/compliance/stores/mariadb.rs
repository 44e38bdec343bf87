//! The suite on MariaDB: a server of the test's own (InnoDB, its
//! durability settings at their defaults), reached through a unix socket.

use idem_runtime::Router;
use idem_test::harness::Mariadb;
use idem_tests::{NatsServer, init_tracing};
use sqlx::{AssertSqlSafe, MySqlPool};

use crate::bed::{Bed, EFFECTS};

/// The pool a router runs on.
pub type Pool = MySqlPool;

/// The transaction a handler takes.
pub type Tx<'c> = sqlx::Transaction<'c, sqlx::MySql>;

/// A statement that runs until the server or the runtime stops it.
pub const RUNAWAY: &str = "SELECT SLEEP(3600)";

/// The suite's SQL as MariaDB takes it: each `$n` placeholder (they come
/// in order, each once) becomes `?`.
pub fn sql(text: &'static str) -> AssertSqlSafe<String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    AssertSqlSafe(out)
}

/// MariaDB, migrated, with the business table.
pub async fn bed(prefix: &str) -> Bed<MySqlPool> {
    init_tracing();
    let (mariadb, nats_server) = tokio::join!(Mariadb::start(), NatsServer::start());
    let pool = mariadb.pool().await;
    idem_runtime::schema::migrate(&pool)
        .await
        .expect("idem migrations apply");
    sqlx::raw_sql(EFFECTS)
        .execute(&pool)
        .await
        .expect("the business table is made");
    let second_pool = mariadb.pool().await;
    let nats = nats_server.client().await;
    Bed::new(
        Box::new((nats_server, mariadb)),
        nats,
        pool,
        second_pool,
        prefix,
    )
    .await
}

/// A router on MariaDB.
pub fn router_with_state<S: Send + Sync + 'static>(state: S) -> Router<S, sqlx::MySql> {
    Router::mariadb_with_state(state)
}

/// Whether a session waits for a lock another holds: a racing claim waits
/// on the first attempt's transaction, which holds the key.
pub async fn someone_waits_for_a_lock(pool: &MySqlPool) -> Option<bool> {
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM information_schema.innodb_lock_waits")
            .fetch_one(pool)
            .await
            .expect("innodb_lock_waits reads");
    Some(waiting > 0)
}
