//! Trace context across services (idem-runtime's feature `otel`), against a
//! real nats-server and PostgreSQL: spans go through the tracing-opentelemetry
//! layer to an SDK tracer provider that keeps them in memory, and the tests
//! read back their trace ids, parents and links.
//!
//! A message published with a known `traceparent` is handled by a handler
//! that queues an outbox message; a relay (running in a span of an unrelated
//! trace, started only after the row is committed) publishes it; a second
//! handler consumes it. Both handlers' spans must be in the original trace,
//! the second one's parent must be the first one's span, and the outbox row
//! must carry the first span's `traceparent`. A message without one starts a
//! trace of its own. In batch mode each message keeps its own trace, and the
//! batch span links to every message it took. A dead letter keeps the
//! original's context, and its replay continues the original trace.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_nats::jetstream;
use idem_runtime::outbox::{Outbox, OutboxError, Relay};
use idem_runtime::{Delivery, Permanent, Route, Router, State, dead_letter, idempotent};
use idem_tests::scenario::*;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::PgPool;
use tracing::Instrument;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Queues the deposit for `<account>.next`, in the handler's transaction,
/// forwarding the incoming headers (the publisher's `traceparent` among
/// them, which the outbox must replace with this handler's span).
#[idempotent(name = "trace.first.v1")]
async fn first(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), OutboxError> {
    let next = format!("{}.next", d.account);
    outbox
        .send_with_headers(tx, &next, &d, delivery.headers())
        .await?;
    Ok(())
}

/// Records the deposit, downstream of [`first`].
#[idempotent(name = "trace.second.v1")]
async fn second(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "trace.second.v1", &d, delivery).await
}

/// Whether [`refusing`] still refuses (the bug a replay comes after).
#[derive(Clone)]
struct Refuses(Arc<AtomicBool>);

/// Dead-letters every message while the bug is in, then records it.
#[idempotent(name = "trace.refusing.v1")]
async fn refusing(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(refuses): State<Refuses>,
    d: Deposit,
) -> Result<(), Permanent> {
    if refuses.0.load(Ordering::SeqCst) {
        return Err(Permanent::new("refused until the fix"));
    }
    record_effect(tx, "trace.refusing.v1", &d, delivery)
        .await
        .map_err(Permanent::new)
}

/// The spans every test of this process exports. Installed once, as the
/// global subscriber (before `TestEnv::start`, whose own `init_tracing`
/// then finds one and does nothing): the runtime's spans are at INFO, and
/// the OpenTelemetry layer gets them whatever `RUST_LOG` lets the log
/// output show.
fn exporter() -> &'static InMemorySpanExporter {
    static INSTALLED: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    let (exporter, _) = INSTALLED.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let otel = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("idem-tests"))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
        let log = tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            );
        tracing_subscriber::registry()
            .with(otel)
            .with(log)
            .try_init()
            .expect("no other global subscriber is installed before this one");
        (exporter, provider)
    });
    exporter
}

/// The finished spans named `name` whose `subject` attribute is `subject`.
fn spans_on(name: &str, subject: &str) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .expect("spans are readable")
        .into_iter()
        .filter(|span| span.name == name && attribute(span, "subject").as_deref() == Some(subject))
        .collect()
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// Waits until `count` finished spans named `name` on `subject` are exported.
async fn wait_spans(name: &str, subject: &str, count: usize) -> Vec<SpanData> {
    eventually(
        &format!("{count} `{name}` spans on {subject} are exported"),
        Duration::from_secs(30),
        || async { spans_on(name, subject).len() >= count },
    )
    .await;
    spans_on(name, subject)
}

/// A fresh W3C parent (sampled): its trace id and span id, and the header.
fn remote_parent() -> (TraceId, SpanId, String) {
    let trace = TraceId::from(u128::from(rand_u64()) << 64 | u128::from(rand_u64()));
    let span = SpanId::from(rand_u64() | 1);
    (trace, span, format!("00-{trace}-{span}-01"))
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64,
    );
    hasher.finish()
}

/// The trace id and parent span id of a `traceparent` header value.
fn parsed(traceparent: &str) -> (TraceId, SpanId) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", traceparent);
    let cx = idem_runtime::trace::extract(&headers);
    let span = cx.span();
    let context = span.span_context();
    assert!(context.is_valid(), "a valid traceparent: {traceparent:?}");
    (context.trace_id(), context.span_id())
}

/// A vendor's trace state, published with each `traceparent`.
const VENDOR_STATE: &str = "vendor=opaque";

/// Publishes `deposit` with, if given, a `Nats-Msg-Id` and a `traceparent`
/// (with [`VENDOR_STATE`]).
async fn publish_traced(
    js: &jetstream::Context,
    subject: &str,
    deposit: &Deposit,
    msg_id: Option<&str>,
    traceparent: Option<&str>,
) {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(msg_id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    }
    if let Some(traceparent) = traceparent {
        headers.insert("traceparent", traceparent);
        headers.insert("tracestate", VENDOR_STATE);
    }
    let payload = serde_json::to_vec(deposit).unwrap().into();
    js.publish_with_headers(subject.to_owned(), headers, payload)
        .await
        .expect("publish is sent")
        .await
        .expect("publish is acknowledged");
}

/// The `traceparent` and `tracestate` stored with each pending outbox row,
/// in id order.
async fn pending_traceparents(pool: &PgPool) -> Vec<(Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT (SELECT h->>1 FROM jsonb_array_elements(headers) h WHERE h->>0 = 'traceparent'),
                (SELECT h->>1 FROM jsonb_array_elements(headers) h WHERE h->>0 = 'tracestate')
         FROM idem_outbox ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .expect("outbox rows are read")
}

/// The pipeline of one test: an input stream handled by [`first`], whose
/// outbox messages go to an output stream handled by [`second`].
struct Hop {
    scenario: Scenario,
    /// `<out>.next`, where [`first`] queues.
    next: String,
    out: String,
}

async fn hop(prefix: &str) -> Hop {
    exporter();
    let scenario = scenario(prefix, Duration::from_secs(120)).await;
    let out = unique_name(&format!("{prefix}_OUT"));
    let next = format!("{out}.next");
    create_stream(&scenario.js, &out, &next, Duration::from_secs(120)).await;
    Hop {
        scenario,
        next,
        out,
    }
}

impl Hop {
    /// A router with `first` on the input (a batch route if `batch` > 1) and
    /// `second` on the output.
    /// The two hops: the first in batches of `batch` (1: per message), the
    /// second per message, so that each downstream message has a span of
    /// its own whose parent the tests check.
    fn router(&self, batch: usize) -> Router {
        let mut input = Route::new(&self.scenario.stream, "first").per_message();
        if batch > 1 {
            // One batch at a time: while the first runs, the rest arrive,
            // so a batch of several forms even if the first is of one.
            input = input.batch(batch).concurrency(1);
        }
        Router::new()
            .route(input, first)
            .route(Route::new(&self.out, "second").per_message(), second)
    }

    fn deposit(&self, amount: i64) -> Deposit {
        Deposit {
            account: self.out.clone(),
            amount,
        }
    }
}

/// Runs a relay until `stop` fires, inside a span of a trace of its own: a
/// relay that took the context at publish time would put the downstream
/// message in that trace.
fn spawn_unrelated_relay(
    nats: async_nats::Client,
    pool: PgPool,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    TraceId,
) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let span = tracing::info_span!("unrelated.relay", subject = "none");
    let unrelated = span.context().span().span_context().trace_id();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(
        async move {
            Relay::new()
                .run_until(nats, pool, async move {
                    let _ = stopped.await;
                })
                .await
                .expect("the relay returns Ok");
        }
        .instrument(span),
    );
    (stop, task, unrelated)
}

#[tokio::test]
async fn the_trace_id_survives_a_hop_through_the_outbox() {
    let hop = hop("TRACEHOP").await;
    let Scenario {
        pool,
        nats,
        js,
        subject,
        ..
    } = &hop.scenario;
    let (trace, published_span, traceparent) = remote_parent();
    publish_traced(
        js,
        subject,
        &hop.deposit(1),
        Some("traced-1"),
        Some(&traceparent),
    )
    .await;

    // No relay yet: the row stays pending, with what the handler stored.
    let (handle, task) = spawn(hop.router(1), nats.clone(), pool.clone());
    let [first_span] = wait_spans("idem.message", subject, 1)
        .await
        .try_into()
        .expect("one span for the first handler");
    let rows = pending_traceparents(pool).await;

    // The first handler's span continues the published trace.
    assert_eq!(
        attribute(&first_span, "handler").as_deref(),
        Some("trace.first.v1")
    );
    assert_eq!(first_span.span_context.trace_id(), trace);
    assert_eq!(first_span.parent_span_id, published_span);
    assert!(first_span.parent_span_is_remote);

    // The outbox row carries the first span's context, taken at enqueue:
    // the forwarded publisher's traceparent was replaced, its trace state
    // went on.
    let [(Some(stored), state)] = rows.as_slice() else {
        panic!("one pending outbox row with a traceparent: {rows:?}");
    };
    assert_eq!(
        parsed(stored),
        (trace, first_span.span_context.span_id()),
        "the row's traceparent names the first handler's span"
    );
    assert_eq!(state.as_deref(), Some(VENDOR_STATE));

    // Now publish from a relay whose own span is in another trace.
    let (stop_relay, relay, unrelated) = spawn_unrelated_relay(nats.clone(), pool.clone());
    assert_ne!(unrelated, trace);
    assert_ne!(
        unrelated,
        TraceId::INVALID,
        "the relay's span has a context"
    );
    let [second_span] = wait_spans("idem.message", &hop.next, 1)
        .await
        .try_into()
        .expect("one span for the second handler");
    stop(handle, task).await;
    let _ = stop_relay.send(());
    relay.await.expect("the relay task does not panic");

    assert_eq!(
        attribute(&second_span, "handler").as_deref(),
        Some("trace.second.v1")
    );
    assert_eq!(
        second_span.span_context.trace_id(),
        trace,
        "the downstream span is in the original trace (not the relay's {unrelated})"
    );
    assert_eq!(
        second_span.parent_span_id,
        first_span.span_context.span_id(),
        "the downstream span's parent is the first handler's span"
    );
    // What reached the stream is what the row stored.
    let stored_message = js
        .get_stream(&hop.out)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .expect("the outbox message is stored");
    assert_eq!(header(&stored_message, "traceparent"), *stored);
    // And the hop applied its effect once.
    assert_eq!(ledger(pool, "trace.second.v1").await, Ledger::once_each(1));
}

#[tokio::test]
async fn a_message_without_a_traceparent_starts_a_fresh_trace() {
    let hop = hop("TRACEFRESH").await;
    let Scenario {
        pool,
        nats,
        js,
        subject,
        ..
    } = &hop.scenario;
    publish_traced(js, subject, &hop.deposit(1), Some("untraced-1"), None).await;
    // A malformed one is no context either (and no panic).
    publish_traced(
        js,
        subject,
        &hop.deposit(2),
        Some("untraced-2"),
        Some("00-not-a-trace-01"),
    )
    .await;

    let (handle, task) = spawn(hop.router(1), nats.clone(), pool.clone());
    let (stop_relay, relay, unrelated) = spawn_unrelated_relay(nats.clone(), pool.clone());
    let firsts = wait_spans("idem.message", subject, 2).await;
    let seconds = wait_spans("idem.message", &hop.next, 2).await;
    stop(handle, task).await;
    let _ = stop_relay.send(());
    relay.await.expect("the relay task does not panic");

    let mut traces = Vec::new();
    for first_span in &firsts {
        let trace = first_span.span_context.trace_id();
        assert_ne!(trace, TraceId::INVALID, "a fresh trace, not an empty id");
        assert_ne!(trace, unrelated);
        assert_eq!(first_span.parent_span_id, SpanId::INVALID, "a root span");
        // The fresh trace goes on downstream.
        let downstream: Vec<&SpanData> = seconds
            .iter()
            .filter(|span| span.span_context.trace_id() == trace)
            .collect();
        assert_eq!(downstream.len(), 1, "one downstream span in trace {trace}");
        assert_eq!(
            downstream[0].parent_span_id,
            first_span.span_context.span_id()
        );
        traces.push(trace);
    }
    assert_ne!(traces[0], traces[1], "each message its own trace");
    assert_eq!(ledger(pool, "trace.second.v1").await, Ledger::once_each(2));
}

#[tokio::test]
async fn in_a_batch_each_message_keeps_its_trace_and_the_batch_links_them() {
    let hop = hop("TRACEBATCH").await;
    let Scenario {
        pool,
        nats,
        js,
        subject,
        ..
    } = &hop.scenario;
    // Published before the router starts, so that batches of several form.
    let mut parents = Vec::new();
    for n in 0..6 {
        let (trace, span, traceparent) = remote_parent();
        publish_traced(
            js,
            subject,
            &hop.deposit(n),
            Some(&format!("batched-{n}")),
            Some(&traceparent),
        )
        .await;
        parents.push((trace, span));
    }

    let (handle, task) = spawn(hop.router(8), nats.clone(), pool.clone());
    let (stop_relay, relay, _) = spawn_unrelated_relay(nats.clone(), pool.clone());
    let seconds = wait_spans("idem.message", &hop.next, parents.len()).await;
    stop(handle, task).await;
    let _ = stop_relay.send(());
    relay.await.expect("the relay task does not panic");
    assert_eq!(
        ledger(pool, "trace.second.v1").await,
        Ledger::once_each(parents.len() as i64)
    );

    // The handler calls in the batch: one span each, in its message's trace.
    let firsts = spans_on("idem.message", subject);
    assert_eq!(firsts.len(), parents.len(), "one span per handler call");
    for (trace, published_span) in &parents {
        let [first_span] = firsts
            .iter()
            .filter(|span| span.span_context.trace_id() == *trace)
            .collect::<Vec<_>>()[..]
        else {
            panic!("one first-handler span in trace {trace}: {firsts:#?}");
        };
        assert_eq!(first_span.parent_span_id, *published_span);
        let [second_span] = seconds
            .iter()
            .filter(|span| span.span_context.trace_id() == *trace)
            .collect::<Vec<_>>()[..]
        else {
            panic!("one downstream span in trace {trace}");
        };
        assert_eq!(
            second_span.parent_span_id,
            first_span.span_context.span_id()
        );
    }

    // The batch spans: each links to the messages it took, and together
    // they took every message; one took several (the fault of interest: a
    // span with many parents).
    let batches: Vec<SpanData> = exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| {
            span.name == "idem.batch"
                && span.links.iter().any(|link| {
                    parents
                        .iter()
                        .any(|(t, _)| link.span_context.trace_id() == *t)
                })
        })
        .collect();
    let mut linked: Vec<String> = batches
        .iter()
        .flat_map(|batch| {
            batch.links.iter().map(|link| {
                format!(
                    "{}-{}",
                    link.span_context.trace_id(),
                    link.span_context.span_id()
                )
            })
        })
        .collect();
    linked.sort();
    let mut expected: Vec<String> = parents.iter().map(|(t, s)| format!("{t}-{s}")).collect();
    expected.sort();
    assert_eq!(
        linked, expected,
        "the batch spans link to each message once"
    );
    assert!(
        batches.iter().any(|batch| batch.links.len() > 1),
        "a batch took several messages: {:?}",
        batches.iter().map(|b| b.links.len()).collect::<Vec<_>>()
    );
    for batch in &batches {
        assert!(
            parents
                .iter()
                .all(|(t, _)| batch.span_context.trace_id() != *t),
            "a batch span is in a trace of its own"
        );
    }
}

#[tokio::test]
async fn a_dead_letter_keeps_the_context_and_its_replay_continues_the_trace() {
    exporter();
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("TRACEDEAD", Duration::from_secs(120)).await;
    let (trace, published_span, traceparent) = remote_parent();
    // No Nats-Msg-Id: the replay's id (the stream position) is then not in
    // JetStream's duplicate window.
    publish_traced(
        &js,
        &subject,
        &Deposit {
            account: "a".into(),
            amount: 1,
        },
        None,
        Some(&traceparent),
    )
    .await;
    let refuses = Refuses(Arc::new(AtomicBool::new(true)));
    let router = Router::with_state(refuses.clone()).route(Route::new(&stream, "r"), refusing);
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    let [failed] = wait_spans("idem.message", &subject, 1)
        .await
        .try_into()
        .expect("one span for the refused attempt");
    let letters = dead_letters(&js, &stream).await;
    let [letter] = letters.as_slice() else {
        panic!("one dead letter: {}", letters.len());
    };
    assert_eq!(header(letter, "Idem-Failure"), "permanent");
    assert_eq!(failed.span_context.trace_id(), trace);
    assert_eq!(
        header(letter, "traceparent"),
        traceparent,
        "the dead letter keeps the original's context"
    );

    refuses.0.store(false, Ordering::SeqCst);
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence)
        .await
        .expect("the replay is published");
    let spans = wait_spans("idem.message", &subject, 2).await;
    stop(handle, task).await;
    let replayed = spans
        .iter()
        .find(|span| span.span_context.span_id() != failed.span_context.span_id())
        .expect("a span for the replay");
    assert_eq!(
        replayed.span_context.trace_id(),
        trace,
        "the replay is in the original trace"
    );
    assert_eq!(
        (replayed.parent_span_id, failed.parent_span_id),
        (published_span, published_span),
        "the refused attempt and the replay are both children of the publisher's span"
    );
    assert_eq!(
        ledger(&pool, "trace.refusing.v1").await,
        Ledger::once_each(1)
    );
}
