//! Progress heartbeats (`+WPI`) that keep ack_wait from expiring while a
//! message is being worked on.
//!
//! One ticker per route serves every message in flight: each message holds
//! a [`Lease`] from the moment it is taken until it is settled. A message is
//! heartbeaten until [`Lease::end`], which returns only once no heartbeat
//! for it can follow; it must be called before the message is acked, NAKed
//! or terminated. A `+WPI` after a NAK would reset the message's redelivery
//! timer to ack_wait and silently replace its backoff.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::Subject;
use async_nats::jetstream::Message;
use bytes::Bytes;

/// The heartbeats of one route.
pub(crate) struct Heartbeats {
    shared: Option<Arc<Shared>>,
}

struct Shared {
    client: async_nats::Client,
    /// The reply (ack) subject of every message in flight, by lease.
    leases: Mutex<HashMap<u64, Subject>>,
    next: AtomicU64,
    /// Held while a tick sends, so that [`Lease::end`] can wait it out.
    sending: tokio::sync::Mutex<()>,
}

/// A message taken from the pull, with the lease it holds already if it
/// waited parked (see `consume/pull.rs`): that lease stays its lease until
/// it is settled.
pub(crate) type Taken = (Message, Option<Lease>);

/// Keeps one message heartbeaten until it ends.
pub(crate) struct Lease {
    id: u64,
    shared: Option<Arc<Shared>>,
}

impl Heartbeats {
    /// Sends `+WPI` every `interval` for each leased message. `None` sends
    /// nothing.
    pub(crate) fn start(client: async_nats::Client, interval: Option<Duration>) -> Self {
        let Some(interval) = interval else {
            return Self { shared: None };
        };
        let shared = Arc::new(Shared {
            client,
            leases: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            sending: tokio::sync::Mutex::new(()),
        });
        tokio::spawn(tick(Arc::downgrade(&shared), interval));
        Self {
            shared: Some(shared),
        }
    }

    /// Heartbeats `message` until the lease ends.
    pub(crate) fn lease(&self, message: &Message) -> Lease {
        let (Some(shared), Some(reply)) = (&self.shared, &message.reply) else {
            return Lease::none();
        };
        let id = shared.next.fetch_add(1, Ordering::Relaxed);
        lock(&shared.leases).insert(id, reply.clone());
        Lease {
            id,
            shared: Some(shared.clone()),
        }
    }
}

impl Lease {
    /// A lease that heartbeats nothing, for a message that cannot take one.
    pub(crate) fn none() -> Self {
        Lease {
            id: 0,
            shared: None,
        }
    }

    /// Stops this message's heartbeats; once this returns, none follows.
    pub(crate) async fn end(mut self) {
        if let Some(shared) = self.shared.take() {
            lock(&shared.leases).remove(&self.id);
            // A tick that took its list before the removal may still be
            // sending: wait for it.
            drop(shared.sending.lock().await);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            lock(&shared.leases).remove(&self.id);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn tick(shared: Weak<Shared>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await; // the first tick fires at once
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // While NATS is away a publish waits for room in the client's
        // queue: send nothing then (the server could not reset a timer
        // anyway), and never hold `sending` (which `Lease::end` waits on)
        // longer than a tick.
        if shared.client.connection_state() != async_nats::connection::State::Connected {
            continue;
        }
        let _sending = shared.sending.lock().await;
        let replies: Vec<Subject> = lock(&shared.leases).values().cloned().collect();
        let sends = async {
            for reply in replies {
                if let Err(error) = shared
                    .client
                    .publish(reply, Bytes::from_static(b"+WPI"))
                    .await
                {
                    tracing::warn!(%error, "progress heartbeat failed");
                }
            }
        };
        if tokio::time::timeout(interval, sends).await.is_err() {
            tracing::warn!(
                "progress heartbeats took longer than their interval; the rest wait for the next tick"
            );
        }
    }
}
