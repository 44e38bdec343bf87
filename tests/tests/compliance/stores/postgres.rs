//! The suite on PostgreSQL: a server of the test's own.

use idem_runtime::Router;
use sqlx::PgPool;

use crate::bed::{Bed, EFFECTS};

/// The pool a router runs on.
pub type Pool = PgPool;

/// The transaction a handler takes.
pub type Tx<'c> = sqlx::PgTransaction<'c>;

/// A statement that runs until the server or the runtime stops it.
pub const RUNAWAY: &str = "SELECT pg_sleep(3600)";

/// PostgreSQL, migrated, with the business table.
pub async fn bed(prefix: &str) -> Bed<PgPool> {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    idem_runtime::schema::migrate(&pool)
        .await
        .expect("idem migrations apply");
    sqlx::raw_sql(EFFECTS)
        .execute(&pool)
        .await
        .expect("the business table is made");
    let second_pool = env.pool().await;
    let nats = env.nats().await;
    Bed::new(Box::new(env), nats, pool, second_pool, prefix).await
}

/// A router on PostgreSQL.
pub fn router_with_state<S: Send + Sync + 'static>(state: S) -> Router<S> {
    Router::with_state(state)
}

/// Whether a session waits for a lock another holds: a racing claim waits
/// on the first attempt's transaction, which holds the key.
pub async fn someone_waits_for_a_lock(pool: &PgPool) -> Option<bool> {
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
        .fetch_one(pool)
        .await
        .expect("pg_locks reads");
    Some(waiting > 0)
}

/// The suite's SQL as PostgreSQL takes it: as written.
pub fn sql(text: &'static str) -> &'static str {
    text
}
