//! What wakes a relay's fresh lane: a notification on [`CHANNEL`], sent by
//! each queuing transaction's trigger, or the poll, whichever comes first.
//!
//! Two rules, whatever the signal:
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
//!   wait that reads and discards, and a cycle runs beside a read
//!   ([`Wakeup::during`]) whose notifications call for one more cycle.
//!
//! A lost LISTEN connection is reconnected by the next wait, and a wake-up
//! follows (notifications may have been lost meanwhile): a cycle then finds
//! what they announced. Only waits are raced against timers here, never a
//! cycle's BEGIN or COMMIT (sqlx#4393). `try_recv` keeps a message it has
//! read only in part when it is cancelled (its read is cancel-safe).

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgNotification};
use tokio::time::Instant;

use super::CHANNEL;
use super::stats::RelayStats;

/// The most notifications one wake-up reads without waiting, so that
/// writers notifying faster than the relay reads cannot keep it from its
/// cycle: the rest are read at the next wait.
const MOST_PER_WAKE_UP: usize = 100_000;

/// The LISTEN connection of one relay, and the waits on it.
pub(super) struct Wakeup {
    listener: Option<PgListener>,
    /// Counts notifications read and wake-ups they caused.
    stats: RelayStats,
}

impl Wakeup {
    pub(super) fn new(stats: RelayStats) -> Self {
        Self {
            listener: None,
            stats,
        }
    }

    /// LISTENs on [`CHANNEL`] if not yet listening. Without a LISTEN
    /// connection the relay polls; this is tried again before each wait.
    pub(super) async fn listen(&mut self, pool: &PgPool) {
        if self.listener.is_some() {
            return;
        }
        let listener = async {
            let mut listener = PgListener::connect_with(pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match listener.await {
            Ok(listener) => self.listener = Some(listener),
            Err(error) => tracing::warn!(%error, "outbox LISTEN failed; polling"),
        }
    }

    /// Waits up to `wait`, reading every notification meanwhile. With
    /// `early`, the first notification ends the wait, together with every
    /// other one already received; without it (a back-off), notifications
    /// are read and discarded until the time is up. Ends early, too, when
    /// the LISTEN connection was lost: notifications may have been lost with
    /// it, so a cycle should look for rows now.
    pub(super) async fn wait(&mut self, wait: Duration, early: bool) {
        let deadline = Instant::now() + wait;
        loop {
            let Some(listener) = self.listener.as_mut() else {
                tokio::time::sleep_until(deadline).await;
                return;
            };
            match tokio::time::timeout_at(deadline, listener.try_recv()).await {
                Err(_) => return,
                Ok(Ok(Some(_))) => {
                    let read = 1 + self.drain();
                    self.stats.notified(read, early);
                    if early {
                        return;
                    }
                }
                // Lost, and reconnected by `try_recv`.
                Ok(Ok(None)) => return,
                Ok(Err(error)) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
                    self.listener = None;
                    return;
                }
            }
        }
    }

    /// Runs `work` (a cycle) to its end, never cancelled, while reading the
    /// notifications that arrive meanwhile, so that a long cycle (a PubAck
    /// timeout) does not leave them unread. Returns its output, and whether
    /// any came (or the LISTEN connection was lost): they may announce rows
    /// committed after the cycle took its own, so another cycle should look.
    pub(super) async fn during<F: Future>(&mut self, work: F) -> (F::Output, bool) {
        enum Next<T> {
            Done(T),
            Received(Result<Option<PgNotification>, sqlx::Error>),
        }
        let mut work = pin!(work);
        let mut notified = false;
        loop {
            let Some(listener) = self.listener.as_mut() else {
                return (work.await, notified);
            };
            // Only the read is cancelled when the cycle ends first, never the
            // cycle (see the module docs).
            let next = tokio::select! {
                biased;
                output = &mut work => Next::Done(output),
                received = listener.try_recv() => Next::Received(received),
            };
            match next {
                Next::Done(output) => return (output, notified),
                Next::Received(Ok(Some(_))) => {
                    let read = 1 + self.drain();
                    self.stats.notified(read, false);
                    notified = true;
                }
                Next::Received(Ok(None)) => notified = true,
                Next::Received(Err(error)) => {
                    tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
                    self.listener = None;
                    notified = true;
                }
            }
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
            match listener.try_recv().now_or_never() {
                Some(Ok(Some(_))) => read += 1,
                // Nothing more yet, or the connection was lost: the cycle
                // this wake-up runs finds what was announced.
                None | Some(Ok(None)) => break,
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
