//! Fault injection for tests (feature `fault-injection`). Never enable it in
//! production: its hooks make the runtime misbehave on purpose.

use std::fmt;
use std::sync::Arc;

use crate::handler::delivery::Delivery;

/// What the runtime does after a commit, as decided by a test hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommit {
    /// Ack as usual.
    Ack,
    /// Act as if the process died between COMMIT and ack: never ack, NAK or
    /// TERM the message, so JetStream redelivers it after ack_wait.
    DropWithoutAck,
}

/// What an outbox relay does after a cycle's PubAcks, as decided by a test
/// hook ([`Relay::fault_after_pubacks`](crate::outbox::Relay::fault_after_pubacks)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterPubAcks {
    /// Delete the rows and commit, as usual.
    Delete,
    /// Act as if the relay's process died between the PubAcks and its
    /// DELETE: roll back (the rows stay pending) and end the relay.
    Crash,
}

type AfterCommitHook = dyn Fn(&Delivery) -> AfterCommit + Send + Sync;

/// Hooks that inject faults into a router's message pipeline.
#[derive(Clone, Default)]
pub struct FaultHooks {
    pub(crate) after_commit: Option<Arc<AfterCommitHook>>,
}

impl FaultHooks {
    /// Calls `hook` after every successful COMMIT, before the ack.
    pub fn after_commit(
        mut self,
        hook: impl Fn(&Delivery) -> AfterCommit + Send + Sync + 'static,
    ) -> Self {
        self.after_commit = Some(Arc::new(hook));
        self
    }

    pub(crate) fn decide_after_commit(&self, delivery: &Delivery) -> AfterCommit {
        self.after_commit
            .as_ref()
            .map_or(AfterCommit::Ack, |hook| hook(delivery))
    }
}

impl fmt::Debug for FaultHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultHooks")
            .field("after_commit", &self.after_commit.is_some())
            .finish()
    }
}
