//! The path of a request on a [`ReplyRoute`]: what the JetStream path
//! ([`pipeline`](super::pipeline)) does, with an answer to a caller who
//! waits at the end of it instead of an ack. See [`reply`](crate::reply)
//! for what a reply route promises.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::consume::pipeline::{Pipeline, Verdict};
use crate::error::class::ErrorClass;
use crate::error::{HandlerError, RejectedMessage};
use crate::handler::Handler;
use crate::handler::delivery::Delivery;
use crate::message_id::{InvalidMessageId, MessageId};
use crate::observe::recorder::Event;
use crate::observe::stats::Stats;
use crate::store::backend::Backend;
use crate::tasks::Signal;

use crate::consume::pipeline::RouteContext;
use crate::reply::{
    Answers, ERROR_HEADER, HAND_BACK_BOUND, MAX_REASON, Mode, REASON_HEADER, ReplyRoute, reason,
};

/// A reply larger than the NATS server accepts: it could never be sent.
#[derive(Debug, thiserror::Error)]
#[error(
    "the reply is {size} bytes, more than the NATS server's max_payload of {max_payload} bytes, so it could never be sent; nothing was committed. Return a smaller value (store the large part and reply with a reference to it), or raise the server's max_payload"
)]
pub(crate) struct ReplyTooLarge {
    size: usize,
    max_payload: usize,
}

/// A request route with its handler and state, type-erased so that one
/// router holds many.
pub(crate) trait BindReply<DB: Backend>: Send + Sync {
    fn route(&self) -> &ReplyRoute;
    fn handler_name(&self) -> &'static str;
    /// Serves the requests of `requests` until shutdown; returns how many it
    /// had to abandon.
    fn start(
        self: Box<Self>,
        requests: async_nats::Subscriber,
        context: RouteContext<DB>,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>>;
}

pub(crate) struct BoundReply<H, S> {
    pub(crate) route: ReplyRoute,
    pub(crate) handler: H,
    pub(crate) stats: Arc<Stats>,
    pub(crate) state: Arc<S>,
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> BindReply<DB> for BoundReply<H, S> {
    fn route(&self) -> &ReplyRoute {
        &self.route
    }

    fn handler_name(&self) -> &'static str {
        self.handler.name()
    }

    fn start(
        self: Box<Self>,
        requests: async_nats::Subscriber,
        context: RouteContext<DB>,
    ) -> Pin<Box<dyn Future<Output = usize> + Send>> {
        let route = self.route.as_route();
        let mode = Mode::Answer(Answers {
            claims_under: self.route.dedup_name(),
            detailed_reasons: self.route.detailed_reasons,
        });
        let pipeline = Arc::new(Pipeline::new(
            route,
            self.handler,
            self.state,
            self.stats,
            mode,
            &context,
        ));
        Box::pin(serve_until_shutdown(
            requests,
            pipeline,
            self.route.concurrency,
            context.shutdown,
            context.grace,
        ))
    }
}

/// Answers requests until shutdown, then waits up to `grace` for those in
/// flight. Returns how many it had to abandon.
async fn serve_until_shutdown<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend>(
    mut requests: async_nats::Subscriber,
    pipeline: Arc<Pipeline<H, S, DB>>,
    concurrency: usize,
    mut shutdown: Signal,
    grace: Duration,
) -> usize {
    let subject = pipeline.route.durable.clone();
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut in_flight = JoinSet::new();
    loop {
        // A free slot first, so that a request is taken only when it can
        // start; shutdown first, so that none is taken after it.
        let slot = tokio::select! {
            biased;
            _ = shutdown.fired() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
        };
        while in_flight.try_join_next().is_some() {}
        let request = tokio::select! {
            biased;
            _ = shutdown.fired() => break,
            next = requests.next() => match next {
                Some(request) => request,
                None => {
                    tracing::error!(subject, "the request subscription ended; this route takes no more requests");
                    shutdown.fired().await;
                    break;
                }
            },
        };
        in_flight.spawn(pipeline.clone().answer(request, slot));
    }

    // Stop taking requests, and tell those received but not started to try
    // again (another worker of the group takes them).
    let _ = requests.unsubscribe().await;
    let mut unstarted = Vec::new();
    while let Some(Some(request)) = requests.next().now_or_never() {
        unstarted.push(request);
    }
    if !unstarted.is_empty() {
        let answers = async {
            for request in &unstarted {
                if let Some(reply) = &request.reply {
                    pipeline
                        .reply(
                            reply,
                            Answer::error(
                                ErrorClass::Transient,
                                reason::SHUTTING_DOWN,
                                "the worker is shutting down and did not start the request; nothing was committed: send it again",
                            ),
                        )
                        .await;
                }
            }
        };
        if tokio::time::timeout(HAND_BACK_BOUND, answers)
            .await
            .is_err()
        {
            tracing::warn!(
                subject,
                "answering unstarted requests at shutdown took too long; their clients time out and retry"
            );
        }
    }
    tracing::info!(
        subject,
        in_flight = in_flight.len(),
        "stopped taking requests; finishing in-flight ones"
    );
    let drained = tokio::time::timeout(grace, async {
        while in_flight.join_next().await.is_some() {}
    })
    .await;
    if drained.is_ok() {
        return 0;
    }
    let abandoned = in_flight.len();
    tracing::error!(
        subject,
        abandoned,
        ?grace,
        "in-flight requests outlived the shutdown grace period; cancelling them (their clients get no reply; a retry finds the claim of any that committed)"
    );
    crate::consume::pull::cancel(in_flight, &subject).await;
    abandoned
}

/// A reply: the stored value, or an error.
pub(crate) enum Answer {
    Value(Bytes),
    Error {
        retry: bool,
        /// One of [`reason`].
        reason: &'static str,
        /// What happened, for the log and, on a route that asks for it, the
        /// requester.
        detail: String,
    },
}

impl Answer {
    /// An error reply for a failure of class `class`: `retry` unless the
    /// same request would fail the same way.
    pub(crate) fn error(
        class: ErrorClass,
        reason: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        let retry = !matches!(
            class,
            ErrorClass::Permanent | ErrorClass::RetryNowThenPermanent
        );
        Answer::Error {
            retry,
            reason,
            detail: detail.into(),
        }
    }
}

/// The `Idem-Reason` class of a failed request.
fn reason_of(error: &HandlerError) -> &'static str {
    match error {
        HandlerError::Infrastructure(_) => reason::DATABASE_UNAVAILABLE,
        HandlerError::ClaimFailed(_) => reason::CLAIM_FAILED,
        HandlerError::Handler { error, .. } if error.is::<ReplyTooLarge>() => {
            reason::REPLY_TOO_LARGE
        }
        HandlerError::Handler { error, .. } if error.is::<crate::codec::EncodeError>() => {
            reason::UNENCODABLE
        }
        HandlerError::Handler { .. } | HandlerError::Aborted => reason::HANDLER_ERROR,
        HandlerError::TimedOut(_) => reason::HANDLER_TIMEOUT,
        HandlerError::Panicked(_) => reason::HANDLER_PANIC,
        HandlerError::ClaimLost => reason::CLAIM_LOST,
        HandlerError::CommitRefused(_) => reason::COMMIT_REFUSED,
    }
}

/// The `Idem-Reason` class of a request refused before it ran.
fn reason_of_rejected(rejected: &RejectedMessage) -> &'static str {
    match rejected {
        RejectedMessage::Decode(_) => reason::UNDECODABLE,
        RejectedMessage::MessageId(InvalidMessageId::Missing) => reason::NO_MESSAGE_ID,
        RejectedMessage::MessageId(_) => reason::BAD_MESSAGE_ID,
    }
}

impl<S: Send + Sync + 'static, H: Handler<S, DB>, DB: Backend> Pipeline<H, S, DB> {
    /// Answers one request. `_slot` is the concurrency permit.
    async fn answer(self: Arc<Self>, request: async_nats::Message, _slot: OwnedSemaphorePermit) {
        self.recorder.record(Event::Received);
        let _in_flight = self.recorder.in_flight(1);
        let Some(reply) = request.reply.clone() else {
            self.recorder.record(Event::Rejected);
            tracing::warn!(
                subject = %request.subject,
                "a message without a reply subject is not a request; dropped"
            );
            return;
        };
        let span = tracing::info_span!(
            "idem.request",
            handler = self.handler.name(),
            subject = %request.subject,
            message_id = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        crate::observe::trace::continue_trace(&span, request.headers.as_ref());
        async {
            let answer = match self.prepare_request(&request) {
                Err(rejected) => {
                    self.recorder.record(Event::Rejected);
                    tracing::warn!(error = %rejected, "request rejected");
                    Answer::error(
                        ErrorClass::Permanent,
                        reason_of_rejected(&rejected),
                        rejected.to_string(),
                    )
                }
                Ok((payload, delivery)) => {
                    let verdict = self
                        .transact_with_retries(&request.payload, payload, &delivery)
                        .await;
                    #[cfg(feature = "fault-injection")]
                    if matches!(verdict, Verdict::Processed(_))
                        && self.faults.decide_after_commit(&delivery)
                            == crate::fault::AfterCommit::DropWithoutAck
                    {
                        // As if the process died right after its COMMIT.
                        tracing::warn!("fault injection: committed but not replying");
                        self.recorder.record(Event::Processed);
                        self.recorder.record(Event::DroppedByFault);
                        return;
                    }
                    match verdict {
                        // Committed, or it may have: a relay of this process
                        // publishes what it queued.
                        Verdict::Processed(_) | Verdict::CommitUnknown(_) => {
                            crate::outbox::after_commit(&delivery, &self.outbox_bell);
                        }
                        // A retry of a request that committed before: that
                        // attempt may have queued rows no relay was woken
                        // for (its process died right after its COMMIT).
                        Verdict::Replayed(_) => self.outbox_bell.ring(),
                        _ => {}
                    }
                    self.answer_of(verdict)
                }
            };
            self.reply(&reply, answer).await;
        }
        .instrument(span)
        .await;
    }

    /// The request's payload and delivery, with its message id: the
    /// handler's key, else its `Nats-Msg-Id` (there is no stream position to
    /// fall back on).
    fn prepare_request(
        &self,
        request: &async_nats::Message,
    ) -> Result<(H::Payload, Delivery), RejectedMessage> {
        let headers = request.headers.clone().unwrap_or_default();
        let carried = match headers.get_last(NATS_MESSAGE_ID) {
            Some(id) => MessageId::from_header(id.as_str().to_owned()),
            None => Err(InvalidMessageId::Missing),
        };
        let payload = self.decode(&request.payload)?;
        // The key sees the delivery with the carried id, if there is one,
        // as on a JetStream route.
        let placeholder = carried.clone().unwrap_or_else(|_| MessageId::none());
        let mut delivery = Delivery::for_request(request.subject.as_str(), headers, placeholder);
        let id = match self.key_of(&payload, &delivery)? {
            Some(key) => MessageId::from_key(key)?,
            None => carried?,
        };
        tracing::Span::current().record("message_id", id.as_str());
        delivery.set_message_id(id);
        delivery.set_handler(self.handler.name());
        #[cfg(feature = "fault-injection")]
        self.faults.saw_delivery(&delivery);
        Ok((payload, delivery))
    }

    /// Refuses, before it is stored and committed, a reply that the NATS
    /// server would refuse to carry: a permanent failure of this request,
    /// rolled back, so that no effect is committed whose reply can never be
    /// sent. Only on a route that answers; a JetStream route's stored
    /// result is read from the database, never sent.
    pub(crate) fn check_reply_size(&self, result: &Bytes) -> Result<(), HandlerError> {
        if self.mode.answers().is_none() {
            return Ok(());
        }
        // A value reply carries no headers: its payload is the whole
        // message the client library checks against max_payload.
        let max_payload = self.nats.max_payload();
        if result.len() <= max_payload {
            return Ok(());
        }
        Err(HandlerError::classified(
            ReplyTooLarge {
                size: result.len(),
                max_payload,
            },
            Some(ErrorClass::Permanent),
        ))
    }

    /// The reply a request's verdict earns.
    fn answer_of(&self, verdict: Verdict) -> Answer {
        match verdict {
            Verdict::Processed(result) => {
                self.recorder.record(Event::Processed);
                tracing::debug!("processed; replying");
                Answer::Value(result.unwrap_or_default())
            }
            Verdict::Replayed(Some(result)) => {
                self.recorder.record(Event::Duplicate);
                tracing::info!("processed before; replying with the stored result");
                Answer::Value(result.unwrap_or_default())
            }
            Verdict::Replayed(None) => {
                self.recorder.record(Event::Duplicate);
                tracing::warn!("processed before, but its claim has expired since");
                Answer::error(
                    ErrorClass::Permanent,
                    reason::EXPIRED,
                    "the request was processed before, but its claim and stored result have expired (retention); sending it again would run it again",
                )
            }
            Verdict::Failed(error) => {
                self.recorder.record(Event::Failed);
                let class = error.class();
                tracing::warn!(%error, ?class, "request failed; rolled back");
                Answer::error(class, reason_of(&error), error.to_string())
            }
            Verdict::CommitUnknown(error) => {
                self.recorder.record(Event::CommitFailed);
                tracing::warn!(%error, "COMMIT failed with an unknown outcome");
                Answer::error(
                    ErrorClass::Transient,
                    reason::COMMIT_UNKNOWN,
                    format!(
                        "COMMIT's outcome is unknown ({}); send the request again with the same id: if it committed, the reply is the stored one",
                        HandlerError::Infrastructure(error)
                    ),
                )
            }
            Verdict::Rejected(error) => {
                self.recorder.record(Event::Rejected);
                Answer::error(
                    ErrorClass::Permanent,
                    reason_of_rejected(&error),
                    error.to_string(),
                )
            }
            // A request is delivered once (never past a limit), and is
            // answered, not held, while the database is away.
            Verdict::Duplicate | Verdict::Exhausted | Verdict::Interrupted | Verdict::Unstarted => {
                self.recorder.record(Event::Failed);
                Answer::error(
                    ErrorClass::Transient,
                    reason::UNAVAILABLE,
                    "the request could not be processed now; send it again",
                )
            }
        }
    }

    /// Publishes `answer` to `reply`. At most once: a reply lost on the way
    /// is recovered by the client's retry. A value the server would refuse
    /// (stored when it still fitted, or the server's max_payload shrank
    /// since) is answered with a `reply-too-large` error instead of
    /// silence: the request was processed, and every retry would fail the
    /// same way.
    async fn reply(&self, reply: &async_nats::Subject, answer: Answer) {
        let answer = match answer {
            Answer::Value(value) if value.len() > self.nats.max_payload() => {
                let max_payload = self.nats.max_payload();
                tracing::error!(
                    size = value.len(),
                    max_payload,
                    "the request was processed, but its stored reply is larger than the NATS server's max_payload and cannot be sent; answering with an error"
                );
                Answer::error(
                    ErrorClass::Permanent,
                    reason::REPLY_TOO_LARGE,
                    format!(
                        "the request was processed and committed, but its stored reply of {} bytes is more than the NATS server's max_payload of {max_payload} bytes, so it cannot be sent",
                        value.len()
                    ),
                )
            }
            answer => answer,
        };
        let published = match answer {
            Answer::Value(value) => self.nats.publish(reply.clone(), value).await,
            Answer::Error {
                retry,
                reason,
                detail,
            } => {
                let detailed = self
                    .mode
                    .answers()
                    .is_some_and(|answers| answers.detailed_reasons);
                let mut headers = HeaderMap::new();
                headers.insert(ERROR_HEADER, if retry { "retry" } else { "permanent" });
                if detailed {
                    headers.insert(
                        REASON_HEADER,
                        one_line(&format!("{reason}: {detail}")).as_str(),
                    );
                } else {
                    headers.insert(REASON_HEADER, reason);
                }
                self.nats
                    .publish_with_headers(reply.clone(), headers, Bytes::new())
                    .await
            }
        };
        if let Err(error) = published {
            tracing::warn!(%error, "the reply could not be sent; the client's retry gets the stored one");
        }
    }
}

/// `text` on one line, at most [`MAX_REASON`] bytes, for a header.
pub(crate) fn one_line(text: &str) -> String {
    let mut line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}
