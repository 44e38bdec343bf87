//! A ledger service that credits accounts from JetStream messages, exactly
//! once, and proves it.
//!
//! It publishes a run of credits, including the two kinds of duplicate the
//! guide describes (a publisher retry inside JetStream's duplicate window,
//! which JetStream drops, and one after it, which JetStream stores again),
//! processes them with the service's `#[idempotent]` handler (in
//! `src/lib.rs`), and checks every balance against the sum of the unique
//! credits, less their fees.
//!
//! `DATABASE_URL`'s scheme chooses the database: PostgreSQL (`postgres://`),
//! a SQLite file (`sqlite:`) or MariaDB (`mysql://`). Run it with
//! `scripts/demo.sh`, which starts nats-server and PostgreSQL on loopback
//! unless `NATS_URL` and `DATABASE_URL` are set; `scripts/demo.sh
//! --database sqlite` runs it on a SQLite file instead, and `--database
//! mariadb` on a MariaDB server of its own.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use clap::Parser;
use idem_runtime::RouterHandle;
use ledger_example::{Credit, DUPLICATE_WINDOW, Fees, STREAM, SUBJECT, credits, mariadb, sqlite};
use tokio::task::JoinHandle;

/// Runs the ledger service against real servers, publishes credits with
/// duplicates among them, and checks that each was applied exactly once.
#[derive(Debug, Parser)]
#[command(name = "ledger-example", version, after_help = AFTER_HELP)]
struct Options {
    /// Unique credits to publish
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = at_least_one::<usize>)]
    credits: usize,
    /// Accounts to spread the credits over
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = at_least_one::<i64>)]
    accounts: i64,
}

/// A whole number of at least 1.
fn at_least_one<T>(value: &str) -> Result<T, String>
where
    T: std::str::FromStr<Err = std::num::ParseIntError> + PartialOrd + From<u8>,
{
    match value.parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(format!("not a whole number: {e}")),
    }
}

const AFTER_HELP: &str = "\
It publishes every credit once, a tenth of them again at once (JetStream
drops those, inside its duplicate window), and another tenth after the
window (JetStream stores those again: only idem's claim stops them). Then it
checks every balance against the sum of its unique credits, less fees.

NATS_URL and DATABASE_URL select the servers (both required): scripts/demo.sh
starts throwaway ones and sets them. DATABASE_URL's scheme chooses the
database: postgres:// (or postgresql://) PostgreSQL, sqlite:///PATH.db a
SQLite file, created if it is missing, mysql://USER@HOST/DB MariaDB. RUST_LOG sets the log filter
(default: warn).";

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| {
        format!("{name} is not set; run scripts/demo.sh, which starts the servers, or set it")
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A bad argument ends here: clap prints why and the usage, and exits 2.
    let options = Options::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,idem_runtime=warn".into()),
        )
        .init();
    let nats = async_nats::connect(env("NATS_URL")?).await?;
    let database = Database::open(&env("DATABASE_URL")?).await?;
    let fees = database.prepare(options.accounts).await?;
    let js = jetstream::new(nats.clone());

    // Credits: unique transfers spread over the accounts.
    let credits: Vec<Credit> = credits(options.credits, options.accounts);
    // What each account must hold, and the fees charged, if every unique
    // credit is applied once.
    let mut expected: BTreeMap<i64, i64> = BTreeMap::new();
    let mut expected_fees = 0;
    for c in &credits {
        let fee = fees.on(c.account, c.amount);
        *expected.entry(c.account).or_default() += c.amount - fee;
        expected_fees += fee;
    }
    expected.retain(|_, balance| *balance != 0);

    // Start the service first, as in production: it creates the stream.
    let (handle, service) = database.start(nats.clone(), fees);
    wait_for_stream(&js).await?;

    let started = Instant::now();
    let mut published = 0;
    let mut dropped_by_jetstream = 0;
    // Every credit once, then a tenth of them again at once: JetStream drops
    // those itself, inside its duplicate window.
    let retried_at_once = credits.len().div_ceil(10);
    for c in credits.iter().chain(&credits[..retried_at_once]) {
        published += 1;
        if publish(&js, c).await? {
            dropped_by_jetstream += 1;
        }
    }
    // Another tenth after the window: JetStream stores these again, and only
    // the dedup claim stands between them and a second credit.
    tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_millis(500)).await;
    let retried_late = credits.len().div_ceil(10);
    for c in &credits[credits.len() - retried_late..] {
        published += 1;
        if publish(&js, c).await? {
            dropped_by_jetstream += 1;
        }
    }
    let stored = published - dropped_by_jetstream;

    let stats = handle.stats("ledger-credit").expect("the route is bound");
    let deadline = Instant::now() + Duration::from_secs(60);
    while (stats.processed() + stats.duplicates()) < stored as u64 {
        if Instant::now() > deadline {
            return Err(format!("timed out: {stats:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    handle.shutdown();
    service.await??;

    let Tally {
        balances,
        entries,
        distinct,
        fees_charged,
    } = database.tally().await?;

    println!("idem ledger example on {}", database.name());
    println!(
        "  credits published              {published:>6}  ({} unique)",
        credits.len()
    );
    println!("  dropped by JetStream (window)  {dropped_by_jetstream:>6}");
    println!("  stored in the stream           {stored:>6}");
    println!("  handler bodies run             {:>6}", stats.processed());
    println!("  duplicates skipped by claim    {:>6}", stats.duplicates());
    println!(
        "  failed / rejected              {:>6} / {}",
        stats.failed(),
        stats.rejected()
    );
    println!("  ledger entries                 {entries:>6}  ({distinct} distinct transfers)");
    println!("  fees charged                   {fees_charged:>6}");
    println!(
        "  took                           {:>6.2}s",
        elapsed.as_secs_f64()
    );
    let exactly_once = entries == credits.len() as i64
        && distinct == entries
        && balances == expected
        && fees_charged == expected_fees;
    if exactly_once {
        println!(
            "exactly once: every balance equals the sum of its unique credits, less their fees"
        );
        Ok(())
    } else {
        println!(
            "NOT exactly once: balances {balances:?}, expected {expected:?}; fees \
             {fees_charged}, expected {expected_fees}"
        );
        Err("the ledger does not match its unique credits".into())
    }
}

/// The database the demo runs on, chosen by DATABASE_URL's scheme.
enum Database {
    Postgres(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
    Mariadb(sqlx::MySqlPool),
}

/// What the ledger holds after the run.
struct Tally {
    /// The balances that are not zero, by account.
    balances: BTreeMap<i64, i64>,
    /// Ledger entries.
    entries: i64,
    /// Distinct transfers among the entries.
    distinct: i64,
    /// The fees of all entries.
    fees_charged: i64,
}

/// The accounts' balances that are not zero, on either database.
const BALANCES: &str = "SELECT id, balance FROM accounts WHERE balance <> 0 ORDER BY id";
/// The entries, their distinct transfers and their fees, on either
/// database: the `CAST` because PostgreSQL's `sum` of a bigint is a numeric.
const ENTRIES: &str = "SELECT count(*), count(DISTINCT transfer_id), \
     CAST(coalesce(sum(fee), 0) AS bigint) FROM ledger_entries";

/// [`ENTRIES`] on MariaDB, whose `CAST` takes `SIGNED` (its `sum` of a
/// bigint is a decimal).
const MARIADB_ENTRIES: &str = "SELECT count(*), count(DISTINCT transfer_id), \
     CAST(coalesce(sum(fee), 0) AS SIGNED) FROM ledger_entries";

impl Database {
    /// Connects to `url`: `postgres://` or `postgresql://` is PostgreSQL,
    /// `sqlite:` a SQLite file, created if it is missing.
    async fn open(url: &str) -> Result<Database, Box<dyn std::error::Error>> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(10)
                .connect(url)
                .await?;
            Ok(Database::Postgres(pool))
        } else if url.starts_with("sqlite:") {
            Ok(Database::Sqlite(sqlite::connect(url).await?))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Ok(Database::Mariadb(mariadb::connect(url).await?))
        } else {
            Err(format!(
                "DATABASE_URL={url} names neither PostgreSQL (postgres://USER@HOST/DB), \
                 a SQLite file (sqlite:///ABSOLUTE/PATH.db) nor MariaDB \
                 (mysql://USER@HOST/DB)"
            )
            .into())
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Database::Postgres(_) => "PostgreSQL",
            Database::Sqlite(_) => "SQLite",
            Database::Mariadb(_) => "MariaDB",
        }
    }

    /// Installs idem's schema, makes a fresh ledger of `accounts` accounts,
    /// and reads its fee schedule.
    async fn prepare(&self, accounts: i64) -> Result<Fees, Box<dyn std::error::Error>> {
        Ok(match self {
            Database::Postgres(pool) => {
                idem_runtime::schema::migrate(pool).await?;
                ledger_example::prepare_ledger(pool, accounts).await?;
                Fees::load(pool).await?
            }
            Database::Sqlite(pool) => {
                idem_runtime::schema::migrate(pool).await?;
                sqlite::prepare_ledger(pool, accounts).await?;
                Fees::load_sqlite(pool).await?
            }
            Database::Mariadb(pool) => {
                idem_runtime::schema::migrate(pool).await?;
                mariadb::prepare_ledger(pool, accounts).await?;
                Fees::load_mariadb(pool).await?
            }
        })
    }

    /// Starts the service in a task, as in production: it creates the
    /// stream. Returns its handle and the task.
    fn start(
        &self,
        nats: async_nats::Client,
        fees: Fees,
    ) -> (RouterHandle, JoinHandle<Result<(), idem_runtime::Error>>) {
        match self {
            Database::Postgres(pool) => {
                let router = ledger_example::router(fees);
                (
                    router.handle(),
                    tokio::spawn(router.run(nats, pool.clone())),
                )
            }
            Database::Sqlite(pool) => {
                let router = sqlite::router(fees);
                (
                    router.handle(),
                    tokio::spawn(router.run(nats, pool.clone())),
                )
            }
            Database::Mariadb(pool) => {
                let router = mariadb::router(fees);
                (
                    router.handle(),
                    tokio::spawn(router.run(nats, pool.clone())),
                )
            }
        }
    }

    /// What the ledger holds, read once the service has stopped.
    async fn tally(&self) -> Result<Tally, sqlx::Error> {
        let (balances, (entries, distinct, fees_charged)): (Vec<(i64, i64)>, (i64, i64, i64)) =
            match self {
                Database::Postgres(pool) => (
                    sqlx::query_as(BALANCES).fetch_all(pool).await?,
                    sqlx::query_as(ENTRIES).fetch_one(pool).await?,
                ),
                Database::Sqlite(pool) => (
                    sqlx::query_as(BALANCES).fetch_all(pool).await?,
                    sqlx::query_as(ENTRIES).fetch_one(pool).await?,
                ),
                Database::Mariadb(pool) => (
                    sqlx::query_as(BALANCES).fetch_all(pool).await?,
                    sqlx::query_as(MARIADB_ENTRIES).fetch_one(pool).await?,
                ),
            };
        Ok(Tally {
            balances: balances.into_iter().collect(),
            entries,
            distinct,
            fees_charged,
        })
    }
}

/// Publishes one credit with its transfer id as `Nats-Msg-Id`; returns
/// whether JetStream reported it a duplicate.
async fn publish(
    js: &jetstream::Context,
    cmd: &Credit,
) -> Result<bool, Box<dyn std::error::Error>> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        cmd.transfer_id.as_str(),
    );
    let ack = js
        .publish_with_headers(SUBJECT, headers, serde_json::to_vec(cmd)?.into())
        .await?
        .await?;
    Ok(ack.duplicate)
}

async fn wait_for_stream(js: &jetstream::Context) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while js.get_stream(STREAM).await.is_err() {
        if Instant::now() > deadline {
            return Err("the service did not create the stream in time".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
