//! The services' `/metrics` endpoint, and reading it back.
//!
//! A service started with `IDEM_METRICS_ADDR=127.0.0.1:9464` (any
//! `host:port`) installs `metrics-exporter-prometheus` there, with idem's
//! histogram buckets, before its router starts; `GET /metrics` (any path)
//! then answers in the Prometheus text format. Unset, no exporter is
//! installed and idem's metrics cost nothing.
//!
//! [`scrape`] reads such an endpoint back (`tests/tests/observe/metrics.rs` and the
//! dashboard renderer, `src/bin/pipeline-dashboard.rs`, use it).

use std::collections::HashMap;
use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use prometheus_parse::{Sample, Scrape, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The environment variable with the address to serve `/metrics` on.
pub const ADDR_VAR: &str = "IDEM_METRICS_ADDR";

/// Installs the Prometheus exporter on the address in
/// [`IDEM_METRICS_ADDR`](ADDR_VAR), if it is set; returns that address.
/// Call it before the router starts: each route takes its metric handles
/// from the recorder installed then.
pub fn install_exporter() -> Result<Option<SocketAddr>, Error> {
    let Ok(addr) = std::env::var(ADDR_VAR) else {
        return Ok(None);
    };
    let addr: SocketAddr = addr
        .parse()
        .map_err(|error| format!("{ADDR_VAR}={addr:?} is not a host:port address: {error}"))?;
    let mut exporter = PrometheusBuilder::new().with_http_listener(addr);
    for (name, buckets) in idem_runtime::observe::metrics::HISTOGRAM_BUCKETS {
        exporter = exporter.set_buckets_for_metric(Matcher::Full(name.into()), buckets)?;
    }
    exporter
        .install()
        .map_err(|error| format!("cannot serve /metrics on {addr}: {error}"))?;
    idem_runtime::observe::metrics::describe();
    tracing::info!(%addr, "serving /metrics");
    Ok(Some(addr))
}

/// One scrape of a `/metrics` endpoint, parsed.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Each metric's description (`# HELP`), by name.
    pub docs: HashMap<String, String>,
    /// Every sample (a histogram is one sample holding its buckets; its
    /// `_sum` and `_count` are samples of their own).
    pub samples: Vec<Sample>,
}

/// `GET http://{addr}/metrics`, parsed.
pub async fn scrape(addr: SocketAddr) -> Result<Metrics, Error> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let response = String::from_utf8(response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or("the /metrics response has no header end")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("/metrics answered {:?}", head.lines().next()).into());
    }
    let scrape = Scrape::parse(body.lines().map(|line| Ok(line.to_owned())))?;
    Ok(Metrics {
        docs: scrape.docs,
        samples: scrape.samples,
    })
}

impl Metrics {
    /// The samples of `metric` whose labels include every pair of `labels`.
    pub fn matching<'a>(
        &'a self,
        metric: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |sample| {
            sample.metric == metric
                && labels
                    .iter()
                    .all(|(name, value)| sample.labels.get(name) == Some(*value))
        })
    }

    /// The sum of the counter, gauge or untyped samples of `metric` with
    /// `labels`, or `None` if there is none.
    pub fn value(&self, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for sample in self.matching(metric, labels) {
            let value = match sample.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                Value::Histogram(_) | Value::Summary(_) => continue,
            };
            *found.get_or_insert(0.0) += value;
        }
        found
    }

    /// The cumulative buckets of histogram `metric` with `labels` (upper
    /// bound, count), summed across the matching series.
    pub fn buckets(&self, metric: &str, labels: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let mut summed: Vec<(f64, f64)> = Vec::new();
        for sample in self.matching(metric, labels) {
            if let Value::Histogram(buckets) = &sample.value {
                for bucket in buckets {
                    match summed.iter_mut().find(|(le, _)| *le == bucket.less_than) {
                        Some((_, count)) => *count += bucket.count,
                        None => summed.push((bucket.less_than, bucket.count)),
                    }
                }
            }
        }
        summed.sort_by(|a, b| a.0.total_cmp(&b.0));
        summed
    }
}
