//! One route's pull, on JetStream's wire protocol: an inbox of its own, pull
//! requests sent to it, and the count of messages those requests still owe.
//!
//! async-nats's `Consumer::stream` keeps its inbox to itself, so the only way
//! to stop it is to drop it, which unsubscribes while the server may still
//! hold a request of it. What the server then delivers goes into a dead
//! inbox: counted as delivered, seen by no one, and redelivered only after
//! ack_wait. This pull can be *closed* instead ([`PullStream::close`]): it
//! stops asking and reads on until every request it sent has ended, either
//! filled or expired (the server's `408`, which follows whatever that request
//! delivered), so that the caller gets every message the server sent it and
//! no request is left on the server.
//!
//! The requests are short ([`PULL_EXPIRES`]) so that closing is quick, and
//! renewed as they are used up or expire: at most about one batch and a half
//! is owed at a time, as with `Consumer::stream`. The pull also notices a
//! reconnect of the client (its connection count moves) and asks again at
//! once, on the same inbox, which the client subscribes again: a restarted
//! server has forgotten the requests, and one that was not restarted
//! delivers what it still owes into the same inbox. A server that goes
//! silent (no message, heartbeat or status for [`PULL_SILENCE`]) is an error
//! of the pull, and the caller opens a new one.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::BatchConfig;
use async_nats::{Client, StatusCode, Subscriber};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::time::Instant;

/// How long one pull request lives on the server. Closing the pull waits at
/// most this long (for the last request's `408`), so it is short; renewing
/// it costs one small publish per route per period when idle.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// How often the server must say it is alive while a request waits
/// (at most half of [`PULL_EXPIRES`], which the server requires).
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);

/// Silence for this long while requests are owed means the server is gone
/// or has lost them: three heartbeats missed.
const PULL_SILENCE: Duration = Duration::from_secs(3);

/// How often an idle pull checks whether the client reconnected.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);

/// How long closing waits past the last request's expiry for its `408`.
const CLOSE_MARGIN: Duration = Duration::from_secs(1);

/// The first pause after the server turned a request away (a `409` such as
/// `Exceeded MaxWaiting`); it doubles with each one in a row, up to
/// [`REFUSED_PAUSE_MAX`].
const REFUSED_PAUSE: Duration = Duration::from_millis(100);
const REFUSED_PAUSE_MAX: Duration = Duration::from_secs(5);

/// Why the pull cannot go on; the caller drops it and opens a new one.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    #[error("the server said nothing for {PULL_SILENCE:?} while pull requests were open")]
    Silent,
    #[error("the pull request could not be sent: {0}")]
    Request(#[from] async_nats::PublishError),
    #[error("no JetStream server answered the pull request")]
    NoResponders,
    #[error("the server ended the pull: {0}")]
    Ended(String),
    #[error("the pull's subscription ended")]
    Unsubscribed,
}

/// One open pull: its inbox, and what its requests still owe.
pub(crate) struct PullStream {
    client: Client,
    context: async_nats::jetstream::Context,
    subscriber: Subscriber,
    /// `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`.
    subject: String,
    inbox: String,
    /// One request's JSON body.
    request: Bytes,
    batch: usize,
    /// How many messages the requests still open may deliver.
    owed: usize,
    /// When the newest request expires on the server.
    expires_at: Instant,
    /// When the server last sent anything on this pull.
    last_heard: Instant,
    /// The client's connection count when last looked at.
    connects: u64,
    statistics: Arc<async_nats::Statistics>,
    /// No request before this, after the server turned one away.
    refused_until: Option<Instant>,
    refusals: u32,
}

/// What one message on the inbox was.
enum Read {
    Message(Box<Message>),
    /// A heartbeat or the end of a request: nothing for the caller.
    Status,
    Fatal(PullError),
}

impl PullStream {
    /// Subscribes to a fresh inbox for `consumer`'s messages, asking for
    /// `batch` at a time. The first request goes out with the first
    /// [`next`](Self::next).
    pub(crate) async fn open(
        consumer: &PullConsumer,
        client: &Client,
        batch: usize,
    ) -> Result<Self, async_nats::SubscribeError> {
        let info = consumer.cached_info();
        // idem's JetStream context has the default API prefix
        // (`router/mod.rs`, `jetstream::new`).
        let subject = format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
            info.stream_name, info.name
        );
        let inbox = client.new_inbox();
        let subscriber = client.subscribe(inbox.clone()).await?;
        let request = serde_json::to_vec(&BatchConfig {
            batch,
            expires: Some(PULL_EXPIRES),
            idle_heartbeat: PULL_HEARTBEAT,
            ..BatchConfig::default()
        })
        .expect("a pull request serializes");
        let statistics = client.statistics();
        let now = Instant::now();
        Ok(PullStream {
            context: async_nats::jetstream::new(client.clone()),
            client: client.clone(),
            subscriber,
            subject,
            inbox,
            request: request.into(),
            batch,
            owed: 0,
            expires_at: now,
            last_heard: now,
            connects: statistics.connects.load(Ordering::Relaxed),
            statistics,
            refused_until: None,
            refusals: 0,
        })
    }

    /// The next message, asking for more first when less than half a batch
    /// is owed. `None` or an error: the pull is over, open a new one.
    ///
    /// Cancel-safe: a request counts as owed only once it was handed to
    /// the client, and a message is taken off the inbox only when returned.
    pub(crate) async fn next(&mut self) -> Option<Result<Message, PullError>> {
        loop {
            self.notice_reconnect();
            if let Err(error) = self.ask_if_low().await {
                return Some(Err(error));
            }
            let silent_at = self.last_heard + PULL_SILENCE;
            let refused_until = self.refused_until;
            let received = tokio::select! {
                biased;
                received = self.subscriber.next() => received,
                _ = tokio::time::sleep_until(silent_at), if self.owed > 0 => {
                    return Some(Err(PullError::Silent));
                }
                _ = tokio::time::sleep(RECONNECT_CHECK) => continue,
                _ = sleep_until(refused_until) => {
                    self.refused_until = None;
                    continue;
                }
            };
            let Some(received) = received else {
                return Some(Err(PullError::Unsubscribed));
            };
            match self.read(received) {
                Read::Message(message) => return Some(Ok(*message)),
                Read::Status => continue,
                Read::Fatal(error) => return Some(Err(error)),
            }
        }
    }

    /// Stops asking, and reads on until every request sent has ended
    /// (filled, or expired with the server's `408`), so that nothing stays
    /// requested on the server. Returns every message that came, for the
    /// caller to start or hand back.
    ///
    /// Takes at most the last request's remaining life and a margin. Not
    /// while NATS is away: the statuses cannot come then, and what the server
    /// kept for a dead connection goes nowhere; such messages are redelivered
    /// after ack_wait.
    pub(crate) async fn close(mut self, route: &str) -> Vec<Message> {
        let mut delivered = Vec::new();
        self.notice_reconnect();
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        let deadline = self.expires_at + CLOSE_MARGIN;
        while connected && self.owed > 0 {
            let received = match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(received)) => received,
                Ok(None) => break,
                Err(_) => {
                    tracing::warn!(
                        route,
                        owed = self.owed,
                        "the server did not end the pull's requests in time; what it delivers into them is redelivered after ack_wait"
                    );
                    break;
                }
            };
            match self.read(received) {
                Read::Message(message) => delivered.push(*message),
                Read::Status => {}
                Read::Fatal(_) => break,
            }
        }
        // What arrived and was not read yet (all of it, when NATS is away).
        while let Some(Some(received)) = self.subscriber.next().now_or_never() {
            if let Read::Message(message) = self.read(received) {
                delivered.push(*message);
            }
        }
        delivered
    }

    /// After a reconnect, the requests owed are forgotten (a restarted
    /// server lost them) and a new one goes out at once. The client has
    /// subscribed the inbox again before it sends anything else.
    fn notice_reconnect(&mut self) {
        let connects = self.statistics.connects.load(Ordering::Relaxed);
        if connects != self.connects {
            tracing::debug!(
                owed = self.owed,
                "the NATS client reconnected; asking for messages again"
            );
            self.connects = connects;
            self.owed = 0;
            self.refused_until = None;
            self.last_heard = Instant::now();
        }
    }

    /// Sends a request when less than half a batch is owed, unless the
    /// server just turned one away.
    async fn ask_if_low(&mut self) -> Result<(), PullError> {
        if self.owed > self.batch / 2 {
            return Ok(());
        }
        if self
            .refused_until
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(());
        }
        self.client
            .publish_with_reply(
                self.subject.clone(),
                self.inbox.clone(),
                self.request.clone(),
            )
            .await?;
        let now = Instant::now();
        if self.owed == 0 {
            // Silence counts from the first request owed.
            self.last_heard = now;
        }
        self.owed += self.batch;
        self.expires_at = now + PULL_EXPIRES;
        Ok(())
    }

    /// Reads one message of the inbox: a message of the stream, a heartbeat,
    /// or a status that ends one request (how many it left undelivered is
    /// in its `Nats-Pending-Messages`).
    fn read(&mut self, received: async_nats::Message) -> Read {
        self.last_heard = Instant::now();
        let status = received.status.unwrap_or(StatusCode::OK);
        match status {
            StatusCode::OK => {
                self.owed = self.owed.saturating_sub(1);
                self.refusals = 0;
                Read::Message(Box::new(Message {
                    message: received,
                    context: self.context.clone(),
                }))
            }
            StatusCode::IDLE_HEARTBEAT => Read::Status,
            StatusCode::TIMEOUT | StatusCode::NOT_FOUND => {
                self.end_request(&received);
                // A request normally ends at its expiry. One that ended long
                // before (an interest that expired at once, say) would
                // otherwise be asked again at once, in a loop: pause first.
                let early = self.expires_at.checked_sub(PULL_EXPIRES / 2);
                if early.is_some_and(|early| Instant::now() < early) {
                    self.refused_until = Some(Instant::now() + REFUSED_PAUSE);
                }
                Read::Status
            }
            StatusCode::REQUEST_TERMINATED => {
                let description = received.description.clone().unwrap_or_default();
                if description == "Consumer Deleted"
                    || description == "Consumer is push based"
                    || description.starts_with("Exceeded MaxRequest")
                {
                    return Read::Fatal(PullError::Ended(description));
                }
                // Ended or turned away for a reason that passes (a new
                // leader, too many waiting requests, a message over the
                // request's size): ask again after a pause.
                self.end_request(&received);
                self.refusals += 1;
                let pause = REFUSED_PAUSE
                    .saturating_mul(1 << (self.refusals - 1).min(16))
                    .min(REFUSED_PAUSE_MAX);
                self.refused_until = Some(Instant::now() + pause);
                tracing::debug!(%description, ?pause, "the server ended a pull request");
                Read::Status
            }
            StatusCode::NO_RESPONDERS => {
                self.owed = self.owed.saturating_sub(self.batch);
                Read::Fatal(PullError::NoResponders)
            }
            status => Read::Fatal(PullError::Ended(format!(
                "{status} {}",
                received.description.as_deref().unwrap_or_default()
            ))),
        }
    }

    /// Takes what one ended request left undelivered off what is owed.
    fn end_request(&mut self, status: &async_nats::Message) {
        let left = status
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Pending-Messages"))
            .and_then(|left| left.as_str().parse().ok())
            .unwrap_or(self.batch);
        self.owed = self.owed.saturating_sub(left);
    }
}

/// Sleeps until `until`, or forever.
async fn sleep_until(until: Option<Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}
