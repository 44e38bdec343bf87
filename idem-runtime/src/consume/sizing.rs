//! How many messages the next batch of a route takes.
//!
//! A route with a fixed size ([`Route::batch`](crate::Route::batch)) always
//! takes up to that many. An adaptive route
//! ([`Route::adaptive_batch`](crate::Route::adaptive_batch)) sizes its
//! batches as TCP sizes its window:
//!
//! - **It only grows under a backlog.** A batch grows the size only if it was
//!   full, that is if as many messages had already arrived as it could take.
//!   An idle route gathers one message at a time and runs it per message, so
//!   it keeps per-message latency; it never waits to fill a batch. At size 1
//!   a route still gathers up to 2, so that a backlog shows (a group of 2)
//!   and starts the growth.
//! - **Slow start, then additive increase.** The size doubles with each full
//!   batch that committed, until the first fallback; after that it grows by
//!   one for every `size` full batches that committed (one per round, as
//!   TCP's window grows by one per round trip).
//! - **Multiplicative decrease.** A batch that fell back (a deadlock, a
//!   serialization failure, a handler's error, a COMMIT that did not commit)
//!   halves the size, down to 1.
//! - **Held at 1.** A fallback that brings the size to 1 holds the route per
//!   message for a while, [`HOLD_MIN`] at first and twice as long after each
//!   such fallback, up to [`HOLD_MAX`]; then a gather tries 2 again. Batches
//!   that commit while the route is held (started before it was) do not
//!   count, and the hold is back to [`HOLD_MIN`] only once the size has
//!   grown to [`HOLD_RESET_SIZE`] again. Under lock contention batches
//!   deadlock, and PostgreSQL finds a deadlock only after its
//!   `deadlock_timeout` (1 s by default), for which both batches, and what
//!   queues behind their locks, stand still: a route whose batches keep
//!   deadlocking must not keep trying them. Measured with `idem-bench
//!   contention` (8 hot rows): without the hold, adaptive batches ran far
//!   below per-message mode, one deadlock a second.
//!
//! - **One batch at a time under conflicts.** Batches that conflict with
//!   each other (a deadlock, a serialization failure, or a lock waited for
//!   past the short `lock_timeout` an adaptive batch's transaction sets)
//!   are not retried in batches, and the route runs one batch at a time for
//!   a while, [`HOLD_MIN`] at first and twice as long after each conflict,
//!   up to [`HOLD_MAX`] (back to [`HOLD_MIN`] after a calm of four holds):
//!   while a batch runs, the route starts nothing else, so that its batches
//!   cannot deadlock with each other and keep their size, and the
//!   throughput it buys. A batch whose messages fall back to one per
//!   transaction no longer counts: they are no batch, and each may wait as
//!   long as its transaction may for a row another session holds (the
//!   route used to stand still behind them for all that time; so it did
//!   after the hold, once as many such batches ran as the limit allowed).
//!   A wait also ends when the hold does. After the hold, two batches may run at once, and
//!   one more after every round of batches that committed (the limit
//!   lifts at [`BATCH_LIMIT_LIFTS`]): a conflict among a few batches costs
//!   less than among every slot's. Measured with `idem-bench contention`:
//!   messages that each also update one of 8 hot rows. A conflict while
//!   the route runs one batch at a time (with another worker's batches,
//!   say) halves the size instead; the other batches of the conflict that
//!   made it run alone, which the route let start before (its pull loop
//!   passed [`may_start`](BatchSizer::may_start), and found no reason to
//!   wait once their messages came) and which fail after,
//!   change nothing (each used to halve the size: three batches that
//!   conflicted together took it from 16 to 4, and every such conflict
//!   brought the route down to 1, held per message). A pull loop let
//!   start before a conflict, and still waiting for messages when it came,
//!   checks again ([`must_wait`](BatchSizer::must_wait)) once they come,
//!   and parks them, leased, until the running batch ends: it no longer
//!   runs a second batch beside the lone one. A batch it does start then
//!   was let start at that check, so that one that runs alone after a
//!   conflict counts as alone.
//!
//! The state is shared by the route's batches in flight, behind a mutex
//! taken once per batch.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a route is first held per message after its batches fell back
/// to size 1: PostgreSQL's default `deadlock_timeout`, what one deadlock
/// costs.
pub(crate) const HOLD_MIN: Duration = Duration::from_secs(1);

/// The longest hold.
pub(crate) const HOLD_MAX: Duration = Duration::from_secs(64);

/// The number of batches at once at which the limit a conflict set lifts.
pub(crate) const BATCH_LIMIT_LIFTS: usize = 16;

/// The size at which batches are taken to work again: the hold is back to
/// [`HOLD_MIN`].
pub(crate) const HOLD_RESET_SIZE: usize = 8;

/// The size of a route's next batch (see the module docs).
#[derive(Debug)]
pub(crate) struct BatchSizer {
    /// The largest size.
    max: usize,
    adaptive: bool,
    state: Mutex<State>,
    /// Rung whenever a batch ends, for [`may_start`](Self::may_start).
    batch_ended: tokio::sync::Notify,
}

#[derive(Debug)]
struct State {
    /// The size the next batch takes at most.
    current: usize,
    /// Whether a batch has fallen back yet: until then, slow start.
    backed_off: bool,
    /// Full batches committed at this size, toward the next +1.
    credits: usize,
    /// How long the next fallback to 1 holds the route per message.
    hold: Duration,
    /// Until when the route is held per message.
    held_until: Option<Instant>,
    /// Batches of the route in flight.
    batches: usize,
    /// Until when the route runs at most one batch at a time, after a
    /// conflict between batches.
    alone_until: Option<Instant>,
    /// Since when it does: a batch that started before then was one of
    /// the batches that conflicted, not one that ran alone.
    alone_since: Option<Instant>,
    /// How many batches may run at once after that, if a conflict set a
    /// limit; it grows by one per round.
    batch_limit: Option<usize>,
    /// Batches committed toward the limit's next +1.
    limit_credits: usize,
    /// How long the next conflict makes the route run one batch at a time.
    conflict_hold: Duration,
    /// When the last conflict was.
    last_conflict: Option<Instant>,
}

impl BatchSizer {
    /// Always `size`.
    pub(crate) fn fixed(size: usize) -> Self {
        Self::new(size.max(1), false)
    }

    /// From 1, up to `max`, as the module docs say.
    pub(crate) fn adaptive(max: usize) -> Self {
        Self::new(max.max(1), true)
    }

    fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max,
            adaptive,
            state: Mutex::new(State {
                current: if adaptive { 1 } else { max },
                backed_off: false,
                credits: 0,
                hold: HOLD_MIN,
                held_until: None,
                batches: 0,
                alone_until: None,
                alone_since: None,
                batch_limit: None,
                limit_credits: 0,
                conflict_hold: HOLD_MIN,
                last_conflict: None,
            }),
            batch_ended: tokio::sync::Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding it leaves a consistent hint.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most messages the next batch takes (see the module docs for
    /// size 1).
    pub(crate) fn next(&self) -> usize {
        self.next_at(Instant::now())
    }

    fn next_at(&self, now: Instant) -> usize {
        let state = self.state();
        if !self.adaptive || state.current > 1 || self.max < 2 {
            return state.current;
        }
        match state.held_until {
            Some(until) if now < until => 1,
            _ => 2,
        }
    }

    /// Whether a group of one runs per message rather than as a batch of
    /// one: always on an adaptive route, and on a fixed one of size 1.
    pub(crate) fn runs_one_alone(&self) -> bool {
        self.adaptive || self.max == 1
    }

    /// Whether batches of this route set a short `lock_timeout` (see
    /// `store::transaction::begin_batch`): adaptive ones, which answer a
    /// conflict by running one batch at a time.
    pub(crate) fn bounds_lock_waits(&self) -> bool {
        self.adaptive
    }

    /// A batch starts: counted until the guard drops (when the batch ends,
    /// or its messages fall back to one per transaction).
    pub(crate) fn batch_started(self: &std::sync::Arc<Self>) -> BatchInFlight {
        self.state().batches += 1;
        BatchInFlight(std::sync::Arc::clone(self))
    }

    /// Waits until the route may start something: at once, unless batches
    /// have conflicted lately and one runs (see the module docs); then
    /// until it ends (or falls back to one message per transaction), or
    /// the hold that limits the route to one batch at a time ends first.
    pub(crate) async fn may_start(&self) {
        loop {
            let ended = self.batch_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let now = Instant::now();
            if !self.must_wait_at(now) {
                return;
            }
            let hold = self.state().alone_until.filter(|until| now < *until);
            match hold {
                Some(until) => {
                    let hold_ends = tokio::time::sleep_until(until.into());
                    tokio::select! {
                        () = ended => {}
                        () = hold_ends => {}
                    }
                }
                None => ended.await,
            }
        }
    }

    /// How many batches may run at once now, if conflicts limited them.
    pub(crate) fn batch_limit(&self) -> Option<usize> {
        self.state().limit_at(Instant::now())
    }

    /// Whether the route must wait now before it starts anything: what a
    /// pull loop let start (by [`may_start`](Self::may_start)) and that
    /// then waited for messages checks again, since batches may have
    /// conflicted meanwhile.
    pub(crate) fn must_wait(&self) -> bool {
        self.must_wait_at(Instant::now())
    }

    fn must_wait_at(&self, now: Instant) -> bool {
        let state = self.state();
        self.adaptive
            && state
                .limit_at(now)
                .is_some_and(|limit| state.batches >= limit)
    }

    /// A batch that the route let start at `started` (when it passed
    /// [`may_start`](Self::may_start)) conflicted with another transaction
    /// (see the module docs): the route runs one batch at a time for a
    /// while, or, if the batch ran alone, the size halves. The other
    /// batches of the same conflict, let start before the route ran alone
    /// and failing after, change nothing more: the conflict was among the
    /// batches, not the size.
    pub(crate) fn conflicted(&self, started: Instant) {
        self.conflicted_at(Instant::now(), started);
    }

    fn conflicted_at(&self, now: Instant, started: Instant) {
        if !self.adaptive {
            return;
        }
        let ran_alone = {
            let mut state = self.state();
            let alone = state.limit_at(now) == Some(1);
            if alone && state.alone_since.is_some_and(|since| started < since) {
                // One of the batches whose conflict made the route run
                // alone.
                return;
            }
            if !alone {
                state.batch_limit = Some(2);
                state.limit_credits = 0;
                let calm = state
                    .last_conflict
                    .is_none_or(|last| now.duration_since(last) > state.conflict_hold * 4);
                if calm {
                    state.conflict_hold = HOLD_MIN;
                }
                state.alone_until = Some(now + state.conflict_hold);
                state.alone_since = Some(now);
                state.conflict_hold = state.conflict_hold.saturating_mul(2).min(HOLD_MAX);
            }
            state.last_conflict = Some(now);
            alone
        };
        if ran_alone {
            self.fell_back_at(now);
        }
    }

    /// A batch of `size` messages committed.
    pub(crate) fn committed(&self, size: usize) {
        self.committed_at(size, Instant::now());
    }

    fn committed_at(&self, size: usize, now: Instant) {
        if !self.adaptive || size < 2 {
            return;
        }
        let mut state = self.state();
        if let Some(limit) = state.batch_limit
            && state.alone_until.is_none_or(|until| now >= until)
        {
            state.limit_credits += 1;
            if state.limit_credits >= limit {
                state.limit_credits = 0;
                state.batch_limit = (limit + 1 < BATCH_LIMIT_LIFTS).then_some(limit + 1);
            }
        }
        // Started before the hold, or not full: it says nothing.
        if state.held_until.is_some_and(|until| now < until) || size < state.current {
            return;
        }
        if !state.backed_off {
            state.current = state.current.saturating_mul(2).min(self.max);
            return;
        }
        state.credits += 1;
        if state.credits >= state.current {
            state.credits = 0;
            state.current = (state.current + 1).min(self.max);
            if state.current >= HOLD_RESET_SIZE {
                state.hold = HOLD_MIN;
            }
        }
    }

    /// A batch fell back: halve the size, and hold the route per message
    /// if that brings it to 1.
    pub(crate) fn fell_back(&self) {
        self.fell_back_at(Instant::now());
    }

    fn fell_back_at(&self, now: Instant) {
        if !self.adaptive {
            return;
        }
        let mut state = self.state();
        // Batches that started together (the tries of 2 when a hold ends)
        // fail together: only the first of them extends the hold.
        if state.held_until.is_some_and(|until| now < until) {
            return;
        }
        state.backed_off = true;
        state.credits = 0;
        state.current = (state.current / 2).max(1);
        if state.current == 1 {
            state.held_until = Some(now + state.hold);
            state.hold = state.hold.saturating_mul(2).min(HOLD_MAX);
        }
    }
}

impl State {
    /// How many batches may run at once at `now`, if a conflict limited
    /// them.
    fn limit_at(&self, now: Instant) -> Option<usize> {
        match self.alone_until {
            Some(until) if now < until => Some(1),
            _ => self.batch_limit,
        }
    }
}

/// Counts a batch as in flight until dropped.
pub(crate) struct BatchInFlight(std::sync::Arc<BatchSizer>);

impl Drop for BatchInFlight {
    fn drop(&mut self) {
        {
            let mut state = self.0.state();
            state.batches = state.batches.saturating_sub(1);
        }
        self.0.batch_ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(sizer: &BatchSizer) -> usize {
        sizer.state().current
    }

    #[test]
    fn a_fixed_size_never_moves() {
        let sizer = BatchSizer::fixed(16);
        sizer.committed(16);
        sizer.fell_back();
        assert_eq!(sizer.next(), 16);
        assert!(!sizer.runs_one_alone());
        assert!(BatchSizer::fixed(1).runs_one_alone());
        assert_eq!(BatchSizer::fixed(1).next(), 1);
    }

    #[test]
    fn full_batches_double_the_size_until_the_first_fallback_then_add_one_per_round() {
        let sizer = BatchSizer::adaptive(64);
        assert_eq!(size(&sizer), 1);
        assert_eq!(sizer.next(), 2, "at 1, a gather takes 2 to show a backlog");
        for expected in [2, 4, 8, 16, 32, 64, 64] {
            sizer.committed(sizer.next());
            assert_eq!(sizer.next(), expected);
        }
        sizer.fell_back();
        assert_eq!(sizer.next(), 32);
        for _ in 0..31 {
            sizer.committed(32);
        }
        assert_eq!(size(&sizer), 32, "31 full batches of 32: not yet a round");
        sizer.committed(32);
        assert_eq!(size(&sizer), 33, "after a fallback, +1 per round");
    }

    #[test]
    fn a_batch_that_was_not_full_does_not_grow_the_size() {
        let sizer = BatchSizer::adaptive(64);
        sizer.committed(1);
        assert_eq!(size(&sizer), 1, "a message alone shows no backlog");
        sizer.committed(2);
        sizer.committed(2);
        assert_eq!(size(&sizer), 4);
        sizer.committed(3);
        assert_eq!(size(&sizer), 4, "3 of 4: no backlog shown");
    }

    #[test]
    fn fallbacks_halve_the_size_and_at_one_hold_the_route_per_message_longer_each_time() {
        let sizer = BatchSizer::adaptive(8);
        for _ in 0..3 {
            sizer.committed(sizer.next());
        }
        assert_eq!(size(&sizer), 8);
        let now = Instant::now();
        for expected in [4, 2] {
            sizer.fell_back_at(now);
            assert_eq!(size(&sizer), expected);
            assert_eq!(sizer.next_at(now), expected, "not held above 1");
        }
        sizer.fell_back_at(now);
        assert_eq!(sizer.next_at(now), 1, "held per message");
        assert_eq!(sizer.next_at(now + HOLD_MIN), 2, "then it tries 2");
        // The try failed: held twice as long.
        let later = now + HOLD_MIN;
        sizer.fell_back_at(later);
        assert_eq!(sizer.next_at(later + HOLD_MIN), 1);
        assert_eq!(sizer.next_at(later + 2 * HOLD_MIN), 2);
        // A batch started before the hold, committing during it: ignored.
        sizer.committed_at(2, later + HOLD_MIN);
        assert_eq!(size(&sizer), 1);
        // A try that commits after the hold grows it again; the hold is
        // back to its shortest only once the size is back to 8.
        let after = later + 2 * HOLD_MIN;
        sizer.committed_at(2, after);
        assert_eq!(
            size(&sizer),
            2,
            "a batch of 2 at size 1 is a full round: +1"
        );
        assert_eq!(sizer.state().hold, 4 * HOLD_MIN);
        for _ in 0..(2 + 3 + 4 + 5 + 6 + 7) {
            let next = size(&sizer);
            sizer.committed_at(next, after);
        }
        assert_eq!(size(&sizer), 8);
        assert_eq!(sizer.state().hold, HOLD_MIN);
    }

    #[test]
    fn the_hold_stops_at_its_longest() {
        let sizer = BatchSizer::adaptive(4);
        let mut now = Instant::now();
        for _ in 0..20 {
            sizer.fell_back_at(now);
            // Each try fails as its hold ends.
            now += sizer.state().hold;
        }
        assert_eq!(sizer.state().hold, HOLD_MAX);
    }

    #[test]
    fn fallbacks_during_a_hold_do_not_extend_it() {
        let sizer = BatchSizer::adaptive(4);
        let now = Instant::now();
        sizer.fell_back_at(now);
        // The other tries of 2 that started with it fail a moment later.
        for _ in 0..7 {
            sizer.fell_back_at(now + Duration::from_millis(10));
        }
        assert_eq!(
            sizer.state().hold,
            2 * HOLD_MIN,
            "doubled once, not 8 times"
        );
        assert_eq!(sizer.next_at(now + HOLD_MIN), 2);
    }

    #[test]
    fn a_conflict_makes_the_route_run_one_batch_at_a_time_for_a_while() {
        let sizer = std::sync::Arc::new(BatchSizer::adaptive(64));
        for _ in 0..4 {
            sizer.committed(sizer.next());
        }
        assert_eq!(size(&sizer), 16);
        let now = Instant::now();
        let running = sizer.batch_started();
        sizer.conflicted_at(now, now);
        assert!(sizer.must_wait_at(now), "a batch runs: nothing else starts");
        assert_eq!(size(&sizer), 16, "the size holds");
        drop(running);
        assert!(!sizer.must_wait_at(now), "none runs: a batch may start");
        let first = sizer.batch_started();
        assert!(
            !sizer.must_wait_at(now + HOLD_MIN),
            "the hold is over: two at once"
        );
        let second = sizer.batch_started();
        assert!(sizer.must_wait_at(now + HOLD_MIN), "but not three");
        // A round of two batches committed: three at once.
        sizer.committed_at(16, now + HOLD_MIN);
        sizer.committed_at(16, now + HOLD_MIN);
        assert!(!sizer.must_wait_at(now + HOLD_MIN));
        drop((first, second));
        // Conflicting again soon after: held twice as long.
        let _running = sizer.batch_started();
        let again = now + HOLD_MIN + Duration::from_millis(10);
        sizer.conflicted_at(again, now + HOLD_MIN);
        assert!(sizer.must_wait_at(again + HOLD_MIN));
        assert!(!sizer.must_wait_at(again + 2 * HOLD_MIN));
        // A conflict while running one batch at a time: the size halves.
        let before = size(&sizer);
        sizer.conflicted_at(
            again + Duration::from_millis(10),
            again + Duration::from_millis(5),
        );
        assert_eq!(size(&sizer), before / 2);
        // After a calm of four holds, the hold is back to its shortest.
        let calm = again + 20 * HOLD_MIN;
        sizer.conflicted_at(calm, calm);
        assert!(!sizer.must_wait_at(calm + HOLD_MIN));
    }

    #[test]
    fn the_batches_of_one_conflict_keep_the_size() {
        let sizer = std::sync::Arc::new(BatchSizer::adaptive(64));
        for _ in 0..4 {
            sizer.committed(sizer.next());
        }
        assert_eq!(size(&sizer), 16);
        // Three batches in flight lock rows in different orders; each is
        // cancelled at the lock wait bound, one after the other.
        let started = Instant::now();
        let at = |ms| started + Duration::from_millis(ms);
        sizer.conflicted_at(at(200), started);
        sizer.conflicted_at(at(201), started);
        sizer.conflicted_at(at(203), at(1));
        assert_eq!(
            size(&sizer),
            16,
            "one conflict among batches: the size holds"
        );
        assert!(
            sizer.state().held_until.is_none(),
            "and the route is not held per message"
        );
        assert_eq!(
            sizer.state().conflict_hold,
            2 * HOLD_MIN,
            "the hold grew once, for the first of them"
        );
        let _alone = sizer.batch_started();
        assert!(sizer.must_wait_at(at(204)), "one batch at a time");
        // A batch that ran alone and conflicted (with another worker's, say):
        // the size halves.
        sizer.conflicted_at(at(500), at(300));
        assert_eq!(size(&sizer), 8);
    }

    #[tokio::test]
    async fn may_start_waits_for_the_running_batch_to_end() {
        let sizer = std::sync::Arc::new(BatchSizer::adaptive(64));
        let running = sizer.batch_started();
        sizer.conflicted(Instant::now());
        let waiting = tokio::spawn({
            let sizer = sizer.clone();
            async move { sizer.may_start().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "held while the batch runs");
        drop(running);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("free once it ended")
            .unwrap();
    }

    #[test]
    fn a_fixed_route_ignores_conflicts() {
        let sizer = std::sync::Arc::new(BatchSizer::fixed(16));
        let _running = sizer.batch_started();
        sizer.conflicted(Instant::now());
        assert_eq!(sizer.next(), 16);
        assert!(!sizer.must_wait_at(Instant::now()));
        assert!(!sizer.bounds_lock_waits());
    }

    #[test]
    fn a_cap_of_one_never_gathers_two() {
        let sizer = BatchSizer::adaptive(1);
        assert_eq!(sizer.next(), 1);
    }
}
