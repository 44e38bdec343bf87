//! A pipeline of two services that hand work on through the transactional
//! outbox, each step exactly once:
//!
//! ```text
//! orders.placed ──▶ orders::place ──outbox──▶ payments.requested
//!                                                    │
//!       ┌──────────────── payments::charge ◀─────────┘
//!       └──outbox──▶ orders.paid ──▶ orders::mark_paid
//! ```
//!
//! - [`orders`] consumes `orders.placed`, writes the order and queues a
//!   `payments.requested`; it also consumes `orders.paid` and marks the
//!   order paid.
//! - [`payments`] consumes `payments.requested`, records one charge per
//!   order and queues an `orders.paid`.
//!
//! Each service is a binary (`src/bin/orders.rs`, `src/bin/payments.rs`)
//! that runs its router and an outbox relay beside it, via [`serve`].
//! `scripts/demo.sh pipeline` starts both and drives them with
//! `src/bin/pipeline-demo.rs`; `tests/tests/pipeline.rs` runs the same
//! routers in-process.

pub mod dashboard;
pub mod demo;
pub mod metrics;
pub mod orders;
pub mod payments;
pub mod report;
pub mod spans;

use std::time::Duration;

use idem_runtime::outbox::Relay;
use idem_runtime::{Route, Router};
use serde::{Deserialize, Serialize};

/// The stream that stores `orders.>`: `orders.placed` and `orders.paid`.
pub const ORDERS_STREAM: &str = "ORDERS";
/// The stream that stores `payments.>`.
pub const PAYMENTS_STREAM: &str = "PAYMENTS";
/// JetStream's publish-dedup window on both streams. Short, so that the demo
/// can wait past it and show a retry that only the claim stops.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);

/// A customer placed an order (published by a shop front; its
/// `Nats-Msg-Id` is `order-<order>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPlaced {
    pub order: i64,
    pub amount: i64,
}

/// The orders service asks for an order to be charged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PaymentRequested {
    pub order: i64,
    pub amount: i64,
}

/// The payments service charged an order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPaid {
    pub order: i64,
    pub charge: i64,
}

/// A stream config for `name`, storing `subjects`.
fn stream_config(name: &str, subjects: &str) -> async_nats::jetstream::stream::Config {
    async_nats::jetstream::stream::Config {
        name: name.into(),
        subjects: vec![subjects.into()],
        duplicate_window: DUPLICATE_WINDOW,
        ..Default::default()
    }
}

/// A route of the pipeline with its ack wait from `PIPELINE_ACK_WAIT_MS`,
/// if set (a test that SIGKILLs services shortens it, so that a killed
/// service's messages come back sooner); JetStream's 30 s otherwise.
fn tuned(route: Route) -> Route {
    match std::env::var("PIPELINE_ACK_WAIT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        Some(ms) => route.ack_wait(Duration::from_millis(ms)),
        None => route,
    }
}

/// Reads an environment variable the services need.
pub fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| {
        format!(
            "{name} is not set; run scripts/demo.sh pipeline, which starts the servers, or set it"
        )
    })
}

/// Connects to `NATS_URL` and `DATABASE_URL`, with logs on stderr filtered
/// by `RUST_LOG` (default: info for idem, warn for the rest) and spans traced
/// across services (see [`spans`]).
pub async fn connect() -> Result<(async_nats::Client, sqlx::PgPool), Box<dyn std::error::Error>> {
    spans::install();
    let nats = async_nats::ConnectOptions::new()
        .event_callback(|event| {
            report::on_nats_event(&event);
            std::future::ready(())
        })
        .connect(env("NATS_URL")?)
        .await?;
    // Each service runs 2 routes of 8 messages in flight, a relay (2
    // connections) and the metrics poll: fewer would leave messages waiting
    // for connections, up to the pool's acquire timeout.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&env("DATABASE_URL")?)
        .await?;
    Ok((nats, pool))
}

/// Runs a service: its router, with an outbox relay beside it that
/// publishes what the handlers queued ([`Router::relay`]), until SIGINT or
/// SIGTERM. The relay stops after the router has settled its last message;
/// what it leaves pending, the next start (or another replica's relay)
/// publishes. With `IDEM_METRICS_ADDR` set, it serves `/metrics` there (see
/// [`metrics`]).
pub async fn serve<S: Send + Sync + 'static>(
    router: Router<S>,
    nats: async_nats::Client,
    pool: sqlx::PgPool,
) -> Result<(), Box<dyn std::error::Error>> {
    metrics::install_exporter().map_err(|error| error.to_string())?;
    let relay = Relay::new();
    report::start(router.handle(), relay.stats());
    Ok(router.relay(relay).run(nats, pool).await?)
}

/// One of the pipeline's services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// `orders`: [`orders::router`].
    Orders,
    /// `payments`: [`payments::router`].
    Payments,
}

/// What each service's binary does: connect, install its schema, and
/// [`serve`] until SIGINT or SIGTERM.
pub async fn run(service: Service) -> Result<(), Box<dyn std::error::Error>> {
    let (nats, pool) = connect().await?;
    match service {
        Service::Orders => {
            orders::migrate(&pool).await?;
            serve(orders::router(), nats, pool).await
        }
        Service::Payments => {
            payments::migrate(&pool).await?;
            serve(payments::router(), nats, pool).await
        }
    }
}
