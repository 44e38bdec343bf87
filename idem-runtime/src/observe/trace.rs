//! Trace context across services (feature `otel`): one order, say, can be
//! followed through every service it passes, over JetStream and the outbox.
//!
//! - **In.** Each message's span (`idem.message`, `idem.request` on a
//!   request route) continues the [W3C trace context] its NATS headers carry
//!   (`traceparent`, `tracestate`): the remote span is set as its
//!   OpenTelemetry parent, so the message's span and everything inside it
//!   (the handler's own spans) belong to the publisher's trace. A message
//!   without a usable `traceparent` starts a trace of its own.
//! - **On, through the outbox.** [`outbox::enqueue`](crate::outbox::enqueue)
//!   (and so [`Outbox::send`](crate::outbox::Outbox::send)) writes the
//!   *current* span's context into the queued message's headers, **when it is
//!   queued**, inside the handler's transaction. The relay publishes the
//!   stored headers as they are, later and from whatever task or process:
//!   the downstream message's span is then a child of the span that queued
//!   it (the handler's `idem.message`, or a span the handler opened inside
//!   it). A `traceparent` and `tracestate` among the headers given (say,
//!   forwarded from the incoming message) are replaced: each hop names its
//!   own span as the parent, as W3C asks. Without a current context (no
//!   layer, no span) the headers are stored as given.
//! - **Batches.** A batch has many parents, and a span has one. The
//!   `idem.batch` span starts a trace of its own and gets a link to each
//!   message's context. Each handler call inside the batch (and each
//!   message of a batch that falls back to one transaction per message)
//!   runs in an `idem.message` span whose parent is that message's context,
//!   so what it queues in the outbox continues that message's trace, as in
//!   per-message mode. A batch handler (`#[idempotent(batch)]`) is one call
//!   for many messages: it runs in the batch span.
//! - **Dead letters and replays.** A dead letter keeps the original's
//!   headers, `traceparent` and `tracestate` included, unchanged (the span
//!   that gave up on it logs why, in the same trace). A replay publishes
//!   them again, so the replayed message's span is one more child of the
//!   original publisher's span: the failed attempts and the replay are
//!   siblings in one trace.
//!
//! Nothing is propagated unless the application installs a
//! [`tracing_opentelemetry`] layer over a tracer provider, and lets the
//! runtime's spans through its filter (they are at `INFO`): without it the
//! spans have no OpenTelemetry context to continue or carry on. The W3C
//! format is used whatever the global propagator is, so that services
//! agree without configuration.
//!
//! ```no_run
//! use opentelemetry::trace::TracerProvider as _;
//! use tracing_subscriber::layer::SubscriberExt as _;
//!
//! let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build(); // add an exporter
//! let subscriber = tracing_subscriber::registry()
//!     .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("orders")));
//! tracing::subscriber::set_global_default(subscriber).unwrap();
//! ```
//!
//! A publisher outside idem (a shop front, a test) starts the trace with
//! [`inject_current`] or [`inject`].
//!
//! [W3C trace context]: https://www.w3.org/TR/trace-context/

use std::borrow::Cow;

use async_nats::HeaderMap;
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header that names the trace and the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header with vendors' trace state.
pub const TRACESTATE: &str = "tracestate";

/// The trace context `headers` carry (W3C `traceparent` and `tracestate`,
/// names matched without regard to case), or an empty context if they carry
/// none or an invalid one.
///
/// ```
/// use opentelemetry::trace::TraceContextExt;
///
/// let mut headers = async_nats::HeaderMap::new();
/// headers.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// let cx = idem_runtime::trace::extract(&headers);
/// assert_eq!(cx.span().span_context().trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// ```
pub fn extract(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

/// Writes the span context of `cx` into `headers` as `traceparent` (and
/// `tracestate`, if it has any). Does nothing if `cx` has no valid span.
pub fn inject(cx: &Context, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(cx, &mut HeadersMut(headers));
}

/// Writes the current span's context into `headers`: what a publisher
/// outside idem calls inside its own span, so that the message's span
/// continues its trace.
pub fn inject_current(headers: &mut HeaderMap) {
    inject(&tracing::Span::current().context(), headers);
}

/// Makes `span` continue the trace `headers` carry. A message without a
/// valid context keeps the parent `span` was created with (none for a
/// message's span: a new trace; the batch span for a message of a batch).
pub(crate) fn continue_trace(span: &tracing::Span, headers: Option<&HeaderMap>) {
    let Some(headers) = headers else { return };
    let parent = extract(headers);
    if parent.span().span_context().is_valid() {
        // Fails only without the OpenTelemetry layer, or for a disabled or
        // already started span: then there is nothing to continue.
        let _ = span.set_parent(parent);
    }
}

/// Links `span` to the context each of `headers` carries (none for those
/// without): a batch's span, which has one parent and many messages.
pub(crate) fn link_each<'a>(
    span: &tracing::Span,
    headers: impl IntoIterator<Item = &'a HeaderMap>,
) {
    for headers in headers {
        // add_link ignores an invalid (absent) context.
        span.add_link(extract(headers).span().span_context().clone());
    }
}

/// `headers` with the current span's context in place of any they carry:
/// what an outbox message is stored with, so that it carries the queuing
/// span's context to wherever it is published from. Each hop names its own
/// span as the parent (W3C), so a `traceparent` forwarded from the incoming
/// message is replaced, with its `tracestate`. Without a current context
/// (no OpenTelemetry layer, no span), `headers` are kept as they are.
pub(crate) fn with_current_context(headers: &HeaderMap) -> Cow<'_, HeaderMap> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return Cow::Borrowed(headers);
    }
    let is_context = |name: &str| {
        name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
    };
    let mut carried = HeaderMap::new();
    for (name, values) in headers
        .iter()
        .filter(|(name, _)| !is_context(name.as_ref()))
    {
        for value in values {
            carried.append(name.clone(), value.clone());
        }
    }
    inject(&cx, &mut carried);
    Cow::Owned(carried)
}

/// NATS headers read as a W3C carrier.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // NATS header names keep their case; W3C names are lower case, and
        // some publishers capitalise them.
        self.0
            .iter()
            .find(|(name, _)| AsRef::<str>::as_ref(*name).eq_ignore_ascii_case(key))
            .and_then(|(_, values)| values.first())
            .map(|value| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

/// NATS headers written as a W3C carrier.
struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        // An empty `tracestate` says nothing; leave it out.
        if !value.is_empty() {
            self.0.insert(key, value.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips_with_its_state() {
        let mut headers = HeaderMap::new();
        headers.insert("Traceparent", PARENT);
        headers.insert("tracestate", "vendor=opaque");
        let cx = extract(&headers);
        let span = cx.span();
        let context = span.span_context();
        assert!(context.is_valid() && context.is_remote());
        assert_eq!(
            context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(context.trace_state().get("vendor"), Some("opaque"));

        let mut out = HeaderMap::new();
        inject(&cx, &mut out);
        assert_eq!(out.get(TRACEPARENT).map(|v| v.as_str()), Some(PARENT));
        assert_eq!(
            out.get(TRACESTATE).map(|v| v.as_str()),
            Some("vendor=opaque")
        );
    }

    #[test]
    fn missing_or_malformed_context_extracts_as_none() {
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(TRACEPARENT, bad);
            assert!(
                !extract(&headers).span().span_context().is_valid(),
                "{bad:?}"
            );
        }
        assert!(!extract(&HeaderMap::new()).span().span_context().is_valid());
    }

    #[test]
    fn no_empty_tracestate_is_written() {
        let context = SpanContext::new(
            TraceId::from(7),
            SpanId::from(9),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
        let mut headers = HeaderMap::new();
        inject(
            &Context::new().with_remote_span_context(context),
            &mut headers,
        );
        assert!(headers.get(TRACEPARENT).is_some());
        assert!(headers.get(TRACESTATE).is_none());
    }

    #[test]
    fn without_a_current_context_headers_are_kept_as_given() {
        // No OpenTelemetry layer here: the current span has no context.
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, PARENT);
        assert!(matches!(with_current_context(&headers), Cow::Borrowed(_)));
        let empty = HeaderMap::new();
        assert!(with_current_context(&empty).get(TRACEPARENT).is_none());
    }
}
