//! idem-bench: how fast idem consumes, against hand-written consumers doing
//! the same work, on real servers with their durability settings on.
//!
//! ```text
//! cargo run --release -p idem-bench -- <mode> [--messages N] [--concurrency C] [options]
//! ```
//!
//! Run `idem-bench --help` for the modes and scenarios, and
//! `idem-bench <mode> --help` for the options of each. Each run prints one
//! JSON object on stdout; progress, tables and targets go to stderr.

mod chart;
mod consumers;
mod databases;
mod fairness;
mod fixture;
mod outbox;
mod probe;
mod report;
mod retention;
mod run;
mod scale;
mod servers;
mod stalls;

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use consumers::{Mode, Pull};
use run::{Context, Database, Measurement, Plan};
use servers::Servers;

/// How fast idem consumes, against hand-written consumers doing the same
/// work, on real servers with their durability settings on.
#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    version,
    arg_required_else_help = true,
    subcommand_value_name = "MODE",
    subcommand_help_heading = "Modes and scenarios",
    after_help = AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where the bench's own servers keep their files [default: TMPDIR]: on
    /// disk, for the 100-million-claim table of `steady` (about 13 GB)
    #[arg(long, value_name = "DIR", global = true)]
    data_dir: Option<PathBuf>,
    /// A setting of the bench's own PostgreSQL, e.g. max_wal_size=1GB (the
    /// WAL it keeps on disk); repeatable
    #[arg(long, value_name = "NAME=VALUE", global = true, value_parser = pg_setting)]
    pg_setting: Vec<String>,
    /// The bench's own nats-server's JetStream sync_interval: `always`
    /// (fsync before each PubAck) or `default` (the server's, every 2 min)
    #[arg(long, value_name = "SYNC", value_enum, global = true, default_value_t = servers::NatsSync::Always)]
    nats_sync: servers::NatsSync,
}

/// `name=value`, a PostgreSQL `-c` setting.
fn pg_setting(value: &str) -> Result<String, String> {
    match value.split_once('=') {
        Some((name, _))
            if !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.') =>
        {
            Ok(value.to_owned())
        }
        _ => Err("expected NAME=VALUE, e.g. max_wal_size=1GB".into()),
    }
}

const AFTER_HELP: &str = "\
Each mode publishes its messages first, then times the consumer from its
start to the last commit. Each run prints one JSON object on stdout;
progress, tables and targets go to stderr. `idem-bench <MODE> --help` lists
the options of a mode or scenario.

NATS_URL and DATABASE_URL select servers (the bench creates and drops a
database per run there: it needs CREATEDB); without them it starts its own
nats-server and PostgreSQL on 127.0.0.1, under --data-dir or TMPDIR, on
disk, and removes them on exit. RUST_LOG sets the log filter (default: warn).";

/// The modes (one consumer each) and the scenarios (several runs each).
#[derive(Debug, Subcommand)]
enum Command {
    /// JetStream pull + ack, no database
    Raw(RawArgs),
    /// async-nats + sqlx: BEGIN / INSERT / COMMIT / ack, no dedup
    Naive(HandWrittenArgs),
    /// As naive, with a dedup INSERT .. ON CONFLICT DO NOTHING first
    Manual(HandWrittenArgs),
    /// An `#[idempotent]` handler run by idem_runtime::Router
    Idem(IdemArgs),
    /// The framework, batched: Route::batch(B), C batches in flight
    #[command(mut_arg("concurrency", |arg| arg.help("Batches in flight")))]
    IdemBatch(IdemBatchArgs),
    /// As idem-batch, with an #[idempotent(batch)] handler: one INSERT per batch
    #[command(mut_arg("concurrency", |arg| arg.help("Batches in flight")))]
    IdemBatchHandler(IdemBatchArgs),
    /// Every mode, one after another, and a table
    #[command(mut_arg("concurrency", |arg| arg.help(CONCURRENCY_WITH_BATCHES)))]
    Compare(CompareArgs),
    /// raw, naive and idem, then both batch modes at B = 1, 16, 64, 256: a table and an SVG chart
    #[command(mut_arg("concurrency", |arg| arg.help(CONCURRENCY_WITH_BATCHES)))]
    Chart(ChartArgs),
    /// naive, idem and idem-default at a fixed offered load: p50/p99 publish to commit
    Latency(LatencyArgs),
    /// idem, idem-default and adaptive batches, each message also updating one of 8 hot rows
    #[command(after_help = CONTENTION)]
    Contention(ContentionArgs),
    /// idem over a large backlog: peak RSS
    Backlog(BacklogArgs),
    /// idem and manual with an empty dedup table, then a pre-filled one
    Prefilled(PrefilledArgs),
    /// idem with retention and the purge running: 100M claims vs an empty table
    #[command(after_help = STEADY)]
    Steady(SteadyArgs),
    /// expiry::purge of a 10M-claim generation under load: its time, p99 during vs otherwise
    Purge(PurgeArgs),
    /// Bytes per claim, heap and indexes: the claims table vs version 1's
    Storage(StorageArgs),
    /// Two routes on a small pool at a fixed rate: each route's p50/p99 publish to ack
    #[command(after_help = FAIRNESS)]
    Fairness(FairnessArgs),
    /// The outbox Relay vs raw publishes; COMMIT -> stored p50/p99, outbox vs publish-after-commit
    #[command(after_help = OUTBOX)]
    Outbox(OutboxArgs),
    /// idem with 1, 2, 4 worker processes on a 3-node cluster (R3) and one server (R1)
    #[command(after_help = scale::HELP)]
    Scale(scale::ScaleArgs),
    /// One worker process of `scale`, which starts it
    #[command(hide = true)]
    ScaleWorker(scale::WorkerArgs),
    /// naive, idem and idem-batch-handler on a SQLite file (feature `sqlite`): msgs/s and ratios
    Sqlite(databases::DatabaseArgs),
    /// naive, idem and idem-batch-handler on a MariaDB server of its own (feature `mariadb`): msgs/s and ratios
    Mariadb(databases::DatabaseArgs),
    /// Every mode and scenario, small, with duplicates: checks correctness only (CI)
    #[command(after_help = SMOKE)]
    Smoke(SmokeArgs),
}

const CONTENTION: &str = "\
Each message also adds 1 to one of 8 rows of bench_hot, picked by its key,
as the chaos suite's ledger does: concurrent transactions wait on each
other's row locks, and batches that lock rows in different orders deadlock.
It runs idem (Route::per_message), idem-default (the route's default
batching) and idem-batch as Route::adaptive_batch(B), and checks that the
hot rows' total equals the distinct messages.";

const SMOKE: &str = "\
Every mode and scenario with small numbers, a tenth of the messages
published twice (with the same Nats-Msg-Id, after the stream's duplicate
window, so that JetStream stores both copies). It checks only correctness:
effects = distinct messages and one skipped duplicate per second copy in the
dedup modes, and a second effect per copy in naive, the control. scale runs
2 worker processes on a 3-node cluster and on one server, without
duplicates (not with NATS_URL or DATABASE_URL set). The target lines mean
little at this size.";

const STEADY: &str = "\
The claims are generated straight into the partitions (COPY, then the
primary key, then ATTACH), not through the broker: the live generations
hold --rows, two older ones a twentieth each. On each table, a throughput
run (a backlog of --messages) then a latency run (--latency-messages at
--rate); before each, one older generation is made due to expire and the
current one due to rotate --rotate-after-ms into the run, and expiry::purge
runs every second beside the router's own, so that it expires, rotates and
ends a transition while idem works. claim p99 is BEGIN to the handler's INSERT, on the server's clock.
Put the servers on disk (--data-dir) for 100M claims: about 13 GB.";

const OUTBOX: &str = "\
Throughput: --messages rows queued in idem_outbox (untimed), then drained by
one Relay (its own cycles until one takes nothing), against raw publishes of
the same payloads with a Nats-Msg-Id each, pipelined in windows of
--relay-batch, on the same connection. Latency: --latency-messages offered
at --rate to an #[idempotent] handler that inserts a row and queues one
outbox message (a Relay runs beside the router), then to a hand-written
handler that publishes after its COMMIT; then both over a backlog of the
same size. Latency is from the wall clock taken right before the COMMIT is
sent (carried in the output message) to the output message's delivery to a
JetStream consumer, which follows its storage (and PubAck).";

const FAIRNESS: &str = "\
Two streams, each with a per-message route of --concurrency messages in
flight, on one router whose pool has --pool connections (fewer than the
routes' sum): --messages are published to each at --rate msgs/s while they
are consumed, and the handler holds its transaction for --hold-ms, as one
with some work in it does (sleeping: the load is on the pool, not the
CPU; the defaults keep about 90 % of the pool busy). It prints each route's
publish -> ack p50, p99 and max, and both together, and checks effects =
inputs.";

const CONCURRENCY_WITH_BATCHES: &str = "Messages in flight (idem-batch: batches in flight)";

/// What every run takes.
#[derive(Debug, Args)]
struct Load {
    /// Messages in flight
    #[arg(long, value_name = "C", default_value_t = 8, value_parser = positive::<usize>)]
    concurrency: usize,
    /// Messages published a second time, after the 100 ms duplicate window
    #[arg(long, value_name = "D", default_value_t = 0, value_parser = whole::<usize>)]
    duplicates: usize,
}

/// The database pools' settings.
#[derive(Debug, Args)]
struct Pools {
    /// Skip sqlx's liveness ping when a pool hands out a connection [default: ping]
    #[arg(long)]
    no_ping: bool,
}

/// How the hand-written consumers fetch.
#[derive(Debug, Args)]
struct Fetch {
    /// Hand-written modes: prefetch with async-nats' messages(), or pull into free slots as the runtime
    #[arg(long, value_name = "HOW", value_enum, default_value_t = Pull::Prefetch)]
    pull: Pull,
}

/// The batch size of `idem-batch`.
#[derive(Debug, Args)]
struct Batch {
    /// Messages per transaction in idem-batch
    #[arg(long, value_name = "B", default_value_t = DEFAULT_BATCH, value_parser = positive::<usize>)]
    batch: usize,
    /// idem-batch and idem-batch-handler size their batches adaptively,
    /// up to B (`Route::adaptive_batch(B)`), instead of `Route::batch(B)`
    #[arg(long)]
    adaptive: bool,
}

const DEFAULT_BATCH: usize = 64;
const DEFAULT_RATE: u64 = 500;

#[derive(Debug, Args)]
struct RawArgs {
    /// Messages published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct HandWrittenArgs {
    /// Messages published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct IdemArgs {
    /// Messages published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct IdemBatchArgs {
    /// Messages published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    batch: Batch,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct CompareArgs {
    /// Messages per mode, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    batch: Batch,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct ContentionArgs {
    /// Messages per mode, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct ChartArgs {
    /// Messages per run, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Where to write the SVG chart (its folder must exist)
    #[arg(long, value_name = "PATH", default_value = "bench/throughput.svg")]
    out: PathBuf,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct LatencyArgs {
    /// Messages per mode, published at --rate while consuming
    #[arg(long, value_name = "N", default_value_t = 5_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Offered load, messages per second
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RATE, value_parser = positive::<u64>)]
    rate: u64,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct BacklogArgs {
    /// Messages queued before the consumer starts
    #[arg(long, value_name = "N", default_value_t = 200_000, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct PrefilledArgs {
    /// Messages per run, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Rows in the pre-filled dedup table
    #[arg(long, value_name = "ROWS", default_value_t = 5_000_000, value_parser = positive::<u64>)]
    prefill: u64,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

#[derive(Debug, Args)]
struct SteadyArgs {
    /// Claims in the full table's live generations
    #[arg(long, value_name = "ROWS", default_value_t = 100_000_000, value_parser = positive::<u64>)]
    rows: u64,
    /// Live generations: the current one and the sealed ones
    #[arg(long, value_name = "G", default_value_t = 3, value_parser = positive::<u32>)]
    generations: u32,
    /// Messages of each throughput run, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 50_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Messages of each latency run, published at --rate while consuming
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = positive::<usize>)]
    latency_messages: usize,
    /// Offered load of the latency runs, messages per second
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RATE, value_parser = positive::<u64>)]
    rate: u64,
    /// When the current generation is due to rotate, in ms after the consumer starts
    #[arg(long, value_name = "MS", default_value_t = 2_000, value_parser = whole::<u64>)]
    rotate_after_ms: u64,
    /// Take the message id from a key expression, whose claim probes every
    /// sealed generation [default: the Nats-Msg-Id, whose claim probes only
    /// the generations sealed after the message was stored]
    #[arg(long)]
    key_expression: bool,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct PurgeArgs {
    /// Claims in the generation the purge expires
    #[arg(long, value_name = "ROWS", default_value_t = 10_000_000, value_parser = positive::<u64>)]
    rows: u64,
    /// Messages published at --rate while consuming; the purge runs a third of the way in
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Offered load, messages per second
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RATE, value_parser = positive::<u64>)]
    rate: u64,
    /// Pieces of the expiring generation [default: as many as the purge's
    /// rotation would make it, by `expiry::pieces_for`; 1: one table, as
    /// before pieces]
    #[arg(long, value_name = "N", value_parser = positive::<u32>)]
    pieces: Option<u32>,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    pools: Pools,
}

#[derive(Debug, Args)]
struct FairnessArgs {
    /// Messages per route, published at --rate while consuming
    #[arg(long, value_name = "N", default_value_t = 6_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Offered load per route, messages per second
    #[arg(long, value_name = "R", default_value_t = 100, value_parser = positive::<u64>)]
    rate: u64,
    /// The pool's connections
    #[arg(long, value_name = "P", default_value_t = 10, value_parser = positive::<u32>)]
    pool: u32,
    /// How long the handler holds its transaction open, in milliseconds
    #[arg(long, value_name = "MS", default_value_t = 40, value_parser = whole::<u64>)]
    hold_ms: u64,
    #[command(flatten)]
    load: Load,
}

#[derive(Debug, Args)]
struct OutboxArgs {
    /// Rows queued in the outbox, then drained by the relay (and raw publishes)
    #[arg(long, value_name = "N", default_value_t = 50_000, value_parser = positive::<usize>)]
    messages: usize,
    /// Messages of each latency and backlog run of the handlers
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = positive::<usize>)]
    latency_messages: usize,
    /// Offered load of the latency runs, messages per second
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RATE, value_parser = positive::<u64>)]
    rate: u64,
    /// The relay's batch size (rows per cycle), and raw's publish window
    #[arg(long, value_name = "B", default_value_t = DEFAULT_RELAY_BATCH, value_parser = positive::<usize>)]
    relay_batch: usize,
    /// Messages in flight in the handlers
    #[arg(long, value_name = "C", default_value_t = 8, value_parser = positive::<usize>)]
    concurrency: usize,
}

/// `Relay`'s default batch size.
const DEFAULT_RELAY_BATCH: usize = 1024;

#[derive(Debug, Args)]
struct StorageArgs {
    /// Claims per table
    #[arg(long, value_name = "ROWS", default_value_t = 1_000_000, value_parser = positive::<u64>)]
    rows: u64,
}

#[derive(Debug, Args)]
struct SmokeArgs {
    /// Messages per run (latency: at most 250)
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = positive::<usize>)]
    messages: usize,
    #[command(flatten)]
    batch: Batch,
    /// Offered load of the latency run, messages per second
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RATE, value_parser = positive::<u64>)]
    rate: u64,
    #[arg(long, value_name = "C", default_value_t = 8, value_parser = positive::<usize>,
          help = CONCURRENCY_WITH_BATCHES)]
    concurrency: usize,
    /// Messages published twice [default: a tenth of --messages, at least 1]
    #[arg(long, value_name = "D", value_parser = whole::<usize>)]
    duplicates: Option<usize>,
    #[command(flatten)]
    pools: Pools,
    #[command(flatten)]
    fetch: Fetch,
}

/// A whole number above zero; `_` may group its digits (`20_000`).
fn positive<T>(value: &str) -> Result<T, String>
where
    T: std::str::FromStr<Err = std::num::ParseIntError> + PartialEq + From<u8>,
{
    let number = whole::<T>(value)?;
    if number == T::from(0) {
        return Err("must be at least 1".into());
    }
    Ok(number)
}

/// A whole number; `_` may group its digits (`20_000`).
fn whole<T>(value: &str) -> Result<T, String>
where
    T: std::str::FromStr<Err = std::num::ParseIntError>,
{
    value
        .replace('_', "")
        .parse()
        .map_err(|e: std::num::ParseIntError| format!("not a whole number: {e}"))
}

/// Why the bench stopped.
#[derive(Debug)]
pub enum BenchError {
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
            BenchError::Interrupted => 130,
            BenchError::Setup(_) | BenchError::Failed(_) => 1,
        }
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Setup(m) => write!(f, "set-up failed: {m}"),
            BenchError::Failed(m) => write!(f, "FAILED: {m}"),
            BenchError::Interrupted => f.write_str("interrupted"),
        }
    }
}

impl std::error::Error for BenchError {}

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Job {
    Mode(Mode),
    Compare,
    Chart,
    Latency,
    Contention,
    Backlog,
    Prefilled,
    Steady,
    Purge,
    Storage,
    Fairness,
    Outbox,
    Scale,
    Smoke,
}

/// The parsed command line, whatever the mode. A field for an option the
/// mode does not take holds a placeholder that the mode does not read.
#[derive(Debug, Clone)]
struct Options {
    job: Job,
    messages: usize,
    /// Messages published a second time (`--duplicates`); `None`: smoke's
    /// default, a tenth of the messages.
    duplicates: Option<usize>,
    concurrency: usize,
    batch: usize,
    /// `--adaptive`: the batching modes use `Route::adaptive_batch`.
    adaptive: bool,
    rate: f64,
    prefill: u64,
    ping: bool,
    pull: Pull,
    /// Where `chart` writes its SVG.
    out: PathBuf,
    /// The retention scenarios' claims (steady, purge, storage).
    rows: u64,
    /// steady: live generations, latency run size, rotation delay.
    generations: u32,
    latency_messages: usize,
    rotate_after: Duration,
    /// steady: ids from the handler's key expression, not Nats-Msg-Id.
    key_expression: bool,
    /// Where the bench's servers keep their files.
    data_dir: Option<PathBuf>,
    /// `--pg-setting`s.
    pg_settings: Vec<String>,
    /// `--nats-sync`.
    nats_sync: servers::NatsSync,
    /// `scale`'s options.
    scale: Option<scale::ScaleArgs>,
    /// `fairness`: the pool's connections, and how long the handler holds
    /// its transaction.
    pool: u32,
    hold: Duration,
    /// `purge --pieces`.
    pieces: Option<u32>,
}

impl Options {
    fn new(job: Job, messages: usize, load: Load) -> Options {
        Options {
            job,
            messages,
            duplicates: Some(load.duplicates),
            concurrency: load.concurrency,
            batch: DEFAULT_BATCH,
            adaptive: false,
            rate: DEFAULT_RATE as f64,
            prefill: 0,
            ping: true,
            pull: Pull::Prefetch,
            out: PathBuf::new(),
            rows: 0,
            generations: 0,
            latency_messages: 0,
            rotate_after: Duration::ZERO,
            key_expression: false,
            data_dir: None,
            nats_sync: servers::NatsSync::Always,
            pg_settings: Vec::new(),
            scale: None,
            pool: 0,
            hold: Duration::ZERO,
            pieces: None,
        }
    }

    fn with_scale(self, args: scale::ScaleArgs) -> Options {
        Options {
            scale: Some(args),
            ..self
        }
    }
}

impl Pools {
    fn ping(&self) -> bool {
        !self.no_ping
    }
}

impl From<Cli> for Options {
    fn from(cli: Cli) -> Options {
        Options {
            data_dir: cli.data_dir,
            nats_sync: cli.nats_sync,
            pg_settings: cli.pg_setting,
            ..Options::from(cli.command)
        }
    }
}

impl From<Command> for Options {
    fn from(command: Command) -> Options {
        let hand_written = |mode, a: HandWrittenArgs| Options {
            ping: a.pools.ping(),
            pull: a.fetch.pull,
            ..Options::new(Job::Mode(mode), a.messages, a.load)
        };
        match command {
            Command::Raw(a) => Options {
                pull: a.fetch.pull,
                ..Options::new(Job::Mode(Mode::Raw), a.messages, a.load)
            },
            Command::Naive(a) => hand_written(Mode::Naive, a),
            Command::Manual(a) => hand_written(Mode::Manual, a),
            Command::Idem(a) => Options {
                ping: a.pools.ping(),
                ..Options::new(Job::Mode(Mode::Idem), a.messages, a.load)
            },
            Command::IdemBatch(a) => Options {
                batch: a.batch.batch,
                adaptive: a.batch.adaptive,
                ping: a.pools.ping(),
                ..Options::new(Job::Mode(Mode::IdemBatch), a.messages, a.load)
            },
            Command::IdemBatchHandler(a) => Options {
                batch: a.batch.batch,
                adaptive: a.batch.adaptive,
                ping: a.pools.ping(),
                ..Options::new(Job::Mode(Mode::IdemBatchHandler), a.messages, a.load)
            },
            Command::Compare(a) => Options {
                batch: a.batch.batch,
                adaptive: a.batch.adaptive,
                ping: a.pools.ping(),
                pull: a.fetch.pull,
                ..Options::new(Job::Compare, a.messages, a.load)
            },
            Command::Contention(a) => Options {
                ping: a.pools.ping(),
                ..Options::new(Job::Contention, a.messages, a.load)
            },
            Command::Chart(a) => Options {
                ping: a.pools.ping(),
                pull: a.fetch.pull,
                out: a.out,
                ..Options::new(Job::Chart, a.messages, a.load)
            },
            Command::Latency(a) => Options {
                rate: a.rate as f64,
                ping: a.pools.ping(),
                pull: a.fetch.pull,
                ..Options::new(Job::Latency, a.messages, a.load)
            },
            Command::Backlog(a) => Options {
                ping: a.pools.ping(),
                ..Options::new(Job::Backlog, a.messages, a.load)
            },
            Command::Prefilled(a) => Options {
                prefill: a.prefill,
                ping: a.pools.ping(),
                pull: a.fetch.pull,
                ..Options::new(Job::Prefilled, a.messages, a.load)
            },
            Command::Steady(a) => Options {
                rows: a.rows,
                generations: a.generations,
                latency_messages: a.latency_messages,
                rate: a.rate as f64,
                rotate_after: Duration::from_millis(a.rotate_after_ms),
                key_expression: a.key_expression,
                ping: a.pools.ping(),
                ..Options::new(Job::Steady, a.messages, a.load)
            },
            Command::Purge(a) => Options {
                rows: a.rows,
                rate: a.rate as f64,
                pieces: a.pieces,
                ping: a.pools.ping(),
                ..Options::new(Job::Purge, a.messages, a.load)
            },
            Command::Storage(a) => Options {
                rows: a.rows,
                ..Options::new(
                    Job::Storage,
                    1,
                    Load {
                        concurrency: 1,
                        duplicates: 0,
                    },
                )
            },
            Command::Fairness(a) => Options {
                rate: a.rate as f64,
                pool: a.pool,
                hold: Duration::from_millis(a.hold_ms),
                ..Options::new(Job::Fairness, a.messages, a.load)
            },
            Command::Outbox(a) => Options {
                latency_messages: a.latency_messages,
                rate: a.rate as f64,
                batch: a.relay_batch,
                ..Options::new(
                    Job::Outbox,
                    a.messages,
                    Load {
                        concurrency: a.concurrency,
                        duplicates: 0,
                    },
                )
            },
            Command::Scale(a) => Options {
                batch: a.batch,
                ..Options::new(
                    Job::Scale,
                    a.messages,
                    Load {
                        concurrency: a.concurrency,
                        duplicates: 0,
                    },
                )
                .with_scale(a)
            },
            Command::ScaleWorker(_) | Command::Sqlite(_) | Command::Mariadb(_) => {
                unreachable!(
                    "main runs a scale worker and the SQLite and MariaDB benches before it reads options"
                )
            }
            Command::Smoke(a) => Options {
                duplicates: a.duplicates,
                concurrency: a.concurrency,
                batch: a.batch.batch,
                adaptive: a.batch.adaptive,
                rate: a.rate as f64,
                ping: a.pools.ping(),
                pull: a.fetch.pull,
                ..Options::new(
                    Job::Smoke,
                    a.messages,
                    Load {
                        concurrency: a.concurrency,
                        duplicates: 0,
                    },
                )
            },
        }
    }
}

/// When the process started, for the timestamps of progress lines.
static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

pub fn since_start() -> std::time::Duration {
    STARTED.get_or_init(Instant::now).elapsed()
}

fn main() -> ExitCode {
    since_start();
    // On a bad argument clap prints the error and the usage and exits with
    // 2; on --help it prints the help and exits with 0.
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            // sqlx flags the dedup-table fill of `prefilled` as a slow
            // statement: expected there, not worth a warning.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
        )
        .init();
    let cli = match cli.command {
        Command::ScaleWorker(args) => return scale::worker(args),
        Command::Sqlite(args) => {
            return database_main(OtherDatabase::Sqlite, args, cli.data_dir, cli.nats_sync);
        }
        Command::Mariadb(args) => {
            return database_main(OtherDatabase::Mariadb, args, cli.data_dir, cli.nats_sync);
        }
        command => Cli { command, ..cli },
    };
    let options = Options::from(cli);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = runtime.block_on(async {
        let need_postgres = options.job != Job::Mode(Mode::Raw);
        let servers = tokio::select! {
            servers = Servers::start(need_postgres, options.data_dir.as_deref(), &options.pg_settings, options.nats_sync) => servers?,
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
    exit_code(result)
}

/// The database of `idem-bench sqlite` or `idem-bench mariadb`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum OtherDatabase {
    Sqlite,
    Mariadb,
}

/// `idem-bench sqlite` and `idem-bench mariadb`: a nats-server of their
/// own (and a MariaDB server), no PostgreSQL.
fn database_main(
    database: OtherDatabase,
    args: databases::DatabaseArgs,
    data_dir: Option<PathBuf>,
    nats_sync: servers::NatsSync,
) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = runtime.block_on(async {
        let mut servers = Servers::start(false, data_dir.as_deref(), &[], nats_sync).await?;
        let bench = async {
            match database {
                OtherDatabase::Sqlite => databases::sqlite(args, &servers).await,
                OtherDatabase::Mariadb => {
                    servers.start_mariadb().await?;
                    databases::mariadb(args, &servers).await
                }
            }
        };
        let result = tokio::select! {
            result = bench => result,
            _ = interrupted() => Err(BenchError::Interrupted),
        };
        drop(servers);
        result
    });
    exit_code(result)
}

/// How the bench exits: 0, or the error's code after printing it.
fn exit_code(result: Result<(), BenchError>) -> ExitCode {
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
    let messages = options.messages;
    match options.job {
        Job::Mode(mode) => {
            let plan = plan(options, mode, "throughput", messages);
            let measured = run::run(&ctx, &plan).await?;
            println!("{}", report::json_line(&measured));
        }
        Job::Compare => {
            compare(&ctx, options, messages).await?;
        }
        Job::Chart => {
            chart(&ctx, options, messages, &options.out).await?;
        }
        Job::Latency => {
            latency(&ctx, options, messages, options.rate).await?;
        }
        Job::Contention => {
            contention(&ctx, options, messages).await?;
        }
        Job::Backlog => {
            backlog(&ctx, options, messages).await?;
        }
        Job::Prefilled => {
            prefilled(&ctx, options, messages, options.prefill).await?;
        }
        Job::Steady => {
            let base = Plan {
                id_from_header: !options.key_expression,
                ..plan(options, Mode::Idem, "steady", messages)
            };
            retention::steady(&ctx, &base, &steady_of(options)).await?;
        }
        Job::Purge => {
            let base = Plan {
                id_from_header: true,
                ..plan(options, Mode::Idem, "purge", messages)
            };
            let purge = retention::Purge {
                probe_dir: servers.dir(),
                ..purge_of(options)
            };
            retention::purge(&ctx, &base, &purge).await?;
        }
        Job::Storage => {
            let base = plan(options, Mode::Naive, "storage", 1);
            retention::storage(&ctx, &base, options.rows).await?;
        }
        Job::Fairness => {
            let base = plan(options, Mode::Idem, "fairness", messages);
            fairness::fairness(&ctx, &base, &fairness_of(options)).await?;
        }
        Job::Outbox => {
            let scenario = outbox::Scenario {
                messages,
                latency_messages: options.latency_messages,
                rate: options.rate,
                concurrency: options.concurrency,
                relay_batch: options.batch,
            };
            outbox::outbox(
                &ctx,
                &plan(options, Mode::Idem, "outbox", messages),
                &scenario,
            )
            .await?;
        }
        Job::Scale => {
            let args = options.scale.as_ref().expect("set with Job::Scale");
            scale::scale(&ctx, servers, args, options.data_dir.as_deref()).await?;
        }
        Job::Smoke => smoke(&ctx, servers, options).await?,
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
        retention: None,
        before_consume: None,
        time_in_tx: false,
        id_from_header: false,
        hot_rows: false,
        adaptive: options.adaptive,
        wait_for_consumer: false,
    }
}

fn steady_of(options: &Options) -> retention::Steady {
    retention::Steady {
        rows: options.rows,
        live: options.generations,
        messages: options.messages,
        latency_messages: options.latency_messages,
        rate: options.rate,
        rotate_after: options.rotate_after,
    }
}

fn fairness_of(options: &Options) -> fairness::Fairness {
    fairness::Fairness {
        messages: options.messages,
        rate: options.rate,
        pool: options.pool,
        concurrency: options.concurrency,
        hold: options.hold,
    }
}

fn purge_of(options: &Options) -> retention::Purge {
    retention::Purge {
        rows: options.rows,
        messages: options.messages,
        rate: options.rate,
        probe_dir: None,
        pieces: options.pieces,
    }
}

/// Runs `plan`, on a database of its own or on `db`, and prints its JSON
/// line.
async fn run_and_print(
    ctx: &Context,
    plan: Plan,
    db: Option<&Database>,
) -> Result<Measurement, BenchError> {
    let measured = match db {
        Some(db) => run::run_on(ctx, &plan, db).await?,
        None => run::run(ctx, &plan).await?,
    };
    let claim = match (measured.claim_p50_ms, measured.claim_p99_ms) {
        (Some(p50), Some(p99)) => format!(", claim p50 {p50:.2} ms, p99 {p99:.2} ms"),
        _ => String::new(),
    };
    eprintln!(
        "idem-bench: [{} {}] {:.0} msgs/s, p50 {:.1} ms, p99 {:.1} ms{claim}, effects {}",
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
        runs.push(run_and_print(ctx, plan(options, mode, "throughput", messages), None).await?);
    }
    // The table goes to stderr with the other human-readable lines: stdout
    // holds only JSON, one object per line.
    eprintln!();
    eprint!("{}", report::compare_table(&runs));
    eprintln!("{}", report::compare_targets(&runs));
    println!("{}", report::compare_summary(&runs));
    Ok(runs)
}

/// The batch sizes `chart` runs the batching modes at.
const CHART_BATCHES: [usize; 4] = [1, 16, 64, 256];

/// raw, naive and idem once each, as references, then idem-batch and
/// idem-batch-handler at each of [`CHART_BATCHES`] (idem-batch at B = 1 is
/// the batch path's cost per message); the table of msgs/s and ratios, and
/// the SVG chart at `out`.
async fn chart(
    ctx: &Context,
    options: &Options,
    messages: usize,
    out: &Path,
) -> Result<Vec<Measurement>, BenchError> {
    // Refuse a folder that is not there now rather than after the runs.
    let folder = out.parent().filter(|p| !p.as_os_str().is_empty());
    if folder.is_some_and(|folder| !folder.is_dir()) {
        return Err(BenchError::setup(format!(
            "cannot write the chart to {}: no such folder",
            out.display()
        )));
    }
    let mut runs = Vec::new();
    for mode in [
        Mode::Raw,
        Mode::Naive,
        Mode::Idem,
        Mode::IdemDefault,
        Mode::IdemDefaultBatchHandler,
    ] {
        runs.push(run_and_print(ctx, plan(options, mode, "throughput", messages), None).await?);
    }
    for batch in CHART_BATCHES {
        for mode in [Mode::IdemBatch, Mode::IdemBatchHandler] {
            let plan = Plan {
                batch,
                ..plan(options, mode, "throughput", messages)
            };
            runs.push(run_and_print(ctx, plan, None).await?);
        }
    }
    chart::write(out, &runs).map_err(|e| BenchError::failed(format!("the chart: {e}")))?;
    eprintln!();
    eprint!("{}", report::chart_table(&runs));
    eprintln!("idem-bench: chart written to {}", out.display());
    println!("{}", report::chart_summary(&runs, out));
    Ok(runs)
}

/// The contention scenario (see [`CONTENTION`]): idem and idem-default over
/// the same backlog, each message also updating one of the hot rows.
async fn contention(
    ctx: &Context,
    options: &Options,
    messages: usize,
) -> Result<Vec<Measurement>, BenchError> {
    let mut runs = Vec::new();
    for mode in [Mode::Idem, Mode::IdemDefault] {
        let plan = Plan {
            hot_rows: true,
            ..plan(options, mode, "contention", messages)
        };
        runs.push(run_and_print(ctx, plan, None).await?);
    }
    // And adaptive batching up to --batch, while it is not the default.
    let adaptive = Plan {
        hot_rows: true,
        adaptive: true,
        ..plan(options, Mode::IdemBatch, "contention", messages)
    };
    runs.push(run_and_print(ctx, adaptive, None).await?);
    eprintln!();
    eprint!("{}", report::compare_table(&runs));
    eprintln!("{}", report::contention_targets(&runs));
    println!("{}", report::contention_summary(&runs));
    Ok(runs)
}

async fn latency(
    ctx: &Context,
    options: &Options,
    messages: usize,
    rate: f64,
) -> Result<Vec<Measurement>, BenchError> {
    let mut runs = Vec::new();
    for mode in [Mode::Naive, Mode::Idem, Mode::IdemDefault] {
        let plan = Plan {
            rate: Some(rate),
            ..plan(options, mode, "latency", messages)
        };
        runs.push(run_and_print(ctx, plan, None).await?);
    }
    let p99 = |mode| runs.iter().find(|m| m.plan.mode == mode).map(|m| m.p99_ms);
    eprintln!(
        "{}",
        report::target(
            &format!("idem p99 <= 10 ms at {rate} msgs/s"),
            p99(Mode::Idem),
            " ms",
            |v| v <= 10.0
        )
    );
    // The default route batches only what has already arrived: at a steady
    // rate it must keep per-message latency.
    let default_over_per_message = p99(Mode::IdemDefault)
        .zip(p99(Mode::Idem))
        .map(|(default, per_message)| default / per_message);
    eprintln!(
        "{}",
        report::target(
            "idem-default p99 / idem (per message) p99 <= 1.2x",
            default_over_per_message,
            "x",
            |v| v <= 1.2
        )
    );
    Ok(runs)
}

async fn backlog(
    ctx: &Context,
    options: &Options,
    messages: usize,
) -> Result<Measurement, BenchError> {
    let measured = run_and_print(ctx, plan(options, Mode::Idem, "backlog", messages), None).await?;
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
            let measured = run_and_print(ctx, plan, None).await?;
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

/// Claims in smoke's retention scenarios.
const SMOKE_ROWS: u64 = 3_000;

/// Every mode and scenario with small numbers: checks that each run ends
/// with the right effects (every run does), not how fast it is.
///
/// A tenth of the messages is published a second time, with the same
/// `Nats-Msg-Id` after the stream's duplicate window, so that JetStream
/// stores both copies, as it does for a publisher retry after the window or
/// a replay. The dedup modes must apply each message once and count each
/// second copy as a duplicate; `naive` and `raw`, the control, must see
/// every copy, which proves the duplicates reach the consumer.
async fn smoke(ctx: &Context, servers: &Servers, options: &Options) -> Result<(), BenchError> {
    let started = Instant::now();
    let n = options.messages;
    let options = &Options {
        duplicates: Some(options.duplicates.unwrap_or((n / 10).max(1))),
        ..options.clone()
    };
    eprintln!(
        "idem-bench: smoke: {n} messages per run, some of them published twice; it checks \
         effects = distinct messages in the dedup modes (and a double effect per duplicate \
         in naive), while the target lines below mean little at this size"
    );
    let mut runs = compare(ctx, options, n).await?;
    runs.extend(latency(ctx, options, n.min(250), options.rate).await?);
    runs.extend(contention(ctx, options, n).await?);
    runs.push(backlog(ctx, options, n).await?);
    runs.extend(prefilled(ctx, options, n, 20_000).await?);
    // The retention scenarios, tiny: no duplicates (they check their own
    // end state), the rotation due at once.
    let retention_options = &Options {
        duplicates: Some(0),
        ..options.clone()
    };
    let base = Plan {
        id_from_header: true,
        ..plan(retention_options, Mode::Idem, "steady", n)
    };
    let steady = retention::Steady {
        rows: SMOKE_ROWS,
        live: 3,
        messages: n,
        latency_messages: n.min(250),
        rate: options.rate,
        rotate_after: Duration::ZERO,
    };
    runs.extend(retention::steady(ctx, &base, &steady).await?);
    let purge = retention::Purge {
        rows: SMOKE_ROWS,
        messages: n.min(250),
        rate: options.rate,
        probe_dir: servers.dir(),
        pieces: Some(4),
    };
    runs.push(retention::purge(ctx, &base, &purge).await?);
    // Two routes on a small pool: checks effects = inputs on both.
    let fair = fairness::Fairness {
        messages: n.min(250),
        rate: options.rate / 2.0,
        pool: 4,
        concurrency: 4,
        hold: Duration::from_millis(5),
    };
    fairness::fairness(
        ctx,
        &plan(retention_options, Mode::Idem, "fairness", n),
        &fair,
    )
    .await?;
    retention::storage(
        ctx,
        &plan(retention_options, Mode::Naive, "storage", 1),
        SMOKE_ROWS,
    )
    .await?;
    let scenario = outbox::Scenario {
        messages: n,
        latency_messages: n.min(250),
        rate: options.rate,
        concurrency: options.concurrency,
        relay_batch: DEFAULT_RELAY_BATCH,
    };
    let outbox_runs = outbox::outbox(
        ctx,
        &plan(retention_options, Mode::Idem, "outbox", n),
        &scenario,
    )
    .await?
    .runs
    .len()
        + 1;
    // The chart goes to a folder of its own, removed afterwards.
    let folder = tempfile::tempdir()
        .map_err(|e| BenchError::setup(format!("a folder for the chart: {e}")))?;
    runs.extend(chart(ctx, options, n, &folder.path().join("throughput.svg")).await?);
    // The scale scenario, tiny: two worker processes on the cluster and on
    // one server, per message and batched; it needs servers of its own.
    let scale = scale::ScaleArgs {
        messages: n.min(200),
        batch_messages: n,
        workers: vec![2],
        concurrency: options.concurrency,
        batch: options.batch,
    };
    let scale_runs = if servers.owned_pids().is_some() {
        scale::scale(ctx, servers, &scale, options.data_dir.as_deref()).await?
    } else {
        eprintln!("idem-bench: smoke: scale skipped: NATS_URL or DATABASE_URL is set");
        0
    };
    let wall = started.elapsed().as_secs_f64();
    let duplicates: usize = runs.iter().map(|m| m.plan.duplicates).sum();
    eprintln!(
        "idem-bench: smoke passed: {} runs with {duplicates} duplicates stored in all, each \
         with the expected effects, in {wall:.1} s",
        runs.len() + outbox_runs + scale_runs
    );
    println!(
        "{}",
        serde_json::json!({
            "mode": "smoke",
            "messages": n,
            "duplicates_per_run": options.duplicates,
            "concurrency": options.concurrency,
            "batch": options.batch,
            "runs_correct": runs.len() + outbox_runs + scale_runs,
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
    use clap::CommandFactory;

    use super::*;

    fn parse(line: &str) -> Result<Options, clap::Error> {
        let args = std::iter::once("idem-bench").chain(line.split_whitespace());
        Cli::try_parse_from(args).map(Options::from)
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_modes_and_flags() {
        let o = parse("idem --messages 1_000 --concurrency 4 --no-ping").unwrap();
        assert_eq!(o.job, Job::Mode(Mode::Idem));
        assert_eq!(o.messages, 1000);
        assert_eq!(o.duplicates, Some(0));
        assert_eq!(o.concurrency, 4);
        assert!(!o.ping);
        assert_eq!(parse("smoke --duplicates 7").unwrap().duplicates, Some(7));
        let o = parse("naive --pull slots").unwrap();
        assert_eq!(
            (o.job, o.pull, o.ping),
            (Job::Mode(Mode::Naive), Pull::Slots, true)
        );
        let o = parse("idem-batch --batch 128").unwrap();
        assert_eq!((o.job, o.batch), (Job::Mode(Mode::IdemBatch), 128));
        assert_eq!(parse("latency --rate 250").unwrap().rate, 250.0);
        assert_eq!(parse("prefilled --prefill 1_000").unwrap().prefill, 1000);
        assert_eq!(parse("compare").unwrap().job, Job::Compare);
        let o = parse("steady --rows 1_000 --generations 4 --latency-messages 7 --data-dir /d")
            .unwrap();
        assert_eq!(
            (o.job, o.rows, o.generations, o.latency_messages),
            (Job::Steady, 1000, 4, 7)
        );
        assert_eq!(o.data_dir, Some(PathBuf::from("/d")));
        let o = parse("--data-dir /d purge --rows 5 --rate 100").unwrap();
        assert_eq!((o.job, o.rows, o.rate), (Job::Purge, 5, 100.0));
        assert_eq!(o.data_dir, Some(PathBuf::from("/d")));
        assert_eq!(parse("storage --rows 9").unwrap().rows, 9);
        let o = parse("storage --pg-setting max_wal_size=1GB --pg-setting a.b=c").unwrap();
        assert_eq!(o.pg_settings, ["max_wal_size=1GB", "a.b=c"]);
        let o = parse("chart --out /tmp/t.svg --concurrency 4 --pull slots").unwrap();
        assert_eq!(
            (o.job, o.out, o.concurrency, o.pull),
            (Job::Chart, PathBuf::from("/tmp/t.svg"), 4, Pull::Slots)
        );
    }

    #[test]
    fn parses_scale() {
        use clap::error::ErrorKind;
        let o = parse("scale --workers 1,3 --batch 16 --messages 500").unwrap();
        let scale = o.scale.unwrap();
        assert_eq!(o.job, Job::Scale);
        assert_eq!(
            (scale.workers, scale.batch, scale.messages),
            (vec![1, 3], 16, 500)
        );
        let scale = parse("scale").unwrap().scale.unwrap();
        assert_eq!(
            (scale.workers, scale.messages, scale.batch_messages),
            (vec![1, 2, 4], 20_000, 100_000)
        );
        assert_eq!(
            parse("scale --workers 1,0").unwrap_err().kind(),
            ErrorKind::ValueValidation
        );
    }

    #[test]
    fn each_mode_has_its_defaults() {
        let messages = |line| parse(line).unwrap().messages;
        assert_eq!(messages("raw"), 20_000);
        assert_eq!(messages("compare"), 20_000);
        assert_eq!(messages("chart"), 20_000);
        assert_eq!(
            parse("chart").unwrap().out,
            PathBuf::from("bench/throughput.svg")
        );
        assert_eq!(messages("latency"), 5_000);
        assert_eq!(messages("backlog"), 200_000);
        assert_eq!(messages("prefilled"), 20_000);
        assert_eq!(messages("smoke"), 500);
        let smoke = parse("smoke").unwrap();
        assert_eq!(smoke.duplicates, None, "smoke's default is a tenth of N");
        assert_eq!((smoke.concurrency, smoke.batch), (8, 64));
        assert_eq!(
            (smoke.rate, smoke.ping, smoke.pull),
            (500.0, true, Pull::Prefetch)
        );
        assert_eq!(parse("prefilled").unwrap().prefill, 5_000_000);
        let steady = parse("steady").unwrap();
        assert_eq!(
            (steady.rows, steady.generations, steady.messages),
            (100_000_000, 3, 50_000)
        );
        assert_eq!(steady.rotate_after, Duration::from_secs(2));
        assert!(!steady.key_expression);
        assert!(parse("steady --key-expression").unwrap().key_expression);
        assert_eq!(parse("purge").unwrap().rows, 10_000_000);
        assert_eq!(parse("storage").unwrap().rows, 1_000_000);
        let o = parse("outbox").unwrap();
        assert_eq!(
            (o.job, o.messages, o.latency_messages, o.rate, o.batch),
            (Job::Outbox, 50_000, 10_000, 500.0, 1024)
        );
        assert_eq!(parse("smoke").unwrap().data_dir, None);
    }

    #[test]
    fn refuses_bad_arguments() {
        use clap::error::ErrorKind;
        let kind = |line| parse(line).unwrap_err().kind();
        assert_eq!(
            kind(""),
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        assert_eq!(kind("fast"), ErrorKind::InvalidSubcommand);
        assert_eq!(kind("idem --messages 0"), ErrorKind::ValueValidation);
        assert_eq!(kind("idem --messages many"), ErrorKind::ValueValidation);
        assert_eq!(kind("naive --pull sometimes"), ErrorKind::InvalidValue);
        assert_eq!(kind("idem --pg-setting fsync"), ErrorKind::ValueValidation);
        // An option the mode does not read is refused, not ignored.
        assert_eq!(kind("idem --batch 8"), ErrorKind::UnknownArgument);
        assert_eq!(kind("backlog --pull slots"), ErrorKind::UnknownArgument);
        assert_eq!(kind("raw --no-ping"), ErrorKind::UnknownArgument);
        // chart picks its batch sizes itself.
        assert_eq!(kind("chart --batch 8"), ErrorKind::UnknownArgument);
        assert_eq!(parse("--help").unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(
            parse("help smoke").unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
    }
}
