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
//! Run it with `scripts/demo.sh`, which starts nats-server and PostgreSQL on
//! loopback unless `NATS_URL` and `DATABASE_URL` are set.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use clap::Parser;
use ledger_example::{Credit, DUPLICATE_WINDOW, Fees, STREAM, SUBJECT, credits, prepare_ledger};

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
starts throwaway ones and sets them. RUST_LOG sets the log filter (default:
warn).";

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
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect(&env("DATABASE_URL")?)
        .await?;

    idem_runtime::schema::migrate(&pool).await?;
    prepare_ledger(&pool, options.accounts).await?;
    let fees = Fees::load(&pool).await?;
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
    let router = ledger_example::router(fees);
    let handle = router.handle();
    let service = tokio::spawn(router.run(nats.clone(), pool.clone()));
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

    let balances: BTreeMap<i64, i64> =
        sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id")
            .fetch_all(&pool)
            .await?
            .into_iter()
            .filter(|&(_, balance)| balance != 0)
            .collect();
    let entries: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_entries")
        .fetch_one(&pool)
        .await?;
    let distinct: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT transfer_id) FROM ledger_entries")
            .fetch_one(&pool)
            .await?;
    let fees_charged: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(fee), 0)::bigint FROM ledger_entries")
            .fetch_one(&pool)
            .await?;

    println!("idem ledger example");
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
