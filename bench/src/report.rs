//! What the bench prints: one JSON object per run on stdout (the last line
//! of each mode's output), and on stderr the compare table and the targets
//! the project reports against.

use serde::Serialize;

use crate::consumers::Mode;
use crate::run::Measurement;

#[derive(Serialize)]
struct Line<'a> {
    mode: &'a str,
    scenario: &'a str,
    messages: usize,
    concurrency: usize,
    /// Messages per transaction: 1 for the per-message modes.
    batch: usize,
    msgs_per_sec: f64,
    /// Publish → ack (acks follow the COMMIT), nearest-rank percentiles.
    p50_ms: f64,
    p99_ms: f64,
    /// VmHWM since the consumer started (the peak is reset then).
    peak_rss_mib: f64,
    effects: u64,
    /// Messages the dedup found already processed (0 in a clean run).
    duplicates: u64,
    elapsed_s: f64,
    max_ms: f64,
    latency_samples: usize,
    rss_at_start_mib: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    offered_rate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    publish_lag_ms: Option<f64>,
    /// CPU µs per message of this process, and of the servers when the
    /// bench runs them.
    client_cpu_us_per_msg: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    servers_cpu_us_per_msg: Option<f64>,
    prefill_rows: u64,
    pool_ping: bool,
    /// How a hand-written mode fetched (`prefetch` or `slots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pull: Option<&'a str>,
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// The JSON line of one run.
pub fn json_line(m: &Measurement) -> String {
    let plan = &m.plan;
    serde_json::to_string(&Line {
        mode: plan.mode.name(),
        scenario: plan.scenario,
        messages: plan.messages,
        concurrency: plan.concurrency,
        batch: plan.mode.batch(plan.batch),
        msgs_per_sec: round(m.msgs_per_sec, 1),
        p50_ms: round(m.p50_ms, 3),
        p99_ms: round(m.p99_ms, 3),
        peak_rss_mib: round(m.peak_rss_mib, 1),
        effects: m.effects,
        duplicates: m.duplicates,
        elapsed_s: round(m.elapsed.as_secs_f64(), 3),
        max_ms: round(m.max_ms, 3),
        latency_samples: m.latency_samples,
        rss_at_start_mib: round(m.rss_at_start_mib, 1),
        offered_rate: plan.rate,
        publish_lag_ms: m.publish_lag_ms.map(|lag| round(lag, 3)),
        client_cpu_us_per_msg: round(m.client_cpu_us_per_msg, 1),
        servers_cpu_us_per_msg: m.servers_cpu_us_per_msg.map(|cpu| round(cpu, 1)),
        prefill_rows: plan.prefill,
        pool_ping: plan.ping,
        pull: plan.mode.hand_written().then(|| plan.pull.name()),
    })
    .expect("a report serializes")
}

fn rate_of(runs: &[Measurement], mode: Mode) -> Option<f64> {
    runs.iter()
        .find(|m| m.plan.mode == mode)
        .map(|m| m.msgs_per_sec)
}

/// The compare table: msgs/s and the ratios to `naive` and `manual`, and
/// CPU µs per message of the client process and of the servers.
pub fn compare_table(runs: &[Measurement]) -> String {
    let naive = rate_of(runs, Mode::Naive);
    let manual = rate_of(runs, Mode::Manual);
    let ratio = |rate: f64, base: Option<f64>| {
        base.map_or_else(|| "-".to_owned(), |base| format!("{:.2}x", rate / base))
    };
    let mut out = format!(
        "{:<11} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8}\n",
        "mode",
        "msgs/s",
        "vs naive",
        "vs manual",
        "p50 ms",
        "p99 ms",
        "RSS MiB",
        "client µs",
        "server µs",
        "effects"
    );
    for m in runs {
        out.push_str(&format!(
            "{:<11} {:>9.0} {:>9} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>9.0} {:>9} {:>8}\n",
            m.plan.mode.name(),
            m.msgs_per_sec,
            ratio(m.msgs_per_sec, naive),
            ratio(m.msgs_per_sec, manual),
            m.p50_ms,
            m.p99_ms,
            m.peak_rss_mib,
            m.client_cpu_us_per_msg,
            m.servers_cpu_us_per_msg
                .map_or_else(|| "-".to_owned(), |cpu| format!("{cpu:.0}")),
            m.effects,
        ));
    }
    out
}

/// One target line: `name  value  PASS|MISS`, or n/a when not measured.
pub fn target(name: &str, value: Option<f64>, unit: &str, pass: impl Fn(f64) -> bool) -> String {
    match value {
        Some(v) if v.is_finite() => format!(
            "  {name:<44} {v:>8.2}{unit:<4} {}",
            if pass(v) { "PASS" } else { "MISS" }
        ),
        _ => format!("  {name:<44} {:>8}{:<4} n/a", "-", ""),
    }
}

/// The targets a compare run measures.
pub fn compare_targets(runs: &[Measurement]) -> String {
    let naive = rate_of(runs, Mode::Naive);
    let manual = rate_of(runs, Mode::Manual);
    let idem = rate_of(runs, Mode::Idem);
    let batch = rate_of(runs, Mode::IdemBatch);
    let over = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    [
        "targets:".to_owned(),
        target("idem-batch >= 5x naive", over(batch, naive), "x", |v| {
            v >= 5.0
        }),
        target("idem >= 1.0x manual", over(idem, manual), "x", |v| v >= 1.0),
    ]
    .join("\n")
}

/// The last line of `compare`: every mode's msgs/s and the ratios.
pub fn compare_summary(runs: &[Measurement]) -> String {
    #[derive(Serialize)]
    struct Summary {
        mode: &'static str,
        messages: usize,
        concurrency: usize,
        batch: usize,
        /// Per mode, in run order.
        msgs_per_sec: Rates,
        idem_vs_manual: Option<f64>,
        idem_vs_naive: Option<f64>,
        manual_vs_naive: Option<f64>,
        idem_batch_vs_naive: Option<f64>,
        idem_batch_vs_manual: Option<f64>,
    }
    let ratio = |a: Mode, b: Mode| Some(round(rate_of(runs, a)? / rate_of(runs, b)?, 3));
    let first = &runs[0].plan;
    let summary = Summary {
        mode: "compare",
        messages: first.messages,
        concurrency: first.concurrency,
        batch: first.batch,
        msgs_per_sec: Rates(
            runs.iter()
                .map(|m| (m.plan.mode.name(), round(m.msgs_per_sec, 1)))
                .collect(),
        ),
        idem_vs_manual: ratio(Mode::Idem, Mode::Manual),
        idem_vs_naive: ratio(Mode::Idem, Mode::Naive),
        manual_vs_naive: ratio(Mode::Manual, Mode::Naive),
        idem_batch_vs_naive: ratio(Mode::IdemBatch, Mode::Naive),
        idem_batch_vs_manual: ratio(Mode::IdemBatch, Mode::Manual),
    };
    serde_json::to_string(&summary).expect("a summary serializes")
}

/// `{mode: rate}` in run order (a `serde_json::Map` would sort the keys).
struct Rates(Vec<(&'static str, f64)>);

impl Serialize for Rates {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(mode, rate)| (mode, rate)))
    }
}
