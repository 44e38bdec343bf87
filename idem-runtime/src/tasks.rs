//! Graceful shutdown: a signal every part of the router can wait on, and the
//! guard that ends a task when its owner goes away.
//!
//! The signal stops every part gracefully. It is not enough when the
//! router's `run` future is dropped instead (a `select!` in the application,
//! an aborted task): a `RouterHandle` may still hold the trigger, so the
//! signal never fires, and a task spawned with a bare `tokio::spawn` would
//! run on forever. Every task the router spawns is therefore [`Owned`] by
//! the future that spawned it (or sits in its `JoinSet`), and aborted when
//! that future is dropped.

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Triggers shutdown. Cloned into every [`RouterHandle`](crate::RouterHandle).
#[derive(Debug, Clone)]
pub(crate) struct Trigger(watch::Sender<bool>);

/// Waits for shutdown.
#[derive(Debug, Clone)]
pub(crate) struct Signal(watch::Receiver<bool>);

pub(crate) fn channel() -> (Trigger, Signal) {
    let (sender, receiver) = watch::channel(false);
    (Trigger(sender), Signal(receiver))
}

impl Trigger {
    pub(crate) fn fire(&self) {
        self.0.send_replace(true);
    }
}

impl Signal {
    /// Resolves once shutdown has been triggered (at once if it already was).
    pub(crate) async fn fired(&mut self) {
        // An error means every trigger is gone, which only happens when the
        // router is being torn down: treat it as shutdown.
        let _ = self.0.wait_for(|fired| *fired).await;
    }

    /// Whether shutdown has been triggered, without waiting.
    pub(crate) fn has_fired(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }
}

/// A spawned task that is aborted when this is dropped, unless it ended
/// before. For tasks that can be cut off at any await: their connections are
/// their own sessions, guarded (see `store/connections.rs`), or checked by the
/// pool when it gets them back.
pub(crate) struct Owned<T>(pub(crate) JoinHandle<T>);

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Listens for Ctrl-C (SIGINT) and SIGTERM from the moment it is called, and
/// fires `trigger` on the first. The handlers are installed before this
/// returns, so a signal that arrives during start-up is not lost.
pub(crate) fn fire_on_os_signal(trigger: Trigger) -> tokio::task::JoinHandle<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut interrupt), Ok(mut terminate)) => tokio::spawn(async move {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
                tracing::info!("signal received; shutting down");
                trigger.fire();
            }),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, "cannot listen for SIGINT/SIGTERM; only RouterHandle::shutdown stops the router");
                tokio::spawn(std::future::pending())
            }
        }
    }
    #[cfg(not(unix))]
    {
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            trigger.fire();
        })
    }
}
