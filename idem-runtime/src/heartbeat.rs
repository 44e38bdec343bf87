//! Progress heartbeats (`+WPI`) that keep ack_wait from expiring mid-work.

use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running heartbeat for one message. Stop it before the final ack so no
/// progress signal follows the ack.
pub(crate) struct Heartbeat {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Sends `+WPI` for `message` every `interval` until stopped. `None`
    /// starts nothing.
    pub(crate) fn start(message: &Message, interval: Option<Duration>) -> Self {
        Self::start_many(std::slice::from_ref(message), interval)
    }

    /// Sends `+WPI` for every message of a batch.
    pub(crate) fn start_many(messages: &[Message], interval: Option<Duration>) -> Self {
        let Some(interval) = interval else {
            return Self {
                stop: None,
                task: None,
            };
        };
        let (stop, mut stopped) = oneshot::channel();
        let messages = messages.to_vec();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.tick().await; // the first tick fires at once
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = ticks.tick() => {
                        for message in &messages {
                            if let Err(error) = message.ack_with(AckKind::Progress).await {
                                tracing::warn!(%error, "progress heartbeat failed");
                            }
                        }
                    }
                }
            }
        });
        Self {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the heartbeat and waits until it can send no more.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
