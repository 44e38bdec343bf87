//! The chaos worker's day-two profile (`CHAOS_PROFILE=day-two`), for the
//! chaos suite's day-two mode (`tests/tests/chaos/day_two.rs`): the parts of
//! a service that production's ordinary accidents meet, all in one router.
//!
//! - **The credit route** runs `credit_and_tell`, named like the kill
//!   profile's handler (`chaos-credit-v1`, so the suite's ledger checks
//!   hold): the same ledger effect, plus a notice of each credit queued in
//!   the outbox for `CHAOS_OUT_SUBJECT`. While `dt_flags` holds an
//!   `audit_subject` it also queues a copy for that subject, and records
//!   the copy's id in `dt_audit_queued` in the same transaction: a feature
//!   deployed before the stream that stores its subject.
//! - **The mirror route** (`CHAOS_MIRROR_DURABLE`, handler
//!   `chaos-mirror-v1`) is a second durable on the credit subject that
//!   dedups by the payload's `ref` (`key = cmd.reference`), where the credit
//!   route dedups by the `Nats-Msg-Id`. A credit whose `ref` is in
//!   `dt_frozen` fails permanently there (a dead letter), until the test
//!   deletes the row (the fix) and replays the dead letter.
//! - **The order route**, a request/reply route on `CHAOS_PLACE_SUBJECT`,
//!   runs `chaos-place.v1` or `chaos-place.v2` (`CHAOS_PLACE_VERSION`): two
//!   names of one handler, as a rolling rename runs them side by side. Each
//!   run of its body writes a row of `dt_orders` (no unique key: a second
//!   run shows) and replies with its transaction id, so a retry that runs
//!   the body again gets another reply. Its claims expire
//!   (`CHAOS_PLACE_RETENTION_MS`): it is the handler with a retention, so the
//!   router's purge rotates and expires claim generations all run long.
//!   Its clients retry for `CHAOS_PLACE_RETRY_HORIZON_MS` and its handler
//!   is stopped after `CHAOS_PLACE_HANDLER_TIMEOUT_MS`, so that so short a
//!   retention is above its retention floor (horizon + 3 × timeout). The
//!   route is named after its subject (the default), so both versions
//!   share its claims (`reply:<subject>`) and its queue group.
//! - **An outbox relay**, in batches of `CHAOS_RELAY_BATCH` rows.
//!
//! | variable | default | |
//! |---|---|---|
//! | `CHAOS_OUT_SUBJECT` | required | where the credit handler's notices go |
//! | `CHAOS_MIRROR_DURABLE` | `chaos-mirror` | the mirror route's durable, on `CHAOS_STREAM` |
//! | `CHAOS_PLACE_SUBJECT` | required | the order route's request subject |
//! | `CHAOS_PLACE_VERSION` | 1 | which name the order handler runs under: `chaos-place.v1` or `.v2` |
//! | `CHAOS_PLACE_RETENTION_MS` | 6000 | the order route's retention |
//! | `CHAOS_PLACE_RETRY_HORIZON_MS` | 2000 | how long the order route's clients retry a request |
//! | `CHAOS_PLACE_HANDLER_TIMEOUT_MS` | 500 | the order route's handler timeout |
//! | `CHAOS_RELAY_BATCH` | 8 | the relay's rows per cycle |

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::outbox::{Outbox, OutboxError, Relay};
use idem_runtime::{
    Classify, Delivery, ErrorClass, ReplyRoute, Route, Router, RouterHandle, State, idempotent,
};
use serde::{Deserialize, Serialize};
use sqlx::PgTransaction;

use crate::{Credit, HandlerDelay, WorkerState, apply_credit, env_or, journal};

/// The profile's tables, beside the kill profile's.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS dt_mirror (
    ref        text        NOT NULL,
    message_id text        NOT NULL,
    worker_pid integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS dt_frozen (ref text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS dt_flags (name text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS dt_audit_queued (
    msg_id     text NOT NULL,
    subject    text NOT NULL,
    message_id text NOT NULL
);
CREATE TABLE IF NOT EXISTS dt_orders (
    order_id   bigint      NOT NULL,
    request_id text        NOT NULL,
    handler    text        NOT NULL,
    txid       bigint      NOT NULL,
    worker_pid integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
";

/// The profile's settings, from the environment.
#[derive(Debug, Clone)]
pub struct Config {
    out_subject: String,
    mirror_durable: String,
    place_subject: String,
    place_version: u8,
    place_retention: Duration,
    place_retry_horizon: Duration,
    place_handler_timeout: Duration,
    relay_batch: usize,
}

impl Config {
    pub fn from_env() -> Result<Config, String> {
        let required = |name: &str| {
            std::env::var(name).map_err(|_| format!("{name} must be set for CHAOS_PROFILE=day-two"))
        };
        let config = Config {
            out_subject: required("CHAOS_OUT_SUBJECT")?,
            mirror_durable: env_or("CHAOS_MIRROR_DURABLE", "chaos-mirror".to_owned())?,
            place_subject: required("CHAOS_PLACE_SUBJECT")?,
            place_version: env_or("CHAOS_PLACE_VERSION", 1)?,
            place_retention: Duration::from_millis(env_or("CHAOS_PLACE_RETENTION_MS", 6000)?),
            place_retry_horizon: Duration::from_millis(env_or(
                "CHAOS_PLACE_RETRY_HORIZON_MS",
                2000,
            )?),
            place_handler_timeout: Duration::from_millis(env_or(
                "CHAOS_PLACE_HANDLER_TIMEOUT_MS",
                500,
            )?),
            relay_batch: env_or("CHAOS_RELAY_BATCH", 8)?,
        };
        if !matches!(config.place_version, 1 | 2) {
            return Err(format!(
                "CHAOS_PLACE_VERSION={}: 1 or 2",
                config.place_version
            ));
        }
        Ok(config)
    }

    /// Connections the profile's routes hold beside the credit route's.
    pub fn connections(&self, concurrency: usize) -> usize {
        concurrency + PLACE_CONCURRENCY
    }
}

/// Requests the order route runs at once in one worker.
const PLACE_CONCURRENCY: usize = 4;

/// What the profile's handlers take from the router's state.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// `CHAOS_OUT_SUBJECT` (empty in the kill profile, which sends nothing).
    out_subject: Arc<str>,
}

impl Settings {
    pub fn of(config: Option<&Config>) -> Settings {
        Settings {
            out_subject: config.map_or("", |c| c.out_subject.as_str()).into(),
        }
    }
}

/// The day-two router: the credit route (with `credit_and_tell`), the
/// mirror route, the order route and a relay.
pub fn router(state: WorkerState, credit: Route, config: &crate::Config) -> Router<WorkerState> {
    let day_two = config.day_two.as_ref().expect("the day-two profile");
    let mirror_route = Route::new(&config.stream, &day_two.mirror_durable)
        .ack_wait(config.ack_wait)
        .concurrency(config.concurrency)
        .batch(config.batch);
    let place_route = ReplyRoute::new(&day_two.place_subject)
        .concurrency(PLACE_CONCURRENCY)
        .client_retry_horizon(day_two.place_retry_horizon)
        .handler_timeout(day_two.place_handler_timeout)
        .retention(day_two.place_retention);
    let router = Router::with_state(state)
        .route(credit, credit_and_tell)
        .route(mirror_route, mirror);
    let router = match day_two.place_version {
        1 => router.reply_route(place_route, place_v1),
        _ => router.reply_route(place_route, place_v2),
    };
    router.relay(Relay::new().batch_size(day_two.relay_batch))
}

/// The notice of a credit, queued in the outbox.
#[derive(Serialize)]
struct Credited<'a> {
    message_id: &'a str,
    account: i32,
    amount: i64,
}

/// The credit, its notice in the outbox, and while a feature flag says so,
/// a copy for the audit subject.
#[idempotent(name = "chaos-credit-v1")]
async fn credit_and_tell(
    tx: &mut PgTransaction<'_>,
    outbox: Outbox,
    State(HandlerDelay(delay)): State<HandlerDelay>,
    State(settings): State<Settings>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), OutboxError> {
    journal("begin", delivery);
    apply_credit(tx, delivery, &cmd).await?;
    let notice = Credited {
        message_id: delivery.message_id().as_str(),
        account: cmd.account,
        amount: cmd.amount,
    };
    outbox.send(tx, &settings.out_subject, &notice).await?;
    let audit: Option<String> =
        sqlx::query_scalar("SELECT value FROM dt_flags WHERE name = 'audit_subject'")
            .fetch_optional(&mut **tx)
            .await?;
    if let Some(subject) = audit {
        let msg_id = outbox.send(tx, &subject, &notice).await?;
        sqlx::query(
            "INSERT INTO dt_audit_queued (msg_id, subject, message_id) VALUES ($1, $2, $3)",
        )
        .bind(&msg_id)
        .bind(&subject)
        .bind(delivery.message_id().as_str())
        .execute(&mut **tx)
        .await?;
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    Ok(())
}

/// Why the mirror failed.
#[derive(Debug, thiserror::Error)]
enum MirrorError {
    /// The test froze this credit's ref: no retry helps until it is deleted
    /// from `dt_frozen`.
    #[error(
        "credit {0} is frozen in the mirror (dt_frozen); delete it there, then replay its dead letter"
    )]
    Frozen(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Classify for MirrorError {
    fn class(&self) -> ErrorClass {
        match self {
            MirrorError::Frozen(_) => ErrorClass::Permanent,
            MirrorError::Database(error) => ErrorClass::of_sqlx(error),
        }
    }
}

/// One row per applied credit, by its ref.
#[idempotent(name = "chaos-mirror-v1", key = cmd.reference)]
async fn mirror(
    tx: &mut PgTransaction<'_>,
    delivery: &Delivery,
    cmd: Credit,
) -> Result<(), MirrorError> {
    let frozen: bool = sqlx::query_scalar("SELECT EXISTS (SELECT FROM dt_frozen WHERE ref = $1)")
        .bind(&cmd.reference)
        .fetch_one(&mut **tx)
        .await?;
    if frozen {
        return Err(MirrorError::Frozen(cmd.reference));
    }
    sqlx::query("INSERT INTO dt_mirror (ref, message_id, worker_pid) VALUES ($1, $2, $3)")
        .bind(&cmd.reference)
        .bind(delivery.message_id().as_str())
        .bind(std::process::id() as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// An order request.
#[derive(Debug, Deserialize)]
struct Place {
    order: i64,
}

/// The reply: which handler ran the body, in which transaction.
#[derive(Serialize)]
struct Placed {
    order: i64,
    handler: &'static str,
    txid: i64,
}

#[idempotent(name = "chaos-place.v1")]
async fn place_v1(
    tx: &mut PgTransaction<'_>,
    delivery: &Delivery,
    cmd: Place,
) -> Result<Placed, sqlx::Error> {
    place(tx, delivery, cmd, "chaos-place.v1").await
}

#[idempotent(name = "chaos-place.v2")]
async fn place_v2(
    tx: &mut PgTransaction<'_>,
    delivery: &Delivery,
    cmd: Place,
) -> Result<Placed, sqlx::Error> {
    place(tx, delivery, cmd, "chaos-place.v2").await
}

/// Both versions' body: one `dt_orders` row per run.
async fn place(
    tx: &mut PgTransaction<'_>,
    delivery: &Delivery,
    cmd: Place,
    handler: &'static str,
) -> Result<Placed, sqlx::Error> {
    let txid: i64 = sqlx::query_scalar(
        "INSERT INTO dt_orders (order_id, request_id, handler, txid, worker_pid) \
         VALUES ($1, $2, $3, txid_current(), $4) RETURNING txid",
    )
    .bind(cmd.order)
    .bind(delivery.message_id().as_str())
    .bind(handler)
    .bind(std::process::id() as i32)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Placed {
        order: cmd.order,
        handler,
        txid,
    })
}

/// The profile's counters in each stats line.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Counters {
    mirror_processed: u64,
    mirror_duplicates: u64,
    mirror_rejected: u64,
    mirror_dead_lettered: u64,
    mirror_dead_letter_failed: u64,
    place_processed: u64,
    place_duplicates: u64,
    place_failed: u64,
    place_rejected: u64,
    relay_published: u64,
    relay_failed: u64,
    relay_cycles: u64,
}

impl Counters {
    /// Summed over every router this process ran.
    pub fn of(config: &Config, handles: &[RouterHandle]) -> Counters {
        let mut c = Counters::default();
        for handle in handles {
            if let Some(s) = handle.stats(&config.mirror_durable) {
                c.mirror_processed += s.processed();
                c.mirror_duplicates += s.duplicates();
                c.mirror_rejected += s.rejected();
                c.mirror_dead_lettered += s.dead_lettered();
                c.mirror_dead_letter_failed += s.dead_letter_failed();
            }
            if let Some(s) = handle.stats(&config.place_subject) {
                c.place_processed += s.processed();
                c.place_duplicates += s.duplicates();
                c.place_failed += s.failed();
                c.place_rejected += s.rejected();
            }
            if let Some(relay) = handle.relay() {
                c.relay_published += relay.published();
                c.relay_failed += relay.failed();
                c.relay_cycles += relay.cycles();
            }
        }
        c
    }
}
