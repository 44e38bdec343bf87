//! Fault injection for tests (feature `fault-injection`). Never enable it in
//! production: its hooks make the runtime misbehave on purpose.
//!
//! This module and [`Router::fault_hooks`](crate::Router::fault_hooks)
//! exist only with the feature, which is off by default. `idem-test` turns
//! it on, so depend on that as a dev-dependency: with Cargo's feature
//! resolver 2 or later (the default of an edition 2021 package), a feature
//! that only dev-dependencies enable stays off in the build you ship.
//!
//! The hooks see a message at three points of its path: when a delivery of
//! it is prepared ([`FaultHooks::on_delivery`]), when a handler call
//! returns, before the transaction ends ([`FaultHooks::after_handler`]),
//! and after a successful COMMIT, before the ack
//! ([`FaultHooks::after_commit`]). `idem-test` builds its faults on them.
//!
//! Every hook is a plain `Fn`, called on the router's task that carries the
//! message, and the message waits for it. Keep hooks short: a hook that
//! blocks holds up a thread of the Tokio runtime, and on a current-thread
//! runtime (`#[tokio::test]`'s default) it holds up the whole router,
//! heartbeats included. A hook that must block should run on a
//! multi-thread runtime (`#[tokio::test(flavor = "multi_thread")]`) and
//! block inside `tokio::task::block_in_place`, which panics on a
//! current-thread runtime.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::ErrorClass;
use crate::handler::delivery::Delivery;

/// What the runtime does after a commit, as decided by a test hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommit {
    /// Ack as usual.
    Ack,
    /// Act as if the process died between COMMIT and ack: never ack, NAK or
    /// TERM the message, so JetStream redelivers it after ack_wait. The
    /// message's heartbeats stop at once (a tick already sending may send
    /// one more), no outbox relay is woken for it, and
    /// [`Stats::dropped_by_fault`](crate::Stats::dropped_by_fault) counts
    /// it. On a reply route, the request gets no reply: the caller times
    /// out, and a retry of it is answered from the stored result.
    DropWithoutAck,
}

/// What becomes of a handler call that returned, before its transaction
/// ends, as decided by a test hook ([`FaultHooks::after_handler`]).
pub enum AfterHandler {
    /// Go on with what the handler returned.
    Return,
    /// Fail the call although the handler returned `Ok`: its transaction
    /// rolls back, and the failure takes the path of `class` (retried,
    /// NAKed with backoff, or dead-lettered). Whatever the body did outside
    /// its transaction stays done, as after a real failure.
    Fail {
        /// The class the failure is handled by.
        class: ErrorClass,
        /// The failure's text, in logs and dead letters.
        reason: String,
    },
    /// Wait for this future before the call returns, as under a slow
    /// handler: the transaction and its claim stay open meanwhile (without
    /// the route's heartbeats, ack_wait can expire and the message be
    /// redelivered). The handler timeout does not cover the wait.
    Wait(Pin<Box<dyn Future<Output = ()> + Send>>),
}

impl fmt::Debug for AfterHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AfterHandler::Return => f.write_str("Return"),
            AfterHandler::Fail { class, reason } => f
                .debug_struct("Fail")
                .field("class", class)
                .field("reason", reason)
                .finish(),
            AfterHandler::Wait(_) => f.write_str("Wait(..)"),
        }
    }
}

/// The failure an [`AfterHandler::Fail`] hook injects.
#[derive(Debug, thiserror::Error)]
#[error("injected by a fault hook: {reason}")]
pub struct InjectedFailure {
    /// The class it is handled by.
    pub class: ErrorClass,
    /// Why, as the hook said.
    pub reason: String,
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
type AfterHandlerHook = dyn Fn(&Delivery) -> AfterHandler + Send + Sync;
type OnDeliveryHook = dyn Fn(&Delivery) + Send + Sync;

/// Hooks that inject faults into a router's message pipeline. Install them
/// with `Router::fault_hooks`.
#[derive(Clone, Default)]
pub struct FaultHooks {
    pub(crate) after_commit: Option<Arc<AfterCommitHook>>,
    pub(crate) after_handler: Option<Arc<AfterHandlerHook>>,
    pub(crate) on_delivery: Option<Arc<OnDeliveryHook>>,
}

impl FaultHooks {
    /// Calls `hook` after every successful COMMIT, before the ack: once for
    /// each message whose handler's work that COMMIT committed, with that
    /// message's delivery.
    ///
    /// - **Per message, also in a batch.** After a batch's COMMIT the
    ///   messages are settled one after another, in the batch's order: the
    ///   hook for the first, then its ack, then the hook for the second,
    ///   and so on. So a message's ack waits for the hooks (and acks) of
    ///   the messages before it in its batch, never for those after it. A
    ///   batch handler's batch is the same: one call per message.
    /// - **Not for duplicates.** A redelivery of a processed message is
    ///   rolled back and acked without a COMMIT of its own, and the hook is
    ///   not called for it, in a batch or alone. Nor is it called when the
    ///   transaction failed, or when its COMMIT's outcome is unknown.
    /// - **Reply routes too.** For a request whose transaction committed,
    ///   the hook runs before the reply is sent;
    ///   [`AfterCommit::DropWithoutAck`] then sends none.
    /// - **Synchronous.** It runs on the task that settles the message,
    ///   while the message is still heartbeaten (see the
    ///   [module docs](self) before blocking in it).
    ///
    /// [`AfterCommit::DropWithoutAck`] drops this message only; the others
    /// of its batch are acked as usual.
    ///
    /// ```
    /// use idem_runtime::fault::{AfterCommit, FaultHooks};
    ///
    /// // Every third message's ack is lost, as if the worker died after COMMIT.
    /// let seen = std::sync::atomic::AtomicU64::new(0);
    /// let hooks = FaultHooks::default().after_commit(move |_delivery| {
    ///     if seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 3 == 2 {
    ///         AfterCommit::DropWithoutAck
    ///     } else {
    ///         AfterCommit::Ack
    ///     }
    /// });
    /// # drop(hooks);
    /// ```
    pub fn after_commit(
        mut self,
        hook: impl Fn(&Delivery) -> AfterCommit + Send + Sync + 'static,
    ) -> Self {
        self.after_commit = Some(Arc::new(hook));
        self
    }

    /// Calls `hook` when a handler call for a message returns, before its
    /// transaction ends (per message, for each message of a batch, and for
    /// each message of a batch handler's call, in the call's order).
    ///
    /// It runs whatever the call returned (an error, a timeout or a panic
    /// too), on reply routes too, and again for each in-process retry and
    /// each fallback of a batch that runs the handler again. It does not run
    /// for a duplicate, whose handler is never called. The hook itself is
    /// synchronous (see the [module docs](self)); the future of an
    /// [`AfterHandler::Wait`] is awaited, and blocks nothing.
    pub fn after_handler(
        mut self,
        hook: impl Fn(&Delivery) -> AfterHandler + Send + Sync + 'static,
    ) -> Self {
        self.after_handler = Some(Arc::new(hook));
        self
    }

    /// Calls `hook` for every delivery once its message id is resolved,
    /// before anything is claimed: what a test watches to see a
    /// redelivery arrive.
    ///
    /// It runs once per delivery, duplicates included, for each message of
    /// a batch as the batch is put together, and for each request on a
    /// reply route. It does not run for a message rejected before its id is
    /// resolved (a payload that does not decode, a bad message id). It is
    /// synchronous (see the [module docs](self)).
    pub fn on_delivery(mut self, hook: impl Fn(&Delivery) + Send + Sync + 'static) -> Self {
        self.on_delivery = Some(Arc::new(hook));
        self
    }

    pub(crate) fn decide_after_commit(&self, delivery: &Delivery) -> AfterCommit {
        self.after_commit
            .as_ref()
            .map_or(AfterCommit::Ack, |hook| hook(delivery))
    }

    pub(crate) fn saw_delivery(&self, delivery: &Delivery) {
        if let Some(hook) = &self.on_delivery {
            hook(delivery);
        }
    }

    /// Applies the after-handler hook to a call's outcome, for each of
    /// `deliveries` (more than one for a batch handler's call).
    pub(crate) async fn apply_after_handler<T>(
        &self,
        deliveries: &[Delivery],
        outcome: Result<T, crate::error::HandlerError>,
    ) -> Result<T, crate::error::HandlerError> {
        let Some(hook) = &self.after_handler else {
            return outcome;
        };
        let mut failure = None;
        for delivery in deliveries {
            match hook(delivery) {
                AfterHandler::Return => {}
                AfterHandler::Wait(wait) => wait.await,
                AfterHandler::Fail { class, reason } => {
                    failure.get_or_insert(InjectedFailure { class, reason });
                }
            }
        }
        match (outcome, failure) {
            (Ok(_), Some(failure)) => {
                tracing::warn!(%failure, "fault injection: failing a handler call that returned Ok");
                let class = failure.class;
                Err(crate::error::HandlerError::classified(failure, Some(class)))
            }
            (outcome, _) => outcome,
        }
    }
}

impl fmt::Debug for FaultHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultHooks")
            .field("after_commit", &self.after_commit.is_some())
            .field("after_handler", &self.after_handler.is_some())
            .field("on_delivery", &self.on_delivery.is_some())
            .finish()
    }
}
