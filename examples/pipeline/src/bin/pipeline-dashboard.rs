//! The dashboard of idem's metrics (`examples/grafana/idem.json`) and an
//! image of it from real data:
//!
//! - `pipeline-dashboard json` prints the Grafana dashboard;
//! - `pipeline-dashboard record --metrics ADDR --metrics ADDR --out FILE.svg`
//!   drives the running orders and payments services (started with
//!   `IDEM_METRICS_ADDR`; `scripts/dashboard.sh` does it all) with a load
//!   that rises and falls, with duplicates, dead letters and poison among
//!   it, scrapes their `/metrics` every second meanwhile, and draws the
//!   dashboard's panels from those scrapes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use clap::{Parser, Subcommand};
use pipeline_example::dashboard::{grafana_json, render_svg};
use pipeline_example::demo::{wait_for_streams, wait_settled};
use pipeline_example::metrics::{Metrics, scrape};
use pipeline_example::{OrderPaid, OrderPlaced, PaymentRequested};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Parser)]
#[command(name = "pipeline-dashboard")]
struct Options {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the Grafana dashboard (examples/grafana/idem.json).
    Json,
    /// Drive the running pipeline, scrape it, and draw the dashboard.
    Record {
        /// A service's /metrics address (give each service's)
        #[arg(long = "metrics", value_name = "HOST:PORT", required = true)]
        metrics: Vec<SocketAddr>,
        /// The SVG to write
        #[arg(long, default_value = "examples/grafana/idem.svg")]
        out: PathBuf,
        /// Orders per second in the calm phases (three times this in the burst)
        #[arg(long, default_value_t = 100)]
        rate: u32,
    },
}

/// The load: (seconds, multiple of the base rate).
const PHASES: [(u64, u32); 3] = [(15, 1), (10, 3), (10, 1)];
/// How often the services are scraped.
const SCRAPE_EVERY: Duration = Duration::from_secs(1);
/// Scrapes kept after the pipeline settles, so the graphs come back down.
const TAIL: Duration = Duration::from_secs(12);

#[tokio::main]
async fn main() -> Result<(), Error> {
    match Options::parse().command {
        Command::Json => {
            println!("{}", serde_json::to_string_pretty(&grafana_json())?);
            Ok(())
        }
        Command::Record { metrics, out, rate } => record(metrics, out, rate).await,
    }
}

async fn record(addrs: Vec<SocketAddr>, out: PathBuf, rate: u32) -> Result<(), Error> {
    let (nats, pool) = pipeline_example::connect()
        .await
        .map_err(|e| e.to_string())?;
    let js = jetstream::new(nats);
    wait_for_streams(&js, Duration::from_secs(30)).await?;

    let started = Instant::now();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let scraper = tokio::spawn(async move {
        let mut scrapes: Vec<(f64, Vec<Metrics>)> = Vec::new();
        let mut ticks = tokio::time::interval(SCRAPE_EVERY);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stopped.changed() => return scrapes,
            }
            let mut instances = Vec::with_capacity(addrs.len());
            for addr in &addrs {
                match scrape(*addr).await {
                    Ok(metrics) => instances.push(metrics),
                    Err(error) => eprintln!("pipeline-dashboard: scraping {addr}: {error}"),
                }
            }
            scrapes.push((started.elapsed().as_secs_f64(), instances));
        }
    });

    let first = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64 * 1_000_000;
    let mut next = first;
    let mut extra = Counts::default();
    let mut retried_up_to = first - 1;
    let tick = Duration::from_millis(100);
    let mut ticks = tokio::time::interval(tick);
    for (seconds, multiple) in PHASES {
        let per_tick = (rate * multiple).div_ceil(10) as i64;
        for tick_index in 0..seconds * 10 {
            ticks.tick().await;
            let orders = next..next + per_tick;
            next += per_tick;
            let mut acks = Vec::new();
            for order in orders {
                let placed = OrderPlaced {
                    order,
                    amount: 1 + (order * 7).rem_euclid(100),
                };
                acks.push(publish(&js, "orders.placed", &format!("order-{order}"), &placed).await?);
                let n = order - first;
                // A payment for an order nobody placed: dead-lettered.
                if n % 250 == 125 {
                    let paid = OrderPaid {
                        order: -order,
                        charge: 0,
                    };
                    acks.push(
                        publish(&js, "orders.paid", &format!("unknown-{order}"), &paid).await?,
                    );
                    extra.unknown += 1;
                }
                // A payload that does not decode as an order (no amount):
                // rejected. (Its order, -1, is one the tally skips.)
                if n % 400 == 200 {
                    let id = format!("poison-{order}");
                    let payload = br#"{"order":-1}"#.to_vec();
                    acks.push(publish_raw(&js, "orders.placed", &id, payload).await?);
                    extra.poison += 1;
                }
            }
            // Once a second: payment requests retried under new ids, for
            // every 20th order already paid (so written): duplicates.
            if tick_index % 10 == 9 {
                let paid: Vec<(i64, i64)> = sqlx::query_as(
                    "SELECT id, amount FROM orders
                     WHERE id > $1 AND id < $2 AND id % 20 = 0 AND times_paid = 1
                     ORDER BY id LIMIT 100",
                )
                .bind(retried_up_to)
                .bind(next)
                .fetch_all(&pool)
                .await?;
                for (order, amount) in paid {
                    let retry = PaymentRequested { order, amount };
                    let id = format!("retried-{order}");
                    acks.push(publish(&js, "payments.requested", &id, &retry).await?);
                    extra.duplicates += 1;
                    retried_up_to = order;
                }
            }
            for ack in acks {
                ack.await?;
            }
        }
    }
    let orders = first..next;
    let published = Instant::now();
    let tally = wait_settled(&js, &pool, &orders, Duration::from_secs(300)).await?;
    let settled = published.elapsed();
    tokio::time::sleep(TAIL).await;
    stop.send(true)?;
    let scrapes = scraper.await?;

    let n = next - first;
    let subtitle = format!(
        "examples/pipeline (orders, payments), {} scrapes 1 s apart; {n} orders ({rate}/s, {}/s for 10 s), {} retried payment requests, {} unknown orders, {} poison; settled {:.1} s after the last publish; rates over {} s",
        scrapes.len(),
        rate * 3,
        extra.duplicates,
        extra.unknown,
        extra.poison,
        settled.as_secs_f64(),
        pipeline_example::dashboard::RATE_WINDOW_SECS,
    );
    render_svg(&out, &scrapes, &subtitle)?;
    println!("{subtitle}");
    println!(
        "orders written {}, charged {}, paid once {}, paid twice {}, outbox pending {}, dead letters {}",
        tally.orders,
        tally.charges,
        tally.paid_once,
        tally.paid_twice,
        tally.outbox_pending,
        tally.dead_letters
    );
    println!("wrote {}", out.display());
    let exactly_once =
        tally.orders == n && tally.charges == n && tally.paid_once == n && tally.paid_twice == 0;
    if !exactly_once {
        return Err("the pipeline's effects do not match its unique orders".into());
    }
    Ok(())
}

#[derive(Debug, Default)]
struct Counts {
    duplicates: u64,
    unknown: u64,
    poison: u64,
}

async fn publish(
    js: &jetstream::Context,
    subject: &str,
    id: &str,
    value: &impl serde::Serialize,
) -> Result<jetstream::context::PublishAckFuture, Error> {
    publish_raw(js, subject, id, serde_json::to_vec(value)?).await
}

async fn publish_raw(
    js: &jetstream::Context,
    subject: &str,
    id: &str,
    payload: Vec<u8>,
) -> Result<jetstream::context::PublishAckFuture, Error> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    Ok(js
        .publish_with_headers(subject.to_owned(), headers, payload.into())
        .await?)
}
