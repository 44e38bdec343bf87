//! `idem-bench outbox`: the transactional outbox's relay against raw
//! JetStream publishes, and the latency from a handler's COMMIT to its
//! outbox message stored in JetStream, against a hand-written handler that
//! publishes after its COMMIT.
//!
//! - **Throughput.** N rows are queued in `idem_outbox` (multi-row inserts,
//!   untimed), then one [`Relay`] drains them as its fresh lane does
//!   ([`Relay::drain`]): cycles of SELECT .. FOR UPDATE SKIP LOCKED, publish
//!   all, await the PubAcks, DELETE and COMMIT, each next cycle taken on a
//!   second connection while the one before awaits its PubAcks. The
//!   baseline, `raw`, publishes the same N payloads with a `Nats-Msg-Id`
//!   each, pipelined in windows of the relay's batch size (send the window,
//!   then await its PubAcks), on the same connection and servers.
//! - **Latency.** Messages are offered at `--rate` to an input stream. The
//!   `outbox` handler (`#[idempotent]`, run by the `Router`, with a `Relay`
//!   running beside it) inserts a row and queues one outbox message; the
//!   `after-commit` handler (hand-written: BEGIN, INSERT, COMMIT, then
//!   publish and await the PubAck, then ack) publishes the same message
//!   itself. Each output message carries the wall-clock time taken at the
//!   end of the handler's work, right before its COMMIT is sent (the
//!   runtime's checked COMMIT for `outbox`, the handler's own for
//!   `after-commit`). A JetStream consumer on the output stream notes when
//!   each message reaches it: JetStream delivers a message only once it is
//!   stored, which is when it sends the PubAck. So the figure is
//!   COMMIT sent → message stored and delivered, for both modes alike: it
//!   includes the COMMIT itself and one delivery hop, a little more than
//!   COMMIT → PubAck.
//! - **Backlog throughput** of both pipelines: the same handlers over a
//!   queued backlog, input consumed to every output message stored.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use idem_runtime::outbox::{Outbox, OutboxError, Relay};
use idem_runtime::{Route, Router, State, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::watch;

use crate::BenchError;
use crate::consumers::Payload;
use crate::run::{Context, Database, Plan, percentile_ms};

/// The scenario's sizes.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Rows the relay drains (and raw publishes).
    pub messages: usize,
    /// Messages of each latency run.
    pub latency_messages: usize,
    /// Offered load of the latency runs, messages per second.
    pub rate: f64,
    /// Messages in flight in the handlers.
    pub concurrency: usize,
    /// The relay's batch size, and raw's publish window.
    pub relay_batch: usize,
}

/// The handler modes of the latency and backlog runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Emit {
    /// `#[idempotent]` + `Outbox` + the router's `Relay`, woken in process
    /// after each COMMIT that queued rows (no NOTIFY trigger, the default).
    Outbox,
    /// The same with the opt-in NOTIFY trigger enabled again: what it costs
    /// the handlers' commits.
    OutboxNotify,
    /// Hand-written: BEGIN, INSERT, COMMIT, publish, await the PubAck, ack.
    AfterCommit,
}

impl Emit {
    fn name(self) -> &'static str {
        match self {
            Emit::Outbox => "outbox",
            Emit::OutboxNotify => "outbox-notify",
            Emit::AfterCommit => "after-commit",
        }
    }
}

/// What each output message carries.
#[derive(Debug, Serialize, Deserialize)]
struct Emitted {
    key: String,
    /// Wall clock, µs since the epoch, right before the COMMIT is sent.
    before_commit_us: i64,
}

/// One handler run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Emitting {
    mode: &'static str,
    /// `latency` (offered at a rate) or `backlog`.
    run: &'static str,
    messages: usize,
    msgs_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// The whole scenario's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The mean of raw's runs before and after the relay's.
    pub raw_msgs_per_sec: f64,
    pub raw_before_msgs_per_sec: f64,
    pub raw_after_msgs_per_sec: f64,
    pub relay_msgs_per_sec: f64,
    pub relay_vs_raw: f64,
    /// Where the CPU went in raw's runs and the relay's drain.
    pub drain_profile: Vec<Phase>,
    /// The drain's statements, from `pg_stat_statements` when the bench's
    /// PostgreSQL preloads it (`--pg-setting
    /// shared_preload_libraries=pg_stat_statements`).
    pub drain_statements: Vec<Statement>,
    pub runs: Vec<Emitting>,
}

/// One timed phase of the relay-against-raw run, and the CPU it used.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    name: &'static str,
    messages: usize,
    seconds: f64,
    msgs_per_sec: f64,
    /// CPU of the bench's process (the NATS client, the relay), per message.
    bench_cpu_us_per_msg: f64,
    /// CPU of nats-server and PostgreSQL (every backend), per message, when
    /// the bench runs them.
    servers_cpu_us_per_msg: Option<f64>,
    /// The machine's idle share of its CPUs during the phase (other people's
    /// work included): near 0, the phase was bound by CPU.
    machine_idle: f64,
}

/// One statement's figures from `pg_stat_statements`.
#[derive(Debug, Clone, Serialize)]
pub struct Statement {
    query: String,
    calls: i64,
    rows: i64,
    mean_ms: f64,
    total_ms: f64,
}

/// The machine's CPU ticks from /proc/stat: (idle and iowait, all).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (idle, ticks.iter().take(8).sum())
}

/// Times `work`, which handles `messages`, with the CPU it and the servers
/// used.
async fn phase<T>(
    ctx: &Context,
    name: &'static str,
    messages: usize,
    work: impl std::future::Future<Output = Result<T, BenchError>>,
) -> Result<(T, Phase), BenchError> {
    let cpu = crate::probe::CpuSample::now(ctx.server_pids.as_deref());
    let machine = machine_ticks();
    let started = Instant::now();
    let output = work.await?;
    let seconds = started.elapsed().as_secs_f64();
    let (bench, servers) = crate::probe::CpuSample::now(ctx.server_pids.as_deref()).since(cpu);
    let (idle, all) = machine_ticks();
    let per_msg = |cpu_s: f64| cpu_s * 1e6 / messages.max(1) as f64;
    let phase = Phase {
        name,
        messages,
        seconds,
        msgs_per_sec: messages as f64 / seconds,
        bench_cpu_us_per_msg: per_msg(bench),
        servers_cpu_us_per_msg: servers.map(per_msg),
        machine_idle: (idle - machine.0) as f64 / (all - machine.1).max(1) as f64,
    };
    Ok((output, phase))
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn progress(what: &str) {
    eprintln!(
        "idem-bench: {:>7.2}s [outbox] {what}",
        crate::since_start().as_secs_f64()
    );
}

/// The output subject, the router's state.
#[derive(Debug, Clone)]
struct Output(String);

#[idempotent(name = "bench.outbox.v1", key = msg.key)]
async fn emit_via_outbox(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    State(out): State<Output>,
    msg: Payload,
) -> Result<(), OutboxError> {
    insert_effect(tx, &msg.key).await?;
    let emitted = Emitted {
        key: msg.key,
        before_commit_us: now_us(),
    };
    outbox.send(tx, &out.0, &emitted).await?;
    Ok(())
}

async fn insert_effect(conn: &mut sqlx::PgConnection, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO bench_effects (message_key, published_us) VALUES ($1, $2)")
        .bind(key)
        .bind(now_us())
        .execute(conn)
        .await?;
    Ok(())
}

/// The whole scenario: the relay against raw, then both handlers at the
/// offered rate and over a backlog.
pub async fn outbox(ctx: &Context, base: &Plan, scenario: &Scenario) -> Result<Report, BenchError> {
    let (phases, statements) = relay_against_raw(ctx, base, scenario).await?;
    let rate = |name: &str| {
        phases
            .iter()
            .find(|p| p.name == name)
            .map_or(f64::NAN, |p| p.msgs_per_sec)
    };
    let (raw_before, relay, raw_after) = (rate("raw (a)"), rate("relay drain"), rate("raw (b)"));
    let raw = (raw_before + raw_after) / 2.0;
    let mut runs = Vec::new();
    let emits = [Emit::AfterCommit, Emit::Outbox, Emit::OutboxNotify];
    for emit in emits {
        runs.push(emitting(ctx, base, scenario, emit, Some(scenario.rate)).await?);
    }
    for emit in emits {
        runs.push(emitting(ctx, base, scenario, emit, None).await?);
    }
    let report = Report {
        raw_msgs_per_sec: raw,
        raw_before_msgs_per_sec: raw_before,
        raw_after_msgs_per_sec: raw_after,
        relay_msgs_per_sec: relay,
        relay_vs_raw: relay / raw,
        drain_profile: phases,
        drain_statements: statements,
        runs,
    };
    eprintln!();
    eprintln!(
        "| relay drain of {} rows | msgs/s | × raw |",
        scenario.messages
    );
    eprintln!("|---|---|---|");
    eprintln!(
        "| raw pipelined publish (mean of {raw_before:.0} before and {raw_after:.0} after) | \
         {raw:.0} | 1.00 |"
    );
    eprintln!("| outbox Relay | {relay:.0} | {:.2} |", relay / raw);
    eprintln!();
    eprintln!("| phase | msgs/s | bench CPU µs/msg | servers CPU µs/msg | machine idle |");
    eprintln!("|---|---|---|---|---|");
    for p in &report.drain_profile {
        eprintln!(
            "| {} | {:.0} | {:.1} | {} | {:.0} % |",
            p.name,
            p.msgs_per_sec,
            p.bench_cpu_us_per_msg,
            p.servers_cpu_us_per_msg
                .map_or_else(|| "–".to_owned(), |us| format!("{us:.1}")),
            p.machine_idle * 100.0
        );
    }
    if !report.drain_statements.is_empty() {
        eprintln!();
        eprintln!("| drain statement (pg_stat_statements) | calls | rows | mean ms | total ms |");
        eprintln!("|---|---|---|---|---|");
        for st in &report.drain_statements {
            eprintln!(
                "| {} | {} | {} | {:.3} | {:.1} |",
                st.query, st.calls, st.rows, st.mean_ms, st.total_ms
            );
        }
    }
    eprintln!();
    eprintln!("| handler | run | msgs | msgs/s | p50 ms | p99 ms | max ms |");
    eprintln!("|---|---|---|---|---|---|---|");
    for r in &report.runs {
        eprintln!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} |",
            r.mode, r.run, r.messages, r.msgs_per_sec, r.p50_ms, r.p99_ms, r.max_ms
        );
    }
    eprintln!(
        "{}",
        crate::report::target(
            "relay >= 0.9x raw publish",
            Some(report.relay_vs_raw),
            "x",
            |v| v >= 0.9
        )
    );
    let backlog = |mode: &str| {
        report
            .runs
            .iter()
            .find(|r| r.mode == mode && r.run == "backlog")
            .map(|r| r.msgs_per_sec)
    };
    let backlog_ratio = backlog("outbox")
        .zip(backlog("after-commit"))
        .map(|(o, a)| o / a);
    eprintln!(
        "{}",
        crate::report::target(
            "outbox backlog >= 0.9x publish-after-commit",
            backlog_ratio,
            "x",
            |v| v >= 0.9
        )
    );
    let p99 = report
        .runs
        .iter()
        .find(|r| r.mode == "outbox" && r.run == "latency")
        .map(|r| r.p99_ms);
    eprintln!(
        "{}",
        crate::report::target(
            &format!(
                "outbox COMMIT -> stored p99 <= 5 ms at {} msgs/s",
                scenario.rate
            ),
            p99,
            " ms",
            |v| v <= 5.0
        )
    );
    println!(
        "{}",
        serde_json::json!({ "mode": "outbox", "report": &report })
    );
    Ok(report)
}

/// A file stream of the run's own for `subject`.
async fn create_stream(ctx: &Context, name: &str, subject: &str) -> Result<(), BenchError> {
    ctx.publisher
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| BenchError::failed(format!("create stream {name}: {e}")))?;
    Ok(())
}

async fn delete_stream(ctx: &Context, name: &str) {
    if let Err(e) = ctx.publisher.delete_stream(name).await {
        tracing::warn!(%e, stream = name, "cannot delete the bench stream");
    }
}

async fn stored(ctx: &Context, name: &str) -> Result<u64, BenchError> {
    let mut stream = ctx
        .publisher
        .get_stream(name)
        .await
        .map_err(|e| BenchError::failed(format!("stream {name}: {e}")))?;
    let info = stream
        .info()
        .await
        .map_err(|e| BenchError::failed(format!("stream {name} info: {e}")))?;
    Ok(info.state.messages)
}

/// The payloads of both throughput runs: the bench's usual message.
fn payloads(n: usize) -> Vec<Vec<u8>> {
    let at = now_us();
    (0..n)
        .map(|i| {
            serde_json::to_vec(&Payload {
                key: format!("{i:032x}"),
                published_us: at,
            })
            .expect("a payload encodes")
        })
        .collect()
}

/// Raw, then the relay's drain, then raw again: each phase's rate and CPU;
/// and the drain's statements, where `pg_stat_statements` is loaded.
async fn relay_against_raw(
    ctx: &Context,
    base: &Plan,
    scenario: &Scenario,
) -> Result<(Vec<Phase>, Vec<Statement>), BenchError> {
    let n = scenario.messages;
    let tag = ctx.next_tag();
    let bodies = payloads(n);
    let (raw_stream, raw_subject) = (format!("BENCH_RAW_{tag}"), format!("bench.{tag}.raw"));
    let (out_stream, out_subject) = (format!("BENCH_OUT_{tag}"), format!("bench.{tag}.out"));
    create_stream(ctx, &raw_stream, &raw_subject).await?;
    create_stream(ctx, &out_stream, &out_subject).await?;
    let db = match Database::create(ctx, &tag, base).await {
        Ok(db) => db,
        Err(e) => {
            delete_stream(ctx, &raw_stream).await;
            delete_stream(ctx, &out_stream).await;
            return Err(e);
        }
    };
    let outcome = async {
        let mut phases = Vec::new();
        // Raw before and after the relay, on a machine whose load drifts.
        let ((), raw_a) = phase(
            ctx,
            "raw (a)",
            n,
            raw_publish(ctx, &raw_subject, &bodies, scenario.relay_batch, "a"),
        )
        .await?;
        phases.push(raw_a);

        let queued = Instant::now();
        queue_rows(&db.pool, &out_subject, &bodies).await?;
        if let Err(e) = sqlx::query("VACUUM ANALYZE idem_outbox")
            .execute(&db.pool)
            .await
        {
            tracing::info!(%e, "VACUUM before the relay run skipped");
        }
        progress(&format!(
            "queued {n} outbox rows in {:.1} s",
            queued.elapsed().as_secs_f64()
        ));
        let statements = Statements::reset(&db.pool).await;
        let relay = Relay::new().batch_size(scenario.relay_batch);
        let (drained, drain) = phase(ctx, "relay drain", n, async {
            relay
                .drain(&ctx.publisher, &db.pool)
                .await
                .map_err(|e| BenchError::failed(format!("relay drain: {e}")))
        })
        .await?;
        if drained.failed > 0 || drained.nats_away.is_some() {
            return Err(BenchError::failed(format!(
                "{} relay publishes failed (NATS away: {:?})",
                drained.failed, drained.nats_away
            )));
        }
        let published = relay.stats().published();
        progress(&format!(
            "relay: {published} rows drained in {:.2} s, {:.0} msgs/s, in {} cycles",
            drain.seconds, drain.msgs_per_sec, drained.cycles
        ));
        phases.push(drain);
        let statements = statements.read(&db.pool).await;
        let ((), raw_b) = phase(
            ctx,
            "raw (b)",
            n,
            raw_publish(ctx, &raw_subject, &bodies, scenario.relay_batch, "b"),
        )
        .await?;
        phases.push(raw_b);
        let (raw_stored, out_stored) = (
            stored(ctx, &raw_stream).await?,
            stored(ctx, &out_stream).await?,
        );
        if published != n as u64 || raw_stored != 2 * n as u64 || out_stored != n as u64 {
            return Err(BenchError::failed(format!(
                "expected {n} relayed and twice {n} raw: relay published {published}, stored \
                 raw {raw_stored}, relayed {out_stored}"
            )));
        }
        Ok((phases, statements))
    }
    .await;
    delete_stream(ctx, &raw_stream).await;
    delete_stream(ctx, &out_stream).await;
    db.drop().await;
    outcome
}

/// `pg_stat_statements`, where the bench's PostgreSQL preloads it.
struct Statements(bool);

/// A row of `pg_stat_statements`: query, calls, rows, mean and total ms.
type StatementRow = (String, i64, i64, f64, f64);

impl Statements {
    /// Creates the extension and resets its figures; `Statements(false)`
    /// where it is not loaded.
    async fn reset(pool: &PgPool) -> Statements {
        let ready = async {
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .execute(pool)
                .await?;
            sqlx::query("SELECT pg_stat_statements_reset()")
                .execute(pool)
                .await?;
            Ok::<_, sqlx::Error>(())
        };
        match ready.await {
            Ok(()) => Statements(true),
            Err(e) => {
                tracing::info!(%e, "no pg_stat_statements: the drain's statements are not profiled");
                Statements(false)
            }
        }
    }

    /// The statements run since the reset, the most time first.
    async fn read(self, pool: &PgPool) -> Vec<Statement> {
        if !self.0 {
            return Vec::new();
        }
        let rows: Result<Vec<StatementRow>, sqlx::Error> = sqlx::query_as(
            "SELECT regexp_replace(left(query, 90), '\\s+', ' ', 'g'), calls, rows,
                    mean_exec_time, total_exec_time
               FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY total_exec_time DESC LIMIT 8",
        )
        .fetch_all(pool)
        .await;
        match rows {
            Ok(rows) => rows
                .into_iter()
                .map(|(query, calls, rows, mean_ms, total_ms)| Statement {
                    query,
                    calls,
                    rows,
                    mean_ms,
                    total_ms,
                })
                .collect(),
            Err(e) => {
                tracing::info!(%e, "pg_stat_statements unreadable");
                Vec::new()
            }
        }
    }
}

/// Publishes `bodies` with ids `raw-<run>-<i>`, in windows of `window`
/// (send the window, then await its PubAcks, as a relay cycle does).
async fn raw_publish(
    ctx: &Context,
    subject: &str,
    bodies: &[Vec<u8>],
    window: usize,
    run: &str,
) -> Result<(), BenchError> {
    let started = Instant::now();
    for (w, chunk) in bodies.chunks(window).enumerate() {
        let mut acks = Vec::with_capacity(chunk.len());
        for (i, body) in chunk.iter().enumerate() {
            let publish = jetstream::message::PublishMessage::build()
                .payload(body.clone().into())
                .message_id(format!("raw-{run}-{}", w * window + i));
            acks.push(
                ctx.publisher
                    .send_publish(subject.to_owned(), publish)
                    .await
                    .map_err(|e| BenchError::failed(format!("raw publish: {e}")))?,
            );
        }
        for ack in acks {
            ack.await
                .map_err(|e| BenchError::failed(format!("raw PubAck: {e}")))?;
        }
    }
    let rate = bodies.len() as f64 / started.elapsed().as_secs_f64();
    progress(&format!(
        "raw ({run}): {} publishes, {rate:.0} msgs/s",
        bodies.len()
    ));
    Ok(())
}

/// Queues `bodies` for `subject` with multi-row inserts, in transactions
/// of 10,000 rows.
async fn queue_rows(pool: &PgPool, subject: &str, bodies: &[Vec<u8>]) -> Result<(), BenchError> {
    const ROWS: usize = 10_000;
    for (c, chunk) in bodies.chunks(ROWS).enumerate() {
        let ids: Vec<String> = (0..chunk.len())
            .map(|i| format!("relay-{}", c * ROWS + i))
            .collect();
        sqlx::query(
            "INSERT INTO idem_outbox (msg_id, subject, payload)
             SELECT id, $2, payload FROM unnest($1::text[], $3::bytea[]) AS t(id, payload)",
        )
        .bind(&ids)
        .bind(subject)
        .bind(chunk)
        .execute(pool)
        .await
        .map_err(|e| BenchError::failed(format!("queue outbox rows: {e}")))?;
    }
    Ok(())
}

/// One handler run: offered at `rate`, or over a queued backlog (`None`).
async fn emitting(
    ctx: &Context,
    base: &Plan,
    scenario: &Scenario,
    emit: Emit,
    rate: Option<f64>,
) -> Result<Emitting, BenchError> {
    let n = scenario.latency_messages;
    let tag = ctx.next_tag();
    let (in_stream, in_subject) = (format!("BENCH_IN_{tag}"), format!("bench.{tag}.in"));
    let (out_stream, out_subject) = (format!("BENCH_OUT_{tag}"), format!("bench.{tag}.out"));
    create_stream(ctx, &in_stream, &in_subject).await?;
    create_stream(ctx, &out_stream, &out_subject).await?;
    // The relay's lanes take connections of their own: two while the fresh
    // lane's cycles overlap, one for the retry lane, and the LISTEN one
    // while the NOTIFY trigger is enabled.
    let db_plan = Plan {
        concurrency: scenario.concurrency + 4,
        ..base.clone()
    };
    let db = match Database::create(ctx, &tag, &db_plan).await {
        Ok(db) => db,
        Err(e) => {
            delete_stream(ctx, &in_stream).await;
            delete_stream(ctx, &out_stream).await;
            return Err(e);
        }
    };
    let run = if rate.is_some() { "latency" } else { "backlog" };
    let outcome = async {
        let receiver = Receiver::start(ctx, &out_stream, n).await?;
        let publish = |i: usize| {
            let body = serde_json::to_vec(&Payload {
                key: format!("{tag}-{i:08}"),
                published_us: now_us(),
            })
            .expect("a payload encodes");
            jetstream::message::PublishMessage::build()
                .payload(body.into())
                .message_id(format!("{tag}-{i}"))
        };
        if rate.is_none() {
            publish_all(ctx, &in_subject, n, None, publish).await?;
        }
        let (stop, stopped) = watch::channel(false);
        let stopped_future = |mut stopped: watch::Receiver<bool>| async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        let started = Instant::now();
        let mut tasks = Vec::new();
        match emit {
            Emit::Outbox | Emit::OutboxNotify => {
                if emit == Emit::OutboxNotify {
                    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
                        .execute(&db.pool)
                        .await
                        .map_err(|e| BenchError::failed(format!("enable NOTIFY: {e}")))?;
                }
                let route = Route::new(in_stream.clone(), format!("bench_outbox_{tag}"))
                    .filter_subject(in_subject.clone())
                    .concurrency(scenario.concurrency);
                let router = Router::with_state(Output(out_subject.clone()))
                    .route(route, emit_via_outbox)
                    .relay(Relay::new());
                let router_stop = stopped_future(stopped.clone());
                let (nats, pool) = (ctx.consumer.clone(), db.pool.clone());
                tasks.push(tokio::spawn(async move {
                    router
                        .run_until(nats, pool, router_stop)
                        .await
                        .map_err(|e| BenchError::failed(format!("router: {e}")))
                }));
            }
            Emit::AfterCommit => {
                let js = jetstream::new(ctx.consumer.clone());
                let consumer = js
                    .get_stream(&in_stream)
                    .await
                    .map_err(|e| BenchError::failed(format!("stream {in_stream}: {e}")))?
                    .create_consumer(pull::Config {
                        durable_name: Some(format!("bench_after_{tag}")),
                        ack_policy: AckPolicy::Explicit,
                        filter_subject: in_subject.clone(),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| BenchError::failed(format!("create consumer: {e}")))?;
                let (pool, out) = (db.pool.clone(), out_subject.clone());
                let concurrency = scenario.concurrency;
                let stop = stopped_future(stopped.clone());
                tasks.push(tokio::spawn(async move {
                    publish_after_commit(consumer, js, pool, out, concurrency, stop).await
                }));
            }
        }
        if let Some(rate) = rate {
            publish_all(ctx, &in_subject, n, Some(rate), publish).await?;
        }
        let received = receiver
            .wait(Duration::from_secs(60 + n as u64 / 100))
            .await;
        let elapsed = started.elapsed();
        let _ = stop.send(true);
        for task in tasks {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(BenchError::failed(format!("a task panicked: {e}"))),
            }
        }
        let mut latencies = received?;
        latencies.sort();
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_effects")
            .fetch_one(&db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("count effects: {e}")))?;
        let out_stored = stored(ctx, &out_stream).await?;
        if effects != n as i64 || out_stored != n as u64 {
            return Err(BenchError::failed(format!(
                "[{}] expected {n} effects and {n} output messages, found {effects} and \
                 {out_stored}",
                emit.name()
            )));
        }
        let figures = Emitting {
            mode: emit.name(),
            run,
            messages: n,
            msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
            p50_ms: percentile_ms(&latencies, 0.50),
            p99_ms: percentile_ms(&latencies, 0.99),
            max_ms: percentile_ms(&latencies, 1.0),
        };
        progress(&format!(
            "[{} {run}] {n} messages, {:.0} msgs/s, COMMIT -> stored p50 {:.2} ms, p99 {:.2} ms",
            emit.name(),
            figures.msgs_per_sec,
            figures.p50_ms,
            figures.p99_ms
        ));
        Ok(figures)
    }
    .await;
    delete_stream(ctx, &in_stream).await;
    delete_stream(ctx, &out_stream).await;
    db.drop().await;
    outcome
}

/// Publishes `n` messages to `subject`, paced at `rate` if given, and
/// awaits their PubAcks.
async fn publish_all(
    ctx: &Context,
    subject: &str,
    n: usize,
    rate: Option<f64>,
    publish: impl Fn(usize) -> jetstream::message::PublishMessage,
) -> Result<(), BenchError> {
    // The input is not what is measured: on a loaded machine with an fsync
    // per message, its PubAcks may wait out the client's 5 s, which ended
    // runs before they were measured.
    let mut publisher = ctx.publisher.clone();
    publisher.set_timeout(Duration::from_secs(60));
    let started = tokio::time::Instant::now();
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        if let Some(rate) = rate {
            tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate)).await;
        }
        acks.push(
            publisher
                .send_publish(subject.to_owned(), publish(i))
                .await
                .map_err(|e| BenchError::failed(format!("publish: {e}")))?,
        );
        // Bound the PubAcks in flight on a long backlog.
        if acks.len() >= 4096 {
            for ack in acks.drain(..) {
                ack.await
                    .map_err(|e| BenchError::failed(format!("PubAck: {e}")))?;
            }
        }
    }
    for ack in acks {
        ack.await
            .map_err(|e| BenchError::failed(format!("PubAck: {e}")))?;
    }
    Ok(())
}

/// The hand-written "publish after commit" consumer: fast, and it loses
/// the output message if it dies between its COMMIT and the PubAck.
async fn publish_after_commit(
    consumer: jetstream::consumer::PullConsumer,
    js: jetstream::Context,
    pool: PgPool,
    out: String,
    concurrency: usize,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), BenchError> {
    let messages = consumer
        .messages()
        .await
        .map_err(|e| BenchError::failed(format!("start pulling: {e}")))?;
    let errors = std::sync::atomic::AtomicU64::new(0);
    messages
        .take_until(stop)
        .for_each_concurrent(concurrency, |message| {
            let (js, pool, out, errors) = (&js, &pool, &out, &errors);
            async move {
                let handled = async {
                    let message = message?;
                    let msg: Payload = serde_json::from_slice(&message.payload)?;
                    let mut tx = pool.begin().await?;
                    insert_effect(&mut tx, &msg.key).await?;
                    let before_commit_us = now_us();
                    tx.commit().await?;
                    let body = serde_json::to_vec(&Emitted {
                        key: msg.key.clone(),
                        before_commit_us,
                    })?;
                    let publish = jetstream::message::PublishMessage::build()
                        .payload(body.into())
                        .message_id(msg.key);
                    js.send_publish(out.clone(), publish).await?.await?;
                    message.ack().await?;
                    Ok::<_, idem_runtime::error::BoxError>(())
                };
                if let Err(error) = handled.await {
                    tracing::warn!(%error, "after-commit handler failed");
                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
        .await;
    match errors.into_inner() {
        0 => Ok(()),
        e => Err(BenchError::failed(format!(
            "{e} after-commit handler calls failed"
        ))),
    }
}

/// Notes when each output message reaches a JetStream consumer (after it
/// is stored), against the time its handler sent the COMMIT.
struct Receiver {
    task: tokio::task::JoinHandle<Result<Vec<Duration>, BenchError>>,
}

impl Receiver {
    async fn start(ctx: &Context, stream: &str, n: usize) -> Result<Receiver, BenchError> {
        let js = jetstream::new(ctx.observer.clone());
        let consumer = js
            .get_stream(stream)
            .await
            .map_err(|e| BenchError::failed(format!("stream {stream}: {e}")))?
            .create_consumer(pull::Config {
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .map_err(|e| BenchError::failed(format!("output consumer: {e}")))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| BenchError::failed(format!("output consumer: {e}")))?;
        let task = tokio::spawn(async move {
            let mut seen = HashSet::with_capacity(n);
            let mut latencies = Vec::with_capacity(n);
            while seen.len() < n {
                let Some(message) = messages.next().await else {
                    break;
                };
                let received_us = now_us();
                let message =
                    message.map_err(|e| BenchError::failed(format!("output consumer: {e}")))?;
                let emitted: Emitted = serde_json::from_slice(&message.payload)
                    .map_err(|e| BenchError::failed(format!("an output message: {e}")))?;
                if seen.insert(emitted.key) {
                    let us = (received_us - emitted.before_commit_us).max(0) as u64;
                    latencies.push(Duration::from_micros(us));
                }
            }
            Ok(latencies)
        });
        Ok(Receiver { task })
    }

    /// The latencies of all `n` messages, or an error after `timeout`.
    async fn wait(mut self, timeout: Duration) -> Result<Vec<Duration>, BenchError> {
        let waited = tokio::time::timeout(timeout, &mut self.task).await;
        if waited.is_err() {
            self.task.abort();
        }
        match waited {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(BenchError::failed(format!("the output consumer: {e}"))),
            Err(_) => Err(BenchError::failed(format!(
                "not every output message arrived within {} s",
                timeout.as_secs()
            ))),
        }
    }
}
