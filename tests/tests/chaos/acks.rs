//! A tap on the consumer's acknowledgements, as JetStream receives them.
//!
//! A worker acks a delivery by publishing `+ACK` (or `-NAK`, `+TERM`, `+WPI`)
//! to the delivery's reply subject, `$JS.ACK.<stream>.<consumer>.<delivered>.
//! <stream seq>.<consumer seq>.<published at>.<pending>`. That is a core NATS
//! publish, so a subscriber of our own gets a copy of each one, tagged with
//! which delivery of which message it settles: the delivery count, and the
//! consumer sequence, which JetStream increments with every delivery it
//! makes (so it orders deliveries in time). The tap is the test's own client on the server itself (never
//! through a fault proxy). It sees what reaches the server, at most once: it
//! misses what a server restart loses, which only makes it undercount.
//!
//! Joined with the ledger (which delivery of a message committed, in which
//! worker), it shows what no worker can report once it is dead: a delivery
//! made after the committing worker died (its consumer sequence is past the
//! consumer's last delivery as read after the death), acked without a second
//! ledger row, is a redelivery of committed work that a later worker's claim
//! absorbed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;

/// How a delivery was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Ack,
    Nak,
    Term,
}

/// One settled delivery.
#[derive(Debug, Clone, Copy)]
pub struct TapAck {
    pub settled: Settled,
    pub stream_seq: u64,
    /// Which delivery of the message this settles (1 for the first).
    pub delivered: u64,
    /// The consumer's sequence of that delivery: later deliveries have
    /// higher ones.
    pub consumer_seq: u64,
}

/// Records every ack, NAK and TERM sent for one consumer.
pub struct AckTap {
    acks: Arc<Mutex<Vec<TapAck>>>,
    task: JoinHandle<()>,
}

impl AckTap {
    /// Subscribes on a client of its own to `nats_url`, before the test
    /// publishes anything.
    pub async fn start(nats_url: &str, stream: &str, consumer: &str) -> AckTap {
        let client = async_nats::ConnectOptions::new()
            .name("chaos-ack-tap")
            // Far more than a run has in flight, so that a busy test runtime
            // does not make the server drop the tap as a slow consumer.
            .subscription_capacity(1 << 17)
            // As fast as the worker's own reconnect after a NATS restart
            // (async-nats backs off up to 4 s), so it misses few acks.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(if attempts <= 1 { 0 } else { 50 })
            })
            .connect(nats_url)
            .await
            .expect("the ack tap connects");
        let mut acks_sub = client
            .subscribe("$JS.ACK.>")
            .await
            .expect("the ack tap subscribes");
        client.flush().await.expect("the ack tap's SUB is sent");
        let acks = Arc::new(Mutex::new(Vec::new()));
        let (stream, consumer) = (stream.to_owned(), consumer.to_owned());
        let task = {
            let acks = acks.clone();
            tokio::spawn(async move {
                // Keeps the client (and its subscription) alive.
                let _client = client;
                while let Some(message) = acks_sub.next().await {
                    if let Some(ack) = parse(&message.subject, &message.payload, &stream, &consumer)
                    {
                        acks.lock().expect("tap lock").push(ack);
                    }
                }
            })
        };
        AckTap { acks, task }
    }

    /// Whether message `stream_seq` was acked for a delivery later than
    /// consumer sequence `after`.
    pub fn acked_after(&self, stream_seq: u64, after: u64) -> bool {
        self.acks.lock().expect("tap lock").iter().any(|a| {
            a.settled == Settled::Ack && a.stream_seq == stream_seq && a.consumer_seq > after
        })
    }

    /// Every ack, NAK and TERM so far, by stream sequence.
    pub fn by_sequence(&self) -> HashMap<u64, Vec<TapAck>> {
        let mut by_seq: HashMap<u64, Vec<TapAck>> = HashMap::new();
        for ack in self.acks.lock().expect("tap lock").iter() {
            by_seq.entry(ack.stream_seq).or_default().push(*ack);
        }
        by_seq
    }
}

impl Drop for AckTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one ack subject, in either of the formats ADR-15 defines (with or
/// without the domain and account hash); `None` for progress (`+WPI`),
/// other consumers, or what does not parse.
fn parse(subject: &str, payload: &[u8], stream: &str, consumer: &str) -> Option<TapAck> {
    let settled = match payload {
        b"" | b"+ACK" => Settled::Ack,
        p if p.starts_with(b"-NAK") => Settled::Nak,
        p if p.starts_with(b"+TERM") => Settled::Term,
        _ => return None,
    };
    let tokens: Vec<&str> = subject.strip_prefix("$JS.ACK.")?.split('.').collect();
    let fields = match tokens.len() {
        7 => &tokens[..],
        n if n >= 9 => &tokens[2..],
        _ => return None,
    };
    if fields[0] != stream || fields[1] != consumer {
        return None;
    }
    Some(TapAck {
        settled,
        stream_seq: fields[3].parse().ok()?,
        delivered: fields[2].parse().ok()?,
        consumer_seq: fields[4].parse().ok()?,
    })
}
