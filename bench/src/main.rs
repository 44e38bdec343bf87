//! idem-bench: how fast idem consumes, against hand-written consumers doing
//! the same work, on real servers with their durability settings on.
//!
//! ```text
//! cargo run --release -p idem-bench -- <mode> [--messages N] [--concurrency C] [--batch B]
//! ```
//!
//! Run `idem-bench help` for the modes and options. Each run prints one JSON
//! object on stdout; progress, tables and targets go to stderr.

mod consumers;
mod probe;
mod report;
mod run;
mod servers;

use std::fmt;
use std::process::ExitCode;
use std::time::Instant;

use consumers::{Mode, Pull};
use run::{Context, Measurement, Plan};
use servers::Servers;

const USAGE: &str = "\
usage: idem-bench <mode> [options]

modes (each publishes N messages first, then times the consumer from its
start to the last commit):
  raw          JetStream pull + ack, no database
  naive        async-nats + sqlx, BEGIN / INSERT / COMMIT / ack, no dedup
  manual       as naive, with a dedup INSERT .. ON CONFLICT DO NOTHING first
  idem         an #[idempotent] handler run by idem_runtime::Router
  idem-batch   the framework, batched: Route::batch(B), C batches in flight
  compare      all of the above, one after another, and a table

scenarios:
  latency      idem and naive at a fixed offered load (--rate, default 500
               msgs/s; default 5000 messages): p50/p99 publish to commit
  backlog      idem over a 200000-message backlog: peak RSS
  prefilled    idem and manual with an empty dedup table, then with one
               pre-filled with --prefill rows (default 5000000)
  smoke        every mode and scenario with small numbers, a tenth of the
               messages published twice; checks only correctness (effects =
               distinct messages, and each duplicate applied once in the
               dedup modes and twice without). For CI.

options:
  --messages N      messages per run (default 20000; see the scenarios)
  --concurrency C   messages in flight (default 8)
  --batch B         messages per transaction for idem-batch (default 64)
  --rate R          offered load of `latency`, msgs/s (default 500)
  --prefill ROWS    dedup rows of `prefilled` (default 5000000)
  --duplicates D    publish D of the messages a second time with the same
                    Nats-Msg-Id, after the stream's duplicate window (made
                    100 ms), so JetStream stores both (default 0; smoke: N/10)
  --no-ping         pools skip sqlx's liveness check on acquire
                    (test_before_acquire(false)), in every mode
  --pull slots      the hand-written modes pull only as many messages as
                    there are free slots, a task per message
                    instead of async-nats' prefetching messages() (default:
                    --pull prefetch); for attributing differences

NATS_URL and DATABASE_URL select servers (the bench creates and drops a
database per run there: it needs CREATEDB); without them it starts its own
nats-server and PostgreSQL on 127.0.0.1, under TMPDIR on disk, and removes
them on exit. RUST_LOG sets the log filter (default: warn).
";

/// Why the bench stopped.
#[derive(Debug)]
pub enum BenchError {
    Usage(String),
    /// Servers, connections, fixtures.
    Setup(String),
    /// A run went wrong or its end state is wrong.
    Failed(String),
    Interrupted,
}

impl BenchError {
    pub fn setup(message: impl Into<String>) -> Self {
        BenchError::Setup(message.into())
    }

    pub fn failed(message: impl Into<String>) -> Self {
        BenchError::Failed(message.into())
    }

    fn exit_code(&self) -> u8 {
        match self {
            BenchError::Usage(_) => 2,
            BenchError::Interrupted => 130,
            BenchError::Setup(_) | BenchError::Failed(_) => 1,
        }
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Usage(m) => write!(f, "{m}\n\n{USAGE}"),
            BenchError::Setup(m) => write!(f, "set-up failed: {m}"),
            BenchError::Failed(m) => write!(f, "FAILED: {m}"),
            BenchError::Interrupted => f.write_str("interrupted"),
        }
    }
}

impl std::error::Error for BenchError {}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Command {
    Mode(Mode),
    Compare,
    Latency,
    Backlog,
    Prefilled,
    Smoke,
}

#[derive(Debug, Clone, Copy)]
struct Options {
    command: Command,
    messages: Option<usize>,
    /// Messages published a second time (`--duplicates`).
    duplicates: Option<usize>,
    concurrency: usize,
    batch: usize,
    rate: f64,
    prefill: u64,
    ping: bool,
    pull: Pull,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Options, BenchError> {
    let usage = |m: String| BenchError::Usage(m);
    let mut args = args.into_iter();
    let command = match args.next().as_deref() {
        None | Some("help" | "-h" | "--help") => return Err(usage("no mode given".into())),
        Some("compare") => Command::Compare,
        Some("latency") => Command::Latency,
        Some("backlog") => Command::Backlog,
        Some("prefilled") => Command::Prefilled,
        Some("smoke") => Command::Smoke,
        Some(name) => {
            Command::Mode(Mode::parse(name).ok_or_else(|| usage(format!("unknown mode {name:?}")))?)
        }
    };
    let mut options = Options {
        command,
        messages: None,
        duplicates: None,
        concurrency: 8,
        batch: 64,
        rate: 500.0,
        prefill: 5_000_000,
        ping: true,
        pull: Pull::Prefetch,
    };
    while let Some(flag) = args.next() {
        let mut number = |flag: &str| -> Result<u64, BenchError> {
            args.next()
                .and_then(|v| v.replace('_', "").parse::<u64>().ok())
                .filter(|&v| v > 0)
                .ok_or_else(|| usage(format!("{flag} needs a positive whole number")))
        };
        match flag.as_str() {
            "--messages" => options.messages = Some(number("--messages")? as usize),
            "--duplicates" => options.duplicates = Some(number("--duplicates")? as usize),
            "--concurrency" => options.concurrency = number("--concurrency")? as usize,
            "--batch" => options.batch = number("--batch")? as usize,
            "--rate" => options.rate = number("--rate")? as f64,
            "--prefill" => options.prefill = number("--prefill")?,
            "--no-ping" => options.ping = false,
            "--pull" => {
                options.pull = match args.next().as_deref() {
                    Some("prefetch") => Pull::Prefetch,
                    Some("slots") => Pull::Slots,
                    _ => return Err(usage("--pull takes prefetch or slots".into())),
                }
            }
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    Ok(options)
}

/// When the process started, for the timestamps of progress lines.
static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

pub fn since_start() -> std::time::Duration {
    STARTED.get_or_init(Instant::now).elapsed()
}

fn main() -> ExitCode {
    since_start();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            // sqlx flags the dedup-table fill of `prefilled` as a slow
            // statement: expected there, not worth a warning.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
        )
        .init();
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("idem-bench: {e}");
            return ExitCode::from(e.exit_code());
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = runtime.block_on(async {
        let need_postgres = options.command != Command::Mode(Mode::Raw);
        let servers = tokio::select! {
            servers = Servers::start(need_postgres) => servers?,
            _ = interrupted() => return Err(BenchError::Interrupted),
        };
        let result = tokio::select! {
            result = bench(&options, &servers) => result,
            _ = interrupted() => Err(BenchError::Interrupted),
        };
        // Stop and remove our servers before the runtime goes away.
        drop(servers);
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-bench: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM, so that the servers are stopped.
async fn interrupted() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn bench(options: &Options, servers: &Servers) -> Result<(), BenchError> {
    describe_machine();
    for line in &servers.description {
        eprintln!("idem-bench: {line}");
    }
    if let Some(url) = &servers.database_url {
        describe_database(url).await?;
    }
    let ctx = Context::connect(
        &servers.nats_url,
        servers.database_url.clone(),
        servers.owned_pids(),
    )
    .await?;
    let messages = |default: usize| options.messages.unwrap_or(default);
    match options.command {
        Command::Mode(mode) => {
            let plan = plan(options, mode, "throughput", messages(20_000));
            let measured = run::run(&ctx, &plan).await?;
            println!("{}", report::json_line(&measured));
        }
        Command::Compare => {
            compare(&ctx, options, messages(20_000)).await?;
        }
        Command::Latency => {
            latency(&ctx, options, messages(5_000), options.rate).await?;
        }
        Command::Backlog => {
            backlog(&ctx, options, messages(200_000)).await?;
        }
        Command::Prefilled => {
            prefilled(&ctx, options, messages(20_000), options.prefill).await?;
        }
        Command::Smoke => smoke(&ctx, options).await?,
    }
    Ok(())
}

fn plan(options: &Options, mode: Mode, scenario: &'static str, messages: usize) -> Plan {
    Plan {
        mode,
        scenario,
        messages,
        concurrency: options.concurrency,
        batch: options.batch,
        rate: None,
        prefill: 0,
        // Never more duplicates than messages to duplicate.
        duplicates: options.duplicates.unwrap_or(0).min(messages),
        ping: options.ping,
        pull: options.pull,
    }
}

/// Runs `plan` and prints its JSON line.
async fn run_and_print(ctx: &Context, plan: Plan) -> Result<Measurement, BenchError> {
    let measured = run::run(ctx, &plan).await?;
    eprintln!(
        "idem-bench: [{} {}] {:.0} msgs/s, p50 {:.1} ms, p99 {:.1} ms, effects {}",
        plan.scenario,
        plan.mode.name(),
        measured.msgs_per_sec,
        measured.p50_ms,
        measured.p99_ms,
        measured.effects
    );
    println!("{}", report::json_line(&measured));
    Ok(measured)
}

async fn compare(
    ctx: &Context,
    options: &Options,
    messages: usize,
) -> Result<Vec<Measurement>, BenchError> {
    let mut runs = Vec::new();
    for mode in Mode::ALL {
        runs.push(run_and_print(ctx, plan(options, mode, "throughput", messages)).await?);
    }
    // The table goes to stderr with the other human-readable lines: stdout
    // holds only JSON, one object per line.
    eprintln!();
    eprint!("{}", report::compare_table(&runs));
    eprintln!("{}", report::compare_targets(&runs));
    println!("{}", report::compare_summary(&runs));
    Ok(runs)
}

async fn latency(
    ctx: &Context,
    options: &Options,
    messages: usize,
    rate: f64,
) -> Result<Vec<Measurement>, BenchError> {
    let mut runs = Vec::new();
    for mode in [Mode::Naive, Mode::Idem] {
        let plan = Plan {
            rate: Some(rate),
            ..plan(options, mode, "latency", messages)
        };
        runs.push(run_and_print(ctx, plan).await?);
    }
    let p99 = runs
        .iter()
        .find(|m| m.plan.mode == Mode::Idem)
        .map(|m| m.p99_ms);
    eprintln!(
        "{}",
        report::target(
            &format!("idem p99 <= 10 ms at {rate} msgs/s"),
            p99,
            " ms",
            |v| v <= 10.0
        )
    );
    Ok(runs)
}

async fn backlog(
    ctx: &Context,
    options: &Options,
    messages: usize,
) -> Result<Measurement, BenchError> {
    let measured = run_and_print(ctx, plan(options, Mode::Idem, "backlog", messages)).await?;
    eprintln!(
        "{}",
        report::target(
            &format!("idem peak RSS <= 100 MiB over a {messages}-message backlog"),
            Some(measured.peak_rss_mib),
            " MiB",
            |v| v <= 100.0
        )
    );
    Ok(measured)
}

async fn prefilled(
    ctx: &Context,
    options: &Options,
    messages: usize,
    rows: u64,
) -> Result<Vec<Measurement>, BenchError> {
    let mut runs = Vec::new();
    let mut targets = Vec::new();
    for mode in [Mode::Manual, Mode::Idem] {
        let mut rates = [0.0; 2];
        for (i, prefill) in [0, rows].into_iter().enumerate() {
            let plan = Plan {
                prefill,
                ..plan(options, mode, "prefilled", messages)
            };
            let measured = run_and_print(ctx, plan).await?;
            rates[i] = measured.msgs_per_sec;
            runs.push(measured);
        }
        targets.push(report::target(
            &format!("{} with {rows} dedup rows >= 0.9x empty", mode.name()),
            Some(rates[1] / rates[0]),
            "x",
            |v| v >= 0.9,
        ));
    }
    for line in targets {
        eprintln!("{line}");
    }
    Ok(runs)
}

/// Every mode and scenario with small numbers: checks that each run ends
/// with the right effects (every run does), not how fast it is.
///
/// A tenth of the messages is published a second time, with the same
/// `Nats-Msg-Id` after the stream's duplicate window, so that JetStream
/// stores both copies, as it does for a publisher retry after the window or
/// a replay. The dedup modes must apply each message once and count each
/// second copy as a duplicate; `naive` and `raw`, the control, must see
/// every copy, which proves the duplicates reach the consumer.
async fn smoke(ctx: &Context, options: &Options) -> Result<(), BenchError> {
    let started = Instant::now();
    let n = options.messages.unwrap_or(500);
    let options = &Options {
        duplicates: Some(options.duplicates.unwrap_or((n / 10).max(1))),
        ..*options
    };
    eprintln!(
        "idem-bench: smoke: {n} messages per run, some of them published twice; it checks \
         effects = distinct messages in the dedup modes (and a double effect per duplicate \
         in naive), while the target lines below mean little at this size"
    );
    let mut runs = compare(ctx, options, n).await?;
    runs.extend(latency(ctx, options, n.min(250), options.rate).await?);
    runs.push(backlog(ctx, options, n).await?);
    runs.extend(prefilled(ctx, options, n, 20_000).await?);
    let wall = started.elapsed().as_secs_f64();
    let duplicates: usize = runs.iter().map(|m| m.plan.duplicates).sum();
    eprintln!(
        "idem-bench: smoke passed: {} runs with {duplicates} duplicates stored in all, each \
         with the expected effects, in {wall:.1} s",
        runs.len()
    );
    println!(
        "{}",
        serde_json::json!({
            "mode": "smoke",
            "messages": n,
            "duplicates_per_run": options.duplicates,
            "concurrency": options.concurrency,
            "batch": options.batch,
            "runs_correct": runs.len(),
            "wall_s": (wall * 10.0).round() / 10.0,
        })
    );
    Ok(())
}

fn describe_machine() {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .map_or("?".into(), |v| v.trim().to_owned());
    eprintln!(
        "idem-bench: {:>7.2}s machine: {cpus} CPUs, {mem} RAM",
        since_start().as_secs_f64()
    );
}

/// Prints the server's version and the settings that decide commit cost.
async fn describe_database(url: &str) -> Result<(), BenchError> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| BenchError::setup(format!("cannot connect to {url}: {e}")))?;
    let mut settings = Vec::new();
    for name in [
        "server_version",
        "fsync",
        "synchronous_commit",
        "wal_sync_method",
        "shared_buffers",
    ] {
        let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(&mut conn)
            .await
            .map_err(|e| BenchError::setup(format!("SHOW {name}: {e}")))?;
        settings.push(format!("{name}={value}"));
    }
    let _ = conn.close().await;
    eprintln!("idem-bench: PostgreSQL settings: {}", settings.join(", "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_modes_and_flags() {
        let o = parse_args(args("idem --messages 1_000 --concurrency 4 --no-ping")).unwrap();
        assert_eq!(o.command, Command::Mode(Mode::Idem));
        assert_eq!(o.messages, Some(1000));
        assert_eq!(o.duplicates, None);
        assert_eq!(
            parse_args(args("smoke --duplicates 7")).unwrap().duplicates,
            Some(7)
        );
        assert_eq!(o.concurrency, 4);
        assert!(!o.ping);
        assert_eq!(
            parse_args(args("compare")).unwrap().command,
            Command::Compare
        );
        assert!(parse_args(args("idem --messages 0")).is_err());
        assert!(parse_args(args("fast")).is_err());
    }
}
