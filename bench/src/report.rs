//! What the bench prints: one JSON object per run on stdout (the last line
//! of each mode's output), and on stderr the compare and chart tables and
//! the targets the project reports against.

use std::path::Path;

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
    /// BEGIN → the handler's INSERT, server clock (retention scenarios).
    #[serde(skip_serializing_if = "Option::is_none")]
    claim_p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claim_p99_ms: Option<f64>,
    /// The route's retention, seconds (retention scenarios).
    #[serde(skip_serializing_if = "Option::is_none")]
    retention_s: Option<f64>,
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
        batch: plan.mode.batch(plan.batch, plan.concurrency),
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
        claim_p50_ms: m.claim_p50_ms.map(|v| round(v, 3)),
        claim_p99_ms: m.claim_p99_ms.map(|v| round(v, 3)),
        retention_s: plan.retention.map(|r| r.as_secs_f64()),
    })
    .expect("a report serializes")
}

fn rate_of(runs: &[Measurement], mode: Mode) -> Option<f64> {
    runs.iter()
        .find(|m| m.plan.mode == mode)
        .map(|m| m.msgs_per_sec)
}

/// `rate / base` as `1.23x`, or `-` without a base.
fn ratio(rate: f64, base: Option<f64>) -> String {
    base.map_or_else(|| "-".to_owned(), |base| format!("{:.2}x", rate / base))
}

/// The wait µs column: the time per message not accounted for by CPU on
/// this machine's cores (waiting on I/O, fsync, the network), as wall µs
/// per message (1e6 / msgs/s) less (client µs + server µs) / `cores`, at
/// least 0. `None` when the servers' CPU is not measured (servers the bench
/// did not start): their CPU would count as waiting.
///
/// It is the share of the run's wall time the cores were idle, per message:
/// 0 means the cores were busy all along. It overstates the waiting where
/// CPU could not be spread over the cores (one busy thread, one idle core),
/// or was spent outside the measured processes (kernel threads such as the
/// file system's journal, or a server process that exited during the run):
/// those count as waiting too. The CPU figures come in 10 ms ticks, so in a
/// run of well under a second (smoke's) the figure is mostly rounding.
fn wait_us_per_msg(m: &Measurement, cores: usize) -> Option<f64> {
    let cpu = m.client_cpu_us_per_msg + m.servers_cpu_us_per_msg?;
    Some((1e6 / m.msgs_per_sec - cpu / cores as f64).max(0.0))
}

/// The cores the CPU columns are spread over.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The compare table: msgs/s and the ratios to `naive` and `manual`; CPU µs
/// per message of the client process and of the servers; and wait µs, the
/// time per message not accounted for by CPU on this machine's cores:
/// waiting on I/O, fsync, the network (wall µs per message less client and
/// server µs over the cores, at least 0; see [`wait_us_per_msg`]).
pub fn compare_table(runs: &[Measurement]) -> String {
    let naive = rate_of(runs, Mode::Naive);
    let manual = rate_of(runs, Mode::Manual);
    let cores = cores();
    let mut out = format!(
        "{:<18} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8}\n",
        "mode",
        "msgs/s",
        "vs naive",
        "vs manual",
        "p50 ms",
        "p99 ms",
        "RSS MiB",
        "client µs",
        "server µs",
        "wait µs",
        "effects"
    );
    for m in runs {
        out.push_str(&format!(
            "{:<18} {:>9.0} {:>9} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>9.0} {:>9} {:>8} {:>8}\n",
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
            wait_us_per_msg(m, cores).map_or_else(|| "-".to_owned(), |us| format!("{us:.0}")),
            m.effects,
        ));
    }
    out
}

/// The chart table: per run, msgs/s and the ratios to `naive` and `raw`,
/// and the CPU and wait µs per message as in [`compare_table`].
pub fn chart_table(runs: &[Measurement]) -> String {
    let naive = rate_of(runs, Mode::Naive);
    let raw = rate_of(runs, Mode::Raw);
    let cores = cores();
    let mut out = format!(
        "{:<18} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
        "mode", "batch", "msgs/s", "vs naive", "vs raw", "client µs", "server µs", "wait µs"
    );
    for m in runs {
        out.push_str(&format!(
            "{:<18} {:>5} {:>9.0} {:>9} {:>9} {:>9.0} {:>9} {:>8}\n",
            m.plan.mode.name(),
            m.plan.mode.batch(m.plan.batch, m.plan.concurrency),
            m.msgs_per_sec,
            ratio(m.msgs_per_sec, naive),
            ratio(m.msgs_per_sec, raw),
            m.client_cpu_us_per_msg,
            m.servers_cpu_us_per_msg
                .map_or_else(|| "-".to_owned(), |cpu| format!("{cpu:.0}")),
            wait_us_per_msg(m, cores).map_or_else(|| "-".to_owned(), |us| format!("{us:.0}")),
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
    let batch_handler = rate_of(runs, Mode::IdemBatchHandler);
    let raw = rate_of(runs, Mode::Raw);
    let default = rate_of(runs, Mode::IdemDefault);
    let default_batch_handler = rate_of(runs, Mode::IdemDefaultBatchHandler);
    let over = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    [
        "targets:".to_owned(),
        target("idem-batch >= 5x naive", over(batch, naive), "x", |v| {
            v >= 5.0
        }),
        target("idem >= 1.0x manual", over(idem, manual), "x", |v| v >= 1.0),
        target("idem >= 1.0x naive", over(idem, naive), "x", |v| v >= 1.0),
        target(
            "idem-batch-handler >= 10x naive",
            over(batch_handler, naive),
            "x",
            |v| v >= 10.0,
        ),
        target(
            "idem-batch-handler >= 0.4x raw",
            over(batch_handler, raw),
            "x",
            |v| v >= 0.4,
        ),
        target(
            "idem >= 0.9x naive (issue 20)",
            over(idem, naive),
            "x",
            |v| v >= 0.9,
        ),
        target("idem-default >= 4x naive", over(default, naive), "x", |v| {
            v >= 4.0
        }),
        target(
            "idem-default-batch-handler >= 12x naive",
            over(default_batch_handler, naive),
            "x",
            |v| v >= 12.0,
        ),
        target(
            "idem-default-batch-handler >= 0.5x raw",
            over(default_batch_handler, raw),
            "x",
            |v| v >= 0.5,
        ),
    ]
    .join("\n")
}

/// The contention scenario's target: the route's default batching at least
/// 1.5× per-message mode (and never below it).
pub fn contention_targets(runs: &[Measurement]) -> String {
    let over = rate_of(runs, Mode::IdemDefault)
        .zip(rate_of(runs, Mode::Idem))
        .map(|(default, idem)| default / idem);
    [
        "targets:".to_owned(),
        target("idem-default >= 1.5x idem (contention)", over, "x", |v| {
            v >= 1.5
        }),
        target(
            "idem-batch (adaptive) >= 1.5x idem (contention)",
            rate_of(runs, Mode::IdemBatch)
                .zip(rate_of(runs, Mode::Idem))
                .map(|(adaptive, idem)| adaptive / idem),
            "x",
            |v| v >= 1.5,
        ),
    ]
    .join("\n")
}

/// The last line of `contention`: both modes' msgs/s and their ratio.
pub fn contention_summary(runs: &[Measurement]) -> String {
    #[derive(Serialize)]
    struct Summary {
        mode: &'static str,
        messages: usize,
        concurrency: usize,
        msgs_per_sec: Rates,
        idem_default_vs_idem: Option<f64>,
        adaptive_vs_idem: Option<f64>,
    }
    let first = &runs[0].plan;
    let summary = Summary {
        mode: "contention",
        messages: first.messages,
        concurrency: first.concurrency,
        msgs_per_sec: Rates(
            runs.iter()
                .map(|m| (m.plan.mode.name(), round(m.msgs_per_sec, 1)))
                .collect(),
        ),
        idem_default_vs_idem: rate_of(runs, Mode::IdemDefault)
            .zip(rate_of(runs, Mode::Idem))
            .map(|(default, idem)| round(default / idem, 3)),
        adaptive_vs_idem: rate_of(runs, Mode::IdemBatch)
            .zip(rate_of(runs, Mode::Idem))
            .map(|(adaptive, idem)| round(adaptive / idem, 3)),
    };
    serde_json::to_string(&summary).expect("a summary serializes")
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
        idem_batch_handler_vs_naive: Option<f64>,
        idem_batch_handler_vs_raw: Option<f64>,
        idem_default_vs_naive: Option<f64>,
        idem_default_batch_handler_vs_naive: Option<f64>,
        idem_default_batch_handler_vs_raw: Option<f64>,
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
        idem_batch_handler_vs_naive: ratio(Mode::IdemBatchHandler, Mode::Naive),
        idem_batch_handler_vs_raw: ratio(Mode::IdemBatchHandler, Mode::Raw),
        idem_default_vs_naive: ratio(Mode::IdemDefault, Mode::Naive),
        idem_default_batch_handler_vs_naive: ratio(Mode::IdemDefaultBatchHandler, Mode::Naive),
        idem_default_batch_handler_vs_raw: ratio(Mode::IdemDefaultBatchHandler, Mode::Raw),
    };
    serde_json::to_string(&summary).expect("a summary serializes")
}

/// The last line of `chart`: each run's mode, batch size, msgs/s and ratios
/// to `naive` and `raw`, and where the chart went.
pub fn chart_summary(runs: &[Measurement], chart: &Path) -> String {
    #[derive(Serialize)]
    struct Summary<'a> {
        mode: &'static str,
        messages: usize,
        concurrency: usize,
        chart: String,
        /// In run order.
        runs: Vec<Run<'a>>,
    }
    #[derive(Serialize)]
    struct Run<'a> {
        mode: &'a str,
        batch: usize,
        msgs_per_sec: f64,
        vs_naive: Option<f64>,
        vs_raw: Option<f64>,
    }
    let naive = rate_of(runs, Mode::Naive);
    let raw = rate_of(runs, Mode::Raw);
    let over = |rate: f64, base: Option<f64>| Some(round(rate / base?, 3));
    let first = &runs[0].plan;
    let summary = Summary {
        mode: "chart",
        messages: first.messages,
        concurrency: first.concurrency,
        chart: chart.display().to_string(),
        runs: runs
            .iter()
            .map(|m| Run {
                mode: m.plan.mode.name(),
                batch: m.plan.mode.batch(m.plan.batch, m.plan.concurrency),
                msgs_per_sec: round(m.msgs_per_sec, 1),
                vs_naive: over(m.msgs_per_sec, naive),
                vs_raw: over(m.msgs_per_sec, raw),
            })
            .collect(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::tests::measured;

    #[test]
    fn wait_is_the_wall_time_the_cores_were_idle() {
        // 1000 msgs/s: 1000 µs a message; 300 + 100 µs of CPU over 2 cores.
        let mut m = measured(Mode::Naive, 1, 1000.0);
        m.client_cpu_us_per_msg = 300.0;
        m.servers_cpu_us_per_msg = Some(100.0);
        assert_eq!(wait_us_per_msg(&m, 2), Some(800.0));
        assert_eq!(wait_us_per_msg(&m, 1), Some(600.0));
        // Busier than the cores can be (the samples are not exact): 0.
        m.client_cpu_us_per_msg = 2500.0;
        assert_eq!(wait_us_per_msg(&m, 2), Some(0.0));
        m.servers_cpu_us_per_msg = None;
        assert_eq!(wait_us_per_msg(&m, 2), None);
    }

    #[test]
    fn compare_reports_the_batch_handler_targets() {
        let runs = [
            measured(Mode::Raw, 64, 20_000.0),
            measured(Mode::Naive, 64, 1_000.0),
            measured(Mode::Idem, 64, 1_100.0),
            measured(Mode::IdemBatchHandler, 64, 9_000.0),
        ];
        let targets = compare_targets(&runs);
        let line = |name: &str| {
            targets
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no target {name:?} in\n{targets}"))
                .to_owned()
        };
        assert!(line("idem >= 1.0x naive").ends_with("PASS"));
        assert!(line("idem-batch-handler >= 10x naive").ends_with("MISS"));
        assert!(line("idem-batch-handler >= 0.4x raw").ends_with("PASS"));
        assert!(line("idem >= 1.0x manual").ends_with("n/a"));
        let summary: serde_json::Value = serde_json::from_str(&compare_summary(&runs)).unwrap();
        assert_eq!(summary["idem_batch_handler_vs_naive"], 9.0);
        assert_eq!(summary["idem_batch_handler_vs_raw"], 0.45);
    }
}
