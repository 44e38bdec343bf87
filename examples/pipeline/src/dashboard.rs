//! The Grafana dashboard for idem's metrics, and an image of it drawn from
//! real scrapes.
//!
//! The panels and their PromQL are defined once, here: [`grafana_json`]
//! writes them as the dashboard (`examples/grafana/idem.json`), and
//! [`render_svg`] evaluates the same queries over a series of scrapes of the
//! services' `/metrics` (taken by `src/bin/pipeline-dashboard.rs` while the
//! pipeline runs) and draws them. No Grafana or Prometheus is involved in
//! the image: rates and quantiles are computed here the way Prometheus
//! computes `rate` and `histogram_quantile`, over a fixed window.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;
use prometheus_parse::Value;
use serde_json::json;

use crate::metrics::Metrics;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The window of `rate` in the image (Grafana uses `$__rate_interval`).
pub const RATE_WINDOW_SECS: f64 = 10.0;

/// One query of a panel. `metric` is the metric's name, `by` the labels
/// it is summed by (each a series), `legend` the series' name, with
/// `{{label}}` standing for a label's value.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub enum Query {
    /// `sum by (<by>) (rate(<metric>{route=~"$route"}[$__rate_interval]))`
    Rate {
        metric: &'static str,
        by: &'static [&'static str],
        legend: &'static str,
    },
    /// `histogram_quantile(<q>, sum by (le) (rate(<metric>_bucket{route=~"$route"}[$__rate_interval])))`
    Quantile {
        q: f64,
        metric: &'static str,
        legend: &'static str,
    },
    /// `sum by (<by>) (<metric>{route=~"$route"})`, with ` > 0` if
    /// `positive`: series that are 0 are left out.
    Sum {
        metric: &'static str,
        by: &'static [&'static str],
        legend: &'static str,
        positive: bool,
    },
    /// `max(<metric>)`: a figure every instance reports alike (the outbox's).
    Max {
        metric: &'static str,
        legend: &'static str,
    },
}

/// A panel: a title, a unit (Grafana's) and its queries.
#[derive(Debug, Clone, Copy)]
pub struct Panel {
    /// Its title.
    pub title: &'static str,
    /// What its values are in (`msgs/s` and `s` become Grafana's `ops`
    /// and `s`).
    pub unit: &'static str,
    /// Its queries, one or more series each.
    pub queries: &'static [Query],
}

const ROUTE: &str = r#"{route=~"$route"}"#;

/// The dashboard's panels.
pub const PANELS: &[Panel] = &[
    Panel {
        title: "Throughput by outcome",
        unit: "msgs/s",
        queries: &[
            Query::Rate {
                metric: "idem_messages_received_total",
                by: &[],
                legend: "received",
            },
            Query::Rate {
                metric: "idem_messages_processed_total",
                by: &[],
                legend: "processed",
            },
            Query::Rate {
                metric: "idem_messages_duplicate_total",
                by: &[],
                legend: "duplicate",
            },
            Query::Rate {
                metric: "idem_messages_failed_total",
                by: &[],
                legend: "failed",
            },
            Query::Rate {
                metric: "idem_messages_retried_total",
                by: &[],
                legend: "retried",
            },
            Query::Rate {
                metric: "idem_messages_rejected_total",
                by: &[],
                legend: "rejected",
            },
            Query::Rate {
                metric: "idem_commit_unknown_total",
                by: &[],
                legend: "commit unknown",
            },
        ],
    },
    Panel {
        title: "Processed by route",
        unit: "msgs/s",
        queries: &[Query::Rate {
            metric: "idem_messages_processed_total",
            by: &["route"],
            legend: "{{route}}",
        }],
    },
    Panel {
        title: "Handler latency",
        unit: "s",
        queries: &[
            Query::Quantile {
                q: 0.5,
                metric: "idem_handler_duration_seconds",
                legend: "p50",
            },
            Query::Quantile {
                q: 0.99,
                metric: "idem_handler_duration_seconds",
                legend: "p99",
            },
        ],
    },
    Panel {
        title: "End-to-end latency (stored to acked)",
        unit: "s",
        queries: &[
            Query::Quantile {
                q: 0.5,
                metric: "idem_end_to_end_duration_seconds",
                legend: "p50",
            },
            Query::Quantile {
                q: 0.99,
                metric: "idem_end_to_end_duration_seconds",
                legend: "p99",
            },
        ],
    },
    Panel {
        title: "In flight",
        unit: "messages",
        queries: &[Query::Sum {
            metric: "idem_messages_in_flight",
            by: &["route"],
            legend: "{{route}}",
            positive: false,
        }],
    },
    Panel {
        title: "Consumer lag",
        unit: "messages",
        queries: &[
            Query::Sum {
                metric: "idem_consumer_pending_messages",
                by: &["route"],
                legend: "{{route}} pending",
                positive: false,
            },
            Query::Sum {
                metric: "idem_consumer_ack_pending_messages",
                by: &["route"],
                legend: "{{route}} ack pending",
                positive: false,
            },
        ],
    },
    Panel {
        title: "Dead letters (total)",
        unit: "messages",
        queries: &[Query::Sum {
            metric: "idem_messages_dead_lettered_total",
            by: &["route", "reason"],
            legend: "{{route}} {{reason}}",
            positive: true,
        }],
    },
    Panel {
        title: "Outbox lag",
        unit: "rows / s",
        queries: &[
            Query::Max {
                metric: "idem_outbox_pending_rows",
                legend: "pending rows",
            },
            Query::Max {
                metric: "idem_outbox_oldest_age_seconds",
                legend: "oldest age (s)",
            },
        ],
    },
];

impl Query {
    /// The query in PromQL, as the dashboard holds it.
    pub fn promql(&self) -> String {
        let by = |labels: &[&str]| {
            if labels.is_empty() {
                String::new()
            } else {
                format!(" by ({})", labels.join(", "))
            }
        };
        match *self {
            Query::Rate { metric, by: b, .. } => {
                format!("sum{} (rate({metric}{ROUTE}[$__rate_interval]))", by(b))
            }
            Query::Quantile { q, metric, .. } => format!(
                "histogram_quantile({q}, sum by (le) (rate({metric}_bucket{ROUTE}[$__rate_interval])))"
            ),
            Query::Sum {
                metric,
                by: b,
                positive,
                ..
            } => format!(
                "sum{} ({metric}{ROUTE}){}",
                by(b),
                if positive { " > 0" } else { "" }
            ),
            Query::Max { metric, .. } => format!("max({metric})"),
        }
    }

    fn legend(&self) -> &'static str {
        match *self {
            Query::Rate { legend, .. }
            | Query::Quantile { legend, .. }
            | Query::Sum { legend, .. }
            | Query::Max { legend, .. } => legend,
        }
    }

    /// Evaluates the query at each scrape (`(seconds, metrics of every
    /// instance)`): one series per legend, as Prometheus would, over a rate
    /// window of [`RATE_WINDOW_SECS`].
    pub fn evaluate(&self, scrapes: &[(f64, Vec<Metrics>)]) -> Vec<(String, Vec<(f64, f64)>)> {
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        match *self {
            Query::Sum {
                metric, by, legend, ..
            }
            | Query::Rate { metric, by, legend } => {
                let totals: Vec<(f64, BTreeMap<String, f64>)> = scrapes
                    .iter()
                    .map(|(t, instances)| (*t, grouped(instances, metric, by, legend)))
                    .collect();
                for (i, (t, groups)) in totals.iter().enumerate() {
                    for (name, value) in groups {
                        let point = if matches!(self, Query::Rate { .. }) {
                            let Some((t0, before)) = window_start(&totals, i) else {
                                continue;
                            };
                            let earlier = before.get(name).copied().unwrap_or(0.0);
                            (value - earlier).max(0.0) / (t - t0)
                        } else {
                            *value
                        };
                        if matches!(self, Query::Sum { positive: true, .. }) && point <= 0.0 {
                            continue;
                        }
                        series.entry(name.clone()).or_default().push((*t, point));
                    }
                }
            }
            Query::Max { metric, legend } => {
                for (t, instances) in scrapes {
                    let value = instances
                        .iter()
                        .filter_map(|m| m.value(metric, &[]))
                        .fold(None, |max: Option<f64>, v| {
                            Some(max.map_or(v, |m| m.max(v)))
                        });
                    if let Some(value) = value {
                        series
                            .entry(legend.to_owned())
                            .or_default()
                            .push((*t, value));
                    }
                }
            }
            Query::Quantile { q, metric, legend } => {
                let buckets: Vec<(f64, Vec<(f64, f64)>)> = scrapes
                    .iter()
                    .map(|(t, instances)| (*t, summed_buckets(instances, metric)))
                    .collect();
                for (i, (t, now)) in buckets.iter().enumerate() {
                    let Some((_, before)) = window_start(&buckets, i) else {
                        continue;
                    };
                    let increase: Vec<(f64, f64)> = now
                        .iter()
                        .map(|&(le, count)| {
                            let earlier = before
                                .iter()
                                .find(|(l, _)| *l == le)
                                .map_or(0.0, |(_, c)| *c);
                            (le, count - earlier)
                        })
                        .collect();
                    if let Some(value) = histogram_quantile(q, &increase) {
                        series
                            .entry(legend.to_owned())
                            .or_default()
                            .push((*t, value));
                    }
                }
            }
        }
        series.into_iter().collect()
    }
}

/// The earliest point at least [`RATE_WINDOW_SECS`] before point `i`, if
/// the scrapes go back that far.
fn window_start<T>(points: &[(f64, T)], i: usize) -> Option<(f64, &T)> {
    let t = points[i].0;
    points[..i]
        .iter()
        .rev()
        .find(|(t0, _)| t - t0 >= RATE_WINDOW_SECS)
        .map(|(t0, value)| (*t0, value))
}

/// The sum of `metric` across instances, grouped by the `by` labels, each
/// group named by `legend` with its `{{label}}`s filled in.
fn grouped(
    instances: &[Metrics],
    metric: &str,
    by: &[&str],
    legend: &str,
) -> BTreeMap<String, f64> {
    let mut groups = BTreeMap::new();
    for sample in instances.iter().flat_map(|m| m.matching(metric, &[])) {
        let value = match sample.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => continue,
        };
        let mut name = legend.to_owned();
        for label in by {
            let value = sample.labels.get(label).unwrap_or("");
            name = name.replace(&format!("{{{{{label}}}}}"), value);
        }
        *groups.entry(name).or_insert(0.0) += value;
    }
    groups
}

/// The cumulative buckets of histogram `metric`, summed across every route
/// and instance (`sum by (le)`).
fn summed_buckets(instances: &[Metrics], metric: &str) -> Vec<(f64, f64)> {
    let mut summed: Vec<(f64, f64)> = Vec::new();
    for buckets in instances.iter().map(|m| m.buckets(metric, &[])) {
        for (le, count) in buckets {
            match summed.iter_mut().find(|(l, _)| *l == le) {
                Some((_, c)) => *c += count,
                None => summed.push((le, count)),
            }
        }
    }
    summed.sort_by(|a, b| a.0.total_cmp(&b.0));
    summed
}

/// Prometheus's `histogram_quantile` over cumulative buckets (sorted by
/// upper bound, the last `+Inf`): linear interpolation inside the bucket
/// the rank falls in; the largest finite bound if it falls in `+Inf`;
/// `None` without observations.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let inside = count - lower.1;
            let fraction = if inside > 0.0 {
                (rank - lower.1) / inside
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * fraction);
        }
        lower = (le, count);
    }
    Some(lower.0)
}

/// The dashboard, as Grafana imports it (a Prometheus data source chosen
/// at import, and a `route` variable).
pub fn grafana_json() -> serde_json::Value {
    let panels: Vec<serde_json::Value> = PANELS
        .iter()
        .enumerate()
        .map(|(i, panel)| {
            let targets: Vec<serde_json::Value> = panel
                .queries
                .iter()
                .enumerate()
                .map(|(j, query)| {
                    json!({
                        "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                        "expr": query.promql(),
                        "legendFormat": query.legend(),
                        "refId": char::from(b'A' + j as u8).to_string(),
                    })
                })
                .collect();
            let unit = match panel.unit {
                "msgs/s" => "ops",
                "s" => "s",
                _ => "short",
            };
            json!({
                "id": i + 1,
                "type": "timeseries",
                "title": panel.title,
                "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i / 2) * 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": targets,
            })
        })
        .collect();
    json!({
        "__inputs": [{
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }],
        "title": "idem",
        "uid": "idem-overview",
        "description": "idem's metrics (idem-runtime/src/metrics.rs): throughput by outcome, latency, in flight, consumer lag, dead letters, outbox lag. Generated by `pipeline-dashboard json` from examples/pipeline/src/dashboard.rs.",
        "tags": ["idem", "nats", "postgresql"],
        "schemaVersion": 39,
        "version": 1,
        "editable": true,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "route",
            "label": "route",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "query": "label_values(idem_messages_received_total, route)",
            "refresh": 2,
            "multi": true,
            "includeAll": true,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
        }]},
        "panels": panels,
    })
}

/// Draws every panel, evaluated over `scrapes`, into an SVG at `path`.
pub fn render_svg(
    path: &Path,
    scrapes: &[(f64, Vec<Metrics>)],
    subtitle: &str,
) -> Result<(), Error> {
    const COLUMNS: usize = 2;
    let rows = PANELS.len().div_ceil(COLUMNS);
    let root = SVGBackend::new(path, (1400, 60 + 340 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(60);
    header.draw_text(
        "idem — the dashboard's queries (examples/grafana/idem.json) over real scrapes",
        &("sans-serif", 22).into_font().color(&BLACK),
        (20, 8),
    )?;
    header.draw_text(
        subtitle,
        &("sans-serif", 15).into_font().color(&BLACK.mix(0.7)),
        (20, 36),
    )?;
    let end = scrapes.last().map_or(1.0, |(t, _)| *t).max(1.0);
    for (panel, area) in PANELS.iter().zip(body.split_evenly((rows, COLUMNS))) {
        let series: Vec<(String, Vec<(f64, f64)>)> = panel
            .queries
            .iter()
            .flat_map(|query| query.evaluate(scrapes))
            .collect();
        let top = series
            .iter()
            .flat_map(|(_, points)| points.iter().map(|(_, v)| *v))
            .fold(0.0, f64::max);
        // Room above the lines for the legend.
        let top = if top > 0.0 { top * 1.5 } else { 1.0 };
        let mut chart = ChartBuilder::on(&area)
            .caption(
                format!("{} ({})", panel.title, panel.unit),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(28)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..end, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        if !series.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 13))
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_as_prometheus_does() {
        let buckets = [(0.1, 50.0), (0.2, 100.0), (f64::INFINITY, 100.0)];
        assert_eq!(histogram_quantile(0.5, &buckets), Some(0.1));
        assert!((histogram_quantile(0.75, &buckets).unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(
            histogram_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        assert_eq!(
            histogram_quantile(0.99, &[(0.1, 1.0), (f64::INFINITY, 10.0)]),
            Some(0.1),
            "in +Inf: the largest finite bound"
        );
    }

    #[test]
    fn the_checked_in_dashboard_is_the_one_these_panels_make() {
        let checked_in: serde_json::Value =
            serde_json::from_str(include_str!("../../grafana/idem.json")).unwrap();
        assert_eq!(
            checked_in,
            grafana_json(),
            "regenerate it: cargo run -p pipeline-example --bin pipeline-dashboard -- json > examples/grafana/idem.json"
        );
    }
}
