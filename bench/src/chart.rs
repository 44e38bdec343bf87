//! The `chart` scenario's picture: msgs/s against batch size, one line per
//! batching mode, with `raw`, `naive` and `idem` as horizontal references,
//! written as SVG. The SVG backend writes text as `<text>` elements that the
//! viewer lays out, so no font file is needed.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::consumers::Mode;
use crate::run::Measurement;

/// The modes drawn as lines against the batch size, and their colours.
const LINES: [(Mode, RGBColor); 2] = [
    (Mode::IdemBatch, RGBColor(0x1f, 0x77, 0xb4)),
    (Mode::IdemBatchHandler, RGBColor(0xd6, 0x27, 0x28)),
];

/// The modes drawn as horizontal references, and their colours.
const REFERENCES: [(Mode, RGBColor); 5] = [
    (Mode::Raw, RGBColor(0x33, 0x33, 0x33)),
    (Mode::Naive, RGBColor(0x8c, 0x56, 0x4b)),
    (Mode::Idem, RGBColor(0x2c, 0xa0, 0x2c)),
    (Mode::IdemDefault, RGBColor(0x94, 0x67, 0xbd)),
    (Mode::IdemDefaultBatchHandler, RGBColor(0xff, 0x7f, 0x0e)),
];

/// The y axis' ticks, msgs/s; those within the drawn range are shown.
const Y_TICKS: [f64; 13] = [
    100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6,
];

/// What each mode does, for the legend.
fn legend_name(mode: Mode) -> String {
    let what = match mode {
        Mode::Raw => "pull + ack, no database",
        Mode::Naive => "BEGIN / INSERT / COMMIT, no dedup",
        Mode::Manual => "naive + dedup INSERT",
        Mode::Idem => "#[idempotent], one message per transaction",
        Mode::IdemBatch => "Route::batch(B), one claim + INSERT per message",
        Mode::IdemBatchHandler => "#[idempotent(batch)], one INSERT per batch",
        Mode::IdemDefault => "#[idempotent], the route's default batching",
        Mode::IdemDefaultBatchHandler => "#[idempotent(batch)], the route's default batching",
    };
    format!("{}: {what}", mode.name())
}

/// `12345.6` as `12 346`: whole msgs/s, thousands apart.
fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(digit);
    }
    out
}

/// Draws `runs` and writes the SVG to `path`. The batching modes' runs
/// give the lines (by their batch size), the first run of each reference
/// mode its horizontal line; a mode without a run is left out.
pub fn write(path: &Path, runs: &[Measurement]) -> Result<(), String> {
    let first = &runs.first().ok_or("no runs to draw")?.plan;
    let mut svg = String::new();
    draw(&mut svg, runs, first.messages, first.concurrency).map_err(|e| e.to_string())?;
    std::fs::write(path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn draw(
    svg: &mut String,
    runs: &[Measurement],
    messages: usize,
    concurrency: usize,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let batches: Vec<f64> = {
        let mut sizes: Vec<usize> = runs
            .iter()
            .filter(|m| m.plan.mode.batches())
            .map(|m| m.plan.batch)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes.into_iter().map(|b| b as f64).collect()
    };
    let (x_low, x_high) = match (batches.first(), batches.last()) {
        (Some(&low), Some(&high)) => (low, high.max(2.0 * low)),
        _ => (1.0, 2.0),
    };
    let (y_low, y_high) = runs
        .iter()
        .map(|m| m.msgs_per_sec)
        .fold((f64::INFINITY, 0f64), |(low, high), rate| {
            (low.min(rate), high.max(rate))
        });
    // Room below the lowest point, and above the highest for the legend.
    let (y_low, y_high) = (y_low / 1.5, y_high * 4.0);
    let y_ticks: Vec<f64> = Y_TICKS
        .into_iter()
        .filter(|tick| (y_low..=y_high).contains(tick))
        .collect();

    let root = SVGBackend::with_string(svg, (1024, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "idem-bench: throughput against batch size ({} messages per run, \
                 concurrency {concurrency}; one run each, on the same servers)",
                thousands(messages as f64)
            ),
            ("sans-serif", 17),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(
            // Batch sizes go by powers of two: a log2 axis, ticked at the
            // sizes run.
            (x_low / 1.3..x_high * 1.3)
                .log_scale()
                .base(2.0)
                .with_key_points(batches.clone()),
            (y_low..y_high).log_scale().with_key_points(y_ticks),
        )?;
    chart
        .configure_mesh()
        .x_desc(format!(
            "batch size B, messages per transaction (log scale; the batch modes keep \
             {concurrency} batches in flight)"
        ))
        .y_desc("msgs/s (log scale)")
        .x_label_formatter(&|b| format!("{b:.0}"))
        .y_label_formatter(&|rate| thousands(*rate))
        .light_line_style(WHITE)
        .draw()?;

    let (left, right) = (x_low / 1.3, x_high * 1.3);
    for (mode, colour) in REFERENCES {
        let Some(rate) = runs
            .iter()
            .find(|m| m.plan.mode == mode)
            .map(|m| m.msgs_per_sec)
        else {
            continue;
        };
        let style = colour.stroke_width(2);
        chart
            .draw_series(DashedLineSeries::new(
                [(left, rate), (right, rate)],
                8,
                5,
                style,
            ))?
            .label(format!(
                "{} ({} msgs/s)",
                legend_name(mode),
                thousands(rate)
            ))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
    }
    let lines: Vec<_> = LINES
        .into_iter()
        .map(|(mode, colour)| {
            let points: Vec<(f64, f64)> = runs
                .iter()
                .filter(|m| m.plan.mode == mode)
                .map(|m| (m.plan.batch as f64, m.msgs_per_sec))
                .collect();
            (mode, colour, points)
        })
        .collect();
    // The highest msgs/s of the lines at `batch`.
    let fastest = |batch: f64| {
        lines
            .iter()
            .flat_map(|(_, _, points)| points)
            .filter(|&&(b, _)| b == batch)
            .fold(0f64, |high, &(_, rate)| high.max(rate))
    };
    for (mode, colour, points) in &lines {
        if points.is_empty() {
            continue;
        }
        let style = colour.stroke_width(3);
        chart
            .draw_series(LineSeries::new(points.clone(), style).point_size(4))?
            .label(legend_name(*mode))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
        // Each point's msgs/s: above it where its line is the fastest at
        // that batch size, below it elsewhere, so that the values of lines
        // close together stay apart.
        chart.draw_series(points.iter().map(|&(batch, rate)| {
            let (at, y) = match rate >= fastest(batch) {
                true => (VPos::Bottom, rate * 1.08),
                false => (VPos::Top, rate / 1.08),
            };
            let style = ("sans-serif", 13)
                .into_font()
                .color(colour)
                .pos(Pos::new(HPos::Center, at));
            Text::new(thousands(rate), (batch, y), style)
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;
    use crate::consumers::Pull;
    use crate::run::Plan;

    /// A made-up run of `mode` at `batch` and `rate` msgs/s.
    pub(crate) fn measured(mode: Mode, batch: usize, rate: f64) -> Measurement {
        Measurement {
            plan: Plan {
                mode,
                scenario: "throughput",
                messages: 20_000,
                concurrency: 8,
                batch,
                rate: None,
                prefill: 0,
                duplicates: 0,
                ping: true,
                pull: Pull::Prefetch,
                retention: None,
                before_consume: None,
                time_in_tx: false,
                id_from_header: false,
                hot_rows: false,
                adaptive: false,
                wait_for_consumer: false,
            },
            msgs_per_sec: rate,
            elapsed: Duration::from_secs_f64(20_000.0 / rate),
            p50_ms: 1.0,
            p99_ms: 2.0,
            max_ms: 3.0,
            latency_samples: 20_000,
            peak_rss_mib: 20.0,
            rss_at_start_mib: 15.0,
            effects: 20_000,
            duplicates: 0,
            publish_lag_ms: None,
            client_cpu_us_per_msg: 50.0,
            servers_cpu_us_per_msg: Some(40.0),
            claim_p50_ms: None,
            claim_p99_ms: None,
            samples: Vec::new(),
            tx_samples: Vec::new(),
        }
    }

    #[test]
    fn thousands_are_spaced() {
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.6), "1 000");
        assert_eq!(thousands(12_345.0), "12 345");
        assert_eq!(thousands(1_234_567.0), "1 234 567");
    }

    #[test]
    fn writes_an_svg_with_every_series_labelled() {
        let mut runs = vec![
            measured(Mode::Raw, 64, 14_000.0),
            measured(Mode::Naive, 64, 2_100.0),
            measured(Mode::Idem, 64, 2_700.0),
        ];
        for (i, batch) in [1, 16, 64, 256].into_iter().enumerate() {
            let rate = 2_000.0 * (i + 1) as f64;
            runs.push(measured(Mode::IdemBatch, batch, rate));
            runs.push(measured(Mode::IdemBatchHandler, batch, 1.5 * rate));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("throughput.svg");
        write(&path, &runs).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        let texts: Vec<&str> = svg
            .split("</text>")
            .filter_map(|s| Some(s.rsplit_once('>')?.1.trim()))
            .collect();
        let has = |text: &str| texts.iter().any(|t| t.starts_with(text));
        for label in [
            "raw: ",
            "naive: ",
            "idem: ",
            "idem-batch: ",
            "idem-batch-handler: ",
        ] {
            assert!(has(label), "no legend entry {label:?} in {texts:?}");
        }
        assert!(has("raw: pull + ack, no database (14 000 msgs/s)"));
        assert!(has(
            "idem-bench: throughput against batch size (20 000 messages"
        ));
        for tick in ["1", "16", "64", "256", "2 000", "10 000"] {
            assert!(texts.contains(&tick), "no tick {tick:?} in {texts:?}");
        }
        // The value of each point, above it.
        assert!(texts.contains(&"12 000"), "{texts:?}");
    }
}
