//! What wakes a relay's fresh lane, whichever comes first:
//!
//! - **This process's COMMITs** ([`after_commit`], [`wake_local_relays`],
//!   [`wake_relays`]). A handler's [`Outbox`](super::Outbox) marks its
//!   delivery when it queues a message; once that transaction has
//!   committed, the runtime rings the bell of its database ([`Bell`], a
//!   `tokio::sync::watch`), and every relay of the process on that database
//!   runs a cycle. No round trip and no lock: the NOTIFY trigger took
//!   PostgreSQL's notification-queue lock at every queuing COMMIT, which
//!   serialised those commits. A ring that comes while a cycle runs calls
//!   for one more (the cycle may have taken its rows before that COMMIT);
//!   rings that come together make one wake-up. A COMMIT whose outcome is
//!   unknown rings too (it may have gone through), and so does a
//!   redelivery found processed before: the attempt that committed may
//!   never have rung (its process died after its COMMIT).
//! - **The poll**, adaptive ([`Poll`]): from `min_poll_interval` after a
//!   cycle that found rows, doubling while polls find none, up to
//!   `poll_interval`. It is what wakes a relay in another process than the
//!   queuing one, and what finds rows whose wake-up was lost (a process that
//!   died between its COMMIT and the ring): nothing committed waits longer
//!   than `poll_interval` for a look.
//! - **A notification on [`CHANNEL`]**, only where the trigger
//!   `idem_outbox_notify` was enabled again (migration 7 disables it; see
//!   the guide's outbox chapter). A relay LISTENs only while the trigger is
//!   enabled (read with its lag about once a second), so that enabling it needs no change to the relays, and a
//!   relay without it holds no LISTEN connection.
//!
//! **One bell per database.** A process may run relays of several
//! databases; a COMMIT wakes those of its own database, named by the
//! pool's connect options (host, port or socket, database). Two pools that
//! name one database differently (`localhost` and `127.0.0.1`) get two
//! bells: a relay then finds the other's rows by its poll.
//!
//! Two rules for the notifications:
//!
//! - **One wake-up covers everything pending.** A cycle takes every row
//!   committed before it, so the notifications that arrived before it are
//!   all served by it. sqlx's `PgListener::try_recv` hands over one
//!   notification per call (and `next_buffered` only holds those that came
//!   while the listener ran queries), so after the first, [`Wakeup`] reads
//!   every one the connection has already received, without waiting for
//!   more. Without that, 20,000 queuing transactions left a relay running
//!   about 14,500 empty cycles in the 5 s after their rows had gone out.
//! - **A relay keeps reading, whatever it does.** PostgreSQL's notification
//!   queue is shared by every database of the server, and its tail moves
//!   only as fast as the slowest listener reads. A relay backing off (NATS
//!   away) that stopped reading held the queue back for everyone, and once
//!   it is full every notifying COMMIT fails (54000). So a back-off is a
//!   wait that reads and discards, and cycles run beside a read
//!   ([`Wakeup::during`]) whose notifications call for one more cycle.
//!
//! A lost LISTEN connection is reconnected by the next wait, and a wake-up
//! follows (notifications may have been lost meanwhile): a cycle then finds
//! what they announced. Only waits are raced against timers here, never a
//! cycle's BEGIN or COMMIT (sqlx#4393). `try_recv` keeps a message it has
//! read only in part when it is cancelled (its read is cancel-safe), and so
//! does `watch::Receiver::changed`.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use sqlx::Pool;
use tokio::sync::watch;
use tokio::time::Instant;

use super::CHANNEL;
use super::stats::RelayStats;
use crate::handler::delivery::Delivery;
use crate::store::backend::Backend;
use crate::store::outbox::{Heard, Listener, OutboxStore};

/// The bell of one database's relays in this process: rung after each
/// COMMIT that queued outbox rows there. A `watch` remembers a ring for
/// each relay until it looks, so a ring between two waits is not lost, and
/// many rings make one wake-up.
#[derive(Debug, Clone)]
pub(crate) struct Bell(Arc<watch::Sender<()>>);

/// Every bell of the process, by [`Backend::database`]. A bell is never removed:
/// one per database the process ever spoke to.
static BELLS: LazyLock<Mutex<HashMap<String, Bell>>> = LazyLock::new(Mutex::default);

impl Bell {
    /// The bell of the database `pool` connects to.
    pub(crate) fn of<DB: Backend>(pool: &Pool<DB>) -> Bell {
        let key = DB::database(pool);
        let mut bells = BELLS.lock().unwrap_or_else(|e| e.into_inner());
        bells
            .entry(key)
            .or_insert_with(|| Bell(Arc::new(watch::channel(()).0)))
            .clone()
    }

    /// Wakes the relays of this bell's database.
    pub(crate) fn ring(&self) {
        self.0.send_modify(|()| {});
    }
}

/// Wakes every relay running in this process, whatever its database, so
/// that it publishes what was committed before this call now rather than
/// at its next poll. [`wake_relays`] wakes only those of one database.
///
/// The runtime rings after each handler's COMMIT that queued a message with
/// [`Outbox`](super::Outbox). Call this (or [`wake_relays`]) yourself after
/// committing a transaction that queued messages outside a handler
/// ([`Outbox::keyed`](super::Outbox::keyed), [`Outbox::random`](super::Outbox::random),
/// [`enqueue`](super::enqueue)). It costs an atomic write per database; a
/// relay that is in the middle of a cycle runs one more, and one of another
/// database looks for rows in vain.
///
/// ```
/// # async fn queue(pool: sqlx::PgPool) -> Result<(), idem_runtime::outbox::OutboxError> {
/// use idem_runtime::outbox::{Outbox, wake_local_relays};
///
/// let mut tx = pool.begin().await?;
/// let outbox: Outbox = Outbox::keyed("checkout:4711");
/// outbox.send(&mut tx, "orders.checked_out", &4711).await?;
/// tx.commit().await?;
/// wake_local_relays();
/// # Ok(())
/// # }
/// ```
pub fn wake_local_relays() {
    let bells = BELLS.lock().unwrap_or_else(|e| e.into_inner());
    for bell in bells.values() {
        bell.ring();
    }
}

/// Wakes the relays running in this process on the database `pool`
/// connects to (as its connect options name it: host, port or socket,
/// database), so that they publish what was committed before this call
/// now rather than at their next poll. See [`wake_local_relays`].
///
/// ```
/// # async fn queue(pool: sqlx::PgPool) -> Result<(), idem_runtime::outbox::OutboxError> {
/// use idem_runtime::outbox::{Outbox, wake_relays};
///
/// let mut tx = pool.begin().await?;
/// let outbox: Outbox = Outbox::keyed("checkout:4711");
/// outbox.send(&mut tx, "orders.checked_out", &4711).await?;
/// tx.commit().await?;
/// wake_relays(&pool);
/// # Ok(())
/// # }
/// ```
pub fn wake_relays<DB: Backend>(pool: &Pool<DB>) {
    Bell::of(pool).ring();
}

/// Rings `bell` if `delivery`'s transaction queued outbox rows; called by
/// the runtime right after that transaction committed, or after its COMMIT
/// failed with an unknown outcome (it may have committed).
pub(crate) fn after_commit(delivery: &Delivery, bell: &Bell) {
    if delivery.take_outbox_queued() {
        bell.ring();
    }
}

/// Why a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Woken {
    /// The poll: nothing announced rows.
    Poll,
    /// A ring of this process, a notification, or a lost LISTEN
    /// connection: rows may be there.
    Signal,
}

/// The fresh lane's adaptive poll: the next wait without a signal.
#[derive(Debug)]
pub(super) struct Poll {
    floor: Duration,
    ceiling: Duration,
    current: Duration,
}

impl Poll {
    /// Starts at `floor`, doubles up to `ceiling` (at least `floor`).
    pub(super) fn new(floor: Duration, ceiling: Duration) -> Self {
        let floor = floor.min(ceiling);
        Self {
            floor,
            ceiling,
            current: floor,
        }
    }

    /// How long the next wait may be.
    pub(super) fn wait(&self) -> Duration {
        self.current
    }

    /// After a cycle: back to the floor if it found rows (more may be
    /// coming), else twice as long, up to the ceiling.
    pub(super) fn after(&mut self, found_rows: bool) {
        self.current = if found_rows {
            self.floor
        } else {
            (self.current * 2).min(self.ceiling)
        };
    }
}

/// The most notifications one wake-up reads without waiting, so that
/// writers notifying faster than the relay reads cannot keep it from its
/// cycle: the rest are read at the next wait.
const MOST_PER_WAKE_UP: usize = 100_000;

/// The LISTEN connection of one relay, and the waits on it.
pub(super) struct Wakeup {
    listener: Option<Listener>,
    /// The bell of the relay's database ([`Bell`]).
    local: watch::Receiver<()>,
    /// Counts notifications read and wake-ups they caused.
    stats: RelayStats,
}

impl Wakeup {
    pub(super) fn new(stats: RelayStats, bell: &Bell) -> Self {
        Self {
            listener: None,
            local: bell.0.subscribe(),
            stats,
        }
    }

    /// LISTENs on [`CHANNEL`] if `enabled` (the trigger is) and not yet
    /// listening; stops listening (`UNLISTEN`, and the connection goes back
    /// to the pool) if not. Without a LISTEN connection the relay polls;
    /// this is tried again before each wait.
    pub(super) async fn listen<DB: OutboxStore>(&mut self, pool: &Pool<DB>, enabled: bool) {
        if !enabled {
            self.listener = None;
            return;
        }
        if self.listener.is_some() {
            return;
        }
        match DB::listen(pool, CHANNEL).await {
            Ok(listener) => self.listener = Some(listener),
            Err(error) => tracing::warn!(%error, "outbox LISTEN failed; polling"),
        }
    }

    /// Waits up to `wait`, reading every notification meanwhile. With
    /// `early`, a ring of this process or the first notification ends the
    /// wait (the latter together with every other one already received);
    /// without it (a back-off), notifications are read and discarded until
    /// the time is up. Ends early, too, when the LISTEN connection was lost:
    /// notifications may have been lost with it, so a cycle should look for
    /// rows now.
    pub(super) async fn wait(&mut self, wait: Duration, early: bool) -> Woken {
        let deadline = Instant::now() + wait;
        loop {
            let Self {
                listener, local, ..
            } = self;
            let rung = async {
                if early {
                    // The sender is a static: never closed.
                    let _ = local.changed().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            let received = async {
                match listener.as_mut() {
                    Some(listener) => listener.next().await,
                    None => std::future::pending().await,
                }
            };
            let received = tokio::select! {
                biased;
                () = rung => return Woken::Signal,
                received = received => received,
                () = tokio::time::sleep_until(deadline) => return Woken::Poll,
            };
            match received {
                Ok(Heard::Notification) => {
                    let read = 1 + self.drain();
                    self.stats.notified(read, early);
                    if early {
                        return Woken::Signal;
                    }
                }
                // Lost, and reconnected by the read.
                Ok(Heard::Reconnected) => return Woken::Signal,
                Err(error) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
                    self.listener = None;
                    return Woken::Signal;
                }
            }
        }
    }

    /// Runs `work` (a drain) to its end, never cancelled, while reading the
    /// notifications that arrive meanwhile, so that a long cycle (a PubAck
    /// timeout) does not leave them unread, and watching the bell. Sets
    /// `announced` whenever one came, the bell rang, or the LISTEN
    /// connection was lost: they may announce rows committed after the
    /// drain's last take, so another cycle should look.
    pub(super) async fn during<F: Future>(&mut self, announced: &AtomicBool, work: F) -> F::Output {
        enum Next<T> {
            Done(T),
            Received(Result<Heard, sqlx::Error>),
            Rung,
        }
        // Rings from here on are for rows the drain may miss; earlier ones
        // are served by its first take.
        self.local.mark_unchanged();
        let mut work = pin!(work);
        loop {
            let Self {
                listener, local, ..
            } = self;
            let received = async {
                match listener.as_mut() {
                    Some(listener) => listener.next().await,
                    None => std::future::pending().await,
                }
            };
            // Only the read and the bell's watch are cancelled when the
            // drain ends first, never the drain (see the module docs).
            let next = tokio::select! {
                biased;
                output = &mut work => Next::Done(output),
                received = received => Next::Received(received),
                // The sender is in a static map: never closed.
                _ = local.changed() => Next::Rung,
            };
            match next {
                Next::Done(output) => return output,
                Next::Received(Ok(Heard::Notification)) => {
                    let read = 1 + self.drain();
                    self.stats.notified(read, false);
                }
                Next::Received(Ok(Heard::Reconnected)) | Next::Rung => {}
                Next::Received(Err(error)) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
                    self.listener = None;
                }
            }
            announced.store(true, Ordering::Relaxed);
        }
    }

    /// Reads, without waiting, every notification the connection has
    /// already received (up to [`MOST_PER_WAKE_UP`]).
    fn drain(&mut self) -> usize {
        let mut read = 0;
        while read < MOST_PER_WAKE_UP {
            let Some(listener) = self.listener.as_mut() else {
                break;
            };
            // One poll: a notification already received is decoded at once;
            // nothing more yet is Pending, and dropping the future then
            // loses nothing (see the module docs).
            match listener.next_now() {
                Some(Ok(Heard::Notification)) => read += 1,
                // Nothing more yet, or the connection was lost: the cycle
                // this wake-up runs finds what was announced.
                None | Some(Ok(Heard::Reconnected)) => break,
                Some(Err(error)) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
                    self.listener = None;
                    break;
                }
            }
        }
        read
    }
}
