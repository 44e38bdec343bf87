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
//!   and starts the growth; once a fallback has brought the size down to 1,
//!   only one gather in [`PROBE_EVERY`] does, so that a route whose batches
//!   keep failing runs per message, and finds out now and then whether they
//!   still do.
//! - **Slow start, then additive increase.** The size doubles with each full
//!   batch that committed, until the first failure; after that it grows by
//!   one per full batch that committed.
//! - **Multiplicative decrease.** A batch that fell back (a deadlock, a
//!   serialization failure, a handler's error, a COMMIT that did not commit)
//!   halves the size, down to 1.
//!
//! The size is shared by the route's batches in flight; updates race
//! harmlessly (each is one atomic read-modify-write of a hint, not a count).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// After a fallback brought the size down to 1: one gather in this many
/// takes up to 2 messages, to probe whether batches commit again.
pub(crate) const PROBE_EVERY: usize = 16;

/// The size of a route's next batch (see the module docs).
#[derive(Debug)]
pub(crate) struct BatchSizer {
    /// The size the next batch takes at most.
    current: AtomicUsize,
    /// The largest size.
    max: usize,
    adaptive: bool,
    /// Whether a batch has fallen back yet: until then, slow start.
    backed_off: AtomicBool,
    /// Gathers at size 1 since the last fallback, for the probes.
    gathers_at_one: AtomicUsize,
}

impl BatchSizer {
    /// Always `size`.
    pub(crate) fn fixed(size: usize) -> Self {
        Self {
            current: AtomicUsize::new(size.max(1)),
            max: size.max(1),
            adaptive: false,
            backed_off: AtomicBool::new(false),
            gathers_at_one: AtomicUsize::new(0),
        }
    }

    /// From 1, up to `max`, as the module docs say.
    pub(crate) fn adaptive(max: usize) -> Self {
        Self {
            current: AtomicUsize::new(1),
            max: max.max(1),
            adaptive: true,
            backed_off: AtomicBool::new(false),
            gathers_at_one: AtomicUsize::new(0),
        }
    }

    /// The most messages the next batch takes (see the module docs for
    /// size 1).
    pub(crate) fn next(&self) -> usize {
        let current = self.current.load(Ordering::Relaxed);
        if !self.adaptive || current > 1 || self.max < 2 {
            return current;
        }
        if !self.backed_off.load(Ordering::Relaxed) {
            return 2;
        }
        let gathers = self.gathers_at_one.fetch_add(1, Ordering::Relaxed);
        if gathers % PROBE_EVERY == PROBE_EVERY - 1 {
            2
        } else {
            1
        }
    }

    /// Whether a group of one runs per message rather than as a batch of
    /// one: always on an adaptive route, and on a fixed one of size 1.
    pub(crate) fn runs_one_alone(&self) -> bool {
        self.adaptive || self.max == 1
    }

    /// A batch of `size` messages committed.
    pub(crate) fn committed(&self, size: usize) {
        if !self.adaptive {
            return;
        }
        let _ = self
            .current
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
                // Not full: it says nothing about a backlog.
                if size < current || size < 2 {
                    return None;
                }
                let grown = if self.backed_off.load(Ordering::Relaxed) {
                    current + 1
                } else {
                    current.saturating_mul(2)
                };
                Some(grown.min(self.max))
            });
    }

    /// A batch fell back: halve the size.
    pub(crate) fn fell_back(&self) {
        if !self.adaptive {
            return;
        }
        self.backed_off.store(true, Ordering::Relaxed);
        let _ = self
            .current
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
                Some((current / 2).max(1))
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(sizer: &BatchSizer) -> usize {
        sizer.current.load(Ordering::Relaxed)
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
    fn full_batches_double_the_size_until_the_first_fallback_then_add_one() {
        let sizer = BatchSizer::adaptive(64);
        assert_eq!(size(&sizer), 1);
        assert_eq!(sizer.next(), 2, "at 1, a gather takes 2 to show a backlog");
        for expected in [2, 4, 8, 16, 32, 64, 64] {
            sizer.committed(sizer.next());
            assert_eq!(sizer.next(), expected);
        }
        sizer.fell_back();
        assert_eq!(sizer.next(), 32);
        sizer.committed(32);
        assert_eq!(sizer.next(), 33, "after a fallback, growth is additive");
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
    fn fallbacks_halve_the_size_down_to_one_and_then_it_only_probes() {
        let sizer = BatchSizer::adaptive(8);
        for _ in 0..3 {
            sizer.committed(sizer.next());
        }
        assert_eq!(size(&sizer), 8);
        for expected in [4, 2, 1, 1] {
            sizer.fell_back();
            assert_eq!(size(&sizer), expected);
        }
        let gathers: Vec<usize> = (0..2 * PROBE_EVERY).map(|_| sizer.next()).collect();
        assert_eq!(
            gathers.iter().filter(|&&n| n == 2).count(),
            2,
            "one probe of 2 per {PROBE_EVERY} gathers: {gathers:?}"
        );
        sizer.committed(2);
        assert_eq!(size(&sizer), 2, "a probe that committed grows it again");
    }

    #[test]
    fn a_cap_of_one_never_gathers_two() {
        let sizer = BatchSizer::adaptive(1);
        assert_eq!(sizer.next(), 1);
    }
}
