//! Graceful shutdown: a signal every part of the router can wait on.

use tokio::sync::watch;

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

    pub(crate) fn is_fired(&self) -> bool {
        *self.0.borrow()
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
pub(crate) async fn os_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = sigterm.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the router");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
