//! Tracing for the pipeline's processes: logs as before, plus the
//! tracing-opentelemetry layer over an SDK tracer provider, so that each
//! message's span continues the trace its `traceparent` carries and the
//! outbox carries it on (idem-runtime's feature `otel`).
//!
//! A real service would export its spans to a collector; here a
//! [`SpanLog`] writes one line per finished `idem.*` span to stderr (the
//! service's log), which is enough to follow one order by its trace id:
//!
//! ```text
//! idem span 1764540000.123456 trace=4bf92f3577b34da6a3ce929d0e0e4736 span=b7ad6b7169203331 parent=00f067aa0ba902b7 idem.message handler=orders.place.v1 subject=orders.placed
//! ```

use std::time::UNIX_EPOCH;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing::Level;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Installs the process's subscriber: logs filtered by `RUST_LOG` (default:
/// info for idem, warn for the rest), and OpenTelemetry spans of idem and of
/// this example at `INFO`, whatever `RUST_LOG` says. (The layer's tracer
/// keeps the provider alive.)
pub fn install() {
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(SpanLog)
        .build();
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("pipeline-example"))
        .with_filter(
            Targets::new()
                .with_target("idem_runtime", Level::INFO)
                .with_target("pipeline_example", Level::INFO),
        );
    // Stdout carries the counters `report` prints, when asked to.
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,idem_runtime=info".into()),
        );
    tracing_subscriber::registry().with(spans).with(logs).init();
}

/// Writes each finished `idem.*` span as one line to stderr.
#[derive(Debug)]
pub struct SpanLog;

impl SpanExporter for SpanLog {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        for span in batch.iter().filter(|span| span.name.starts_with("idem.")) {
            eprintln!("{}", line(span));
        }
        Ok(())
    }
}

/// One span's line: start time, ids, name and the attributes that say
/// which handler and subject.
fn line(span: &SpanData) -> String {
    let started = span
        .start_time
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let mut text = format!(
        "idem span {started:.6} trace={} span={} parent={} {}",
        span.span_context.trace_id(),
        span.span_context.span_id(),
        span.parent_span_id,
        span.name
    );
    for attribute in &span.attributes {
        if matches!(attribute.key.as_str(), "handler" | "subject" | "delivered") {
            text.push_str(&format!(" {}={}", attribute.key, attribute.value));
        }
    }
    text
}
