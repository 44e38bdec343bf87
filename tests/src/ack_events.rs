//! What JetStream hears back, event by event: every ack, NAK, TERM and
//! progress heartbeat sent for one stream's deliveries, parsed from the ack
//! subject (which delivery of which message it settles), with what the
//! test's probe said when it arrived. For the order of a settle and a
//! commit; [`crate::scenario::AckLog`] keeps only each delivery's kinds.

use std::sync::{Arc, Mutex};

use futures_util::StreamExt;

/// How a delivery was settled, read from the body the consumer sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckKind {
    /// `+ACK`, or an empty body.
    Ack,
    /// `-NAK`, with or without a delay.
    Nak,
    /// `+TERM`.
    Term,
    /// `+WPI`, a progress heartbeat.
    Progress,
    /// Anything else.
    Other,
}

/// One message sent to a delivery's reply subject (`$JS.ACK...`).
#[derive(Debug, Clone)]
pub struct AckEvent {
    /// The stream sequence of the message it settles.
    pub stream_sequence: u64,
    /// The delivery count of the delivery it settles.
    pub delivered: u64,
    /// What it says.
    pub kind: AckKind,
    /// What the test's probe said when it arrived.
    pub probe: bool,
}

/// Records the acks of one stream's consumers, from a connection of its own,
/// as the server receives them.
pub struct AckLog {
    events: Arc<Mutex<Vec<AckEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AckLog {
    /// Subscribes before returning, so no ack sent afterwards is missed.
    /// `probe` is evaluated as each event arrives.
    pub async fn start(
        client: async_nats::Client,
        stream: &str,
        probe: impl Fn() -> bool + Send + 'static,
    ) -> AckLog {
        let mut acks = client
            .subscribe("$JS.ACK.>")
            .await
            .expect("subscribe to acks");
        client.flush().await.expect("the subscription is live");
        let events = Arc::new(Mutex::new(Vec::new()));
        let log = events.clone();
        let stream = stream.to_owned();
        let task = tokio::spawn(async move {
            let _client = client;
            while let Some(message) = acks.next().await {
                let Some((name, delivered, stream_sequence)) =
                    parse_ack_subject(message.subject.as_str())
                else {
                    continue;
                };
                if name != stream {
                    continue;
                }
                let body = &message.payload[..];
                let kind = if body.is_empty() || body.starts_with(b"+ACK") {
                    AckKind::Ack
                } else if body.starts_with(b"-NAK") {
                    AckKind::Nak
                } else if body.starts_with(b"+TERM") {
                    AckKind::Term
                } else if body.starts_with(b"+WPI") {
                    AckKind::Progress
                } else {
                    AckKind::Other
                };
                log.lock().unwrap().push(AckEvent {
                    stream_sequence,
                    delivered,
                    kind,
                    probe: probe(),
                });
            }
        });
        AckLog { events, task }
    }

    /// Every event so far, in the order the server received them.
    pub fn events(&self) -> Vec<AckEvent> {
        self.events.lock().unwrap().clone()
    }

    /// The events of `kind` for stream sequence `sequence`.
    pub fn of(&self, sequence: u64, kind: AckKind) -> Vec<AckEvent> {
        self.events()
            .into_iter()
            .filter(|e| e.stream_sequence == sequence && e.kind == kind)
            .collect()
    }
}

impl Drop for AckLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `(stream, delivered, stream sequence)` of an ack subject, in either
/// format of ADR-15: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...` (7
/// tokens after the prefix) or with `<domain>.<account hash>.` in front (9
/// or more).
pub fn parse_ack_subject(subject: &str) -> Option<(String, u64, u64)> {
    let tokens: Vec<&str> = subject.strip_prefix("$JS.ACK.")?.split('.').collect();
    let first = match tokens.len() {
        7 => 0,
        n if n >= 9 => 2,
        _ => return None,
    };
    Some((
        tokens[first].to_owned(),
        tokens[first + 2].parse().ok()?,
        tokens[first + 3].parse().ok()?,
    ))
}
