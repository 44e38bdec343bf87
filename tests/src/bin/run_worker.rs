//! A worker process for `tests/tests/lifecycle/shutdown.rs`, written the way an
//! application would be: it calls [`Router::run`], which handles SIGTERM and
//! Ctrl-C itself, and exits 0 when `run` returns `Ok`.
//!
//! Its handler prints `{"event":"handling","id":..,"seq":..}` on stdout when
//! its body starts (after the claim), holds the transaction open for
//! `RUN_HOLD_MS`, then writes one row to the test's `effects` table (see
//! [`idem_tests::scenario::prepare_database`], which creates it). After `run` returns it
//! prints `{"event":"stopped"}`.
//!
//! # Environment
//!
//! | variable | default | |
//! |---|---|---|
//! | `NATS_URL`, `DATABASE_URL` | required | |
//! | `RUN_STREAM`, `RUN_DURABLE` | required | the stream must exist |
//! | `RUN_CONCURRENCY` | 4 | |
//! | `RUN_HOLD_MS` | 1500 | how long each handler holds its transaction |
//! | `RUN_ACK_WAIT_MS` | 30000 | |

use std::io::Write;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, State, idempotent};
use serde::Deserialize;

/// The handler name in the dedup table and in `effects`.
const HANDLER: &str = "run-worker";

/// The payload the tests publish (`common::Deposit`).
#[derive(Debug, Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

/// How long the handler holds each message inside its transaction
/// (`RUN_HOLD_MS`): the router's state.
#[derive(Clone, Copy)]
struct Hold(Duration);

#[idempotent(name = "run-worker")]
async fn deposit(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(Hold(hold)): State<Hold>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    say(&serde_json::json!({
        "event": "handling",
        "id": delivery.message_id().as_str(),
        "seq": delivery.stream_sequence(),
    }));
    tokio::time::sleep(hold).await;
    sqlx::query(
        "INSERT INTO effects (handler, message_id, account, amount, delivered) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(HANDLER)
    .bind(delivery.message_id().as_str())
    .bind(&d.account)
    .bind(d.amount)
    .bind(i64::try_from(delivery.delivered()).unwrap_or(i64::MAX))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// One line on stdout, flushed at once so that the test sees it while the
/// handler still holds its transaction.
fn say(line: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn env_or<T: FromStr>(name: &str, default: Option<T>) -> Result<T, String> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name}={value:?} does not parse")),
        Err(_) => default.ok_or_else(|| format!("{name} must be set")),
    }
}

async fn run() -> Result<(), String> {
    let nats_url: String = env_or("NATS_URL", None)?;
    let database_url: String = env_or("DATABASE_URL", None)?;
    let stream: String = env_or("RUN_STREAM", None)?;
    let durable: String = env_or("RUN_DURABLE", None)?;
    let concurrency: usize = env_or("RUN_CONCURRENCY", Some(4))?;
    let hold = Duration::from_millis(env_or("RUN_HOLD_MS", Some(1500))?);
    let ack_wait = Duration::from_millis(env_or("RUN_ACK_WAIT_MS", Some(30_000))?);

    let nats = async_nats::connect(&nats_url)
        .await
        .map_err(|e| format!("connect to NATS at {nats_url}: {e}"))?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(concurrency).unwrap_or(u32::MAX) + 2)
        .connect(&database_url)
        .await
        .map_err(|e| format!("connect to {database_url}: {e}"))?;
    Router::with_state(Hold(hold))
        .route(
            Route::new(stream, durable)
                .concurrency(concurrency)
                .ack_wait(ack_wait),
            deposit,
        )
        .run(nats, pool)
        .await
        .map_err(|e| format!("router: {e}"))?;
    say(&serde_json::json!({ "event": "stopped" }));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,idem_runtime=info".into()),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("run_worker: {error}");
            ExitCode::FAILURE
        }
    }
}
