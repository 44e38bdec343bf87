//! The retry policy: how often, and how far apart, a failing message is tried.

use std::time::Duration;

/// How a route retries failed messages.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | `max_deliver` | 10 | deliveries before a transiently failing message is dead-lettered |
/// | `backoff` | 1 s doubling to 5 min | NAK delay after the n-th failed delivery: `initial × 2^(n-1)`, capped |
/// | `jitter` | ±20 % | spreads retries of messages that failed together |
/// | `in_process_attempts` | 3 | tries of one delivery for [`ErrorClass::RetryNow`](crate::ErrorClass::RetryNow) and [`ErrorClass::RetryNowThenPermanent`](crate::ErrorClass::RetryNowThenPermanent) errors before NAKing or dead-lettering |
///
/// The same backoff, capped at 30 s, paces the retries of a message that is
/// *held* rather than NAKed: while the database cannot be used at all
/// (BEGIN, the claim or a connection fails) and while a dead letter cannot
/// be published. A held message keeps its lease through heartbeats and
/// uses up no delivery.
///
/// The limit is enforced by the runtime. The consumer's server-side
/// `max_deliver` is set 3 further out, as a backstop for a message that
/// never reaches the runtime; the router dead-letters what that backstop
/// stops (see the guide's failure handling chapter). A message that arrives past the
/// limit (its earlier attempts crashed the worker) is dead-lettered without
/// running, unless its claim shows it was processed (the check waits for an
/// attempt still running), in which case it is acked.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_deliver(5)
///     .backoff(Duration::from_millis(200), Duration::from_secs(10));
/// assert_eq!(policy.nak_delay_without_jitter(1), Duration::from_millis(200));
/// assert_eq!(policy.nak_delay_without_jitter(3), Duration::from_millis(800));
/// assert_eq!(policy.nak_delay_without_jitter(20), Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub(crate) max_deliver: u64,
    initial: Duration,
    max: Duration,
    pub(crate) jitter: f64,
    pub(crate) in_process_attempts: u32,
    pub(crate) in_process_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_deliver: 10,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            jitter: 0.2,
            in_process_attempts: 3,
            in_process_backoff: Duration::from_millis(20),
        }
    }
}

impl RetryPolicy {
    /// Dead-letter a message whose `max_deliver`-th delivery fails
    /// transiently. At least 1.
    pub fn max_deliver(mut self, max_deliver: u64) -> Self {
        self.max_deliver = max_deliver.max(1);
        self
    }

    /// NAK delays start at `initial` and double per delivery up to `max`.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial = initial;
        self.max = max.max(initial);
        self
    }

    /// Randomize each NAK delay by up to ±`fraction` (clamped to 0..=1).
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = fraction.clamp(0.0, 1.0);
        self
    }

    /// Tries of one delivery for errors worth retrying at once. At least 1.
    pub fn in_process_attempts(mut self, attempts: u32) -> Self {
        self.in_process_attempts = attempts.max(1);
        self
    }

    /// The NAK delay after delivery number `delivered` failed, before jitter.
    pub fn nak_delay_without_jitter(&self, delivered: u64) -> Duration {
        let doublings = delivered.saturating_sub(1).min(32) as u32;
        self.initial
            .checked_mul(1u32 << doublings.min(31))
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// Every NAK delay the policy can give, before jitter: after deliveries
    /// 1 to `max_deliver − 1` (the last delivery is dead-lettered, not
    /// NAKed), as runs of equal delays `(delay, how many)`. Once the delay
    /// stops growing (it reached `max`, or stopped doubling) the rest is one
    /// run, so a huge `max_deliver` costs nothing.
    pub(crate) fn nak_delay_runs(&self) -> Vec<(Duration, u64)> {
        let last = self.max_deliver.saturating_sub(1);
        let mut runs: Vec<(Duration, u64)> = Vec::new();
        let mut delivered = 1;
        while delivered <= last {
            let delay = self.nak_delay_without_jitter(delivered);
            // `nak_delay_without_jitter` doubles at most 31 times.
            let count = if delay >= self.max || delivered >= 32 {
                last - delivered + 1
            } else {
                1
            };
            match runs.last_mut() {
                Some((previous, n)) if *previous == delay => *n += count,
                _ => runs.push((delay, count)),
            }
            delivered += count;
        }
        runs
    }

    /// The NAK delay after delivery number `delivered` failed.
    pub(crate) fn nak_delay(&self, delivered: u64) -> Duration {
        let base = self.nak_delay_without_jitter(delivered);
        if self.jitter == 0.0 {
            return base;
        }
        let factor = 1.0 + self.jitter * (2.0 * rand::random::<f64>() - 1.0);
        base.mul_f64(factor)
    }

    /// How long a held message waits before its `attempt`-th retry: the
    /// backoff, capped at 30 s so that a recovered database is noticed soon,
    /// with jitter.
    pub(crate) fn hold_delay(&self, attempt: u64) -> Duration {
        const HOLD_CAP: Duration = Duration::from_secs(30);
        let base = self.nak_delay_without_jitter(attempt).min(HOLD_CAP);
        if self.jitter == 0.0 {
            return base;
        }
        base.mul_f64(1.0 + self.jitter * (2.0 * rand::random::<f64>() - 1.0))
    }

    /// Whether a failure of delivery number `delivered` is the last allowed.
    pub(crate) fn exhausted(&self, delivered: u64) -> bool {
        delivered >= self.max_deliver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_fraction() {
        let policy = RetryPolicy::default().jitter(0.2);
        for delivered in 1..6 {
            let base = policy.nak_delay_without_jitter(delivered).as_secs_f64();
            for _ in 0..50 {
                let delay = policy.nak_delay(delivered).as_secs_f64();
                assert!(
                    (base * 0.8..=base * 1.2).contains(&delay),
                    "{delay} vs {base}"
                );
            }
        }
    }

    #[test]
    fn nak_delay_runs_list_every_delay_once_it_stops_growing_as_one_run() {
        let policy = RetryPolicy::default().max_deliver(14);
        let runs = policy.nak_delay_runs();
        let listed: Vec<Duration> = runs
            .iter()
            .flat_map(|(delay, n)| std::iter::repeat_n(*delay, *n as usize))
            .collect();
        let each: Vec<Duration> = (1..14)
            .map(|n| policy.nak_delay_without_jitter(n))
            .collect();
        assert_eq!(listed, each);
        assert_eq!(runs.last(), Some(&(Duration::from_secs(300), 4)));
        assert!(
            RetryPolicy::default()
                .max_deliver(1)
                .nak_delay_runs()
                .is_empty()
        );
        let huge = RetryPolicy::default()
            .max_deliver(u64::MAX)
            .backoff(Duration::from_nanos(1), Duration::MAX);
        let runs = huge.nak_delay_runs();
        assert_eq!(runs.len(), 32);
        assert_eq!(runs.iter().map(|(_, n)| n).sum::<u64>(), u64::MAX - 1);
    }

    #[test]
    fn the_last_delivery_is_max_deliver() {
        let policy = RetryPolicy::default().max_deliver(3);
        assert!(!policy.exhausted(2));
        assert!(policy.exhausted(3));
    }
}
