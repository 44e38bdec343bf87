//! The six ways of consuming the same messages, all doing the same handler
//! work: one INSERT into the business table `bench_effects`.
//!
//! - `raw`: pull and ack, no database.
//! - `naive`: BEGIN, INSERT, COMMIT, ack. At-least-once.
//! - `manual`: BEGIN, dedup INSERT (skip when it inserted nothing), INSERT,
//!   COMMIT, ack. Hand-written effectively-once, against the dedup table a
//!   user would write: (handler, message id) as text, and the time, indexed
//!   for a purge.
//! - `idem`: an `#[idempotent]` handler run by `idem_runtime::Router`.
//! - `idem-batch`: the same, batched (`Route::batch(B)`): `concurrency`
//!   batches of up to B messages in flight, one transaction each.
//! - `idem-batch-handler`: the same batches, handed to an
//!   `#[idempotent(batch)]` handler that writes the fresh messages of each
//!   with one statement.
//! - `idem-default`: the `idem` handler on a route left at its defaults for
//!   batching (adaptive: see `Route::adaptive_batch`), where `idem` asks
//!   for `Route::per_message()`.
//! - `idem-default-batch-handler`: the `idem-batch-handler` handler on a
//!   route left at its defaults.
//!
//! The hand-written modes pull the way an async-nats user would by default:
//! `consumer.messages()` (pull requests of 200, refilled ahead of need) fed
//! into `for_each_concurrent(C, ..)`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, Message};
use futures_util::StreamExt;
use idem_runtime::retention::Unbounded;
use idem_runtime::route;
use idem_runtime::{Route, Router, RouterHandle, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::BenchError;
use crate::run::Plan;

/// The handler name: the same in the `idem` claim and the `manual` dedup
/// insert, so both write identical dedup rows.
pub const HANDLER_NAME: &str = "bench.effect.v1";

/// How long JetStream waits for an ack, as the runtime's default.
const ACK_WAIT: Duration = Duration::from_secs(30);

/// What every message carries. `key` is the dedup key (32 random hex
/// digits, like a UUID); `published_us` is stored with the effect for
/// inspection (latency itself is measured on the bench's monotonic clock).
#[derive(Debug, Serialize, Deserialize)]
pub struct Payload {
    pub key: String,
    pub published_us: i64,
}

/// Which consumer to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Raw,
    Naive,
    Manual,
    Idem,
    IdemBatch,
    IdemBatchHandler,
    IdemDefault,
    IdemDefaultBatchHandler,
}

impl Mode {
    pub const ALL: [Mode; 8] = [
        Mode::Raw,
        Mode::Naive,
        Mode::Manual,
        Mode::Idem,
        Mode::IdemBatch,
        Mode::IdemBatchHandler,
        Mode::IdemDefault,
        Mode::IdemDefaultBatchHandler,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Raw => "raw",
            Mode::Naive => "naive",
            Mode::Manual => "manual",
            Mode::Idem => "idem",
            Mode::IdemBatch => "idem-batch",
            Mode::IdemBatchHandler => "idem-batch-handler",
            Mode::IdemDefault => "idem-default",
            Mode::IdemDefaultBatchHandler => "idem-default-batch-handler",
        }
    }

    pub fn uses_database(self) -> bool {
        self != Mode::Raw
    }

    /// Whether the bench's own code consumes (rather than the runtime).
    pub fn hand_written(self) -> bool {
        matches!(self, Mode::Raw | Mode::Naive | Mode::Manual)
    }

    /// Whether the mode writes a dedup row per message.
    pub fn dedups(self) -> bool {
        matches!(
            self,
            Mode::Manual
                | Mode::Idem
                | Mode::IdemBatch
                | Mode::IdemBatchHandler
                | Mode::IdemDefault
                | Mode::IdemDefaultBatchHandler
        )
    }

    /// Whether the runtime batches messages in this mode.
    pub fn batches(self) -> bool {
        matches!(self, Mode::IdemBatch | Mode::IdemBatchHandler)
    }

    /// Messages per transaction at most, as reported: `batch` for the modes
    /// that choose it; for those left at the runtime's defaults, the largest
    /// adaptive batch a route at `concurrency` takes within the default
    /// `max_ack_pending` (1000); 1 for the per-message modes.
    pub fn batch(self, batch: usize, concurrency: usize) -> usize {
        let adaptive_cap = |cap: usize| cap.min(1000 / concurrency.max(1)).max(1);
        match self {
            Mode::IdemBatch | Mode::IdemBatchHandler => batch,
            Mode::IdemDefault => adaptive_cap(route::DEFAULT_ADAPTIVE_MAX),
            Mode::IdemDefaultBatchHandler => {
                adaptive_cap(route::DEFAULT_ADAPTIVE_MAX_BATCH_HANDLER)
            }
            Mode::Raw | Mode::Naive | Mode::Manual | Mode::Idem => 1,
        }
    }

    /// Whether the mode runs the batch handler.
    fn batch_handler(self) -> bool {
        matches!(self, Mode::IdemBatchHandler | Mode::IdemDefaultBatchHandler)
    }
}

/// The one statement of handler work, shared by every database mode.
async fn insert_effect(conn: &mut PgConnection, payload: &Payload) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO bench_effects (message_key, published_us) VALUES ($1, $2)")
        .bind(&payload.key)
        .bind(payload.published_us)
        .execute(conn)
        .await?;
    Ok(())
}

/// The `idem` and `idem-batch` handler.
#[idempotent(name = "bench.effect.v1", key = msg.key)]
async fn effect(tx: &mut sqlx::PgTransaction<'_>, msg: Payload) -> Result<(), sqlx::Error> {
    insert_effect(tx, &msg).await
}

/// As [`effect()`], with the message's `Nats-Msg-Id` as its id (the default)
/// instead of a key expression: on a route that declares its
/// publisher-retry horizon, the runtime then knows the earliest time the
/// message can have been claimed, and its claim probes only the
/// generations sealed after it. A key expression may repeat at any time,
/// so its claim probes every sealed generation.
#[idempotent(name = "bench.effect.v1")]
async fn effect_by_msg_id(
    tx: &mut sqlx::PgTransaction<'_>,
    msg: Payload,
) -> Result<(), sqlx::Error> {
    insert_effect(tx, &msg).await
}

/// The contention scenario's handler: the effect, and 1 added to one of the
/// hot rows, picked by the key.
#[idempotent(name = "bench.effect.v1", key = msg.key)]
async fn effect_on_a_hot_row(
    tx: &mut sqlx::PgTransaction<'_>,
    msg: Payload,
) -> Result<(), sqlx::Error> {
    insert_effect(tx, &msg).await?;
    sqlx::query("UPDATE bench_hot SET total = total + 1 WHERE id = abs(hashtext($1)) % $2")
        .bind(&msg.key)
        .bind(crate::run::HOT_ROWS)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The `idem-batch-handler` handler: the fresh messages of a batch, written
/// with one statement.
#[idempotent(name = "bench.effect.v1", key = |msg| msg.key, batch)]
async fn effects(tx: &mut sqlx::PgTransaction<'_>, msgs: Vec<Payload>) -> Result<(), sqlx::Error> {
    let (keys, published): (Vec<String>, Vec<i64>) = msgs
        .into_iter()
        .map(|msg| (msg.key, msg.published_us))
        .unzip();
    sqlx::query(
        "INSERT INTO bench_effects (message_key, published_us) \
         SELECT * FROM unnest($1::text[], $2::int8[])",
    )
    .bind(keys)
    .bind(published)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The route for the batching modes: the one place that knows how the
/// runtime batches.
fn batch_route(route: Route, batch: usize, adaptive: bool) -> Route {
    if adaptive {
        route.adaptive_batch(batch)
    } else {
        route.batch(batch)
    }
}

/// Where a consumer reads from.
pub struct Source<'a> {
    pub stream: &'a str,
    pub subject: &'a str,
}

/// JetStream's max_ack_pending for every mode: the runtime's default,
/// raised if more messages can be in flight (the runtime refuses less).
fn max_ack_pending(in_flight: usize) -> i64 {
    (in_flight as i64).max(1000)
}

/// A running consumer of any mode.
pub enum Consumer {
    HandWritten {
        stop: watch::Sender<bool>,
        counts: Arc<Counts>,
        task: JoinHandle<Result<(), BenchError>>,
    },
    Framework {
        durable: String,
        handle: RouterHandle,
        task: JoinHandle<Result<(), idem_runtime::Error>>,
    },
}

/// What the hand-written consumers did.
#[derive(Debug, Default)]
pub struct Counts {
    pub acked: AtomicU64,
    pub duplicates: AtomicU64,
    pub errors: AtomicU64,
}

/// What a consumer reports after it stopped.
#[derive(Debug, Default)]
pub struct ConsumerReport {
    /// Messages committed and acked (raw: acked).
    pub processed: u64,
    pub duplicates: u64,
    pub errors: u64,
}

impl Consumer {
    /// Creates the durable consumer (or starts the router, which does) and
    /// starts consuming.
    /// Starts `plan`'s mode, with its concurrency, batch size, fetch and
    /// retention.
    pub async fn start(
        plan: &Plan,
        nats: &async_nats::Client,
        pool: Option<&PgPool>,
        source: Source<'_>,
    ) -> Result<Consumer, BenchError> {
        let Plan {
            mode,
            concurrency,
            batch,
            pull,
            retention,
            ..
        } = *plan;
        let durable = format!("bench-{}", mode.name());
        match mode {
            Mode::Raw | Mode::Naive | Mode::Manual => {
                let js = jetstream::new(nats.clone());
                let stream = js
                    .get_stream(source.stream)
                    .await
                    .map_err(|e| BenchError::failed(format!("get stream: {e}")))?;
                let consumer: PullConsumer = stream
                    .create_consumer(pull::Config {
                        durable_name: Some(durable),
                        ack_policy: AckPolicy::Explicit,
                        ack_wait: ACK_WAIT,
                        max_ack_pending: max_ack_pending(concurrency),
                        filter_subject: source.subject.to_owned(),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| BenchError::failed(format!("create consumer: {e}")))?;
                let (stop, stopped) = watch::channel(false);
                let counts = Arc::new(Counts::default());
                let task = tokio::spawn(hand_written(
                    mode,
                    consumer,
                    pool.cloned(),
                    concurrency,
                    pull,
                    stopped,
                    counts.clone(),
                ));
                Ok(Consumer::HandWritten { stop, counts, task })
            }
            Mode::Idem
            | Mode::IdemBatch
            | Mode::IdemBatchHandler
            | Mode::IdemDefault
            | Mode::IdemDefaultBatchHandler => {
                let pool = pool.expect("idem modes have a database").clone();
                let mut route = Route::new(source.stream, durable.clone())
                    .filter_subject(source.subject)
                    .ack_wait(ACK_WAIT)
                    .concurrency(concurrency)
                    .max_ack_pending(max_ack_pending(
                        concurrency * mode.batch(batch, concurrency),
                    ));
                if mode.batches() {
                    route = batch_route(route, batch, plan.adaptive);
                } else if mode == Mode::Idem {
                    route = route.per_message();
                }
                if let Some(retention) = retention {
                    // The bench's streams keep their messages (max_age 0),
                    // and no run republishes a message: the retention floor's
                    // unbounded terms do not apply here.
                    route = route
                        .retention(retention)
                        .publisher_retry_horizon(Duration::ZERO)
                        .accept_duplicates_after_retention(Unbounded::StreamMaxAge);
                }
                let router = if mode.batch_handler() {
                    Router::new().route(route, effects)
                } else if plan.hot_rows {
                    Router::new().route(route, effect_on_a_hot_row)
                } else if plan.id_from_header {
                    Router::new().route(route, effect_by_msg_id)
                } else {
                    Router::new().route(route, effect)
                };
                let handle = router.handle();
                let task = tokio::spawn(router.run_until(
                    nats.clone(),
                    pool,
                    std::future::pending::<()>(),
                ));
                Ok(Consumer::Framework {
                    durable,
                    handle,
                    task,
                })
            }
        }
    }

    /// The durable consumer a router makes at start-up (`None` for a
    /// hand-written consumer, which has made its own before it starts).
    pub fn durable(&self) -> Option<&str> {
        match self {
            Consumer::HandWritten { .. } => None,
            Consumer::Framework { durable, .. } => Some(durable),
        }
    }

    /// Whether the consumer stopped by itself (an error: it should run until
    /// told to stop).
    pub fn ended(&self) -> bool {
        match self {
            Consumer::HandWritten { task, .. } => task.is_finished(),
            Consumer::Framework { task, .. } => task.is_finished(),
        }
    }

    /// Its counters so far, for progress and stall reports.
    pub fn progress(&self) -> ConsumerReport {
        match self {
            Consumer::HandWritten { counts, .. } => ConsumerReport {
                processed: counts.acked.load(Ordering::Relaxed),
                duplicates: counts.duplicates.load(Ordering::Relaxed),
                errors: counts.errors.load(Ordering::Relaxed),
            },
            Consumer::Framework {
                durable, handle, ..
            } => match handle.stats(durable) {
                Some(stats) => ConsumerReport {
                    processed: stats.processed(),
                    duplicates: stats.duplicates(),
                    errors: stats.failed() + stats.commit_failed() + stats.rejected(),
                },
                None => ConsumerReport::default(),
            },
        }
    }

    /// Stops consuming, lets in-flight messages finish, and reports.
    pub async fn stop(self) -> Result<ConsumerReport, BenchError> {
        let report = self.progress();
        let ended = match self {
            Consumer::HandWritten { stop, task, .. } => {
                let _ = stop.send(true);
                task.await
                    .map_err(|e| BenchError::failed(format!("consumer task: {e}")))?
            }
            Consumer::Framework { handle, task, .. } => {
                handle.shutdown();
                task.await
                    .map_err(|e| BenchError::failed(format!("router task: {e}")))?
                    .map_err(|e| BenchError::failed(format!("router: {e}")))
            }
        };
        ended.map(|()| report)
    }
}

/// How the hand-written modes fetch messages (`--pull`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pull {
    /// `consumer.messages()`: async-nats keeps pull requests of 200 going
    /// ahead of need. What a hand-written consumer does by default.
    Prefetch,
    /// The runtime's strategy, for attributing the difference: wait for a
    /// free slot, pull exactly as many messages as there are free slots,
    /// spawn a task per message.
    Slots,
}

impl Pull {
    pub fn name(self) -> &'static str {
        match self {
            Pull::Prefetch => "prefetch",
            Pull::Slots => "slots",
        }
    }
}

/// `--pull prefetch|slots`, by [`Pull::name`].
impl clap::ValueEnum for Pull {
    fn value_variants<'a>() -> &'a [Self] {
        &[Pull::Prefetch, Pull::Slots]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

/// The hand-written consumer loop of `raw`, `naive` and `manual`.
async fn hand_written(
    mode: Mode,
    consumer: PullConsumer,
    pool: Option<PgPool>,
    concurrency: usize,
    pull: Pull,
    mut stopped: watch::Receiver<bool>,
    counts: Arc<Counts>,
) -> Result<(), BenchError> {
    if pull == Pull::Slots {
        return pull_slots(mode, consumer, pool, concurrency, stopped, counts).await;
    }
    let messages = consumer
        .messages()
        .await
        .map_err(|e| BenchError::failed(format!("start pulling: {e}")))?;
    let stop = async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    messages
        .take_until(stop)
        .for_each_concurrent(concurrency, |message| {
            let pool = pool.as_ref();
            let counts = &counts;
            async move {
                match message {
                    Ok(message) => handle_and_count(mode, pool, message, counts).await,
                    Err(error) => {
                        tracing::warn!(%error, "pull failed");
                        counts.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
        .await;
    Ok(())
}

/// [`Pull::Slots`]: only as many messages as there are free slots.
async fn pull_slots(
    mode: Mode,
    consumer: PullConsumer,
    pool: Option<PgPool>,
    concurrency: usize,
    mut stopped: watch::Receiver<bool>,
    counts: Arc<Counts>,
) -> Result<(), BenchError> {
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut tasks = JoinSet::new();
    loop {
        let first = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("never closed"),
            _ = stopped.wait_for(|stop| *stop) => break,
        };
        let mut free = vec![first];
        while let Ok(slot) = slots.clone().try_acquire_owned() {
            free.push(slot);
        }
        while tasks.try_join_next().is_some() {}
        let mut batch = consumer
            .batch()
            .max_messages(free.len())
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .map_err(|e| BenchError::failed(format!("pull: {e}")))?;
        while let Some(message) = batch.next().await {
            let Ok(message) = message else { break };
            let slot = free.pop().expect("no more messages than free slots");
            let (pool, counts) = (pool.clone(), counts.clone());
            tasks.spawn(async move {
                handle_and_count(mode, pool.as_ref(), message, &counts).await;
                drop(slot);
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

async fn handle_and_count(mode: Mode, pool: Option<&PgPool>, message: Message, counts: &Counts) {
    match handle(mode, pool, &message).await {
        Ok(Handled::Processed) => {
            counts.acked.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Handled::Duplicate) => {
            counts.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        Err(error) => {
            tracing::warn!(%error, mode = mode.name(), "message failed; NAKing it");
            counts.errors.fetch_add(1, Ordering::Relaxed);
            let _ = message.ack_with(AckKind::Nak(None)).await;
        }
    }
}

enum Handled {
    Processed,
    Duplicate,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One message of a hand-written mode: its transaction, then the ack.
async fn handle(mode: Mode, pool: Option<&PgPool>, message: &Message) -> Result<Handled, BoxError> {
    let handled = match (mode, pool) {
        (Mode::Raw, _) => Handled::Processed,
        (Mode::Naive, Some(pool)) => {
            let payload: Payload = serde_json::from_slice(&message.payload)?;
            let mut tx = pool.begin().await?;
            insert_effect(&mut tx, &payload).await?;
            tx.commit().await?;
            Handled::Processed
        }
        (Mode::Manual, Some(pool)) => {
            let payload: Payload = serde_json::from_slice(&message.payload)?;
            let mut tx = pool.begin().await?;
            let claimed = sqlx::query(
                "INSERT INTO manual_processed_messages (handler, message_id) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
            )
            .bind(HANDLER_NAME)
            .bind(&payload.key)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if claimed == 1 {
                insert_effect(&mut tx, &payload).await?;
                tx.commit().await?;
                Handled::Processed
            } else {
                tx.rollback().await?;
                Handled::Duplicate
            }
        }
        _ => return Err(format!("{} is not a hand-written database mode", mode.name()).into()),
    };
    message.ack().await?;
    Ok(handled)
}
