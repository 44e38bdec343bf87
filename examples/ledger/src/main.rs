//! A ledger service that credits accounts from JetStream messages, exactly
//! once, and proves it.
//!
//! It publishes a run of credits, including the two kinds of duplicate the
//! guide describes (a publisher retry inside JetStream's duplicate window,
//! which JetStream drops, and one after it, which JetStream stores again),
//! processes them with an `#[idempotent]` handler, and checks every balance
//! against the sum of the unique credits, less their fees.
//!
//! The handler takes the fee schedule from the service's state
//! ([`Router::with_state`], [`State`]): loaded from the database once at
//! start-up and shared by every delivery, rather than kept in a `static`.
//!
//! Run it with `scripts/demo.sh`, which starts nats-server and PostgreSQL on
//! loopback unless `NATS_URL` and `DATABASE_URL` are set.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use clap::Parser;
use idem_runtime::error::{Classify, ErrorClass};
use idem_runtime::{FromRef, Route, Router, State, idempotent};
use serde::{Deserialize, Serialize};

const STREAM: &str = "LEDGER";
const SUBJECT: &str = "ledger.credit";
/// Short, so the demo can wait past it to show a retry JetStream cannot catch.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);

/// A credit to one account, identified by its transfer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Credit {
    transfer_id: String,
    account: i64,
    amount: i64,
}

/// Why a credit failed.
#[derive(Debug, thiserror::Error)]
enum LedgerError {
    #[error("account {0} does not exist")]
    UnknownAccount(i64),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// An unknown account will not appear on a retry, so that error is
/// permanent: the credit is dead-lettered at once instead of retried.
impl Classify for LedgerError {
    fn class(&self) -> ErrorClass {
        match self {
            LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
            LedgerError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// The service's state: what its handlers need besides the message, made
/// once at start-up and shared by every delivery. A handler takes a part of
/// it with `State<T>`; more parts (a client of another service, settings)
/// would be more fields.
#[derive(Clone, FromRef)]
struct Ledger {
    fees: Fees,
}

/// The fee schedule: the percentage of each credit that an account pays as
/// a fee, by account. Read from the `fee_schedule` table at start-up, so a
/// change takes effect on the next start.
#[derive(Debug, Clone)]
struct Fees(Arc<BTreeMap<i64, i64>>);

impl Fees {
    async fn load(pool: &sqlx::PgPool) -> Result<Fees, sqlx::Error> {
        let rates = sqlx::query_as::<_, (i64, i64)>("SELECT account, percent FROM fee_schedule")
            .fetch_all(pool)
            .await?;
        Ok(Fees(Arc::new(rates.into_iter().collect())))
    }

    /// The fee on a credit of `amount` to `account`, in whole units rounded
    /// down: none for an account without a rate.
    fn on(&self, account: i64, amount: i64) -> i64 {
        amount * self.0.get(&account).copied().unwrap_or(0) / 100
    }
}

/// Credits an account, less its fee. The dedup key is the transfer id, so a
/// credit republished under any `Nats-Msg-Id` is still applied once.
#[idempotent(name = "ledger.credit.v1", key = cmd.transfer_id)]
async fn credit(
    tx: &mut sqlx::PgTransaction<'_>,
    State(fees): State<Fees>,
    cmd: Credit,
) -> Result<(), LedgerError> {
    let fee = fees.on(cmd.account, cmd.amount);
    let updated = sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(cmd.amount - fee)
        .bind(cmd.account)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(LedgerError::UnknownAccount(cmd.account));
    }
    sqlx::query(
        "INSERT INTO ledger_entries (transfer_id, account, amount, fee) VALUES ($1, $2, $3, $4)",
    )
    .bind(&cmd.transfer_id)
    .bind(cmd.account)
    .bind(cmd.amount)
    .bind(fee)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

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
    let credits: Vec<Credit> = (0..options.credits)
        .map(|i| Credit {
            transfer_id: format!("transfer-{i:06}"),
            account: 1 + (i as i64 % options.accounts),
            amount: 1 + (i as i64 * 7) % 100,
        })
        .collect();
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
    let router = Router::with_state(Ledger { fees }).route(
        Route::new(STREAM, "ledger-credit")
            .filter_subject(SUBJECT)
            .create_stream(stream::Config {
                name: STREAM.into(),
                subjects: vec!["ledger.>".into()],
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .concurrency(8),
        credit,
    );
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

/// A fresh ledger: zeroed accounts and no entries, so each run proves
/// itself, and a fee schedule in which accounts pay 0, 5 or 10 % by turns.
async fn prepare_ledger(pool: &sqlx::PgPool, accounts: i64) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS ledger_entries, fee_schedule, accounts;
         CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
         CREATE TABLE fee_schedule (
             account bigint PRIMARY KEY REFERENCES accounts,
             percent bigint NOT NULL CHECK (percent BETWEEN 0 AND 99));
         CREATE TABLE ledger_entries (
             transfer_id text NOT NULL, account bigint NOT NULL,
             amount bigint NOT NULL, fee bigint NOT NULL);
         DELETE FROM idem_claims WHERE handler_id IN (SELECT id FROM idem_handlers WHERE name = 'ledger.credit.v1');",
    )
    .execute(pool)
    .await?;
    sqlx::query("INSERT INTO accounts (id) SELECT generate_series(1, $1)")
        .bind(accounts)
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO fee_schedule (account, percent) SELECT id, 5 * (id % 3) FROM accounts",
    )
    .execute(pool)
    .await?;
    Ok(())
}
