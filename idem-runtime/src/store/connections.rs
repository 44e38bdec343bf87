//! The connections a router's messages use: handed out in the order the
//! messages asked for them, whichever route they are on, reused between
//! messages, and guarded so that every connection is safe to cancel.
//!
//! # Turns
//!
//! One [`Connections`] serves every route of a router. A message takes a
//! *turn* before it takes a connection, from a fair semaphore
//! ([`tokio::sync::Semaphore`] hands out permits in the order they were
//! asked for) with one permit per connection of the pool, less those the
//! router's relay and metrics poll use (so that messages that keep the
//! pool busy never starve them: with every connection taken by messages,
//! the poll waited out a whole 30 s run for one). It holds the turn as
//! long as it holds the connection, and gives both up together. So
//! when the routes want more connections than the pool has, the waiting
//! messages are served first come, first served, across routes: a route
//! cannot keep the connections it has for its own next messages while
//! another route's messages wait (before, two routes at 8 in flight on a
//! pool of 10 left some messages waiting out the pool's whole 30 s acquire
//! timeout while hundreds of later ones were served).
//!
//! A turn waits at most the pool's `acquire_timeout`, and then fails as the
//! pool would (`PoolTimedOut`: the message is held as if the database were
//! away). A message that waits longer than [`WARN_AFTER`] is warned about
//! (at most every [`WARN_EVERY`]), naming the connections the messages may
//! use and how many messages wait, and every wait is recorded (`idem_connection_wait_seconds`,
//! [`Stats::longest_connection_wait`](crate::Stats::longest_connection_wait)).
//!
//! # Reuse
//!
//! sqlx's pool checks a connection's liveness on every acquire by default
//! (`test_before_acquire`): one extra round trip per message. A connection
//! whose last transaction ended cleanly goes, with its turn given up, to a
//! list of idle connections that the next message to get a turn takes,
//! whatever its route, for as long as it was used in the last 250 ms; a
//! sweeper gives back what falls idle longer. A turn is given up only after
//! its connection is in the list, and a kept connection holds no turn, so
//! the turns in use plus the idle connections never exceed the turns there
//! are: a message with a turn finds a connection in the list or in the
//! pool (unless something outside the router holds the pool's connections). A
//! kept connection carries whether its session holds idem's prepared
//! statements, the same for every route of a router (see
//! `transaction::Begin`): one that began a message's transaction does; one
//! that only asked whether a batch committed may not.
//!
//! # Never back to the pool in an unknown state
//!
//! A connection in use is a [`Leased`] guard. Only [`Leased::keep`] keeps
//! it for reuse; dropped any other way (an error, a timeout, a panic, a task
//! aborted at shutdown), the connection is **closed**, never returned to the
//! pool in a state nobody knows: it may be inside a transaction, or halfway
//! through a statement. So the router never needs to close the
//! application's pool to stay safe. Neither the turn nor the connection is
//! ever awaited around BEGIN or COMMIT: both are taken before the
//! transaction begins.
//!
//! When a kept connection turns out dead (the server restarted, or ended
//! it), [`Connections::forget_idle`] gives all the others back to the pool,
//! which checks each before anyone uses it, so that a retry does not take
//! one dead kept connection after another.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, Postgres};
use tokio::sync::{Semaphore, SemaphorePermit};

/// How long a connection may sit unused and still skip the pool's check.
const REUSE_WITHIN: Duration = Duration::from_millis(250);

/// A message that has waited this long for its turn is warned about.
const WARN_AFTER: Duration = Duration::from_secs(5);

/// At most one such warning per this long; the rest go to `debug`.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// The connections kept for the next message: each with when it was last
/// used, and whether its session holds idem's prepared statements (one that
/// only answered a question, such as whether a transaction committed, does
/// not).
type Idle<DB> = Vec<(PoolConnection<DB>, Instant, bool)>;

/// One router's connections to its database (`DB`: any sqlx database; a
/// router's is PostgreSQL so far).
pub(crate) struct Connections<DB: Database = Postgres> {
    pool: Pool<DB>,
    /// One permit per connection the router's messages may use, handed
    /// out first come, first served.
    turns: Semaphore,
    /// The turns there are.
    size: usize,
    /// When a long wait was last warned about.
    warned_at: Mutex<Option<Instant>>,
    /// Messages waiting for a turn now, for the warning.
    waiting: AtomicUsize,
    /// How long a turn may be waited for: the pool's acquire timeout.
    wait_at_most: Duration,
    idle: Mutex<Idle<DB>>,
}

impl<DB: Database> Connections<DB> {
    /// Starts handing out up to `turns` of `pool`'s connections (at least
    /// one) to one router's messages; the sweeper stops when the router
    /// drops its `Arc`.
    pub(crate) fn start(pool: Pool<DB>, turns: usize) -> Arc<Self> {
        let size = turns.max(1);
        let connections = Arc::new(Self {
            wait_at_most: pool.options().get_acquire_timeout(),
            pool,
            turns: Semaphore::new(size),
            size,
            warned_at: Mutex::new(None),
            waiting: AtomicUsize::new(0),
            idle: Mutex::new(Vec::new()),
        });
        tokio::spawn(sweep(Arc::downgrade(&connections)));
        connections
    }

    /// The pool the connections come from.
    pub(crate) fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// A connection for one message (or batch), once its turn comes: one
    /// used cleanly moments ago, or one from the pool. `waited` is told how
    /// long the turn took (its route records it).
    pub(crate) async fn take(
        &self,
        waited: impl FnOnce(Duration),
    ) -> Result<Leased<'_, DB>, sqlx::Error> {
        let asked = Instant::now();
        let turn = self.turn(asked).await;
        waited(asked.elapsed());
        let turn = turn?;
        let kept = {
            let mut idle = self.lock();
            let stale = drain_stale(&mut idle);
            let kept = idle.pop();
            drop(idle);
            drop(stale);
            kept
        };
        // A kept connection says whether its session holds the prepared
        // statements (see `transaction`); a new one does not.
        let (connection, prepared) = match kept {
            Some((connection, _, prepared)) => (connection, prepared),
            None => (self.pool.acquire().await?, false),
        };
        Ok(Leased {
            connection: Some(connection),
            home: self,
            prepared,
            _turn: turn,
        })
    }

    /// Waits for a turn, first come, first served: warns once the wait
    /// passes [`WARN_AFTER`], and gives up at the pool's acquire timeout.
    async fn turn(&self, asked: Instant) -> Result<SemaphorePermit<'_>, sqlx::Error> {
        let waiting = Waiting::count(&self.waiting);
        let mut warned = false;
        let turn = self.turns.acquire();
        tokio::pin!(turn);
        loop {
            let until = if warned {
                asked + self.wait_at_most
            } else {
                asked + WARN_AFTER.min(self.wait_at_most)
            };
            match tokio::time::timeout_at(until.into(), &mut turn).await {
                Ok(Ok(turn)) => return Ok(turn),
                // Never closed.
                Ok(Err(_)) => return Err(sqlx::Error::PoolClosed),
                Err(_) if warned || asked.elapsed() >= self.wait_at_most => {
                    return Err(sqlx::Error::PoolTimedOut);
                }
                Err(_) => {
                    warned = true;
                    self.warn_of_a_long_wait(waiting.now());
                }
            }
        }
    }

    /// Warns that a message has waited [`WARN_AFTER`] for its turn, at most
    /// once per [`WARN_EVERY`] (then at `debug`).
    fn warn_of_a_long_wait(&self, waiting: usize) {
        let now = Instant::now();
        let due = {
            let mut warned_at = self
                .warned_at
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let due = warned_at.is_none_or(|at| now.duration_since(at) >= WARN_EVERY);
            if due {
                *warned_at = Some(now);
            }
            due
        };
        if due {
            tracing::warn!(
                waited_s = WARN_AFTER.as_secs(),
                connections = self.size,
                waiting,
                "a message has waited {}s for a database connection: all {} connections the router's messages may use are taken, and {} message(s) wait for one, served in the order they asked; a message gives up after the pool's acquire timeout ({}s) and is held. The pool is smaller than the routes' concurrency: see `idem_connection_wait_seconds` (this warning at most every {}s)",
                WARN_AFTER.as_secs(),
                self.size,
                waiting,
                self.wait_at_most.as_secs(),
                WARN_EVERY.as_secs()
            );
        } else {
            tracing::debug!(
                connections = self.size,
                waiting,
                "a message has waited {}s for a database connection",
                WARN_AFTER.as_secs()
            );
        }
    }

    /// Gives every kept connection back to the pool, which checks each
    /// before it is used again. Called when a kept one turned out dead.
    pub(crate) fn forget_idle(&self) {
        let forgotten = std::mem::take(&mut *self.lock());
        drop(forgotten);
    }

    fn lock(&self) -> MutexGuard<'_, Idle<DB>> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Counts a message among those waiting for a turn while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn count(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(waiting)
    }

    fn now(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection in use, with its message's turn. Dropped without
/// [`Leased::keep`], it is closed.
pub struct Leased<'a, DB: Database = Postgres> {
    connection: Option<PoolConnection<DB>>,
    home: &'a Connections<DB>,
    /// Whether the session holds idem's prepared statements.
    prepared: bool,
    /// Given up when the guard drops, after the connection is kept or
    /// closed.
    _turn: SemaphorePermit<'a>,
}

impl<DB: Database> Leased<'_, DB> {
    /// Whether the session holds idem's prepared statements; from now on it
    /// is taken to (the statement about to run prepares them).
    pub(crate) fn mark_prepared(&mut self) -> bool {
        std::mem::replace(&mut self.prepared, true)
    }

    /// Keeps the connection for the next message to get a turn: its last
    /// transaction ended cleanly.
    pub(crate) fn keep(mut self) {
        let Some(connection) = self.connection.take() else {
            return;
        };
        // Into the list before the turn is given up (when `self` drops), so
        // that the message the turn goes to finds it there.
        self.home
            .lock()
            .push((connection, Instant::now(), self.prepared));
    }
}

impl<DB: Database> Deref for Leased<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.connection
            .as_ref()
            .expect("a leased connection is present until kept")
    }
}

impl<DB: Database> DerefMut for Leased<'_, DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.connection
            .as_mut()
            .expect("a leased connection is present until kept")
    }
}

impl<DB: Database> Drop for Leased<'_, DB> {
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
fn drain_stale<DB: Database>(idle: &mut Idle<DB>) -> Idle<DB> {
    let fresh_from = idle.partition_point(|(_, used, _)| used.elapsed() > REUSE_WITHIN);
    idle.drain(..fresh_from).collect()
}

async fn sweep<DB: Database>(connections: Weak<Connections<DB>>) {
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
