//! The servers failing under a running router, against real servers: what the
//! database's or NATS's fault costs must be a retry or a wait, never a
//! delivery or a message.
//!
//! - `postgres`: restarts, outages and a missing dedup table.
//! - `connections`: dead kept connections and lost prepared statements.
//! - `locks`: statements stuck on a lock.
//! - `pool`: a pool smaller than the routes' concurrency.
//! - `nats`: the route's consumer deleted under it.
//! - `pull_requests`: the limits a consumer puts on pull requests.

mod connections;
mod locks;
mod nats;
mod pool;
mod postgres;
mod pull_requests;

/// The highest delivery count among `handler`'s applied effects: 1 when
/// every message was applied on its first delivery. A message NAKed while
/// held (`Interrupted`, at shutdown) uses up a delivery without counting
/// as failed, so `Stats::failed` alone does not show it.
async fn latest_delivery(pool: &sqlx::PgPool, handler: &str) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(delivered), 0) FROM effects WHERE handler = $1")
        .bind(handler)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A pool of its own for the worker, named so the test can find its
/// connections in `pg_stat_activity`.
async fn worker_pool(database_url: &str) -> sqlx::PgPool {
    let options: sqlx::postgres::PgConnectOptions = database_url.parse().unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.application_name("idem-worker"))
        .await
        .unwrap()
}
