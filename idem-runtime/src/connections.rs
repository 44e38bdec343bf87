//! Connections a route keeps between messages.
//!
//! sqlx's pool checks a connection's liveness on every acquire by default
//! (`test_before_acquire`): one extra round trip per message. A route hands a
//! connection that just committed cleanly straight to its next message
//! instead, for as long as it was used in the last few seconds. A connection
//! that failed in any way goes back to the pool, which checks it before
//! anyone uses it again; a reused one that turns out to be dead fails its
//! BEGIN, which is retried in-process on a fresh connection.
//!
//! A route never hoards connections: it keeps at most its fair share of the
//! pool (the pool's size divided by the router's routes), and a connection
//! unused for a quarter of a second goes back to the pool (a sweeper sees to
//! it when the route falls idle).

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::Postgres;

/// How long a connection may sit unused and still skip the pool's check.
const REUSE_WITHIN: Duration = Duration::from_millis(250);

pub(crate) struct Connections {
    pool: PgPool,
    keep_at_most: usize,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
}

impl Connections {
    /// Starts keeping connections for one route; the sweeper stops when the
    /// route drops its `Arc`.
    pub(crate) fn start(pool: PgPool, keep_at_most: usize) -> Arc<Self> {
        let connections = Arc::new(Self {
            pool,
            keep_at_most,
            idle: Mutex::new(Vec::new()),
        });
        tokio::spawn(sweep(Arc::downgrade(&connections)));
        connections
    }

    /// A connection used cleanly moments ago, or one from the pool.
    pub(crate) async fn take(&self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let reused = {
            let mut idle = self.lock();
            let stale = self.drain_stale(&mut idle);
            let reused = idle.pop();
            drop(idle);
            drop(stale);
            reused
        };
        match reused {
            Some((connection, _)) => Ok(connection),
            None => self.pool.acquire().await,
        }
    }

    /// Keeps a connection whose last transaction ended cleanly, up to the
    /// route's share; past it the connection goes back to the pool.
    pub(crate) fn put_back(&self, connection: PoolConnection<Postgres>) {
        let mut idle = self.lock();
        if idle.len() < self.keep_at_most {
            idle.push((connection, Instant::now()));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(PoolConnection<Postgres>, Instant)>> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Removes the connections unused for longer than [`REUSE_WITHIN`]; the
    /// caller drops them (outside the lock), which returns them to the pool.
    fn drain_stale(
        &self,
        idle: &mut Vec<(PoolConnection<Postgres>, Instant)>,
    ) -> Vec<(PoolConnection<Postgres>, Instant)> {
        let fresh_from = idle.partition_point(|(_, used)| used.elapsed() > REUSE_WITHIN);
        idle.drain(..fresh_from).collect()
    }
}

async fn sweep(connections: Weak<Connections>) {
    let mut ticks = tokio::time::interval(REUSE_WITHIN);
    loop {
        ticks.tick().await;
        let Some(connections) = connections.upgrade() else {
            return;
        };
        let stale = {
            let mut idle = connections.lock();
            connections.drain_stale(&mut idle)
        };
        drop(stale);
    }
}
