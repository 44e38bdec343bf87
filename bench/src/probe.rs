//! How the bench measures: when each message was published, when its ack
//! reached NATS, and how much memory the process holds.
//!
//! Latency is publish → ack, on one monotonic clock (this process's):
//! - the publish time is taken just before `publish` hands the message to
//!   the client, and the PubAck gives its stream sequence;
//! - a separate connection subscribes to `$JS.ACK.>`, which is where every
//!   consumer sends its acks, and timestamps each `+ACK` on arrival.
//!
//! Every mode acks only after its COMMIT has returned, so this is publish to
//! commit plus one loopback hop, taken the same way for every mode, the
//! framework included (whose commit the bench cannot see otherwise), and
//! for `raw` too. It needs no clock shared with the database server.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::BenchError;
use crate::consumers::{Consumer, Payload};

/// PubAcks awaited at once while publishing a backlog.
const PUBLISH_WINDOW: usize = 512;

/// No new ack for this long means the run is stuck.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// One published message.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    pub seq: u64,
    pub at: Instant,
}

/// What publishing took.
pub struct PublishReport {
    pub messages: Vec<Published>,
    /// Paced publishing: how far the latest publish fell behind schedule.
    pub max_lag: Duration,
}

/// Publishes one message per key to `subject`: as fast as PubAcks allow
/// (`rate` `None`, a backlog), or at a fixed `rate` per second. With
/// `with_ids`, each carries its key as `Nats-Msg-Id`, as a publisher that
/// may retry sets it.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    keys: &[String],
    rate: Option<f64>,
    with_ids: bool,
) -> Result<PublishReport, BenchError> {
    let started = Instant::now();
    let mut messages = Vec::with_capacity(keys.len());
    let mut max_lag = Duration::ZERO;
    let mut pending = FuturesUnordered::new();
    let settle = |done: Result<Published, BenchError>, messages: &mut Vec<Published>| {
        done.map(|published| messages.push(published))
    };
    for (i, key) in keys.iter().enumerate() {
        if let Some(rate) = rate {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            // Collect PubAcks while waiting for the next slot.
            loop {
                tokio::select! {
                    biased;
                    _ = tokio::time::sleep_until(due.into()) => break,
                    Some(done) = pending.next(), if !pending.is_empty() => settle(done, &mut messages)?,
                }
            }
            max_lag = max_lag.max(Instant::now().saturating_duration_since(due));
        }
        while pending.len() >= PUBLISH_WINDOW {
            let done = pending.next().await.expect("not empty");
            settle(done, &mut messages)?;
        }
        let at = Instant::now();
        let ack = send(js, subject, key, with_ids).await?;
        pending.push(async move {
            let ack = ack
                .await
                .map_err(|e| BenchError::failed(format!("PubAck: {e}")))?;
            Ok(Published {
                seq: ack.sequence,
                at,
            })
        });
    }
    while let Some(done) = pending.next().await {
        settle(done, &mut messages)?;
    }
    Ok(PublishReport { messages, max_lag })
}

/// A message published with [`publish_one`].
pub struct PublishedOne {
    pub published: Published,
    /// JetStream dropped it: a copy with the same `Nats-Msg-Id` is inside
    /// the stream's duplicate window.
    pub duplicate: bool,
}

/// Publishes one message for `key`, with `key` as its `Nats-Msg-Id`, and
/// waits for its PubAck.
pub async fn publish_one(
    js: &jetstream::Context,
    subject: &str,
    key: &str,
) -> Result<PublishedOne, BenchError> {
    let at = Instant::now();
    let ack = send(js, subject, key, true)
        .await?
        .await
        .map_err(|e| BenchError::failed(format!("PubAck: {e}")))?;
    Ok(PublishedOne {
        published: Published {
            seq: ack.sequence,
            at,
        },
        duplicate: ack.duplicate,
    })
}

/// Sends the message for `key` and returns the future of its PubAck.
async fn send(
    js: &jetstream::Context,
    subject: &str,
    key: &str,
    with_id: bool,
) -> Result<jetstream::context::PublishAckFuture, BenchError> {
    let payload = serde_json::to_vec(&Payload {
        key: key.to_owned(),
        published_us: unix_micros(),
    })
    .expect("a payload serializes");
    let sent = if with_id {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, key);
        js.publish_with_headers(subject.to_owned(), headers, payload.into())
            .await
    } else {
        js.publish(subject.to_owned(), payload.into()).await
    };
    sent.map_err(|e| BenchError::failed(format!("publish: {e}")))
}

fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Watches the acks of one stream.
pub struct AckObserver {
    seen: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<AckTimes>,
}

/// When each stream sequence was first acked.
#[derive(Debug, Default)]
pub struct AckTimes {
    by_seq: Vec<Option<Instant>>,
}

impl AckTimes {
    pub fn get(&self, seq: u64) -> Option<Instant> {
        self.by_seq.get(seq as usize).copied().flatten()
    }

    /// The last first-ack: when the last message was settled.
    pub fn last(&self) -> Option<Instant> {
        self.by_seq.iter().flatten().max().copied()
    }
}

impl AckObserver {
    /// Subscribes (on its own connection) before any consumer starts.
    pub async fn start(
        client: &async_nats::Client,
        stream: &str,
        expected: usize,
    ) -> Result<AckObserver, BenchError> {
        let mut acks = client
            .subscribe("$JS.ACK.>")
            .await
            .map_err(|e| BenchError::failed(format!("subscribe to acks: {e}")))?;
        // The subscription is live on the server once the flush returns.
        client
            .flush()
            .await
            .map_err(|e| BenchError::failed(format!("flush: {e}")))?;
        let seen = Arc::new(AtomicUsize::new(0));
        let (stop, mut stopped) = oneshot::channel::<()>();
        let stream = stream.to_owned();
        let counter = seen.clone();
        let task = tokio::spawn(async move {
            let mut times = AckTimes {
                by_seq: vec![None; expected + 1],
            };
            loop {
                let message = tokio::select! {
                    biased;
                    _ = &mut stopped => break,
                    message = acks.next() => match message {
                        Some(message) => message,
                        None => break,
                    },
                };
                let now = Instant::now();
                // +ACK, or an empty body, which JetStream also takes as an ack.
                let is_ack = message.payload.is_empty() || message.payload.starts_with(b"+ACK");
                let Some(seq) = acked_sequence(&message.subject, &stream) else {
                    continue;
                };
                if !is_ack {
                    continue;
                }
                let seq = seq as usize;
                if seq >= times.by_seq.len() {
                    times.by_seq.resize(seq + 1, None);
                }
                if times.by_seq[seq].is_none() {
                    times.by_seq[seq] = Some(now);
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
            times
        });
        Ok(AckObserver {
            seen,
            stop: Some(stop),
            task,
        })
    }

    /// Waits until `expected` distinct messages were acked. Fails if the
    /// consumer ends, or if no ack arrives for a minute.
    pub async fn wait_for_all(
        &self,
        expected: usize,
        consumer: &Consumer,
    ) -> Result<(), BenchError> {
        self.wait_for(
            expected,
            || {
                consumer
                    .ended()
                    .then(|| "the consumer stopped by itself".to_owned())
            },
            || format!("consumer counts: {:?}", consumer.progress()),
        )
        .await
    }

    /// Waits until `expected` distinct messages were acked. Fails when
    /// `ended` says why the consumers stopped, or if no ack arrives for a
    /// minute; `counts` describes the consumers for the error.
    pub async fn wait_for(
        &self,
        expected: usize,
        mut ended: impl FnMut() -> Option<String>,
        counts: impl Fn() -> String,
    ) -> Result<(), BenchError> {
        let mut last = 0;
        let mut last_change = Instant::now();
        loop {
            let seen = self.seen.load(Ordering::Relaxed);
            if seen >= expected {
                return Ok(());
            }
            if seen != last {
                last = seen;
                last_change = Instant::now();
            }
            let why = ended().or_else(|| {
                (last_change.elapsed() > STALL_TIMEOUT).then(|| "no progress for a minute".into())
            });
            if let Some(why) = why {
                return Err(BenchError::failed(format!(
                    "{why} after {seen} of {expected} acks ({})",
                    counts()
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub async fn finish(mut self) -> Result<AckTimes, BenchError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task)
            .await
            .map_err(|e| BenchError::failed(format!("ack observer: {e}")))
    }
}

/// The stream sequence an ack subject names, if it is `stream`'s. Both
/// formats of ADR-15: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...`
/// (9 tokens) and `$JS.ACK.<domain>.<account>.<stream>...` (11 or more).
fn acked_sequence(subject: &str, stream: &str) -> Option<u64> {
    let rest = subject.strip_prefix("$JS.ACK.")?;
    let tokens: Vec<&str> = rest.split('.').collect();
    let (name, seq) = match tokens.len() {
        7 => (tokens[0], tokens[3]),
        n if n >= 9 => (tokens[2], tokens[5]),
        _ => return None,
    };
    (name == stream).then(|| seq.parse().ok()).flatten()
}

/// CPU time used so far by this process and by the servers, in clock
/// ticks (USER_HZ).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSample {
    process: u64,
    /// nats-server, the postmaster and all its children (backends, WAL
    /// writer, checkpointer); `None` unless the bench runs both servers.
    servers: Option<u64>,
}

/// Linux reports /proc times in USER_HZ, which is 100 on every architecture
/// the kernel supports today.
const TICKS_PER_SEC: f64 = 100.0;

impl CpuSample {
    pub fn now(server_pids: Option<&[u32]>) -> CpuSample {
        let process = proc_stat("self").map_or(0, |(_, ticks)| ticks);
        let servers = server_pids.map(|pids| {
            let mut ticks = 0;
            let entries = std::fs::read_dir("/proc").into_iter().flatten().flatten();
            for entry in entries {
                let name = entry.file_name();
                let Some(name) = name
                    .to_str()
                    .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
                else {
                    continue;
                };
                let Some((ppid, used)) = proc_stat(name) else {
                    continue;
                };
                let pid: u32 = name.parse().unwrap_or(0);
                if pids.contains(&pid) || pids.contains(&ppid) {
                    ticks += used;
                }
            }
            ticks
        });
        CpuSample { process, servers }
    }

    /// CPU seconds since `earlier`: (this process, the servers).
    pub fn since(self, earlier: CpuSample) -> (f64, Option<f64>) {
        let seconds =
            |later: u64, earlier: u64| later.saturating_sub(earlier) as f64 / TICKS_PER_SEC;
        (
            seconds(self.process, earlier.process),
            self.servers
                .zip(earlier.servers)
                .map(|(later, earlier)| seconds(later, earlier)),
        )
    }
}

/// (parent pid, utime + stime) of /proc/`pid`/stat.
fn proc_stat(pid: &str) -> Option<(u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may contain spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// Resets the process's peak RSS (VmHWM) to its current RSS, so that a
/// run's peak excludes what earlier phases held. Linux ≥ 4.0.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A memory figure of this process from /proc/self/status, in MiB
/// (`VmHWM`: peak resident; `VmRSS`: resident now).
pub fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects_of_both_formats() {
        assert_eq!(
            acked_sequence("$JS.ACK.S1.c.1.42.40.1700000000.5", "S1"),
            Some(42)
        );
        assert_eq!(
            acked_sequence("$JS.ACK.hub.ACC.S1.c.2.7.9.1700000000.0.tok", "S1"),
            Some(7)
        );
        assert_eq!(acked_sequence("$JS.ACK.S2.c.1.42.40.1.5", "S1"), None);
        assert_eq!(acked_sequence("$JS.API.INFO", "S1"), None);
    }
}
