//! `idem-bench sqlite`: idem on a SQLite file against a hand-written
//! consumer on the same file and the same nats-server (issue 22's
//! per-database figures).
//!
//! Three modes, one after another, each on a fresh stream and a fresh file
//! (WAL, `synchronous = FULL`), each given the same messages published
//! beforehand, each timed from the consumer's start to its last commit:
//!
//! - `naive`: pull, `BEGIN; INSERT; COMMIT`, ack, one message at a time on
//!   one connection (SQLite runs one writer at a time anyway);
//! - `idem`: an `#[idempotent]` handler doing the same INSERT, per message;
//! - `idem-batch-handler`: an `#[idempotent(batch)]` handler, batches of B.
//!
//! Every mode must end with one row per message; the ratios are against
//! `naive` of the same run.

use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use clap::Args;
use futures_util::StreamExt;
use idem_runtime::{Delivery, Route, Router, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use crate::BenchError;
use crate::servers::Servers;

/// `idem-bench sqlite`'s arguments.
#[derive(Debug, Args)]
pub struct SqliteArgs {
    /// Messages each mode processes
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// The batch handler's batch size
    #[arg(long, default_value_t = 64)]
    batch: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct Credit {
    account: u64,
    amount: i64,
}

#[idempotent(name = "bench-sqlite")]
async fn credit(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    delivery: &Delivery,
    credit: Credit,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO ledger (msg_id, account, amount) VALUES (?, ?, ?)")
        .bind(delivery.message_id().as_str())
        .bind(credit.account as i64)
        .bind(credit.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(name = "bench-sqlite-batch", batch)]
async fn credits(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    deliveries: &[Delivery],
    credits: Vec<Credit>,
) -> Result<(), sqlx::Error> {
    for (delivery, credit) in deliveries.iter().zip(credits) {
        sqlx::query("INSERT INTO ledger (msg_id, account, amount) VALUES (?, ?, ?)")
            .bind(delivery.message_id().as_str())
            .bind(credit.account as i64)
            .bind(credit.amount)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Naive,
    Idem,
    IdemBatchHandler,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Naive => "naive",
            Mode::Idem => "idem",
            Mode::IdemBatchHandler => "idem-batch-handler",
        }
    }
}

/// Runs the three modes and prints a table and one JSON summary line.
pub async fn run(args: SqliteArgs, servers: &Servers) -> Result<(), BenchError> {
    let nats = async_nats::connect(&servers.nats_url)
        .await
        .map_err(|e| BenchError::setup(format!("connect to NATS: {e}")))?;
    let dir = tempfile::tempdir().map_err(|e| BenchError::setup(format!("temp dir: {e}")))?;
    let mut rates = Vec::new();
    for mode in [Mode::Naive, Mode::Idem, Mode::IdemBatchHandler] {
        let path = dir.path().join(format!("{}.db", mode.name()));
        let rate = one(mode, &args, &nats, &path).await?;
        eprintln!("idem-bench sqlite: {:<20} {rate:>9.0} msgs/s", mode.name());
        rates.push((mode, rate));
    }
    let naive = rates[0].1;
    println!("| mode | msgs/s | ÷ naive |");
    println!("|---|---|---|");
    for (mode, rate) in &rates {
        println!("| {} | {rate:.0} | {:.2}× |", mode.name(), rate / naive);
    }
    let summary: serde_json::Map<String, serde_json::Value> = rates
        .iter()
        .map(|(mode, rate)| (mode.name().to_owned(), serde_json::json!(rate.round())))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "scenario": "sqlite",
            "messages": args.messages,
            "batch": args.batch,
            "msgs_per_sec": summary,
        })
    );
    Ok(())
}

/// One mode: publish, then time the consumer until every row is there.
async fn one(
    mode: Mode,
    args: &SqliteArgs,
    nats: &async_nats::Client,
    path: &std::path::Path,
) -> Result<f64, BenchError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| BenchError::failed(format!("{what}: {e}"));
    let js = jetstream::new(nats.clone());
    let stream_name = format!(
        "BENCH_SQLITE_{}",
        mode.name().replace('-', "_").to_uppercase()
    );
    let subject = format!("{stream_name}.credit");
    let _ = js.delete_stream(&stream_name).await;
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .map_err(|e| failed("create stream", &e))?;
    let mut acks = Vec::with_capacity(1_000);
    for i in 0..args.messages {
        let payload = serde_json::to_vec(&Credit {
            account: i % 100,
            amount: 1,
        })
        .expect("a credit encodes");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("m-{i}").as_str(),
        );
        let ack = js
            .publish_with_headers(subject.clone(), headers, payload.into())
            .await
            .map_err(|e| failed("publish", &e))?;
        acks.push(ack);
        // Every message stored before the clock starts; a thousand acks
        // awaited at a time (the client stalls with too many unread).
        if acks.len() == 1_000 || i + 1 == args.messages {
            for ack in acks.drain(..) {
                ack.await.map_err(|e| failed("publish ack", &e))?;
            }
        }
    }
    let pool = pool(path).await.map_err(|e| failed("open SQLite", &e))?;
    idem_runtime::schema::migrate(&pool)
        .await
        .map_err(|e| failed("migrate", &e))?;
    sqlx::raw_sql("CREATE TABLE ledger (msg_id TEXT NOT NULL, account INTEGER NOT NULL, amount INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .map_err(|e| failed("create table", &e))?;

    let started = Instant::now();
    let consumer = match mode {
        Mode::Naive => tokio::spawn(naive(
            js.clone(),
            stream_name.clone(),
            subject.clone(),
            pool.clone(),
        )),
        Mode::Idem | Mode::IdemBatchHandler => {
            let route = Route::new(&stream_name, "bench").filter_subject(&subject);
            let router = if mode == Mode::Idem {
                Router::sqlite().route(route.per_message(), credit)
            } else {
                Router::sqlite().route(route.batch(args.batch), credits)
            };
            let nats = nats.clone();
            let pool = pool.clone();
            tokio::spawn(async move {
                // Aborted below, once every row is there.
                router
                    .run_until(nats, pool, std::future::pending())
                    .await
                    .map_err(|e| e.to_string())
            })
        }
    };
    let rows = loop {
        let (rows, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT msg_id) FROM ledger")
                .fetch_one(&pool)
                .await
                .map_err(|e| failed("count", &e))?;
        if rows as u64 >= args.messages {
            break (rows, distinct);
        }
        if consumer.is_finished() {
            return Err(BenchError::failed(format!(
                "{}: the consumer stopped after {rows} rows",
                mode.name()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let elapsed = started.elapsed();
    consumer.abort();
    if rows != (args.messages as i64, args.messages as i64) {
        return Err(BenchError::failed(format!(
            "{}: {} rows for {} distinct messages, {} published",
            mode.name(),
            rows.0,
            rows.1,
            args.messages
        )));
    }
    pool.close().await;
    Ok(args.messages as f64 / elapsed.as_secs_f64())
}

async fn pool(path: &std::path::Path) -> Result<SqlitePool, sqlx::Error> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
}

/// The hand-written consumer: pull, one transaction per message, ack after
/// COMMIT.
async fn naive(
    js: jetstream::Context,
    stream_name: String,
    subject: String,
    pool: SqlitePool,
) -> Result<(), String> {
    let stream = js
        .get_stream(&stream_name)
        .await
        .map_err(|e| e.to_string())?;
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("bench-naive".into()),
            filter_subject: subject,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    let mut connection = pool.acquire().await.map_err(|e| e.to_string())?;
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| e.to_string())?;
        let credit: Credit = serde_json::from_slice(&message.payload).map_err(|e| e.to_string())?;
        let id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default();
        let mut tx = sqlx::Connection::begin(&mut *connection)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO ledger (msg_id, account, amount) VALUES (?, ?, ?)")
            .bind(id)
            .bind(credit.account as i64)
            .bind(credit.amount)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        message.ack().await.map_err(|e| e.to_string())?;
    }
    Ok(())
}
