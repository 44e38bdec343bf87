//! Counters a service prints for a test that runs it as a process
//! (`tests/tests/chaos/pipeline.rs`), off unless `PIPELINE_REPORT_MS` is set.
//!
//! With `PIPELINE_REPORT_MS=<ms>`, the service prints one JSON object per
//! line on stdout whenever a counter changed (checked every 10 ms) and at
//! least every `<ms>`: its routes' [`Stats`](idem_runtime::Stats), its
//! relay's [`RelayStats`], and its NATS client's connection events. Each line
//! goes out in one `write(2)`, so a SIGKILL loses no line already written,
//! and the last line of a killed service is at most 10 ms old.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::RouterHandle;
use idem_runtime::outbox::RelayStats;
use serde::Serialize;

/// The pipeline's durable consumers: a service reports those it runs.
const DURABLES: [&str; 3] = ["orders-place", "orders-mark-paid", "payments-charge"];

static NATS_CONNECTS: AtomicU64 = AtomicU64::new(0);
static NATS_DISCONNECTS: AtomicU64 = AtomicU64::new(0);
static NATS_RECONNECTS: AtomicU64 = AtomicU64::new(0);
static NATS_DOWN: AtomicBool = AtomicBool::new(false);

/// Counts a NATS client event (and logs it): `connect` passes each one here.
pub fn on_nats_event(event: &async_nats::Event) {
    match event {
        async_nats::Event::Connected => {
            NATS_CONNECTS.fetch_add(1, Ordering::Relaxed);
            if NATS_DOWN.swap(false, Ordering::Relaxed) {
                NATS_RECONNECTS.fetch_add(1, Ordering::Relaxed);
            }
        }
        async_nats::Event::Disconnected => {
            NATS_DISCONNECTS.fetch_add(1, Ordering::Relaxed);
            NATS_DOWN.store(true, Ordering::Relaxed);
        }
        _ => {}
    }
    tracing::warn!(%event, "nats connection event");
}

/// One route's counters.
#[derive(Serialize, PartialEq, Eq, Clone)]
struct RouteReport {
    durable: &'static str,
    received: u64,
    processed: u64,
    duplicates: u64,
    failed: u64,
    commit_failed: u64,
    rejected: u64,
    retried_in_process: u64,
    infrastructure_errors: u64,
    abandoned_transactions: u64,
    dead_lettered: u64,
}

/// One stats line.
#[derive(Serialize, PartialEq, Eq, Clone)]
struct Report {
    event: &'static str,
    pid: u32,
    routes: Vec<RouteReport>,
    relay_published: u64,
    relay_duplicates: u64,
    relay_failed: u64,
    relay_cycles: u64,
    nats_connects: u64,
    nats_disconnects: u64,
    nats_reconnects: u64,
}

fn snapshot(router: &RouterHandle, relay: &RelayStats) -> Report {
    let routes = DURABLES
        .iter()
        .filter_map(|&durable| {
            let s = router.stats(durable)?;
            Some(RouteReport {
                durable,
                received: s.received(),
                processed: s.processed(),
                duplicates: s.duplicates(),
                failed: s.failed(),
                commit_failed: s.commit_failed(),
                rejected: s.rejected(),
                retried_in_process: s.retried_in_process(),
                infrastructure_errors: s.infrastructure_errors(),
                abandoned_transactions: s.abandoned_transactions(),
                dead_lettered: s.dead_lettered(),
            })
        })
        .collect();
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    Report {
        event: "stats",
        pid: std::process::id(),
        routes,
        relay_published: relay.published(),
        relay_duplicates: relay.duplicates(),
        relay_failed: relay.failed(),
        relay_cycles: relay.cycles(),
        nats_connects: load(&NATS_CONNECTS),
        nats_disconnects: load(&NATS_DISCONNECTS),
        nats_reconnects: load(&NATS_RECONNECTS),
    }
}

/// Writes `report` as one line in one `write(2)` (stdout is line-buffered,
/// so a whole line goes straight to the pipe).
fn emit(report: &Report) {
    let mut line = serde_json::to_string(report).expect("a report serializes");
    line.push('\n');
    // A test that stopped reading has ended; nothing to report to then.
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
}

/// Starts reporting if `PIPELINE_REPORT_MS` is set; a no-op otherwise.
pub fn start(router: RouterHandle, relay: RelayStats) {
    let Some(every) = std::env::var("PIPELINE_REPORT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(Duration::from_millis)
    else {
        return;
    };
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(Duration::from_millis(10));
        let mut last: Option<(Report, Instant)> = None;
        loop {
            ticks.tick().await;
            let now = snapshot(&router, &relay);
            if let Some((before, at)) = &last
                && *before == now
                && at.elapsed() < every
            {
                continue;
            }
            emit(&now);
            last = Some((now, Instant::now()));
        }
    });
}
