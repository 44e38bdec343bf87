//! Step 3 of a run: the traffic, and the faults that act on publishing and
//! on the servers.
//!
//! The messages are published in segments, one more than the server
//! restarts asked for: a restart comes between two segments, once the
//! routers have committed something since the segment before began, so
//! that it meets messages in flight. PostgreSQL restarts while the next
//! segment is published; nats-server restarts before it (a publish cannot
//! reach a server that is down). Copies for
//! [`Fault::DuplicateInWindow`] follow their originals at once; copies for
//! [`Fault::DuplicateAfterWindow`] go out at the end, once the window since
//! their originals has passed. Requests are sent beside all of this.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::future::join_all;

use crate::bed::Bed;
use crate::faults::{Fault, Faults};
use crate::plan::Plan;
use crate::report::{Copy, Happened, RequestLog, Restart};
use crate::run::{Connections, Message, SHORT_WINDOW};

/// How long a request waits for its reply before the client sends it again.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

pub(crate) struct Driver<'b> {
    pub(crate) bed: &'b Bed,
    pub(crate) js: jetstream::Context,
    pub(crate) plan: Arc<Plan>,
    pub(crate) faults: Faults,
    pub(crate) messages: Vec<Message>,
    pub(crate) requests: Vec<Message>,
    pub(crate) happened: Arc<Mutex<Happened>>,
    pub(crate) connections: Arc<Connections>,
    pub(crate) deadline: Instant,
}

impl Driver<'_> {
    pub(crate) async fn drive(self) {
        tokio::join!(self.publish_all(), self.send_requests());
    }

    async fn publish_all(&self) {
        let restarts: Vec<Fault> = [Fault::PostgresRestart, Fault::NatsRestart]
            .into_iter()
            .filter(|fault| self.faults.contains(*fault))
            .collect();
        let each = self.faults.each();
        let copied_at_once = if self.faults.contains(Fault::DuplicateInWindow) {
            each
        } else {
            0
        };
        let copied_late = if self.faults.contains(Fault::DuplicateAfterWindow) {
            each
        } else {
            0
        };
        let mut published_at: HashMap<usize, Instant> = HashMap::new();
        let segments = split(self.messages.len(), restarts.len() + 1);
        for (n, segment) in segments.into_iter().enumerate() {
            let publish = async {
                for i in segment {
                    let message = &self.messages[i];
                    self.publish(message).await;
                    published_at.insert(i, Instant::now());
                    if i < copied_at_once {
                        let ack = self.publish(message).await;
                        self.happened.lock().unwrap().in_window.push(Copy {
                            id: message.id.clone(),
                            stored: !ack.duplicate,
                            sequence: ack.sequence,
                        });
                    }
                }
            };
            match n.checked_sub(1).map(|r| restarts[r]) {
                None => publish.await,
                Some(Fault::PostgresRestart) => {
                    let restart = self.restart_postgres();
                    tokio::join!(restart, publish);
                }
                Some(_) => {
                    self.restart_nats().await;
                    publish.await;
                }
            }
        }
        for i in 0..copied_late.min(self.messages.len()) {
            let message = &self.messages[i];
            let since = published_at[&i].elapsed();
            if since < SHORT_WINDOW {
                tokio::time::sleep(SHORT_WINDOW - since + Duration::from_millis(100)).await;
            }
            // A copy can still fall inside the window on a slow server
            // clock: a publisher keeps retrying, and so does this.
            let ack = loop {
                let ack = self.publish(message).await;
                if !ack.duplicate || Instant::now() > self.deadline {
                    break ack;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            self.happened.lock().unwrap().after_window.push(Copy {
                id: message.id.clone(),
                stored: !ack.duplicate,
                sequence: ack.sequence,
            });
        }
    }

    /// Publishes `message` with JetStream and returns its PubAck, trying
    /// again while NATS does not answer (a restart), until the deadline.
    async fn publish(&self, message: &Message) -> jetstream::publish::PublishAck {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, message.id.as_str());
        loop {
            let sent = self
                .js
                .publish_with_headers(
                    message.subject.clone(),
                    headers.clone(),
                    message.payload.clone(),
                )
                .await;
            let error = match sent {
                Ok(pending) => match pending.await {
                    Ok(ack) => return ack,
                    Err(error) => error.to_string(),
                },
                Err(error) => error.to_string(),
            };
            assert!(
                Instant::now() < self.deadline,
                "idem-test: cannot publish message {} to {}: {error}; is a stream storing \
                 the subject? (a route's `create_stream`, or your set-up, must create it)",
                message.id,
                message.subject
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the routers have committed something since the last
    /// restart (or the start): the traffic a restart should meet. At most
    /// 30 s; a restart that met no traffic is reported as not shown.
    async fn wait_for_traffic(&self) {
        let since = {
            let happened = self.happened.lock().unwrap();
            [&happened.postgres, &happened.nats]
                .into_iter()
                .flatten()
                .map(|restart| restart.commits_before)
                .max()
                .unwrap_or(0)
        };
        let until = Instant::now() + Duration::from_secs(30);
        while self.plan.commits() <= since && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn restart_postgres(&self) {
        self.wait_for_traffic().await;
        let commits_before = self.plan.commits();
        let (old, new) = self
            .bed
            .with_servers(async |servers| {
                let old = servers.postgres.pid();
                servers.postgres.restart_immediate().await;
                (old, servers.postgres.pid())
            })
            .await;
        self.happened.lock().unwrap().postgres = Some(Restart {
            old_pid: old,
            new_pid: new,
            commits_before,
            disconnects_before: 0,
        });
    }

    async fn restart_nats(&self) {
        self.wait_for_traffic().await;
        let commits_before = self.plan.commits();
        let disconnects_before = self.connections.disconnects.load(Ordering::SeqCst);
        let (old, new) = self
            .bed
            .with_servers(async |servers| {
                let old = servers.nats.pid();
                servers.nats.kill_and_restart().await;
                (old, servers.nats.pid())
            })
            .await;
        self.happened.lock().unwrap().nats = Some(Restart {
            old_pid: old,
            new_pid: new,
            commits_before,
            disconnects_before,
        });
    }

    /// Sends every request as a client that retries does, all at once.
    async fn send_requests(&self) {
        let client = self.bed.nats();
        let logs = join_all(
            self.requests
                .iter()
                .map(|request| self.send_request(&client, request)),
        )
        .await;
        let mut happened = self.happened.lock().unwrap();
        for (request, log) in self.requests.iter().zip(logs) {
            happened.requests.insert(request.id.clone(), log);
        }
    }

    /// Sends `request` until it is answered, with the same id each time,
    /// and once more after that, as a client that lost the answer would.
    async fn send_request(&self, client: &async_nats::Client, request: &Message) -> RequestLog {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, request.id.as_str());
        let mut log = RequestLog {
            subject: request.subject.clone(),
            ..RequestLog::default()
        };
        while log.answers.len() < 2 && Instant::now() < self.deadline {
            log.sent += 1;
            let sent = client
                .send_request(
                    request.subject.clone(),
                    async_nats::Request::new()
                        .headers(headers.clone())
                        .payload(request.payload.clone())
                        .timeout(Some(REQUEST_TIMEOUT)),
                )
                .await;
            match sent {
                Ok(reply) => {
                    let error = reply
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(idem_runtime::reply::ERROR_HEADER))
                        .map(|v| v.as_str().to_owned());
                    match error.as_deref() {
                        None => log.answers.push(reply.payload.clone()),
                        Some("retry") => log.errors.push(reason_of(&reply)),
                        Some(_) => {
                            log.errors.push(reason_of(&reply));
                            log.refused = true;
                            break;
                        }
                    }
                }
                Err(error) => log.errors.push(error.to_string()),
            }
            if log.answers.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        log
    }
}

fn reason_of(reply: &async_nats::Message) -> String {
    reply
        .headers
        .as_ref()
        .and_then(|h| h.get(idem_runtime::reply::REASON_HEADER))
        .map_or_else(|| "an error reply".to_owned(), |v| v.as_str().to_owned())
}

/// `0..n` in `parts` consecutive ranges, as even as may be.
fn split(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    (0..parts)
        .map(|p| (n * p / parts)..(n * (p + 1) / parts))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn split_covers_every_message_once_in_order() {
        assert_eq!(split(10, 3), vec![0..3, 3..6, 6..10]);
        assert_eq!(split(2, 3), vec![0..0, 0..1, 1..2]);
        assert_eq!(split(0, 1), vec![0..0]);
    }
}
