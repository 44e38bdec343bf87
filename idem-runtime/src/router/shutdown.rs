//! Shutdown: waiting for the signal, then stopping in order: the routes
//! (in-flight messages finish and ack), the relay (so that it publishes what
//! their last messages queued), the purge, and the final flush to NATS.

use std::future::Future;
use std::pin::Pin;

use super::run::Running;

impl Running {
    /// Waits until `shutdown` resolves, the router is shut down (its handle
    /// or an OS signal), or the NATS client is gone for good: then `true`,
    /// and the router returns an error once it has stopped.
    pub(super) async fn until_shutdown(
        &self,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        nats: &async_nats::Client,
    ) -> bool {
        let mut stopped = self.signal.clone();
        tokio::select! {
            _ = shutdown.as_mut() => {
                self.trigger.fire();
                false
            }
            _ = stopped.fired() => false,
            _ = client_gone(nats) => {
                tracing::error!("the NATS client's connection task is gone (async-nats stopped, e.g. on a header it cannot parse); stopping, so that the process can be restarted");
                self.trigger.fire();
                true
            }
        }
    }

    /// Stops every part in order, each within the grace period.
    pub(super) async fn shut_down(mut self, nats: &async_nats::Client) {
        // The purge stops by itself after the run it is in (it checks the
        // signal between runs); it is waited for last, within the grace
        // period counted from here.
        let shutdown_began = tokio::time::Instant::now();
        tracing::info!("shutting down: no new messages; waiting for in-flight ones");
        let mut abandoned = 0;
        while let Some(finished) = self.routes.join_next().await {
            match finished {
                Ok(count) => abandoned += count,
                Err(error) => tracing::error!(%error, "a route task failed"),
            }
        }
        if abandoned > 0 {
            tracing::error!(
                abandoned,
                "messages were abandoned at shutdown; their connections were closed, and JetStream redelivers them after ack_wait"
            );
        }
        let _ = self.stop_relay.send(());
        if let Some(relaying) = self.relaying {
            // The relay checks for the stop between cycles, and a cycle in
            // progress runs to its COMMIT (never cut short: sqlx#4393). A
            // cycle can outlast the grace period (its database away, its
            // PubAcks timing out): then it is left to finish on its own,
            // not cancelled, and what it did not delete stays pending.
            match tokio::time::timeout(self.grace, relaying).await {
                Ok(Ok(Ok(()))) => tracing::info!("outbox relay stopped"),
                Ok(Ok(Err(error))) => {
                    tracing::error!(%error, "the outbox relay stopped; its rows stay pending for the next relay")
                }
                Ok(Err(error)) => tracing::error!(%error, "the outbox relay task failed"),
                Err(_) => tracing::warn!(
                    grace_ms = self.grace.as_millis() as u64,
                    "the outbox relay did not stop within the grace period; left to finish its cycle, its rows stay pending for the next relay"
                ),
            }
        }
        if let Some(mut purging) = self.purging {
            // Not cut short at once: a run cut short leaves its step for the
            // next run to resume, and this one may be about to finish it.
            // Past the grace period it is aborted (its own session: no
            // pooled connection is left halfway through a statement), and
            // the next purge resumes whatever step it has not finished.
            let left = self.grace.saturating_sub(shutdown_began.elapsed());
            match tokio::time::timeout(left, &mut purging.0).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::error!(%error, "the claims purge task failed"),
                Err(_) => tracing::warn!(
                    grace_ms = self.grace.as_millis() as u64,
                    "the claims purge did not finish its run within the grace period; it is stopped, and the next purge resumes whatever step it has not finished"
                ),
            }
        }
        // The final acks, and the NAKs of messages handed back, must reach the
        // server before `run` returns and the process exits. Not a database
        // call, so a bound here is safe; a server that is away cannot be
        // waited for.
        if tokio::time::timeout(FLUSH_BOUND, nats.flush())
            .await
            .is_err()
        {
            tracing::warn!(
                "could not flush the final acks to NATS; unacked messages are redelivered and deduplicated"
            );
        }
        tracing::info!("shut down");
    }
}

/// Resolves once the NATS client's connection task has stopped for good: a
/// flush cannot even be queued. (While it reconnects, a flush is queued and
/// waits; that is not gone.)
async fn client_gone(nats: &async_nats::Client) {
    let mut checks = tokio::time::interval(CLIENT_CHECK);
    loop {
        checks.tick().await;
        let flushed = tokio::time::timeout(CLIENT_CHECK, nats.flush()).await;
        if let Ok(Err(error)) = flushed
            && error.kind() == async_nats::client::FlushErrorKind::SendError
        {
            return;
        }
    }
}

/// How often the router checks that its NATS client still runs.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// How long `run` waits, at the end, for its final acks to reach NATS.
const FLUSH_BOUND: std::time::Duration = std::time::Duration::from_secs(5);
