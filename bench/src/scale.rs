//! `idem-bench scale`: how throughput grows with worker processes, and
//! what replication costs.
//!
//! Each run publishes a backlog to a fresh stream, then starts W worker
//! processes (this binary's hidden `scale-worker` mode), each with its own
//! NATS connection (every node's URL) and PostgreSQL pool, all running the
//! bench's `idem` handler on one shared durable consumer, per message or
//! batched (`Route::batch(B)`). It times them from the signal to start to
//! the last first-ack, and checks the end state (effects = messages, one
//! claim each) so that a broken run reports no figure. It does this on a
//! 3-node JetStream cluster (stream and consumer at R3) and on one server
//! (R1), against the same PostgreSQL.
//!
//! Besides throughput, per message: the workers' CPU (summed over the
//! processes), the servers' CPU (the nats-server(s) of the run and
//! PostgreSQL with its children), and PostgreSQL's committed transactions
//! (`pg_stat_database.xact_commit` of the run's database).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use clap::Args;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use tempfile::TempDir;
use tokio::sync::mpsc;

use crate::BenchError;
use crate::consumers::{Consumer, ConsumerReport, Mode, Pull, Source};
use crate::probe::{self, AckObserver, CpuSample};
use crate::run::{self, Context, Database, Plan};
use crate::servers::{self, OwnedProcess, Servers};

pub const HELP: &str = "\
Each run publishes a backlog to a fresh stream, starts W worker processes
(each its own NATS connection with every node's URL, and its own PostgreSQL
pool of C connections) on one shared durable consumer, and times them from
the signal to start to the last ack; the end state is checked (effects =
messages, one claim each). Runs: per message (idem) and batched
(idem-batch: Route::batch(B), the same handler), each with every worker
count, on a 3-node JetStream cluster (stream and consumer R3) and on one
nats-server (R1), against the same PostgreSQL. Per message: client CPU (the
workers), server CPU (the run's nats-server(s), PostgreSQL) and PostgreSQL
transactions (pg_stat_database.xact_commit). Needs its own servers: NATS_URL
and DATABASE_URL must be unset.";

/// `idem-bench scale`'s options.
#[derive(Debug, Clone, Args)]
pub struct ScaleArgs {
    /// Messages of each per-message run, published, then consumed
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = crate::positive::<usize>)]
    pub messages: usize,
    /// Messages of each batch-mode run
    #[arg(long, value_name = "N", default_value_t = 100_000, value_parser = crate::positive::<usize>)]
    pub batch_messages: usize,
    /// Worker process counts, comma-separated; the first is the baseline
    #[arg(long, value_name = "W,..", default_value = "1,2,4", value_delimiter = ',',
          value_parser = crate::positive::<usize>)]
    pub workers: Vec<usize>,
    /// Messages in flight per worker (batch mode: batches)
    #[arg(long, value_name = "C", default_value_t = 8, value_parser = crate::positive::<usize>)]
    pub concurrency: usize,
    /// Messages per transaction in batch mode
    #[arg(long, value_name = "B", default_value_t = crate::DEFAULT_BATCH, value_parser = crate::positive::<usize>)]
    pub batch: usize,
}

/// `idem-bench scale-worker`'s options, set by `scale`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Every node's client URL, comma-separated
    #[arg(long)]
    nats: String,
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    stream: String,
    #[arg(long)]
    subject: String,
    #[arg(long)]
    concurrency: usize,
    /// Batch size; per message without it
    #[arg(long)]
    batch: Option<usize>,
}

/// The `application_name` prefix of the workers' connections: how the
/// bench finds their backends in `pg_stat_activity`.
const WORKER_APPLICATION: &str = "idem-bench-scale-worker";

/// How long a worker gets to connect, or to stop and report.
const WORKER_TIMEOUT: Duration = Duration::from_secs(60);

/// Nodes of the cluster.
const CLUSTER_SIZE: usize = 3;

/// One measured run.
#[derive(Debug, Clone)]
struct ScaleRun {
    system: &'static str,
    /// `None`: per message.
    batch: Option<usize>,
    workers: usize,
    messages: usize,
    msgs_per_sec: f64,
    /// CPU µs per message: the workers, the run's nats-server(s), and
    /// PostgreSQL with its children.
    client_us: f64,
    nats_us: f64,
    postgres_us: f64,
    transactions: u64,
}

impl ScaleRun {
    fn mode(&self) -> String {
        match self.batch {
            None => "per message".into(),
            Some(b) => format!("batch {b}"),
        }
    }

    fn servers_us(&self) -> f64 {
        self.nats_us + self.postgres_us
    }

    fn cpu_us(&self) -> f64 {
        self.client_us + self.servers_us()
    }

    /// Messages per second that one core of client and server CPU carries.
    fn per_core(&self) -> f64 {
        1e6 / self.cpu_us()
    }

    /// Cores the run kept busy: CPU per message times messages per second.
    fn cores_busy(&self) -> f64 {
        self.cpu_us() * self.msgs_per_sec / 1e6
    }

    fn transactions_per_msg(&self) -> f64 {
        self.transactions as f64 / self.messages as f64
    }
}

/// A NATS system to run against: the cluster or the single server.
struct System {
    name: &'static str,
    replicas: usize,
    urls: Vec<String>,
    js: jetstream::Context,
    observer: async_nats::Client,
    /// The nats-server(s), and PostgreSQL's postmaster, for their CPU time.
    nats_pids: Vec<u32>,
    postgres_pid: u32,
}

impl System {
    async fn connect(
        name: &'static str,
        replicas: usize,
        urls: Vec<String>,
        (nats_pids, postgres_pid): (Vec<u32>, u32),
    ) -> Result<System, BenchError> {
        let publisher = connect(&urls, "scale publisher").await?;
        let observer = connect(&urls, "scale ack observer").await?;
        let system = System {
            name,
            replicas,
            urls,
            js: jetstream::new(publisher),
            observer,
            nats_pids,
            postgres_pid,
        };
        system.create_idem_streams().await?;
        Ok(system)
    }

    /// idem's dead-letter and advisory streams at the system's replica
    /// count, before any worker starts: otherwise each worker's router
    /// would race to create them, with one replica (see the guide's
    /// "Running at scale" chapter).
    async fn create_idem_streams(&self) -> Result<(), BenchError> {
        for config in [
            stream::Config {
                name: idem_runtime::dead_letter::DEFAULT_STREAM.to_owned(),
                subjects: vec![idem_runtime::dead_letter::DEFAULT_SUBJECTS.to_owned()],
                ..Default::default()
            },
            stream::Config {
                name: idem_runtime::dead_letter::ADVISORY_STREAM.to_owned(),
                subjects: vec!["$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>".to_owned()],
                retention: stream::RetentionPolicy::WorkQueue,
                max_age: Duration::from_secs(7 * 24 * 3600),
                ..Default::default()
            },
        ] {
            let name = config.name.clone();
            // An existing one (an earlier scenario's, in smoke) is used as it
            // is, as the runtime does.
            self.js
                .get_or_create_stream(stream::Config {
                    num_replicas: self.replicas,
                    ..config
                })
                .await
                .map_err(|e| BenchError::setup(format!("create {name} on {}: {e}", self.name)))?;
        }
        Ok(())
    }
}

async fn connect(urls: &[String], name: &str) -> Result<async_nats::Client, BenchError> {
    async_nats::ConnectOptions::new()
        .name(format!("idem-bench {name}"))
        .connect(urls)
        .await
        .map_err(|e| BenchError::setup(format!("cannot connect to NATS at {urls:?}: {e}")))
}

/// Runs every combination of mode, worker count and system, then prints
/// the table and the planning model; returns the number of runs.
pub async fn scale(
    ctx: &Context,
    servers: &Servers,
    args: &ScaleArgs,
    data_dir: Option<&Path>,
) -> Result<usize, BenchError> {
    let (Some(pids), Some(admin_url)) = (servers.owned_pids(), ctx.database_url.as_deref()) else {
        return Err(BenchError::setup(
            "scale measures its servers' CPU and starts its own cluster: unset NATS_URL and \
             DATABASE_URL",
        ));
    };
    let (single_nats, postgres) = (pids[0], pids[1]);
    let load_before = load_average();
    eprintln!("idem-bench: scale: load average before: {load_before}");
    let cluster = Cluster::start(data_dir).await?;
    let systems = [
        System::connect(
            "one server, R1",
            1,
            vec![servers.nats_url.clone()],
            (vec![single_nats], postgres),
        )
        .await?,
        System::connect(
            "3-node cluster, R3",
            CLUSTER_SIZE,
            cluster.urls.clone(),
            (cluster.pids(), postgres),
        )
        .await?,
    ];
    let mut runs = Vec::new();
    for batch in [None, Some(args.batch)] {
        let messages = match batch {
            None => args.messages,
            Some(_) => args.batch_messages,
        };
        for &workers in &args.workers {
            for system in &systems {
                let measured =
                    run_once(ctx, admin_url, system, batch, workers, messages, args).await?;
                eprintln!(
                    "idem-bench: [scale {} {} W={workers}] {:.0} msgs/s, client {:.0} µs, NATS \
                     {:.0} µs, PostgreSQL {:.0} µs, {:.3} PostgreSQL transactions per message",
                    system.name,
                    measured.mode(),
                    measured.msgs_per_sec,
                    measured.client_us,
                    measured.nats_us,
                    measured.postgres_us,
                    measured.transactions_per_msg()
                );
                println!("{}", json_line(&measured));
                runs.push(measured);
            }
        }
    }
    drop(systems);
    drop(cluster);
    let load_after = load_average();
    eprintln!();
    eprintln!("load average before: {load_before}; after: {load_after}");
    eprint!("{}", table(&runs));
    eprint!("{}", model(&runs));
    println!(
        "{}",
        serde_json::json!({
            "mode": "scale",
            "runs": runs.len(),
            "load_before": load_before,
            "load_after": load_after,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        })
    );
    Ok(runs.len())
}

/// One run: a fresh stream and database, the backlog, `workers` worker
/// processes, the figures, the end-state check.
async fn run_once(
    ctx: &Context,
    admin_url: &str,
    system: &System,
    batch: Option<usize>,
    workers: usize,
    messages: usize,
    args: &ScaleArgs,
) -> Result<ScaleRun, BenchError> {
    let tag = ctx.next_tag();
    let stream_name = format!("BENCH_SCALE_{tag}");
    let subject = format!("bench.scale.{tag}");
    system
        .js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::File,
            num_replicas: system.replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| BenchError::failed(format!("create stream {stream_name}: {e}")))?;
    let plan = Plan {
        mode: if batch.is_some() {
            Mode::IdemBatch
        } else {
            Mode::Idem
        },
        scenario: "scale",
        messages,
        // The bench's own pool: one connection, idle during the run.
        concurrency: 1,
        batch: batch.unwrap_or(1),
        rate: None,
        prefill: 0,
        duplicates: 0,
        ping: true,
        pull: Pull::Prefetch,
        retention: None,
        before_consume: None,
        time_in_tx: false,
        id_from_header: false,
        hot_rows: false,
        adaptive: false,
        wait_for_consumer: false,
    };
    let outcome = match Database::create(ctx, &tag, &plan).await {
        Ok(db) => {
            let outcome = measure(
                admin_url,
                system,
                &plan,
                &db,
                (&stream_name, &subject),
                workers,
                args.concurrency,
                batch,
            )
            .await;
            db.drop().await;
            outcome
        }
        Err(e) => Err(e),
    };
    if let Err(e) = system.js.delete_stream(&stream_name).await {
        tracing::warn!(%e, stream = stream_name, "cannot delete the bench stream");
    }
    remove_advisory_watchers(&system.js).await;
    outcome
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    admin_url: &str,
    system: &System,
    plan: &Plan,
    db: &Database,
    (stream, subject): (&str, &str),
    workers: usize,
    concurrency: usize,
    batch: Option<usize>,
) -> Result<ScaleRun, BenchError> {
    let n = plan.messages;
    let label = format!(
        "[scale {} {} W={workers}]",
        system.name,
        match batch {
            None => "per message".into(),
            Some(b) => format!("batch {b}"),
        }
    );
    let say = |what: &str| {
        eprintln!(
            "idem-bench: {:>7.2}s {label} {what}",
            crate::since_start().as_secs_f64()
        )
    };
    say(&format!("publishing a backlog of {n} messages"));
    let keys = run::message_keys(n);
    probe::publish(&system.js, subject, &keys, None, false).await?;

    let mut admin = PgConnection::connect(admin_url)
        .await
        .map_err(|e| BenchError::setup(format!("cannot connect to {admin_url}: {e}")))?;
    // The bench's own connection flushes its set-up's statistics now, so
    // that they do not land in the run's count.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&db.pool)
        .await
        .map_err(|e| BenchError::setup(format!("flush statistics: {e}")))?;

    let mut command = vec![
        "scale-worker".to_owned(),
        format!("--nats={}", system.urls.join(",")),
        format!("--database-url={}", db.url()),
        format!("--stream={stream}"),
        format!("--subject={subject}"),
        format!("--concurrency={concurrency}"),
    ];
    if let Some(b) = batch {
        command.push(format!("--batch={b}"));
    }
    let mut processes = Vec::with_capacity(workers);
    for _ in 0..workers {
        processes.push(WorkerProcess::spawn(&command)?);
    }
    for process in &mut processes {
        let line = process.next_line("ready").await?;
        if line != "ready" {
            return Err(BenchError::failed(format!(
                "worker {} said {line:?} instead of ready",
                process.pid()
            )));
        }
    }
    let worker_pids: Vec<u32> = processes.iter().map(WorkerProcess::pid).collect();
    say(&format!("{workers} workers ready; consuming"));
    let observer = AckObserver::start(&system.observer, stream, n).await?;
    let transactions_before = transactions(&mut admin, db.name()).await?;
    let postgres_pids = [system.postgres_pid];
    let nats_before = CpuSample::now(Some(&system.nats_pids));
    let postgres_before = CpuSample::now(Some(&postgres_pids));
    let workers_before = CpuSample::now(Some(&worker_pids));
    let started = Instant::now();
    for process in &mut processes {
        process.send("go")?;
    }
    let waited = observer
        .wait_for(
            n,
            || processes.iter_mut().find_map(WorkerProcess::exit_reason),
            || format!("{workers} worker processes"),
        )
        .await;
    let cpu_since =
        |pids: &[u32], before| CpuSample::now(Some(pids)).since(before).1.unwrap_or(0.0);
    let nats_cpu = cpu_since(&system.nats_pids, nats_before);
    let postgres_cpu = cpu_since(&postgres_pids, postgres_before);
    let workers_cpu = cpu_since(&worker_pids, workers_before);
    let acks = observer.finish().await?;
    waited?;

    // Stop every worker and add up what they report.
    let mut report = ConsumerReport::default();
    for process in &mut processes {
        process.send("stop")?;
    }
    for process in &mut processes {
        let line = process.next_line("its report").await?;
        let counts: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            BenchError::failed(format!("worker {} reported {line:?}: {e}", process.pid()))
        })?;
        let count = |name: &str| {
            counts[name].as_u64().ok_or_else(|| {
                BenchError::failed(format!(
                    "worker {} reported no {name}: {line:?}",
                    process.pid()
                ))
            })
        };
        report.processed += count("processed")?;
        report.duplicates += count("duplicates")?;
        report.errors += count("errors")?;
        process.wait_success().await?;
    }
    let transactions_after = settled_transactions(&mut admin, db.name()).await?;
    let _ = admin.close().await;
    let effects = run::verify(plan, Some(db), &report).await?;
    say(&format!(
        "{effects} effects, one per message; {} workers stopped",
        processes.len()
    ));

    let last_ack = acks.last().unwrap_or_else(Instant::now);
    let elapsed = last_ack.saturating_duration_since(started);
    Ok(ScaleRun {
        system: system.name,
        batch,
        workers,
        messages: n,
        msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
        client_us: workers_cpu * 1e6 / n as f64,
        nats_us: nats_cpu * 1e6 / n as f64,
        postgres_us: postgres_cpu * 1e6 / n as f64,
        transactions: transactions_after.saturating_sub(transactions_before),
    })
}

/// Committed transactions of `database` so far.
async fn transactions(admin: &mut PgConnection, database: &str) -> Result<u64, BenchError> {
    let count: i64 =
        sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
            .bind(database)
            .fetch_one(&mut *admin)
            .await
            .map_err(|e| BenchError::failed(format!("read pg_stat_database: {e}")))?;
    Ok(count.max(0) as u64)
}

/// Committed transactions of `database` once the workers' backends have
/// exited: a backend reports its last counts as it exits, just after it
/// leaves `pg_stat_activity`, so the count is read until it holds still.
async fn settled_transactions(admin: &mut PgConnection, database: &str) -> Result<u64, BenchError> {
    let deadline = Instant::now() + WORKER_TIMEOUT;
    loop {
        let backends: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE $2",
        )
        .bind(database)
        .bind(format!("{WORKER_APPLICATION}%"))
        .fetch_one(&mut *admin)
        .await
        .map_err(|e| BenchError::failed(format!("read pg_stat_activity: {e}")))?;
        if backends == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(BenchError::failed(format!(
                "{backends} worker backends still connected {WORKER_TIMEOUT:?} after the \
                 workers exited"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut last = transactions(admin, database).await?;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = transactions(admin, database).await?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// Deletes the routes' advisory watchers (a durable consumer per route on
/// `IDEM_ADVISORIES`), so that the idle consumers of earlier runs, R3 on
/// the cluster, do not add to later runs' server CPU.
async fn remove_advisory_watchers(js: &jetstream::Context) {
    use futures_util::StreamExt;
    let Ok(stream) = js
        .get_stream(idem_runtime::dead_letter::ADVISORY_STREAM)
        .await
    else {
        return;
    };
    let names: Vec<String> = stream
        .consumer_names()
        .filter_map(|name| async move { name.ok() })
        .collect()
        .await;
    for name in names {
        if let Err(e) = stream.delete_consumer(&name).await {
            tracing::warn!(%e, consumer = name, "cannot delete an advisory watcher");
        }
    }
}

/// A worker process and the lines it prints.
struct WorkerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl WorkerProcess {
    /// Starts this binary with `args`, in a process group of its own (a
    /// Ctrl-C reaches only the bench, which then kills the workers).
    fn spawn(args: &[String]) -> Result<WorkerProcess, BenchError> {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe()
            .map_err(|e| BenchError::setup(format!("cannot find the bench's binary: {e}")))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .map_err(|e| BenchError::setup(format!("cannot start a worker: {e}")))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (sender, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(WorkerProcess {
            child,
            stdin,
            lines,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn send(&mut self, command: &str) -> Result<(), BenchError> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| BenchError::failed(format!("worker {}: {e}", self.pid())))
    }

    /// The worker's next line on stdout: `what` it should say.
    async fn next_line(&mut self, what: &str) -> Result<String, BenchError> {
        match tokio::time::timeout(WORKER_TIMEOUT, self.lines.recv()).await {
            Ok(Some(line)) => Ok(line),
            Ok(None) => Err(BenchError::failed(format!(
                "worker {} exited before it said {what} ({})",
                self.pid(),
                self.exit_reason().unwrap_or_default()
            ))),
            Err(_) => Err(BenchError::failed(format!(
                "worker {} did not say {what} within {WORKER_TIMEOUT:?}",
                self.pid()
            ))),
        }
    }

    /// Why the worker is gone, if it is.
    fn exit_reason(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        Some(format!("worker {} exited: {status}", self.child.id()))
    }

    async fn wait_success(&mut self) -> Result<(), BenchError> {
        let deadline = Instant::now() + WORKER_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().ok().flatten() {
                return match status.success() {
                    true => Ok(()),
                    false => Err(BenchError::failed(format!(
                        "worker {} exited with {status}",
                        self.pid()
                    ))),
                };
            }
            if Instant::now() > deadline {
                return Err(BenchError::failed(format!(
                    "worker {} did not exit within {WORKER_TIMEOUT:?} of its report",
                    self.pid()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for WorkerProcess {
    /// A worker still running here belongs to a failed or interrupted run.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The `scale-worker` process: connects, says `ready`, starts its router
/// on `go`, stops it on `stop` (or when its stdin closes: the bench is
/// gone), prints its counts as JSON and exits.
pub fn worker(args: WorkerArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run_worker(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem-bench scale-worker {}: {e}", std::process::id());
            ExitCode::FAILURE
        }
    }
}

async fn run_worker(args: WorkerArgs) -> Result<(), BenchError> {
    let urls: Vec<String> = args.nats.split(',').map(str::to_owned).collect();
    let nats = connect(&urls, &format!("scale worker {}", std::process::id())).await?;
    let options: PgConnectOptions = args
        .database_url
        .parse()
        .map_err(|e| BenchError::setup(format!("bad --database-url: {e}")))?;
    let options = options.application_name(&format!("{WORKER_APPLICATION}-{}", std::process::id()));
    let connections = args.concurrency as u32;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .acquire_timeout(WORKER_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| BenchError::setup(format!("cannot connect to PostgreSQL: {e}")))?;
    // Every connection open, and the statistics of its start-up flushed, so
    // that the run counts only the transactions of its work.
    let mut held = Vec::new();
    for _ in 0..connections {
        let mut conn = pool
            .acquire()
            .await
            .map_err(|e| BenchError::setup(format!("open the pool: {e}")))?;
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&mut *conn)
            .await
            .map_err(|e| BenchError::setup(format!("flush statistics: {e}")))?;
        held.push(conn);
    }
    drop(held);

    let mut commands = stdin_lines();
    say("ready");
    match commands.recv().await.as_deref() {
        Some("go") => {}
        other => {
            return Err(BenchError::setup(format!(
                "expected go on stdin, got {other:?}"
            )));
        }
    }
    let plan = Plan {
        mode: if args.batch.is_some() {
            Mode::IdemBatch
        } else {
            Mode::Idem
        },
        scenario: "scale",
        messages: 0,
        concurrency: args.concurrency,
        batch: args.batch.unwrap_or(1),
        rate: None,
        prefill: 0,
        duplicates: 0,
        ping: true,
        pull: Pull::Prefetch,
        retention: None,
        before_consume: None,
        time_in_tx: false,
        id_from_header: false,
        hot_rows: false,
        adaptive: false,
        wait_for_consumer: false,
    };
    let source = Source {
        stream: &args.stream,
        subject: &args.subject,
    };
    let consumer = Consumer::start(&plan, &nats, Some(&pool), source).await?;
    // Until `stop` or EOF; a router that ends by itself failed, and stop()
    // returns its error.
    loop {
        tokio::select! {
            _ = commands.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if consumer.ended() {
                    break;
                }
            }
        }
    }
    let report = consumer.stop().await?;
    // Closed connections end their backends, which report their last
    // statistics as they exit.
    pool.close().await;
    say(&serde_json::json!({
        "processed": report.processed,
        "duplicates": report.duplicates,
        "errors": report.errors,
    })
    .to_string());
    Ok(())
}

/// The lines of stdin, read on a thread of their own; the channel closes
/// at EOF.
fn stdin_lines() -> mpsc::UnboundedReceiver<String> {
    let (sender, receiver) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if sender.send(line.trim().to_owned()).is_err() {
                break;
            }
        }
    });
    receiver
}

/// One line to the bench, on stdout.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A 3-node JetStream cluster of the bench's own, as the single server:
/// on disk under `--data-dir` or TMPDIR, `sync_interval: always`.
struct Cluster {
    nodes: Vec<OwnedProcess>,
    urls: Vec<String>,
    // Dropped last: the processes stop before their files are removed.
    _dir: TempDir,
}

impl Cluster {
    async fn start(data_dir: Option<&Path>) -> Result<Cluster, BenchError> {
        let parent = data_dir.map_or_else(std::env::temp_dir, Path::to_owned);
        let dir = tempfile::Builder::new()
            .prefix("idem-bench-cluster-")
            .tempdir_in(&parent)
            .map_err(|e| {
                BenchError::setup(format!(
                    "cannot create a temp dir in {}: {e}",
                    parent.display()
                ))
            })?;
        let route_ports: Vec<u16> = (0..CLUSTER_SIZE)
            .map(|_| servers::free_port())
            .collect::<Result<_, _>>()?;
        let routes = route_ports
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut cluster = Cluster {
            nodes: Vec::new(),
            urls: Vec::new(),
            _dir: dir,
        };
        for (i, port) in route_ports.iter().enumerate() {
            let extra = format!(
                "server_name: n{i}\ncluster {{\n  name: idem_bench_{}\n  listen: \
                 \"127.0.0.1:{port}\"\n  routes: [{routes}]\n}}\n",
                std::process::id()
            );
            let node_dir = cluster._dir.path().join(format!("n{i}"));
            let (process, client_port) = servers::start_nats(&node_dir, &extra).await?;
            cluster.nodes.push(process);
            cluster.urls.push(format!("nats://127.0.0.1:{client_port}"));
        }
        // A start takes about 10 s here: before it takes a stream, the
        // cluster elects JetStream's meta leader (NATS draws the election
        // timeout between 4 and 9 s).
        cluster.wait_until_ready().await?;
        eprintln!(
            "idem-bench: scale: 3-node cluster on {} (JetStream file store, sync_interval: \
             always, in {} on {})",
            cluster.urls.join(", "),
            cluster._dir.path().display(),
            servers::file_system_of(cluster._dir.path())
        );
        Ok(cluster)
    }

    /// Waits until an R3 stream can be created: a meta leader is elected
    /// and every node has joined.
    async fn wait_until_ready(&self) -> Result<(), BenchError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let name = format!("BENCH_CLUSTER_PROBE_{}", std::process::id());
        let js = jetstream::new(connect(&self.urls, "scale cluster probe").await?);
        loop {
            let created = js
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![format!("{name}.>")],
                    num_replicas: CLUSTER_SIZE,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(_) => {
                    return js.delete_stream(&name).await.map(drop).map_err(|e| {
                        BenchError::setup(format!("delete the probe stream {name}: {e}"))
                    });
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(BenchError::setup(format!(
                        "the cluster did not take an R{CLUSTER_SIZE} stream within a minute: {e}"
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    fn pids(&self) -> Vec<u32> {
        self.nodes.iter().map(OwnedProcess::pid).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in self.nodes.drain(..) {
            node.stop();
        }
    }
}

/// /proc/loadavg's three averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".into())
}

fn json_line(run: &ScaleRun) -> String {
    serde_json::json!({
        "mode": "scale",
        "system": run.system,
        "batch": run.batch,
        "workers": run.workers,
        "messages": run.messages,
        "msgs_per_sec": run.msgs_per_sec.round(),
        "client_cpu_us_per_msg": (run.client_us * 10.0).round() / 10.0,
        "nats_cpu_us_per_msg": (run.nats_us * 10.0).round() / 10.0,
        "postgres_cpu_us_per_msg": (run.postgres_us * 10.0).round() / 10.0,
        "msgs_per_sec_per_core": run.per_core().round(),
        "cores_busy": (run.cores_busy() * 100.0).round() / 100.0,
        "pg_transactions": run.transactions,
        "pg_transactions_per_msg": (run.transactions_per_msg() * 1000.0).round() / 1000.0,
    })
    .to_string()
}

/// The run a row is compared with: the same mode, on one server, with the
/// first worker count.
fn baseline<'a>(runs: &'a [ScaleRun], run: &ScaleRun) -> Option<&'a ScaleRun> {
    runs.iter()
        .find(|r| r.batch == run.batch && r.replicas_of_one())
}

impl ScaleRun {
    fn replicas_of_one(&self) -> bool {
        self.system.starts_with("one server")
    }
}

/// The markdown table of every run.
fn table(runs: &[ScaleRun]) -> String {
    let mut out = String::from(
        "| NATS | mode | workers | msgs/s | × base | client µs | NATS µs | PostgreSQL µs | \
         cores busy | msgs/s per core | PG tx per msg |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for run in runs {
        let ratio = baseline(runs, run).map_or(f64::NAN, |b| run.msgs_per_sec / b.msgs_per_sec);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {ratio:.2} | {:.0} | {:.0} | {:.0} | {:.2} | {} | {:.3} |\n",
            run.system,
            run.mode(),
            run.workers,
            thousands(run.msgs_per_sec),
            run.client_us,
            run.nats_us,
            run.postgres_us,
            run.cores_busy(),
            thousands(run.per_core()),
            run.transactions_per_msg(),
        ));
    }
    out.push_str(
        "(× base: against the same mode on one server with the first worker count; CPU per \
         message; cores busy = CPU per message × msgs/s)\n",
    );
    out
}

/// The planning model: per system and mode, messages per second per core
/// of client and server CPU, and messages per PostgreSQL transaction,
/// taken over the runs' worker counts.
fn model(runs: &[ScaleRun]) -> String {
    let mut out = String::from("\nPlanning model (over the worker counts: mean, min–max):\n");
    let mut groups: Vec<(&str, Option<usize>)> = Vec::new();
    for run in runs {
        if !groups.contains(&(run.system, run.batch)) {
            groups.push((run.system, run.batch));
        }
    }
    for (system, batch) in groups {
        let group: Vec<&ScaleRun> = runs
            .iter()
            .filter(|r| r.system == system && r.batch == batch)
            .collect();
        let stat = |f: fn(&ScaleRun) -> f64| {
            let values: Vec<f64> = group.iter().map(|r| f(r)).collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (mean, min, max)
        };
        let (core, core_min, core_max) = stat(ScaleRun::per_core);
        let (client, _, _) = stat(|r| r.client_us);
        let (nats, _, _) = stat(|r| r.nats_us);
        let (postgres, _, _) = stat(|r| r.postgres_us);
        let (tx, _, _) = stat(ScaleRun::transactions_per_msg);
        out.push_str(&format!(
            "- {system}, {}: {} msgs/s per core ({}–{}): {client:.0} µs client + {nats:.0} µs \
             NATS + {postgres:.0} µs PostgreSQL per message; {:.1} messages per PostgreSQL \
             transaction\n",
            group[0].mode(),
            thousands(core),
            thousands(core_min),
            thousands(core_max),
            1.0 / tx,
        ));
    }
    out
}

/// `12345.6` as `12,346`.
fn thousands(value: f64) -> String {
    if !value.is_finite() {
        return "?".into();
    }
    let digits = format!("{:.0}", value.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if value < 0.0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(system: &'static str, batch: Option<usize>, workers: usize, rate: f64) -> ScaleRun {
        ScaleRun {
            system,
            batch,
            workers,
            messages: 1000,
            msgs_per_sec: rate,
            client_us: 100.0,
            nats_us: 50.0,
            postgres_us: 100.0,
            transactions: 1010,
        }
    }

    #[test]
    fn figures_follow_from_the_measurements() {
        let r = run("one server, R1", None, 1, 4000.0);
        assert_eq!(r.per_core(), 4000.0);
        assert_eq!(r.cores_busy(), 1.0);
        assert_eq!(r.transactions_per_msg(), 1.01);
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
    }

    #[test]
    fn ratios_are_against_the_same_mode_on_one_server() {
        let runs = [
            run("one server, R1", None, 1, 4000.0),
            run("3-node cluster, R3", None, 1, 2000.0),
            run("one server, R1", Some(64), 1, 40000.0),
            run("3-node cluster, R3", Some(64), 2, 10000.0),
        ];
        assert_eq!(baseline(&runs, &runs[1]).unwrap().msgs_per_sec, 4000.0);
        assert_eq!(baseline(&runs, &runs[3]).unwrap().msgs_per_sec, 40000.0);
        let table = table(&runs);
        assert!(table.contains("| 3-node cluster, R3 | per message | 1 | 2,000 | 0.50 |"));
        assert!(table.contains("| 3-node cluster, R3 | batch 64 | 2 | 10,000 | 0.25 |"));
        assert!(model(&runs).contains("one server, R1, per message: 4,000 msgs/s per core"));
    }
}
