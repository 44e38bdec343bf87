//! The faults a run can inject, and sets of them.
//!
//! Each fault is one way the world breaks a handler that is not safe: a
//! message seen twice, an attempt that commits and is not acked, two
//! attempts at once, a COMMIT whose outcome is lost, a rollback after the
//! body ran, a server that restarts, a dead letter sent back. A run injects
//! each fault it was given into the user's own routers, and
//! [`Run::until_settled`](crate::Run::until_settled) fails unless each one
//! is shown to have happened: a test never passes on a fault that did not
//! land.

use std::collections::BTreeSet;
use std::fmt;

/// One fault a [`Run`](crate::Run) can inject.
///
/// The faults that act on a message ("per message" below) each pick their
/// own messages: the first ones each handler sees, a few per fault
/// ([`Faults::messages_each`]), no message given two (crash-before-ack, the
/// first ones without another fault that commit: publish enough messages
/// for it beyond those the others take). The others act on the
/// publishing or on a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Fault {
    /// A publisher retry inside the stream's duplicate window: the same
    /// message, same `Nats-Msg-Id`, published again at once. Shown by the
    /// PubAck, which says JetStream dropped it as a duplicate.
    DuplicateInWindow,
    /// A publisher retry after the duplicate window, which JetStream stores
    /// again: only the handler's claim stands between it and a second
    /// effect. The run shortens the window of every stream its routes read
    /// to 1 s (after the routers started), waits it out, and republishes.
    /// Shown by the PubAck: stored, at a new sequence.
    DuplicateAfterWindow,
    /// Per message: the worker commits, then dies before it acks; JetStream
    /// redelivers after ack_wait (a request gets no reply, and its client
    /// sends it again). Injected with the runtime's hook that drops the
    /// message after COMMIT. Shown by the redelivery.
    CrashBeforeAck,
    /// Per message: ack_wait expires while the first attempt still runs,
    /// its transaction and claim open, and JetStream redelivers. The run
    /// turns the routes' heartbeats off and holds the first attempt open
    /// after its handler returned until the redelivery has arrived (and,
    /// when PostgreSQL shows it, waits on a lock). Shown by the redelivery's
    /// arrival during the hold. Not for requests.
    RedeliveryDuringAttempt,
    /// Per message: the connection is cut right after PostgreSQL ran the
    /// COMMIT that follows the message's handler, before the worker hears
    /// the result. Injected by a proxy between the routers and PostgreSQL.
    /// Shown by the proxy's count of cut COMMITs.
    AmbiguousCommit,
    /// Per message: the handler's call fails after its body ran (a
    /// transient error), so its transaction rolls back and the message is
    /// tried again. Whatever the body did outside the transaction is done
    /// twice. Shown by the later attempt.
    HandlerFailure,
    /// PostgreSQL is stopped like a crash (immediate shutdown) and started
    /// again while messages flow. Shown by a new server process and
    /// commits after it. Needs a server of the kit's own (no
    /// `DATABASE_URL`).
    PostgresRestart,
    /// nats-server is SIGKILLed and started again on its store while
    /// messages flow. Shown by a new server process, and by the routers'
    /// clients seeing the connection drop and come back. Needs a server of
    /// the kit's own (no `NATS_URL`), and streams on file storage.
    NatsRestart,
    /// Per message: the handler fails permanently, the message is
    /// dead-lettered, and the run replays the dead letter, then replays it
    /// again after the stream's duplicate window (as a retried bulk replay
    /// would), and discards it. Shown by the dead letter and both replays
    /// stored. Not for requests.
    DeadLetterReplay,
}

impl Fault {
    /// Every fault, in the order a report lists them.
    pub const ALL: [Fault; 9] = [
        Fault::DuplicateInWindow,
        Fault::DuplicateAfterWindow,
        Fault::CrashBeforeAck,
        Fault::RedeliveryDuringAttempt,
        Fault::AmbiguousCommit,
        Fault::HandlerFailure,
        Fault::PostgresRestart,
        Fault::NatsRestart,
        Fault::DeadLetterReplay,
    ];

    /// The fault's name in reports, e.g. `crash-before-ack`.
    ///
    /// ```
    /// use idem_test::Fault;
    /// assert_eq!(Fault::CrashBeforeAck.name(), "crash-before-ack");
    /// assert_eq!(Fault::CrashBeforeAck.to_string(), "crash-before-ack");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Fault::DuplicateInWindow => "duplicate-in-window",
            Fault::DuplicateAfterWindow => "duplicate-after-window",
            Fault::CrashBeforeAck => "crash-before-ack",
            Fault::RedeliveryDuringAttempt => "redelivery-during-attempt",
            Fault::AmbiguousCommit => "ambiguous-commit",
            Fault::HandlerFailure => "handler-failure",
            Fault::PostgresRestart => "postgres-restart",
            Fault::NatsRestart => "nats-restart",
            Fault::DeadLetterReplay => "dead-letter-replay",
        }
    }

    /// What the fault does, in one line, for reports.
    pub fn what(self) -> &'static str {
        match self {
            Fault::DuplicateInWindow => {
                "published again at once (JetStream drops the copy in its duplicate window)"
            }
            Fault::DuplicateAfterWindow => {
                "published again after the duplicate window (JetStream stores the copy)"
            }
            Fault::CrashBeforeAck => {
                "committed, then not acked, as if the worker died; redelivered"
            }
            Fault::RedeliveryDuringAttempt => {
                "redelivered while the first attempt was still open (ack_wait expired)"
            }
            Fault::AmbiguousCommit => {
                "connection cut after PostgreSQL ran the COMMIT, before the worker heard it"
            }
            Fault::HandlerFailure => "handler ran, then its call failed: rolled back and retried",
            Fault::PostgresRestart => "PostgreSQL crashed (immediate shutdown) and restarted",
            Fault::NatsRestart => "nats-server SIGKILLed and restarted on its store",
            Fault::DeadLetterReplay => {
                "failed permanently, dead-lettered, replayed twice (once after the window)"
            }
        }
    }

    /// Whether the fault picks messages of its own (rather than acting on
    /// the publishing or a server).
    pub(crate) fn per_message(self) -> bool {
        matches!(
            self,
            Fault::CrashBeforeAck
                | Fault::RedeliveryDuringAttempt
                | Fault::AmbiguousCommit
                | Fault::HandlerFailure
                | Fault::DeadLetterReplay
        )
    }

    /// Whether the fault can act on a request of a reply route.
    pub(crate) fn fits_requests(self) -> bool {
        matches!(
            self,
            Fault::CrashBeforeAck | Fault::AmbiguousCommit | Fault::HandlerFailure
        )
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The faults a run injects, and how many messages each per-message fault
/// takes per handler (2 by default).
///
/// ```
/// use idem_test::{Fault, Faults};
///
/// let all = Faults::all();
/// assert!(all.contains(Fault::NatsRestart));
///
/// let some = Faults::none().with(Fault::HandlerFailure).with(Fault::CrashBeforeAck);
/// assert_eq!(some.iter().count(), 2);
///
/// let quick = Faults::all().without(Fault::NatsRestart).messages_each(1);
/// assert!(!quick.contains(Fault::NatsRestart));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Faults {
    set: BTreeSet<Fault>,
    each: usize,
}

impl Default for Faults {
    fn default() -> Self {
        Faults::none()
    }
}

impl Faults {
    /// No fault: the run only publishes and waits.
    pub fn none() -> Faults {
        Faults {
            set: BTreeSet::new(),
            each: 2,
        }
    }

    /// Every [`Fault`].
    pub fn all() -> Faults {
        Fault::ALL.into_iter().fold(Faults::none(), Faults::with)
    }

    /// This set and `fault`.
    pub fn with(mut self, fault: Fault) -> Faults {
        self.set.insert(fault);
        self
    }

    /// This set without `fault`.
    pub fn without(mut self, fault: Fault) -> Faults {
        self.set.remove(&fault);
        self
    }

    /// How many messages each per-message fault takes, per handler
    /// (default 2; at least 1).
    pub fn messages_each(mut self, n: usize) -> Faults {
        self.each = n.max(1);
        self
    }

    /// Whether `fault` is in the set.
    pub fn contains(&self, fault: Fault) -> bool {
        self.set.contains(&fault)
    }

    /// The faults, in report order.
    pub fn iter(&self) -> impl Iterator<Item = Fault> + '_ {
        self.set.iter().copied()
    }

    pub(crate) fn each(&self) -> usize {
        self.each
    }
}

impl From<Fault> for Faults {
    fn from(fault: Fault) -> Faults {
        Faults::none().with(fault)
    }
}

impl FromIterator<Fault> for Faults {
    fn from_iter<I: IntoIterator<Item = Fault>>(faults: I) -> Faults {
        faults.into_iter().fold(Faults::none(), Faults::with)
    }
}
