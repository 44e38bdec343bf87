//! `idem-bench sqlite` and `idem-bench mariadb`: idem on another database
//! than PostgreSQL against a hand-written consumer on the same database and
//! the same nats-server (issue 22's per-database figures).
//!
//! Three modes, one after another, each on a fresh stream and fresh tables
//! (SQLite: a new file, WAL, `synchronous = FULL`; MariaDB: a new database
//! on a server of the bench's own, on disk, `innodb_flush_log_at_trx_commit
//! = 1`), each given the same messages published beforehand, each timed
//! from the consumer's start to its last commit:
//!
//! - `naive`: pull, `BEGIN; INSERT; COMMIT`, ack, one message at a time on
//!   one connection;
//! - `idem`: an `#[idempotent]` handler doing the same INSERT, per message;
//! - `idem-batch-handler`: an `#[idempotent(batch)]` handler, batches of B.
//!
//! Every mode must end with one row per message; the ratios are against
//! `naive` of the same run. The SQL is the same text on both databases
//! (`?` placeholders); each database's module (written by
//! `database_bench!`) holds its handlers, its pool and its naive consumer.

use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::servers::Servers;

/// The arguments of `idem-bench sqlite` and `idem-bench mariadb`.
#[derive(Debug, Args)]
pub struct DatabaseArgs {
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Naive,
    Idem,
    IdemBatchHandler,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::Naive, Mode::Idem, Mode::IdemBatchHandler];

    fn name(self) -> &'static str {
        match self {
            Mode::Naive => "naive",
            Mode::Idem => "idem",
            Mode::IdemBatchHandler => "idem-batch-handler",
        }
    }
}

/// The business table every mode writes (no unique key).
const LEDGER: &str = "CREATE TABLE ledger (msg_id VARCHAR(64) NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)";

/// What every mode writes per message.
const INSERT: &str = "INSERT INTO ledger (msg_id, account, amount) VALUES (?, ?, ?)";

/// Prints the table and the JSON summary line of `rates` (naive first).
fn report(scenario: &str, args: &DatabaseArgs, rates: &[(Mode, f64)]) {
    let naive = rates[0].1;
    println!("| mode | msgs/s | ÷ naive |");
    println!("|---|---|---|");
    for (mode, rate) in rates {
        println!("| {} | {rate:.0} | {:.2}× |", mode.name(), rate / naive);
    }
    let summary: serde_json::Map<String, serde_json::Value> = rates
        .iter()
        .map(|(mode, rate)| (mode.name().to_owned(), serde_json::json!(rate.round())))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "scenario": scenario,
            "messages": args.messages,
            "batch": args.batch,
            "msgs_per_sec": summary,
        })
    );
}

/// A fresh stream for `mode` of `scenario`, holding `args.messages`
/// credits (each with its own message id), all stored before it returns.
/// Returns the stream's name and subject.
async fn publish(
    js: &jetstream::Context,
    scenario: &str,
    mode: Mode,
    args: &DatabaseArgs,
) -> Result<(String, String), BenchError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| BenchError::failed(format!("{what}: {e}"));
    let stream_name = format!(
        "BENCH_{}_{}",
        scenario.to_uppercase(),
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
    Ok((stream_name, subject))
}

/// Waits until `count` says every message has its row, or the consumer
/// stopped; checks one row per message. Returns msgs/s since `started`.
async fn until_every_row<F, Fut>(
    mode: Mode,
    args: &DatabaseArgs,
    started: Instant,
    consumer: &tokio::task::JoinHandle<Result<(), String>>,
    count: F,
) -> Result<f64, BenchError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(i64, i64), sqlx::Error>>,
{
    let rows = loop {
        let rows = count()
            .await
            .map_err(|e| BenchError::failed(format!("count: {e}")))?;
        if rows.0 as u64 >= args.messages {
            break rows;
        }
        if consumer.is_finished() {
            return Err(BenchError::failed(format!(
                "{}: the consumer stopped after {} rows",
                mode.name(),
                rows.0
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
    Ok(args.messages as f64 / elapsed.as_secs_f64())
}

/// One database's bench: its handlers (named `bench-<scenario>`), its naive
/// consumer, and `one(mode, ...)`, which runs a mode on a fresh pool from
/// `$open` and returns msgs/s.
macro_rules! database_bench {
    ($module:ident, $database:ty, $router:expr) => {
        mod $module {
            use std::time::Instant;

            use async_nats::jetstream::{self, consumer::pull};
            use futures_util::StreamExt;
            use idem_runtime::{Delivery, Route, idempotent};
            use sqlx::Pool;

            use super::{Credit, DatabaseArgs, INSERT, LEDGER, Mode};
            use crate::BenchError;

            type Database = $database;

            #[idempotent(name = "bench-credit")]
            async fn credit(
                tx: &mut sqlx::Transaction<'_, Database>,
                delivery: &Delivery,
                credit: Credit,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(INSERT)
                    .bind(delivery.message_id().as_str())
                    .bind(credit.account as i64)
                    .bind(credit.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            #[idempotent(name = "bench-credits", batch)]
            async fn credits(
                tx: &mut sqlx::Transaction<'_, Database>,
                deliveries: &[Delivery],
                credits: Vec<Credit>,
            ) -> Result<(), sqlx::Error> {
                for (delivery, credit) in deliveries.iter().zip(credits) {
                    sqlx::query(INSERT)
                        .bind(delivery.message_id().as_str())
                        .bind(credit.account as i64)
                        .bind(credit.amount)
                        .execute(&mut **tx)
                        .await?;
                }
                Ok(())
            }

            /// Runs `mode` on `pool` (fresh, empty) over the stream
            /// `publish` filled; returns msgs/s.
            pub(super) async fn one(
                mode: Mode,
                args: &DatabaseArgs,
                nats: &async_nats::Client,
                pool: Pool<Database>,
                (stream_name, subject): (String, String),
            ) -> Result<f64, BenchError> {
                let failed = |what: &str, e: &dyn std::fmt::Display| {
                    BenchError::failed(format!("{what}: {e}"))
                };
                let js = jetstream::new(nats.clone());
                idem_runtime::schema::migrate(&pool)
                    .await
                    .map_err(|e| failed("migrate", &e))?;
                sqlx::raw_sql(LEDGER)
                    .execute(&pool)
                    .await
                    .map_err(|e| failed("create table", &e))?;
                let started = Instant::now();
                let consumer = match mode {
                    Mode::Naive => tokio::spawn(naive(js, stream_name, subject, pool.clone())),
                    Mode::Idem | Mode::IdemBatchHandler => {
                        let route = Route::new(&stream_name, "bench").filter_subject(&subject);
                        let router = if mode == Mode::Idem {
                            $router.route(route.per_message(), credit)
                        } else {
                            $router.route(route.batch(args.batch), credits)
                        };
                        let (nats, pool) = (nats.clone(), pool.clone());
                        tokio::spawn(async move {
                            // Aborted once every row is there.
                            router
                                .run_until(nats, pool, std::future::pending())
                                .await
                                .map_err(|e| e.to_string())
                        })
                    }
                };
                let rate = super::until_every_row(mode, args, started, &consumer, || {
                    sqlx::query_as("SELECT count(*), count(DISTINCT msg_id) FROM ledger")
                        .fetch_one(&pool)
                })
                .await?;
                pool.close().await;
                Ok(rate)
            }

            /// The hand-written consumer: pull, one transaction per
            /// message, ack after COMMIT.
            async fn naive(
                js: jetstream::Context,
                stream_name: String,
                subject: String,
                pool: Pool<Database>,
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
                    let credit: Credit =
                        serde_json::from_slice(&message.payload).map_err(|e| e.to_string())?;
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
                        .map(|id| id.as_str().to_owned())
                        .unwrap_or_default();
                    let mut tx = sqlx::Connection::begin(&mut *connection)
                        .await
                        .map_err(|e| e.to_string())?;
                    sqlx::query(INSERT)
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
        }
    };
}

database_bench!(on_sqlite, sqlx::Sqlite, idem_runtime::Router::sqlite());
database_bench!(on_mariadb, sqlx::MySql, idem_runtime::Router::mariadb());

/// `idem-bench sqlite`: the three modes, each on a new file.
pub async fn sqlite(args: DatabaseArgs, servers: &Servers) -> Result<(), BenchError> {
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };
    let nats = connect(servers).await?;
    let js = jetstream::new(nats.clone());
    let dir = tempfile::tempdir().map_err(|e| BenchError::setup(format!("temp dir: {e}")))?;
    let mut rates = Vec::new();
    for mode in Mode::ALL {
        let stream = publish(&js, "sqlite", mode, &args).await?;
        let path = dir.path().join(format!("{}.db", mode.name()));
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
            .map(|options| {
                options
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(Duration::from_secs(30))
            })
            .map_err(|e| BenchError::setup(format!("SQLite options: {e}")))?;
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .map_err(|e| BenchError::setup(format!("open SQLite: {e}")))?;
        let rate = on_sqlite::one(mode, &args, &nats, pool, stream).await?;
        eprintln!("idem-bench sqlite: {:<20} {rate:>9.0} msgs/s", mode.name());
        rates.push((mode, rate));
    }
    report("sqlite", &args, &rates);
    Ok(())
}

/// `idem-bench mariadb`: the three modes, each on a new database of the
/// bench's MariaDB server.
pub async fn mariadb(args: DatabaseArgs, servers: &Servers) -> Result<(), BenchError> {
    use sqlx::ConnectOptions;
    use sqlx::mysql::MySqlPoolOptions;
    let root = servers
        .mariadb
        .clone()
        .ok_or_else(|| BenchError::setup("no MariaDB server was started"))?;
    let nats = connect(servers).await?;
    let js = jetstream::new(nats.clone());
    let mut rates = Vec::new();
    for mode in Mode::ALL {
        let stream = publish(&js, "mariadb", mode, &args).await?;
        let database = format!("bench_{}", mode.name().replace('-', "_"));
        let mut admin = root
            .connect()
            .await
            .map_err(|e| BenchError::setup(format!("connect to MariaDB: {e}")))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {database}; CREATE DATABASE {database}"
        )))
        .execute(&mut admin)
        .await
        .map_err(|e| BenchError::setup(format!("create database: {e}")))?;
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect_with(root.clone().database(&database))
            .await
            .map_err(|e| BenchError::setup(format!("connect to MariaDB: {e}")))?;
        let rate = on_mariadb::one(mode, &args, &nats, pool, stream).await?;
        eprintln!("idem-bench mariadb: {:<20} {rate:>9.0} msgs/s", mode.name());
        rates.push((mode, rate));
    }
    report("mariadb", &args, &rates);
    Ok(())
}

async fn connect(servers: &Servers) -> Result<async_nats::Client, BenchError> {
    async_nats::connect(&servers.nats_url)
        .await
        .map_err(|e| BenchError::setup(format!("connect to NATS: {e}")))
}
