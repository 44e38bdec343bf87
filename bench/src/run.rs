//! One measured run: a fresh stream and database, the messages, the
//! consumer, the numbers, and the end-state check.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::BenchError;
use crate::consumers::{self, Consumer, HANDLER_NAME, Mode, Pull, Source};
use crate::probe::{self, AckObserver};

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mode: Mode,
    /// `throughput` (publish a backlog, then consume), `latency`, `backlog`
    /// or `prefilled`.
    pub scenario: &'static str,
    pub messages: usize,
    pub concurrency: usize,
    pub batch: usize,
    /// Publish at this many messages per second while consuming, instead of
    /// publishing the whole backlog first.
    pub rate: Option<f64>,
    /// Rows put in the dedup table (under another handler) before the run.
    pub prefill: u64,
    /// How many of the messages are published a second time, with the same
    /// `Nats-Msg-Id` and payload, after the stream's duplicate window: stored
    /// twice, as a publisher retry after the window is.
    pub duplicates: usize,
    /// The pool pings each connection before handing it out (sqlx's
    /// default, `test_before_acquire(true)`), in every mode.
    pub ping: bool,
    /// How the hand-written modes fetch.
    pub pull: Pull,
    /// The idem route's `Route::retention`: its claims expire, and the
    /// router runs the purge in the background.
    pub retention: Option<Duration>,
    /// SQL run on the run's database just before the consumer starts (the
    /// retention scenarios arm a rotation and an expiry with it).
    pub before_consume: Option<String>,
    /// Record, with each effect, when its transaction began and how long
    /// after that the handler's INSERT ran (the claim's latency, as the
    /// handler sees it), on the server's clock.
    pub time_in_tx: bool,
    /// idem: publish each message with its key as `Nats-Msg-Id`, and take
    /// that as its id, instead of the handler's key expression.
    pub id_from_header: bool,
    /// Each message also adds 1 to one of [`HOT_ROWS`] rows of `bench_hot`,
    /// picked by its key: the contention scenario.
    pub hot_rows: bool,
    /// The batching modes size their batches adaptively, up to `batch`.
    pub adaptive: bool,
    /// A run at a fixed rate starts publishing only once the router has
    /// made its durable consumer, so that its start-up (a second or more on
    /// a loaded machine) does not show in the latencies.
    pub wait_for_consumer: bool,
}

/// The rows the contention scenario's messages update.
pub const HOT_ROWS: i32 = 8;

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Measurement {
    pub plan: Plan,
    pub msgs_per_sec: f64,
    pub elapsed: Duration,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub latency_samples: usize,
    pub peak_rss_mib: f64,
    pub rss_at_start_mib: f64,
    pub effects: u64,
    pub duplicates: u64,
    pub publish_lag_ms: Option<f64>,
    /// CPU microseconds per message while consuming: this process (the
    /// consumer, the framework, the bench's probes) and the servers (when
    /// the bench runs them). On a machine with few cores throughput is
    /// bounded by their sum, whatever else runs there.
    pub client_cpu_us_per_msg: f64,
    pub servers_cpu_us_per_msg: Option<f64>,
    /// With `Plan::time_in_tx`: BEGIN → the handler's INSERT, nearest-rank.
    pub claim_p50_ms: Option<f64>,
    pub claim_p99_ms: Option<f64>,
    /// Each copy's publish and first ack, for latencies by time window.
    pub samples: Vec<Sample>,
    /// With `Plan::time_in_tx`, per effect: (transaction start, Unix µs;
    /// BEGIN → handler INSERT, µs).
    pub tx_samples: Vec<(i64, i64)>,
}

/// When one message was published and when its first ack was seen.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub published: Instant,
    pub acked: Instant,
}

/// The connections every run shares. Publisher, consumer and ack observer
/// each have their own, as separate processes would.
pub struct Context {
    pub publisher: jetstream::Context,
    pub consumer: async_nats::Client,
    pub observer: async_nats::Client,
    pub database_url: Option<String>,
    /// The servers' pids, when the bench runs them (for their CPU time).
    pub server_pids: Option<Vec<u32>>,
    runs: AtomicU32,
}

impl Context {
    pub async fn connect(
        nats_url: &str,
        database_url: Option<String>,
        server_pids: Option<Vec<u32>>,
    ) -> Result<Context, BenchError> {
        let connect = |name: &'static str| async move {
            async_nats::ConnectOptions::new()
                .name(format!("idem-bench {name}"))
                .connect(nats_url)
                .await
                .map_err(|e| {
                    BenchError::setup(format!("cannot connect to NATS at {nats_url}: {e}"))
                })
        };
        Ok(Context {
            publisher: jetstream::new(connect("publisher").await?),
            consumer: connect("consumer").await?,
            observer: connect("ack observer").await?,
            database_url,
            server_pids,
            runs: AtomicU32::new(0),
        })
    }

    /// A name no other run of this or another bench process uses.
    pub fn next_tag(&self) -> String {
        let n = self.runs.fetch_add(1, Ordering::Relaxed);
        format!("{}_{n}", std::process::id())
    }
}

/// The stream's publish-dedup window in a run with duplicates: short, so
/// that the second copies, published after it, are stored.
const DUPLICATE_WINDOW: Duration = Duration::from_millis(100);

/// Runs `plan` on fresh fixtures and removes them afterwards.
pub async fn run(ctx: &Context, plan: &Plan) -> Result<Measurement, BenchError> {
    let (stream_name, subject) = create_stream(ctx, plan).await?;
    let tag = stream_name.trim_start_matches("BENCH_").to_owned();
    let database = match plan.mode.uses_database() {
        true => match Database::create(ctx, &tag, plan).await {
            Ok(db) => Some(db),
            Err(e) => {
                delete_stream(ctx, &stream_name).await;
                return Err(e);
            }
        },
        false => None,
    };
    let outcome = measure(ctx, plan, &stream_name, &subject, database.as_ref()).await;
    let teardown = Instant::now();
    delete_stream(ctx, &stream_name).await;
    if let Some(db) = database {
        db.drop().await;
    }
    progress(
        plan,
        &format!(
            "removed the stream and database in {:.2} s",
            teardown.elapsed().as_secs_f64()
        ),
    );
    outcome
}

/// A stream of the run's own; returns its name and subject.
async fn create_stream(ctx: &Context, plan: &Plan) -> Result<(String, String), BenchError> {
    let tag = ctx.next_tag();
    let stream_name = format!("BENCH_{tag}");
    let subject = format!("bench.{tag}");
    ctx.publisher
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::File,
            // Zero is JetStream's default, 2 minutes.
            duplicate_window: if plan.duplicates > 0 {
                DUPLICATE_WINDOW
            } else {
                Duration::ZERO
            },
            ..Default::default()
        })
        .await
        .map_err(|e| BenchError::failed(format!("create stream {stream_name}: {e}")))?;
    Ok((stream_name, subject))
}

/// Runs `plan` on a fresh stream and on `db`, made by [`Database::create`]
/// and kept for more runs (its dedup table is not emptied; the effects
/// are).
pub async fn run_on(ctx: &Context, plan: &Plan, db: &Database) -> Result<Measurement, BenchError> {
    let (stream_name, subject) = create_stream(ctx, plan).await?;
    let outcome = async {
        sqlx::query("TRUNCATE bench_effects")
            .execute(&db.pool)
            .await
            .map_err(|e| BenchError::setup(format!("empty bench_effects: {e}")))?;
        measure(ctx, plan, &stream_name, &subject, Some(db)).await
    }
    .await;
    delete_stream(ctx, &stream_name).await;
    outcome
}

async fn delete_stream(ctx: &Context, name: &str) {
    if let Err(e) = ctx.publisher.delete_stream(name).await {
        tracing::warn!(%e, stream = name, "cannot delete the bench stream");
    }
}

async fn measure(
    ctx: &Context,
    plan: &Plan,
    stream: &str,
    subject: &str,
    db: Option<&Database>,
) -> Result<Measurement, BenchError> {
    let n = plan.messages;
    let keys = message_keys(n);
    // The messages published twice, spread over the run.
    let twice: Vec<String> = (0..plan.duplicates)
        .map(|i| keys[i * n / plan.duplicates].clone())
        .collect();
    let with_ids = !twice.is_empty() || plan.id_from_header;
    // Every copy is acked, the second ones too.
    let total = n + twice.len();
    let observer = AckObserver::start(&ctx.observer, stream, total).await?;
    let source = || Source { stream, subject };
    let pool = db.map(|db| &db.pool);
    let cpu_now = || probe::CpuSample::now(ctx.server_pids.as_deref());
    let start_consumer = || async {
        if let (Some(sql), Some(pool)) = (&plan.before_consume, pool) {
            sqlx::raw_sql(AssertSqlSafe(sql.clone()))
                .execute(pool)
                .await
                .map_err(|e| BenchError::setup(format!("before the consumer starts: {e}")))?;
        }
        Consumer::start(plan, &ctx.consumer, pool, source()).await
    };

    let (published, consumer, started, rss_at_start, cpu_at_start) = match plan.rate {
        None => {
            progress(plan, &format!("publishing a backlog of {n} messages"));
            let publishing = Instant::now();
            let mut published =
                probe::publish(&ctx.publisher, subject, &keys, None, with_ids).await?;
            publish_twice(ctx, plan, stream, subject, &twice, &mut published).await?;
            progress(
                plan,
                &format!(
                    "published in {:.2} s; consuming",
                    publishing.elapsed().as_secs_f64()
                ),
            );
            probe::reset_peak_rss();
            let rss_at_start = probe::status_mib("VmRSS");
            let cpu_at_start = cpu_now();
            let started = Instant::now();
            let consumer = start_consumer().await?;
            (published, consumer, started, rss_at_start, cpu_at_start)
        }
        Some(rate) => {
            probe::reset_peak_rss();
            let rss_at_start = probe::status_mib("VmRSS");
            let cpu_at_start = cpu_now();
            let started = Instant::now();
            let consumer = start_consumer().await?;
            if plan.wait_for_consumer {
                wait_for_consumer(ctx, stream, &consumer).await?;
            }
            progress(
                plan,
                &format!("publishing {n} messages at {rate} msgs/s while consuming"),
            );
            let mut published =
                probe::publish(&ctx.publisher, subject, &keys, Some(rate), with_ids).await?;
            publish_twice(ctx, plan, stream, subject, &twice, &mut published).await?;
            (published, consumer, started, rss_at_start, cpu_at_start)
        }
    };
    let waited = observer.wait_for_all(total, &consumer).await;
    let peak_rss_mib = probe::status_mib("VmHWM");
    let (client_cpu, servers_cpu) = cpu_now().since(cpu_at_start);
    let stopping = Instant::now();
    let stopped = consumer.stop().await;
    progress(
        plan,
        &format!(
            "all acked; consumer stopped in {:.2} s",
            stopping.elapsed().as_secs_f64()
        ),
    );
    let acks = observer.finish().await?;
    waited?;
    let report = stopped?;

    let samples: Vec<Sample> = published
        .messages
        .iter()
        .filter_map(|p| {
            Some(Sample {
                published: p.at,
                acked: acks.get(p.seq)?,
            })
        })
        .collect();
    let mut latencies: Vec<Duration> = samples
        .iter()
        .map(|s| s.acked.saturating_duration_since(s.published))
        .collect();
    latencies.sort_unstable();
    let last_ack = acks.last().unwrap_or_else(Instant::now);
    let elapsed = last_ack.saturating_duration_since(started);

    let effects = verify(plan, db, &report).await?;
    let tx_samples: Vec<(i64, i64)> = match (plan.time_in_tx, db) {
        (true, Some(db)) => sqlx::query_as("SELECT tx_started_us, in_tx_us FROM bench_effects")
            .fetch_all(&db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("read the transaction times: {e}")))?,
        _ => Vec::new(),
    };
    let mut in_tx: Vec<Duration> = tx_samples
        .iter()
        .map(|&(_, us)| Duration::from_micros(us.max(0).unsigned_abs()))
        .collect();
    in_tx.sort_unstable();
    let claim_percentile = |q| plan.time_in_tx.then(|| percentile_ms(&in_tx, q));
    Ok(Measurement {
        plan: plan.clone(),
        msgs_per_sec: total as f64 / elapsed.as_secs_f64(),
        elapsed,
        p50_ms: percentile_ms(&latencies, 0.50),
        p99_ms: percentile_ms(&latencies, 0.99),
        max_ms: percentile_ms(&latencies, 1.0),
        latency_samples: latencies.len(),
        peak_rss_mib,
        rss_at_start_mib: rss_at_start,
        effects,
        duplicates: report.duplicates,
        publish_lag_ms: plan.rate.map(|_| published.max_lag.as_secs_f64() * 1000.0),
        client_cpu_us_per_msg: client_cpu * 1e6 / total as f64,
        servers_cpu_us_per_msg: servers_cpu.map(|cpu| cpu * 1e6 / total as f64),
        claim_p50_ms: claim_percentile(0.50),
        claim_p99_ms: claim_percentile(0.99),
        samples,
        tx_samples,
    })
}

/// Waits until the router behind `consumer` has made its durable consumer
/// on `stream` (a hand-written consumer makes it before it starts).
async fn wait_for_consumer(
    ctx: &Context,
    stream: &str,
    consumer: &Consumer,
) -> Result<(), BenchError> {
    let Some(durable) = consumer.durable() else {
        return Ok(());
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stream = ctx
            .publisher
            .get_stream(stream)
            .await
            .map_err(|e| BenchError::failed(format!("get stream {stream}: {e}")))?;
        if stream.consumer_info(durable).await.is_ok() {
            return Ok(());
        }
        if consumer.ended() || Instant::now() > deadline {
            return Err(BenchError::failed(format!(
                "the router made no consumer {durable} within a minute"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes `keys` a second time, with the same `Nats-Msg-Id` as their
/// first copies, once the stream's duplicate window has passed, and checks
/// that the stream stored every copy. A copy JetStream still drops as a
/// duplicate is published again after a pause, as a retrying publisher
/// would do.
async fn publish_twice(
    ctx: &Context,
    plan: &Plan,
    stream: &str,
    subject: &str,
    keys: &[String],
    published: &mut probe::PublishReport,
) -> Result<(), BenchError> {
    if keys.is_empty() {
        return Ok(());
    }
    tokio::time::sleep(DUPLICATE_WINDOW).await;
    let mut dropped = 0;
    for key in keys {
        loop {
            let copy = probe::publish_one(&ctx.publisher, subject, key).await?;
            if !copy.duplicate {
                published.messages.push(copy.published);
                break;
            }
            dropped += 1;
            if dropped > 10 * keys.len() {
                return Err(BenchError::failed(format!(
                    "JetStream keeps dropping second copies as duplicates, {DUPLICATE_WINDOW:?} \
                     after the first"
                )));
            }
            tokio::time::sleep(DUPLICATE_WINDOW / 2).await;
        }
    }
    let stored = ctx
        .publisher
        .get_stream(stream)
        .await
        .map_err(|e| BenchError::failed(format!("get stream {stream}: {e}")))?
        .info()
        .await
        .map_err(|e| BenchError::failed(format!("stream info {stream}: {e}")))?
        .state
        .messages;
    let expected = (plan.messages + keys.len()) as u64;
    if stored != expected {
        return Err(BenchError::failed(format!(
            "the stream holds {stored} messages, expected {expected}: {} published once and {} \
             of them a second time",
            plan.messages,
            keys.len()
        )));
    }
    progress(
        plan,
        &format!(
            "published {} of the messages a second time; the stream stored all {stored}",
            keys.len()
        ),
    );
    Ok(())
}

/// Checks the end state. The dedup modes: one effect per distinct message
/// and no duplicate effect, one dedup row per message, and each second copy
/// counted as a duplicate. The others (the control): one effect per copy
/// stored, the second copies included. Returns the effects.
pub(crate) async fn verify(
    plan: &Plan,
    db: Option<&Database>,
    report: &consumers::ConsumerReport,
) -> Result<u64, BenchError> {
    let n = plan.messages as u64;
    let twice = plan.duplicates as u64;
    // What the consumer must apply: each distinct message once with dedup,
    // every stored copy without.
    let applied = if plan.mode.dedups() { n } else { n + twice };
    let mode = plan.mode.name();
    let Some(db) = db else {
        // raw: its effect is the ack, and every copy was acked once.
        if report.processed != applied {
            return Err(BenchError::failed(format!(
                "{mode}: the consumer acked {} messages, expected {applied}",
                report.processed
            )));
        }
        return Ok(report.processed);
    };
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_key) FROM bench_effects")
            .fetch_one(&db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("count effects: {e}")))?;
    if rows as u64 != applied || distinct as u64 != n {
        return Err(BenchError::failed(format!(
            "{mode}: effects = {rows} rows for {distinct} distinct messages, expected {applied} \
             and {n} ({n} messages, {twice} of them stored twice): FAILED effects = {}",
            if plan.mode.dedups() {
                "distinct messages"
            } else {
                "stored messages"
            }
        )));
    }
    if plan.mode.dedups() {
        let claims = count_claims(plan.mode, &db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("count dedup rows: {e}")))?;
        if claims as u64 != n {
            return Err(BenchError::failed(format!(
                "{mode}: {claims} dedup rows, expected {n}"
            )));
        }
    }
    if report.processed != applied || report.errors != 0 {
        return Err(BenchError::failed(format!(
            "{mode}: the consumer reports {} processed and {} failed, expected {applied} and 0",
            report.processed, report.errors
        )));
    }
    if plan.hot_rows {
        let total: i64 = sqlx::query_scalar("SELECT sum(total)::int8 FROM bench_hot")
            .fetch_one(&db.pool)
            .await
            .map_err(|e| BenchError::failed(format!("sum the hot rows: {e}")))?;
        if total as u64 != n {
            return Err(BenchError::failed(format!(
                "{mode}: the hot rows add up to {total}, expected {n}: one per distinct message"
            )));
        }
    }
    if plan.mode.dedups() && report.duplicates != twice {
        return Err(BenchError::failed(format!(
            "{mode}: the consumer skipped {} duplicates, expected {twice}: one per second copy",
            report.duplicates
        )));
    }
    Ok(rows as u64)
}

/// The dedup rows of the effects' messages (`HANDLER_NAME`'s). Looked up
/// by key, from the effects' keys first, so that a dedup table of 100
/// million rows costs index probes, never a scan or a join the planner
/// could turn around; a claim made during a generation transition is in
/// two partitions, and counts once.
async fn count_claims(mode: Mode, pool: &PgPool) -> Result<i64, sqlx::Error> {
    let ids: Vec<String> = sqlx::query_scalar("SELECT message_key FROM bench_effects")
        .fetch_all(pool)
        .await?;
    let count = if mode == Mode::Manual {
        "SELECT count(*) FROM manual_processed_messages
          WHERE handler = $1 AND message_id = ANY ($2)"
    } else {
        "SELECT count(DISTINCT key) FROM idem_claims
          WHERE key = ANY (ARRAY(SELECT idem_key($1, id) FROM unnest($2::text[]) AS id))
            AND handler_id = (SELECT id FROM idem_handlers WHERE name = $1)"
    };
    sqlx::query_scalar(count)
        .bind(HANDLER_NAME)
        .bind(ids)
        .fetch_one(pool)
        .await
}

/// The nearest-rank percentile `q` of sorted `values`, in milliseconds.
pub fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

/// `n` distinct dedup keys of 32 hex digits, spread like UUIDs so that the
/// claims land all over the index, as real message ids do.
pub(crate) fn message_keys(n: usize) -> Vec<String> {
    let seed = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), n);
    (0..n as u64)
        .map(|i| {
            let a = splitmix64(seed ^ i);
            let b = splitmix64(a ^ 0x9e37_79b9_7f4a_7c15);
            // The index keeps keys distinct even if a and b collide.
            format!("{a:016x}{b:08x}{i:08x}", b = b as u32)
        })
        .collect()
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn progress(plan: &Plan, what: &str) {
    eprintln!(
        "idem-bench: {:>7.2}s [{} {}] {what}",
        crate::since_start().as_secs_f64(),
        plan.scenario,
        plan.mode.name()
    );
}

/// A database of its own for one run, on the `DATABASE_URL` server (or the
/// bench's own), so that no run sees another's rows and no user data is
/// touched. Dropped afterwards.
pub struct Database {
    admin_url: String,
    name: String,
    pub pool: PgPool,
}

impl Database {
    pub async fn create(ctx: &Context, tag: &str, plan: &Plan) -> Result<Database, BenchError> {
        let admin_url = ctx
            .database_url
            .clone()
            .expect("the servers start PostgreSQL when a mode needs it");
        let name = format!("idem_bench_{tag}");
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .map_err(|e| BenchError::setup(format!("cannot connect to {admin_url}: {e}")))?;
        // The name is ours (digits and underscores): safe in SQL.
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .map_err(|e| {
                BenchError::setup(format!(
                    "cannot create database {name} (the bench needs CREATEDB on DATABASE_URL): {e}"
                ))
            })?;
        let _ = admin.close().await;
        let url = with_database(&admin_url, &name);
        // A router leaves one of its pool's connections to its metrics
        // poll: one more, so that its messages run --concurrency at once,
        // as the hand-written modes' do.
        let connections = plan.concurrency as u32 + u32::from(!plan.mode.hand_written());
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .min_connections(connections)
            .test_before_acquire(plan.ping)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await
            .map_err(|e| BenchError::setup(format!("cannot connect to {url}: {e}")));
        let pool = match pool {
            Ok(pool) => pool,
            Err(e) => {
                drop_database(&admin_url, &name).await;
                return Err(e);
            }
        };
        let db = Database {
            admin_url,
            name,
            pool,
        };
        if let Err(e) = db.prepare(plan).await {
            db.drop().await;
            return Err(e);
        }
        Ok(db)
    }

    /// The business table, the dedup schema, the prefill, a warm pool and a
    /// fresh checkpoint, so the timed part starts from the same state in
    /// every mode.
    async fn prepare(&self, plan: &Plan) -> Result<(), BenchError> {
        let sql =
            |what: &'static str| move |e: sqlx::Error| BenchError::setup(format!("{what}: {e}"));
        // No key of its own: a duplicate effect shows up as an extra row.
        let effects = if plan.time_in_tx {
            "CREATE TABLE bench_effects (
                 message_key   text   NOT NULL,
                 published_us  bigint NOT NULL,
                 tx_started_us bigint NOT NULL
                     DEFAULT (extract(epoch FROM transaction_timestamp()) * 1e6)::bigint,
                 in_tx_us      bigint NOT NULL
                     DEFAULT (extract(epoch FROM clock_timestamp() - transaction_timestamp())
                              * 1e6)::bigint)"
        } else {
            "CREATE TABLE bench_effects (message_key text NOT NULL, published_us bigint NOT NULL)"
        };
        sqlx::query(effects)
            .execute(&self.pool)
            .await
            .map_err(sql("create bench_effects"))?;
        if plan.hot_rows {
            sqlx::query(
                "CREATE TABLE bench_hot AS
                     SELECT id, 0::bigint AS total FROM generate_series(0, $1 - 1) AS id",
            )
            .bind(HOT_ROWS)
            .execute(&self.pool)
            .await
            .map_err(sql("create bench_hot"))?;
            sqlx::query("ALTER TABLE bench_hot ADD PRIMARY KEY (id)")
                .execute(&self.pool)
                .await
                .map_err(sql("key bench_hot"))?;
        }
        if plan.mode == Mode::Manual {
            // What a hand-written consumer keeps: the message id as it is.
            sqlx::raw_sql(
                "CREATE TABLE manual_processed_messages (
                     handler      text        NOT NULL,
                     message_id   text        NOT NULL,
                     processed_at timestamptz NOT NULL DEFAULT now(),
                     PRIMARY KEY (handler, message_id));
                 CREATE INDEX ON manual_processed_messages (processed_at);",
            )
            .execute(&self.pool)
            .await
            .map_err(sql("create the manual dedup table"))?;
        } else if plan.mode.dedups() {
            idem_runtime::schema::migrate(&self.pool)
                .await
                .map_err(|e| BenchError::setup(format!("idem schema: {e}")))?;
        }
        if plan.prefill > 0 {
            progress(
                plan,
                &format!("filling the dedup table with {} rows", plan.prefill),
            );
            let started = Instant::now();
            let (fill, table) = if plan.mode == Mode::Manual {
                (
                    "INSERT INTO manual_processed_messages (handler, message_id)
                     SELECT 'bench.prefill.v1', md5(g::text) FROM generate_series(1, $1) AS g",
                    "manual_processed_messages",
                )
            } else {
                (
                    "WITH handler AS (
                         INSERT INTO idem_handlers (name) VALUES ('bench.prefill.v1') RETURNING id)
                     INSERT INTO idem_claims (key, gen, handler_id)
                     SELECT idem_key('bench.prefill.v1', md5(g::text)), 1, handler.id
                       FROM generate_series(1, $1) AS g, handler",
                    "idem_claims",
                )
            };
            sqlx::query(fill)
                .bind(plan.prefill as i64)
                .execute(&self.pool)
                .await
                .map_err(sql("prefill the dedup table"))?;
            sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
                .execute(&self.pool)
                .await
                .map_err(sql("vacuum the dedup table"))?;
            progress(
                plan,
                &format!("filled in {:.1} s", started.elapsed().as_secs_f64()),
            );
        }
        // Every connection open and used once, so no run pays for connects.
        let mut held = Vec::new();
        for _ in 0..plan.concurrency {
            held.push(self.pool.acquire().await.map_err(sql("warm the pool"))?);
        }
        drop(held);
        // So that no earlier run's or the prefill's dirty pages are flushed
        // during this one. Needs superuser (or pg_checkpoint); skip without.
        if let Err(e) = sqlx::query("CHECKPOINT").execute(&self.pool).await {
            tracing::info!(%e, "CHECKPOINT before the run skipped");
        }
        Ok(())
    }

    /// The URL of this run's database, for other processes.
    pub fn url(&self) -> String {
        with_database(&self.admin_url, &self.name)
    }

    /// Its name, as `pg_stat_database` and `pg_stat_activity` show it.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub async fn drop(self) {
        self.pool.close().await;
        drop_database(&self.admin_url, &self.name).await;
    }
}

async fn drop_database(admin_url: &str, name: &str) {
    let dropped = async {
        let mut admin = PgConnection::connect(admin_url).await?;
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await?;
        admin.close().await
    };
    if let Err(e) = dropped.await {
        tracing::warn!(%e, database = name, "cannot drop the bench database");
    }
}

/// `url` with its database (the path) replaced by `database`, keeping any
/// `?query`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let host_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[host_start..]
        .find('/')
        .map_or(base.len(), |i| host_start + i);
    let mut out = format!("{}/{database}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_swaps_the_path_only() {
        assert_eq!(
            with_database("postgres://u@h:5/postgres?sslmode=disable", "b1"),
            "postgres://u@h:5/b1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "b1"), "postgres://h/b1");
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let values: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&values, 0.5), 50.0);
        assert_eq!(percentile_ms(&values, 0.99), 99.0);
        assert_eq!(percentile_ms(&values, 1.0), 100.0);
    }

    #[test]
    fn keys_are_distinct() {
        let keys = message_keys(10_000);
        let set: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(set.len(), keys.len());
        assert!(keys.iter().all(|k| k.len() == 32));
    }
}
