//! Where a handler's messages come from, and how they are paced.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream;

use crate::ack::AckMode;
use crate::error::Error;

/// How progress heartbeats are sent while a handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeartbeatSetting {
    /// Every third of ack_wait.
    Auto,
    Every(Duration),
    Off,
}

/// One binding of a handler to a JetStream durable pull consumer.
///
/// Defaults, each checked at start-up:
///
/// | setting | default |
/// |---|---|
/// | `ack_wait` | 30 s (JetStream's default) |
/// | `max_deliver` | unlimited (-1, JetStream's default) |
/// | `max_ack_pending` | 1000 (JetStream's default); must be ≥ `concurrency` |
/// | `concurrency` | 8 messages in flight per route in this process |
/// | heartbeat | `+WPI` every ack_wait / 3 while a handler runs |
/// | ack | plain `+ACK` ([`AckMode::Ack`]) |
/// | `nak_delay` | 1 s before a failed message is redelivered |
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{AckMode, Route};
///
/// let route = Route::new("LEDGER", "ledger-credit")
///     .filter_subject("ledger.credit")
///     .ack_wait(Duration::from_secs(10))
///     .concurrency(16)
///     .ack_mode(AckMode::DoubleAck);
/// assert_eq!(route.durable_name(), "ledger-credit");
/// ```
#[derive(Debug, Clone)]
pub struct Route {
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) filter_subjects: Vec<String>,
    pub(crate) create_stream: Option<stream::Config>,
    pub(crate) ack_wait: Duration,
    pub(crate) max_deliver: i64,
    pub(crate) max_ack_pending: i64,
    pub(crate) concurrency: usize,
    heartbeat: HeartbeatSetting,
    pub(crate) ack_mode: AckMode,
    pub(crate) nak_delay: Duration,
    pub(crate) pull_expires: Duration,
}

impl Route {
    /// A route that reads `stream` through the durable consumer `durable`.
    /// The consumer is created, or updated to this route's settings, at
    /// start-up.
    pub fn new(stream: impl Into<String>, durable: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            durable: durable.into(),
            filter_subjects: Vec::new(),
            create_stream: None,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: 1000,
            concurrency: 8,
            heartbeat: HeartbeatSetting::Auto,
            ack_mode: AckMode::Ack,
            nak_delay: Duration::from_secs(1),
            pull_expires: Duration::from_secs(2),
        }
    }

    /// Only deliver messages whose subject matches `subject` (wildcards
    /// allowed). May be called more than once.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subjects.push(subject.into());
        self
    }

    /// Create the stream with `config` if it is missing, or update it to
    /// `config` if it exists. Without this, a missing stream is a start-up
    /// error.
    pub fn create_stream(mut self, config: stream::Config) -> Self {
        self.create_stream = Some(config);
        self
    }

    /// How long JetStream waits for an ack before redelivering.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// The most deliveries of one message (-1: unlimited).
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// The most unacked messages JetStream hands out for this consumer,
    /// across all workers. Delivery stalls silently when it is reached.
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending;
        self
    }

    /// The most messages this process handles at once for this route. Each
    /// holds a pooled connection while it runs, so keep the pool at least as
    /// large as the sum over routes.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Send a progress heartbeat (`+WPI`) every `interval` while a handler
    /// runs, instead of every ack_wait / 3.
    pub fn heartbeat_every(mut self, interval: Duration) -> Self {
        self.heartbeat = HeartbeatSetting::Every(interval);
        self
    }

    /// Send no progress heartbeats: a handler that outlives ack_wait is then
    /// redelivered while it runs. The redelivery waits on the claim and is
    /// skipped, so this is safe, but it wastes work; meant for tests.
    pub fn without_heartbeat(mut self) -> Self {
        self.heartbeat = HeartbeatSetting::Off;
        self
    }

    /// How a committed message is acked.
    pub fn ack_mode(mut self, ack_mode: AckMode) -> Self {
        self.ack_mode = ack_mode;
        self
    }

    /// How long a failed message waits before it is redelivered.
    pub fn nak_delay(mut self, nak_delay: Duration) -> Self {
        self.nak_delay = nak_delay;
        self
    }

    /// The durable consumer's name, which also names the route in logs and
    /// errors.
    pub fn durable_name(&self) -> &str {
        &self.durable
    }

    /// The heartbeat interval in force, if any.
    pub fn heartbeat_interval(&self) -> Option<Duration> {
        match self.heartbeat {
            HeartbeatSetting::Auto => Some(self.ack_wait / 3),
            HeartbeatSetting::Every(interval) => Some(interval),
            HeartbeatSetting::Off => None,
        }
    }

    /// Refuses settings that stall or misbehave.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let refuse = |reason: String| {
            Err(Error::Config {
                route: self.durable.clone(),
                reason,
            })
        };
        if self.stream.is_empty() || self.durable.is_empty() {
            return refuse("the stream and durable consumer names must not be empty".into());
        }
        if self.concurrency == 0 {
            return refuse("concurrency must be at least 1".into());
        }
        if self.ack_wait.is_zero() {
            return refuse("ack_wait must be positive".into());
        }
        if self.max_ack_pending >= 0 && (self.max_ack_pending as u64) < self.concurrency as u64 {
            return refuse(format!(
                "max_ack_pending ({}) is below concurrency ({}); raise max_ack_pending or lower concurrency",
                self.max_ack_pending, self.concurrency
            ));
        }
        if let Some(interval) = self.heartbeat_interval()
            && (interval.is_zero() || interval >= self.ack_wait)
        {
            return refuse(format!(
                "the heartbeat interval ({interval:?}) must be positive and shorter than ack_wait ({:?})",
                self.ack_wait
            ));
        }
        Ok(())
    }

    /// The durable pull consumer this route reads from.
    pub(crate) fn consumer_config(&self) -> pull::Config {
        let (filter_subject, filter_subjects) = match self.filter_subjects.as_slice() {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            max_ack_pending: self.max_ack_pending,
            filter_subject,
            filter_subjects,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_heartbeat_is_a_third_of_ack_wait() {
        let route = Route::new("S", "c");
        route.validate().unwrap();
        assert_eq!(route.heartbeat_interval(), Some(Duration::from_secs(10)));
    }

    #[test]
    fn settings_that_stall_are_refused() {
        let err = Route::new("S", "c")
            .concurrency(10)
            .max_ack_pending(5)
            .validate()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("max_ack_pending (5) is below concurrency (10)")
        );
        let err = Route::new("S", "c")
            .ack_wait(Duration::from_secs(1))
            .heartbeat_every(Duration::from_secs(2))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("shorter than ack_wait"));
    }
}
