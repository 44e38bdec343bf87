//! Connections a route keeps between messages, and the guard that makes
//! every connection safe to cancel.
//!
//! sqlx's pool checks a connection's liveness on every acquire by default
//! (`test_before_acquire`): one extra round trip per message. A route hands a
//! connection whose last transaction ended cleanly straight to its next
//! message instead, for as long as it was used in the last 250 ms. A route
//! never hoards connections: it keeps at most its fair share of the pool
//! (the pool's size divided by the router's routes), and a sweeper gives
//! back what falls idle.
//!
//! A connection in use is a [`Leased`] guard. Only [`Leased::keep`] keeps
//! it for reuse; dropped any other way (an error, a timeout, a panic, a task
//! aborted at shutdown), the connection is **closed**, never returned to the
//! pool in a state nobody knows: it may be inside a transaction, or halfway
//! through a statement. So the router never needs to close the
//! application's pool to stay safe.
//!
//! When a kept connection turns out dead (the server restarted, or ended
//! it), [`Connections::forget_idle`] gives all the others back to the pool,
//! which checks each before anyone uses it, so that a retry does not take
//! one dead kept connection after another.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, Postgres};

/// How long a connection may sit unused and still skip the pool's check.
const REUSE_WITHIN: Duration = Duration::from_millis(250);

type Idle = Vec<(PoolConnection<Postgres>, Instant)>;

pub(crate) struct Connections {
    pool: PgPool,
    keep_at_most: usize,
    idle: Mutex<Idle>,
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
    pub(crate) async fn take(&self) -> Result<Leased<'_>, sqlx::Error> {
        let kept = {
            let mut idle = self.lock();
            let stale = drain_stale(&mut idle);
            let kept = idle.pop();
            drop(idle);
            drop(stale);
            kept
        };
        // A kept connection began a transaction of the route's before, so
        // its session holds the prepared statements (see `transaction`).
        let (connection, prepared) = match kept {
            Some((connection, _)) => (connection, true),
            None => (self.pool.acquire().await?, false),
        };
        Ok(Leased {
            connection: Some(connection),
            home: self,
            prepared,
        })
    }

    /// Gives every kept connection back to the pool, which checks each
    /// before it is used again. Called when a kept one turned out dead.
    pub(crate) fn forget_idle(&self) {
        let forgotten = std::mem::take(&mut *self.lock());
        drop(forgotten);
    }

    fn lock(&self) -> MutexGuard<'_, Idle> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A connection in use. Dropped without [`Leased::keep`], it is closed.
pub(crate) struct Leased<'a> {
    connection: Option<PoolConnection<Postgres>>,
    home: &'a Connections,
    /// Whether the session holds idem's prepared statements.
    prepared: bool,
}

impl Leased<'_> {
    /// Whether the session holds idem's prepared statements; from now on it
    /// is taken to (the statement about to run prepares them).
    pub(crate) fn mark_prepared(&mut self) -> bool {
        std::mem::replace(&mut self.prepared, true)
    }

    /// Keeps the connection for the route's next message: its last
    /// transaction ended cleanly. Past the route's share it goes back to the
    /// pool instead.
    pub(crate) fn keep(mut self) {
        let Some(connection) = self.connection.take() else {
            return;
        };
        let mut idle = self.home.lock();
        if idle.len() < self.home.keep_at_most {
            idle.push((connection, Instant::now()));
        }
    }
}

impl Deref for Leased<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.connection
            .as_ref()
            .expect("a leased connection is present until kept")
    }
}

impl DerefMut for Leased<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.connection
            .as_mut()
            .expect("a leased connection is present until kept")
    }
}

impl Drop for Leased<'_> {
    fn drop(&mut self) {
        if let Some(mut connection) = self.connection.take() {
            // Its state is unknown (mid-transaction, mid-statement): close
            // it rather than let the pool hand it to someone else.
            connection.close_on_drop();
        }
    }
}

/// Removes the connections unused for longer than [`REUSE_WITHIN`]; the
/// caller drops them (outside the lock), which returns them to the pool.
fn drain_stale(idle: &mut Idle) -> Idle {
    let fresh_from = idle.partition_point(|(_, used)| used.elapsed() > REUSE_WITHIN);
    idle.drain(..fresh_from).collect()
}

async fn sweep(connections: Weak<Connections>) {
    let mut ticks = tokio::time::interval(REUSE_WITHIN);
    loop {
        ticks.tick().await;
        let Some(connections) = connections.upgrade() else {
            return;
        };
        let stale = drain_stale(&mut connections.lock());
        drop(stale);
    }
}
