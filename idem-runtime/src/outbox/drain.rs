//! The fresh lane's cycles, overlapped: while one cycle's PubAcks are out,
//! the one before it is finished and the one after it is taken, on a
//! second connection.
//!
//! ```text
//!  session A  take 1 ┐                     ┌ finish 1 + take 3 ┐
//!  NATS              └ publish 1, PubAcks ─┤                   └ publish 3, PubAcks ─┐
//!  session B           take 2 (early) ─────┴ publish 2, PubAcks ─┬───────────────────┘
//!  session B                                                     └ finish 2 + take 4 ...
//! ```
//!
//! A cycle's own steps are those of `cycle.rs`; what this adds is when the
//! next one starts. These rules keep one relay's order, and the per-row
//! failure lane, as they are with one cycle at a time:
//!
//! - **A cycle publishes only once the cycle before it has its PubAcks**:
//!   every earlier row is acknowledged, or its failure decided. Only its
//!   take runs early, and a take running beside a cycle skips that cycle's
//!   locked rows (`SKIP LOCKED`), so it takes exactly the rows after them.
//! - **A take runs early only after a take none of whose rows was cut**
//!   by `max_cycle_bytes` (a row locked and cut stays locked until its
//!   cycle ends, so an early take would skip it and publish the rows after
//!   it first), when that take was full or something announced rows since
//!   (a ring, a notification); and never in a lane that publishes one row
//!   at a time ([`LostConnections`]).
//! - **An early take is rolled back, unpublished,** when the cycle before
//!   it leaves rows fresh (NATS away, a lost connection, a publish the
//!   client could not queue), or the relay is stopping: the next drain
//!   begins with the rows left fresh, so they keep their place. Rows whose
//!   failure is recorded on them leave the fresh lane for the retry lane,
//!   as with one cycle at a time.
//! - A cycle is finished (its failures recorded, its acknowledged rows
//!   deleted, COMMIT) while the next one publishes: in one message with the
//!   take after next when that runs on its session. With no cycle
//!   publishing, the next take runs beside the finish on the other session,
//!   unless rows of the cycle finishing were cut: they stay locked until
//!   its COMMIT, so the take then follows it in the same message.
//!
//! A drain holds up to two connections ([`Sessions`]), taken from the pool
//! when first needed; the lane keeps them between drains while it is busy,
//! outside any transaction, and gives them back once it is idle. A
//! database error ends the drain: the session it came
//! from is closed, the cycle whose PubAcks are in is still finished on its
//! own session if it can be, and any other open transaction goes with its
//! session (closed, so that the server releases its rows at once). Rows
//! published and not deleted are published again by a later cycle, and
//! JetStream drops the copy within its duplicate window.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use async_nats::jetstream;
use sqlx::Pool;

use super::cycle::{Acked, Cycles, LostConnections, Open, RelayError};
use super::stats::Drain;
use crate::store::outbox::{Advanced, Lane, Marks, OutboxStore, RelaySession, Take};

/// The fresh lane's connections: two while its cycles overlap, taken from
/// the pool as they are first needed. The lane keeps them between drains
/// while it is busy (each outside a transaction then), and gives them back
/// once a poll finds nothing to do ([`Sessions::release`]); a dropped
/// session that may be inside a transaction is closed instead.
pub(super) struct Sessions<S>([Option<S>; 2]);

impl<S> Default for Sessions<S> {
    fn default() -> Self {
        Sessions([None, None])
    }
}

impl<S> Sessions<S> {
    /// Gives both back to the pool (or closes one a transaction may be open
    /// on, after an error).
    pub(super) fn release(&mut self) {
        self.0 = [None, None];
    }
}

/// What a drain is told while it runs.
#[derive(Debug, Default)]
pub(super) struct Signals {
    /// Something announced rows since the drain last looked (a ring of this
    /// process, a notification, a lost LISTEN connection): rows may have
    /// committed after its last take, so another cycle runs even after one
    /// that was not full.
    pub(super) announced: AtomicBool,
    /// The relay is stopping: no cycle is taken early any more, and the
    /// drain ends once the cycle publishing now is finished.
    pub(super) stopping: AtomicBool,
}

/// Runs fresh cycles until one takes nothing or is not full (and nothing
/// was announced meanwhile), finds NATS away or leaves rows fresh, the
/// relay is stopping, or `most` cycles have run; cycles overlap as the
/// module docs say.
///
/// Each step runs up to three things at once: the head of the cycle taken
/// last (publish, PubAcks: NATS only), the finish of the cycle before it,
/// and the next take, on the session the head does not hold (after the
/// finish, in one message, when the finish is on that session too).
pub(super) async fn drain<DB: OutboxStore>(
    cycles: &Cycles,
    js: &jetstream::Context,
    pool: &Pool<DB>,
    sessions: &mut Sessions<DB::Relay>,
    lost: &mut LostConnections,
    signals: &Signals,
    most: usize,
) -> Result<Drain, RelayError> {
    let mut drain = Drain::default();
    // The cycle taken and not yet published, on its slot.
    let mut ahead: Option<(usize, Open)> = None;
    // The cycle whose PubAcks are in, to finish, on its slot.
    let mut behind: Option<(usize, Acked)> = None;
    // Whether a take is due at the next step without a head.
    let mut wanted = most > 0;
    // Cycles published so far.
    let mut headed = 0;
    loop {
        let alone = lost.alone();
        let take = cycles.take(Lane::Fresh, alone);
        let head = ahead.take();
        let finish = behind.take();
        let take_now = match &head {
            // Early, beside the head (see the module docs).
            Some((_, open)) => {
                !alone
                    && open.uncut()
                    && headed + 2 <= most
                    && !stopping(signals)
                    && (open.full() || announced(signals))
            }
            None => wanted,
        };
        if head.is_none() && finish.is_none() && !take_now {
            return Ok(drain);
        }
        // The take runs on the session the head does not hold, where the
        // cycle to finish is too (both then go in one message). With no
        // head, beside the finish on the other session; but after it, in
        // one message, if rows of that cycle were cut (they stay locked
        // until its COMMIT, and a take beside it would skip them).
        let take_slot = match (&head, &finish) {
            (Some((slot, _)), _) => 1 - slot,
            (None, Some((slot, acked))) if acked.cut => *slot,
            (None, Some((slot, _))) => 1 - slot,
            (None, None) => 0,
        };
        let fused = finish.as_ref().is_some_and(|(slot, _)| *slot == take_slot);
        let marks = finish.as_ref().map(|(_, acked)| cycles.marks(acked));
        let finishing = finish
            .as_ref()
            .zip(marks.as_ref())
            .map(|((_, acked), marks)| (acked.acknowledged.as_slice(), marks));
        let [first, second] = &mut sessions.0;
        let (other, at_take) = if take_slot == 0 {
            (second, first)
        } else {
            (first, second)
        };
        // Each part's time, for the step's trace.
        let started = Instant::now();
        let finish_work = async {
            let advanced = match finishing {
                Some(finishing) if !fused => {
                    Some(advance(other, pool, Some(finishing), None).await)
                }
                _ => None,
            };
            (advanced, started.elapsed())
        };
        let take_work = async {
            let advanced = match (fused, take_now) {
                (true, _) => {
                    Some(advance(at_take, pool, finishing, take_now.then_some(take)).await)
                }
                (false, true) => Some(advance(at_take, pool, None, Some(take)).await),
                (false, false) => None,
            };
            (advanced, started.elapsed())
        };
        let head_work = async move {
            let acked = match head {
                Some((slot, open)) => Some((slot, cycles.head(js, open, alone).await)),
                None => None,
            };
            (acked, started.elapsed())
        };
        let ((acked, head_time), (finished, finish_time), (taken, take_time)) =
            tokio::join!(head_work, finish_work, take_work);
        tracing::trace!(
            head = acked.as_ref().map(|(_, acked)| acked.cycle.taken),
            head_us = head_time.as_micros() as u64,
            finish = finished.is_some() || fused,
            finish_us = finish_time.as_micros() as u64,
            take = take_now,
            fused,
            take_us = take_time.as_micros() as u64,
            "outbox drain step"
        );

        // The cycle finished, if it committed.
        let committed = if fused {
            taken.as_ref().is_some_and(|advanced| advanced.committed)
        } else {
            finished.as_ref().is_some_and(|advanced| advanced.committed)
        };
        if let Some((_, acked)) = finish
            && committed
        {
            drain.add(&cycles.finished(acked));
        }
        // A failed message leaves its session in an unknown state: closed.
        let mut failure = None;
        if let Some(Advanced {
            taken: Err(error), ..
        }) = finished
        {
            sessions.0[1 - take_slot] = None;
            failure = Some(error);
        }
        let taken = match taken.map(|advanced| advanced.taken) {
            Some(Err(error)) => {
                sessions.0[take_slot] = None;
                failure.get_or_insert(error);
                None
            }
            Some(Ok(rows)) => {
                let open = Open::of(take, rows);
                if open.is_none() {
                    cycles.stats.empty_cycle();
                }
                open
            }
            None => None,
        };
        if let Some(error) = failure {
            // Rows taken beside a failure are released with their session.
            if taken.is_some() {
                sessions.0[take_slot] = None;
            }
            if let Some((slot, acked)) = acked {
                drain.headed(&acked.cycle);
                finish_alone(cycles, sessions, slot, acked, &mut drain).await;
            }
            return Err(RelayError::Database(error));
        }

        let Some((slot, acked)) = acked else {
            // Nothing published this step: what was wanted is taken.
            wanted = false;
            ahead = taken.map(|open| (take_slot, open));
            continue;
        };
        headed += 1;
        lost.count(&acked.cycle);
        drain.headed(&acked.cycle);
        if acked.crashed {
            if taken.is_some()
                && let Some(session) = sessions.0[take_slot].as_mut()
            {
                session.rollback().await?;
            }
            let session = sessions.0[slot].as_mut().expect("the head's session");
            return Err(cycles.crash(session, &acked).await);
        }
        let go_on = acked.cycle.nats_away.is_none()
            && !acked.left_fresh()
            && !lost.alone()
            && headed < most
            && !stopping(signals);
        let more = acked.cycle.more;
        behind = Some((slot, acked));
        wanted = match taken {
            Some(open) if go_on => {
                ahead = Some((take_slot, open));
                false
            }
            Some(_) => {
                // Taken early, not to be published now (see the module
                // docs): released, unpublished.
                drain.more = true;
                let rolled_back = match sessions.0[take_slot].as_mut() {
                    Some(session) => session.rollback().await,
                    None => Ok(()),
                };
                if let Err(error) = rolled_back {
                    sessions.0[take_slot] = None;
                    let (slot, acked) = behind.take().expect("just set");
                    finish_alone(cycles, sessions, slot, acked, &mut drain).await;
                    return Err(RelayError::Database(error));
                }
                false
            }
            // An early take that found nothing: no row was waiting then,
            // and only a newer announcement calls for another look.
            None if take_now => {
                drain.more = false;
                go_on && announced(signals)
            }
            None => go_on && (more || announced(signals)),
        };
    }
}

/// Runs `finishing` and `take` on the session in `slot` (taken from the
/// pool if there is none): see [`RelaySession::advance`].
async fn advance<DB: OutboxStore>(
    slot: &mut Option<DB::Relay>,
    pool: &Pool<DB>,
    finishing: Option<(&[i64], &Marks)>,
    take: Option<Take>,
) -> Advanced {
    if slot.is_none() {
        match DB::Relay::acquire(pool).await {
            Ok(session) => *slot = Some(session),
            Err(error) => {
                return Advanced {
                    committed: false,
                    taken: Err(error),
                };
            }
        }
    }
    let session = slot.as_mut().expect("just set");
    session.advance(finishing, take).await
}

fn announced(signals: &Signals) -> bool {
    signals.announced.swap(false, Ordering::Relaxed)
}

fn stopping(signals: &Signals) -> bool {
    signals.stopping.load(Ordering::Relaxed)
}

/// Finishes `acked` on its own session after the drain failed elsewhere,
/// if it can: its acknowledged rows are deleted rather than published
/// again. A failure here is logged; the error already met is the drain's.
async fn finish_alone<S: RelaySession<DB>, DB>(
    cycles: &Cycles,
    sessions: &mut Sessions<S>,
    slot: usize,
    acked: Acked,
    drain: &mut Drain,
) {
    let Some(session) = sessions.0[slot].as_mut() else {
        return;
    };
    if acked.crashed {
        return;
    }
    let marks = cycles.marks(&acked);
    let advanced = session
        .advance(Some((&acked.acknowledged, &marks)), None)
        .await;
    match advanced.taken {
        Ok(_) if advanced.committed => drain.add(&cycles.finished(acked)),
        Ok(_) => {}
        Err(error) => {
            sessions.0[slot] = None;
            tracing::warn!(%error, "an outbox cycle could not be finished after another failed; its rows stay pending, and are published again");
        }
    }
}
