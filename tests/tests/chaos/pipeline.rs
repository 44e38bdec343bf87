//! The example pipeline under chaos: the `orders` and `payments` services
//! (examples/pipeline/src/bin, two processes of each, each with its outbox
//! relay beside its router) run while orders flow, and the test SIGKILLs
//! and restarts them at random, restarts PostgreSQL with an immediate
//! shutdown, and SIGKILLs nats-server and restarts it on its store dir.
//!
//! Orders are published with `Nats-Msg-Id: order-<n>`, paced, retried
//! through the NATS outage with the same id; a tenth again at once (inside
//! JetStream's duplicate window) and a tenth again after the window (stored
//! twice; only the claim stops them).
//!
//! At the end:
//!
//! - every order exists once, is charged once (`charges`: N rows for N
//!   distinct orders) and was marked paid once (`times_paid = 1`: the
//!   `orders.paid` effect applied once), and each handler holds N claims;
//! - the outbox is empty; the three consumers have nothing pending and
//!   nothing awaiting ack; nothing was rejected or dead-lettered;
//! - every `payments.requested` or `orders.paid` the stream stores twice (a
//!   relay's republish after the duplicate window) was absorbed by the
//!   claim: its order is still charged once and paid once.
//!
//! # Proof that the faults landed
//!
//! - **Kills.** Each kill is aimed: the test polls `pg_stat_activity` for
//!   the target's sessions (each process has an `application_name` of its
//!   own) until a handler transaction is open, or, for a relay kill (every
//!   fourth), until its relay holds a batch it took (`FOR UPDATE SKIP
//!   LOCKED`) and is publishing it. It then freezes the process (SIGSTOP),
//!   reads what it holds (its sessions still inside a transaction, and
//!   through `pgrowlocks` the outbox rows its relay has locked), and
//!   SIGKILLs it. A handler transaction is told from the relay's own by
//!   what it locks: it has claimed, so it holds a lock on `idem_claims`,
//!   which a relay never touches. Every kill must have met work (a
//!   transaction open, messages in flight, or outbox rows held), at least
//!   three in four (every one aimed at it) must have frozen an open
//!   handler transaction. A relay's locked row that the stream already
//!   stored when the relay was frozen is a message published,
//!   acknowledged and not deleted: at least one relay kill must show one.
//!   Every second relay kill waits for a relay holding such a row and
//!   holds the freeze past the duplicate window before the SIGKILL: each
//!   of its such rows must then be stored twice (the next relay's
//!   republish is not a duplicate JetStream drops), and each copy absorbed
//!   (acked, its consumer's ack floor past it, and its order charged and
//!   paid once).
//! - **PostgreSQL restart:** while it is down, the routers' own counters
//!   (failed, retried in process, commit failed, infrastructure errors,
//!   abandoned transactions) must move; after it is back, they must
//!   commit again.
//! - **nats-server restart:** every running service's client reports the
//!   disconnect, then the reconnect.
//!
//! Faults are placed by progress (the number of charges), evenly spread
//! with jitter over the first two thirds or so of the orders, and strike
//! serving processes; the publisher stays at most half a fault spacing
//! ahead of the charges, so that each fault meets orders in flight (a kill
//! whose aim begins once the flow has reached its cap lets it go on by
//! half a spacing).
//!
//! # Modes
//!
//! Quick by default (500 orders, 8 kills; 20 to 45 s on a shared 2-core
//! machine), which CI runs:
//!
//! ```sh
//! cargo nextest run -p idem-tests --test chaos pipeline::
//! ```
//!
//! The long mode:
//!
//! ```sh
//! IDEM_PIPELINE_CHAOS_ORDERS=5000 cargo test -p idem-tests --test chaos -- --nocapture pipeline::
//! ```
//!
//! (5,000 orders and 10 kills: about 90 s.) Other knobs:
//! `IDEM_PIPELINE_CHAOS_KILLS` (default 8, or one per 500 orders if more;
//! below 4 no kill aims at a relay; `0` for a measuring run with only the
//! server restarts, which skips the kills' proofs),
//! `IDEM_PIPELINE_CHAOS_RATE` (orders published per second, default 40, 100
//! above 1,000 orders; the publisher also stays at most half a fault
//! spacing ahead of the charges), `IDEM_PIPELINE_CHAOS_SEED` (replays
//! the schedule a failed run printed), `IDEM_PIPELINE_CHAOS_LOG_DIR` (keep
//! the services' logs there; by default a temp dir kept only on failure).
//!
//! The test needs servers of its own: with `NATS_URL` or `DATABASE_URL` set
//! it is built as ignored, except under `CI` (see `tests/build.rs`). It
//! reads row locks with `pgrowlocks`, from PostgreSQL's contrib modules
//! (part of Debian's `postgresql-15`).

mod service;

use idem_tests::seeded::{Rng, env_or};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_tests::TestEnv;
use pipeline_example::{DUPLICATE_WINDOW, ORDERS_STREAM, OrderPlaced, PAYMENTS_STREAM};
use sqlx::PgPool;

use service::{Ended, Kind, Report, Service};

/// The services' ack wait: short, so a killed service's messages come
/// back soon (JetStream's default, 30 s, would stretch every kill).
const ACK_WAIT_MS: &str = "2000";
/// How long the pipeline may go without a new charge while faults are due.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a kill waits for its aim before it kills anyway.
const AIM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a service may take to exit after SIGTERM.
const SIGTERM_GRACE: Duration = Duration::from_secs(30);
/// The service processes: two of each.
const SLOTS: [Kind; 4] = [Kind::Orders, Kind::Orders, Kind::Payments, Kind::Payments];
/// The handlers' names (`#[idempotent(name = ..)]` in examples/pipeline).
const HANDLERS: [&str; 3] = [
    "orders.place.v1",
    "payments.charge.v1",
    "orders.mark-paid.v1",
];

/// What a kill aims at.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Aim {
    /// A handler transaction open in the target.
    Transaction,
    /// The target's relay holding a batch it is publishing. With `hold`,
    /// the batch must hold a row whose message the stream stored already
    /// (published, acknowledged, not deleted), and the target is kept
    /// frozen past the duplicate window before the SIGKILL, so that the
    /// next relay's publish of that row is stored again.
    Relay { hold: bool },
}

/// The condition, on `pg_stat_activity AS a`, that a session is inside a
/// handler transaction: it has claimed a message. The claim is the first
/// statement of every handler transaction, and a relay never touches
/// `idem_claims` (it reads and deletes outbox rows only), so this leaves
/// the relay's own transaction out whatever SQL it runs.
const HANDLER_TRANSACTION: &str = "a.backend_xid IS NOT NULL AND EXISTS (
    SELECT FROM pg_locks l
     WHERE l.pid = a.pid AND l.locktype = 'relation'
       AND l.relation = 'idem_claims'::regclass)";

/// The condition, on `pg_stat_activity AS a`, that a session is the relay
/// holding a batch it took and is publishing: its last message ran one of
/// the relay's takes, by the name of its prepared statement (the SQL it
/// sends is `BEGIN; SET LOCAL ...; EXECUTE idem_relay_take_fresh_v1(..)`,
/// and only a session's first message holds the statement's text).
const RELAY_PUBLISHING: &str = "a.state = 'idle in transaction' AND a.backend_xid IS NOT NULL
    AND a.query LIKE '%EXECUTE idem_relay_take_%'";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Kill(Aim),
    RestartPostgres,
    RestartNats,
}

/// An outbox row a frozen relay held locked.
#[derive(Debug, Clone)]
struct HeldRow {
    subject: String,
    order: i64,
    /// The last sequence of the row's stream while the relay was frozen:
    /// a copy stored at or below it was the frozen relay's publish.
    stream_last_seq: u64,
}

/// What one kill met.
#[derive(Debug)]
struct Kill {
    app: String,
    aim: Aim,
    /// Freezes it took to catch the aim (the last one is the kill's).
    attempts: u32,
    /// Its sessions inside a handler transaction (one that has claimed a
    /// message, see [`HANDLER_TRANSACTION`]) while the process was frozen:
    /// the first 60 characters of each one's latest statement.
    open_transactions: Vec<String>,
    /// Its other sessions inside a transaction that had written or locked
    /// something (a transaction id assigned): the relay's.
    other_transactions: Vec<String>,
    /// Messages its routers had received and not settled.
    in_flight: u64,
    /// Outbox rows its relay held locked.
    held_rows: Vec<HeldRow>,
    /// Outbox rows pending at the kill (any relay's).
    outbox_pending: i64,
}

impl Kill {
    fn met_work(&self) -> bool {
        !self.open_transactions.is_empty()
            || !self.other_transactions.is_empty()
            || self.in_flight > 0
            || !self.held_rows.is_empty()
    }
}

/// What the PostgreSQL restart did to the services.
#[derive(Debug, Default)]
struct PgRestart {
    failures_while_down: u64,
    processed_at_restart: u64,
    processed_after: u64,
    down_for: Duration,
}

/// What the nats-server restart did to each service running through it:
/// (app, disconnects, reconnects) it reported during the fault.
#[derive(Debug, Default)]
struct NatsRestart {
    seen: Vec<(String, u64, u64)>,
    down_for: Duration,
}

/// What the publisher sent.
#[derive(Debug, Default)]
struct Published {
    messages: u64,
    within_window: u64,
    after_window: u64,
    dropped_by_jetstream: u64,
    /// Publishes that failed (NATS down) and were sent again.
    retries: u64,
}

/// Publishes `orders.placed` for orders `1..=n` at `rate` per second, each
/// retried with its id until JetStream acknowledges it; every tenth again at
/// once (within the window) and, after all, orders `5, 15, ..` again after
/// the window. It publishes order `k` only once fewer than `ahead` orders
/// before it are uncharged, so that every fault (placed by the charges)
/// meets orders in flight, and only up to `cap`, which the schedule moves:
/// the flow may not outrun the faults.
async fn publish(
    js: jetstream::Context,
    pool: PgPool,
    n: i64,
    rate: f64,
    ahead: i64,
    cap: Arc<AtomicI64>,
) -> Published {
    let mut out = Published::default();
    let mut next = Instant::now();
    let send = async |order: i64, out: &mut Published| {
        let placed = OrderPlaced {
            order,
            amount: 1 + (order * 7).rem_euclid(100),
        };
        let payload: bytes::Bytes = serde_json::to_vec(&placed).expect("encodes").into();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("order-{order}").as_str(),
            );
            let acked = match js
                .publish_with_headers("orders.placed", headers, payload.clone())
                .await
            {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match acked {
                Ok(ack) => {
                    out.messages += 1;
                    out.dropped_by_jetstream += u64::from(ack.duplicate);
                    return;
                }
                Err(error) => {
                    assert!(
                        Instant::now() < deadline,
                        "order {order} was not published within 120 s: {error}"
                    );
                    out.retries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    };
    for order in 1..=n {
        // While PostgreSQL is down the charges are unknown: publish on, so
        // that the outage meets work.
        while cap.load(Ordering::Relaxed) < order
            || charges(&pool)
                .await
                .is_some_and(|made| made + ahead < order)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep_until(next.into()).await;
        next = Instant::now() + Duration::from_secs_f64(1.0 / rate);
        send(order, &mut out).await;
        if order % 10 == 0 {
            send(order, &mut out).await;
            out.within_window += 1;
        }
    }
    tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_millis(500)).await;
    for order in (5..=n).step_by(10) {
        send(order, &mut out).await;
        out.after_window += 1;
    }
    out
}

/// The service processes and everything they reported.
struct Services {
    nats_url: String,
    database_url: String,
    log_dir: PathBuf,
    slots: Vec<Option<Service>>,
    next_ordinal: usize,
    /// Every process that ended: killed, exited by itself, or stopped.
    ended: Vec<Ended>,
    /// Processes that exited by themselves, and when.
    unexpected: Vec<(Instant, String, String)>,
}

impl Services {
    fn spawn(&mut self, slot: usize) {
        self.next_ordinal += 1;
        let service = Service::spawn(
            SLOTS[slot],
            self.next_ordinal,
            &self.nats_url,
            &self.database_url,
            &[("PIPELINE_ACK_WAIT_MS", ACK_WAIT_MS.to_owned())],
            &self.log_dir,
        );
        self.slots[slot] = Some(service);
    }

    /// Restarts any service that exited by itself (as a supervisor would),
    /// recording the exit.
    fn supervise(&mut self) {
        for slot in 0..self.slots.len() {
            let exited = self.slots[slot].as_mut().and_then(Service::exited);
            if let Some(status) = exited {
                let ended = self.slots[slot].take().expect("present").reap(status);
                eprintln!(
                    "pipeline-chaos: {} exited by itself ({status}); restarting",
                    ended.app
                );
                self.unexpected
                    .push((Instant::now(), ended.app.clone(), ended.log_tail.clone()));
                self.ended.push(ended);
                self.spawn(slot);
            }
        }
    }

    /// The latest report of every running service, by app.
    fn reports(&self) -> Vec<(String, Report)> {
        self.slots
            .iter()
            .flatten()
            .filter_map(|s| Some((s.app.clone(), s.last()?)))
            .collect()
    }

    /// The latest report of `app`, running or ended.
    fn report_of(&self, app: &str) -> Option<Report> {
        self.slots
            .iter()
            .flatten()
            .find(|s| s.app == app)
            .and_then(Service::last)
            .or_else(|| {
                self.ended
                    .iter()
                    .find(|e| e.app == app)
                    .and_then(|e| e.last.clone())
            })
    }

    fn sum_over(&self, apps: &[String], field: impl Fn(&Report) -> u64) -> u64 {
        apps.iter()
            .filter_map(|app| self.report_of(app))
            .map(|r| field(&r))
            .sum()
    }
}

/// Charges made so far; `None` while PostgreSQL is down.
async fn charges(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .ok()
}

/// Polls until `app` shows what `aim` waits for; false at `deadline`.
async fn wait_for_aim(pool: &PgPool, app: &str, aim: Aim, deadline: Instant) -> bool {
    let sql = match aim {
        Aim::Transaction => format!(
            "SELECT count(*) FROM pg_stat_activity a
              WHERE a.application_name = $1 AND {HANDLER_TRANSACTION}"
        ),
        Aim::Relay { .. } => format!(
            "SELECT count(*) FROM pg_stat_activity a
              WHERE a.application_name = $1 AND {RELAY_PUBLISHING}"
        ),
    };
    while Instant::now() < deadline {
        // PostgreSQL may be restarting; the aim then simply waits.
        if let Ok(found) = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.as_str()))
            .bind(app)
            .fetch_one(pool)
            .await
            && found > 0
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

/// What a frozen process holds.
struct Frozen {
    /// Its sessions inside a handler transaction: the first 60 characters
    /// of each one's latest statement.
    handler_transactions: Vec<String>,
    /// Its other sessions inside a transaction that wrote or locked
    /// something.
    other_transactions: Vec<String>,
    /// The outbox rows its relay has locked: (subject, payload, msg_id).
    locked: Vec<(String, Vec<u8>, String)>,
}

/// Reads what the frozen process `app` holds.
async fn frozen_state(pool: &PgPool, app: &str) -> Frozen {
    let open: Vec<(String, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT left(a.query, 60), ({HANDLER_TRANSACTION}) FROM pg_stat_activity a
          WHERE a.application_name = $1 AND a.backend_xid IS NOT NULL"
    )))
    .bind(app)
    .fetch_all(pool)
    .await
    .expect("pg_stat_activity reads");
    let locked: Vec<(String, Vec<u8>, String)> = sqlx::query_as(
        "SELECT o.subject, o.payload, o.msg_id FROM idem_outbox o
           JOIN pgrowlocks('idem_outbox') l ON o.ctid = l.locked_row
          WHERE l.pids && ARRAY(SELECT pid FROM pg_stat_activity WHERE application_name = $1)",
    )
    .bind(app)
    .fetch_all(pool)
    .await
    .expect("pgrowlocks reads");
    let (handler, other): (Vec<_>, Vec<_>) = open.into_iter().partition(|(_, handler)| *handler);
    Frozen {
        handler_transactions: handler.into_iter().map(|(query, _)| query).collect(),
        other_transactions: other.into_iter().map(|(query, _)| query).collect(),
        locked,
    }
}

/// How far back from a stream's last message [`any_stored`] looks for a
/// locked row's copy: the relay published its batch just before it was
/// frozen, and the other relays at most a few batches since.
const STORED_LOOKBACK: u64 = 400;

/// Whether `stream` stores a message with one of the ids `ids` at or below
/// `last_seq`, looking back at most [`STORED_LOOKBACK`] messages from it.
async fn any_stored(js: &jetstream::Context, stream: &str, last_seq: u64, ids: &[&str]) -> bool {
    if ids.is_empty() {
        return false;
    }
    let handle = js.get_stream(stream).await.expect("stream");
    let first = last_seq.saturating_sub(STORED_LOOKBACK).max(1);
    for seq in (first..=last_seq).rev() {
        if let Ok(message) = handle.get_raw_message(seq).await
            && let Some(id) = message.headers.get(async_nats::header::NATS_MESSAGE_ID)
            && ids.contains(&id.as_str())
        {
            return true;
        }
    }
    false
}

/// Kills the service in `slot` as `aim` says, and starts a new one.
///
/// The kill is aimed: wait until the target shows the aim in
/// `pg_stat_activity`, freeze it (SIGSTOP), and look again at what it holds
/// now that it cannot move; if the aim slipped away in between, let it go
/// on (SIGCONT) and try again. `None` if the aim was not caught within
/// `AIM_TIMEOUT` (the target had no work: after a NATS reconnect a route can
/// take nothing for about 15 s, see README); the target then runs on.
async fn kill(
    services: &mut Services,
    pool: &PgPool,
    js: &jetstream::Context,
    slot: usize,
    aim: Aim,
) -> Option<Kill> {
    let deadline = Instant::now() + AIM_TIMEOUT;
    let mut attempts = 0;
    let (app, target, frozen, last_seq) = loop {
        attempts += 1;
        // A target that exited by itself (at start-up, while a server was
        // away) is replaced first, and the new one aimed at.
        services.supervise();
        let app = services.slots[slot].as_ref().expect("running").app.clone();
        let aimed = wait_for_aim(pool, &app, aim, deadline).await;
        let mut target = services.slots[slot].take().expect("running");
        target.freeze();
        if target.exited().is_some() {
            services.slots[slot] = Some(target);
            continue;
        }
        // Statements the server was running finish, and PubAcks come back
        // to a frozen relay (which cannot delete its rows now).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let frozen = frozen_state(pool, &app).await;
        let mut last_seq = BTreeMap::new();
        for stream in [ORDERS_STREAM, PAYMENTS_STREAM] {
            let mut handle = js.get_stream(stream).await.expect("stream");
            let info = handle.info().await.expect("stream info");
            last_seq.insert(stream, info.state.last_sequence);
        }
        let caught = match aim {
            Aim::Transaction => !frozen.handler_transactions.is_empty(),
            Aim::Relay { hold: false } => !frozen.locked.is_empty(),
            // Held past the window only if a row is already stored,
            // so that the republish after the window is stored again.
            Aim::Relay { hold: true } => {
                let mut published = false;
                for stream in [ORDERS_STREAM, PAYMENTS_STREAM] {
                    let ids: Vec<&str> = frozen
                        .locked
                        .iter()
                        .filter(|(subject, ..)| stream_of(subject) == stream)
                        .map(|(.., id)| id.as_str())
                        .collect();
                    published |= any_stored(js, stream, last_seq[stream], &ids).await;
                }
                published
            }
        };
        if aimed && caught {
            break (app, target, frozen, last_seq);
        }
        target.thaw();
        services.slots[slot] = Some(target);
        if Instant::now() >= deadline {
            return None;
        }
    };
    if aim == (Aim::Relay { hold: true }) {
        // Past the duplicate window: the next relay's publish of these
        // rows is stored again, and only the claims downstream stop it.
        tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_millis(500)).await;
    }
    let held_rows = frozen
        .locked
        .into_iter()
        .map(|(subject, payload, _)| HeldRow {
            order: order_of(&payload),
            stream_last_seq: last_seq[stream_of(&subject)],
            subject,
        })
        .collect();
    let outbox_pending = idem_runtime::outbox::lag(pool)
        .await
        .expect("outbox lag")
        .pending;
    let in_flight = target.last().map_or(0, |r| r.in_flight());
    let ended = target.sigkill();
    assert!(
        ended.was_sigkilled(),
        "{app} ended by SIGKILL: {:?}",
        ended.status
    );
    services.ended.push(ended);
    services.spawn(slot);
    Some(Kill {
        app,
        aim,
        attempts,
        open_transactions: frozen.handler_transactions,
        other_transactions: frozen.other_transactions,
        in_flight,
        held_rows,
        outbox_pending,
    })
}

/// The stream that stores `subject`.
fn stream_of(subject: &str) -> &'static str {
    if subject.starts_with("payments.") {
        PAYMENTS_STREAM
    } else {
        ORDERS_STREAM
    }
}

fn order_of(payload: &[u8]) -> i64 {
    #[derive(serde::Deserialize)]
    struct ForOrder {
        order: i64,
    }
    serde_json::from_slice::<ForOrder>(payload)
        .expect("a pipeline message names its order")
        .order
}

/// Every message of `stream`: the sequences stored per (subject, order).
async fn scan(js: &jetstream::Context, stream: &str) -> BTreeMap<(String, i64), Vec<u64>> {
    let mut handle = js.get_stream(stream).await.expect("stream");
    let state = handle.info().await.expect("stream info").state.clone();
    let mut stored: BTreeMap<(String, i64), Vec<u64>> = BTreeMap::new();
    for seq in state.first_sequence..=state.last_sequence {
        let message = handle
            .get_raw_message(seq)
            .await
            .expect("no message is deleted");
        stored
            .entry((message.subject.to_string(), order_of(&message.payload)))
            .or_default()
            .push(seq);
    }
    stored
}

/// Waits, supervising, until `done` holds for the services' reports.
async fn wait_reports(
    services: &mut Services,
    what: &str,
    timeout: Duration,
    mut done: impl FnMut(&Services) -> bool,
) {
    let deadline = Instant::now() + timeout;
    loop {
        services.supervise();
        if done(services) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {timeout:?}; reports: {:?}",
            services.reports()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn restart_postgres(env: &mut TestEnv, services: &mut Services) -> PgRestart {
    let apps: Vec<String> = services.reports().into_iter().map(|(app, _)| app).collect();
    let failures_before = services.sum_over(&apps, Report::failures);
    let down = Instant::now();
    env.postgres_mut().stop_immediate().await;
    // Down until the routers have met the outage in their own counters.
    wait_reports(
        services,
        "a router failure while PostgreSQL is down",
        Duration::from_secs(30),
        |s| s.sum_over(&apps, Report::failures) > failures_before,
    )
    .await;
    let failures_while_down = services.sum_over(&apps, Report::failures) - failures_before;
    let processed_at_restart = services.sum_over(&apps, Report::processed);
    env.postgres_mut().start_again().await;
    let down_for = down.elapsed();
    // Processes that started while it was down exited and were restarted:
    // count every service running now.
    let mut after: Vec<String> = apps.clone();
    wait_reports(
        services,
        "a commit after the PostgreSQL restart",
        Duration::from_secs(60),
        |s| {
            after = apps
                .iter()
                .cloned()
                .chain(s.reports().into_iter().map(|(app, _)| app))
                .collect();
            after.sort();
            after.dedup();
            s.sum_over(&after, Report::processed) > processed_at_restart
        },
    )
    .await;
    PgRestart {
        failures_while_down,
        processed_at_restart,
        processed_after: services.sum_over(&after, Report::processed),
        down_for,
    }
}

async fn restart_nats(env: &mut TestEnv, services: &mut Services) -> NatsRestart {
    let before: Vec<(String, Report)> = services.reports();
    let down = Instant::now();
    env.nats_server_mut().kill();
    let running = |s: &Services, app: &str| s.slots.iter().flatten().any(|x| x.app == app);
    wait_reports(
        services,
        "every service seeing nats-server go",
        Duration::from_secs(30),
        |s| {
            before.iter().all(|(app, b)| {
                !running(s, app)
                    || s.report_of(app)
                        .is_some_and(|r| r.nats_disconnects > b.nats_disconnects)
            })
        },
    )
    .await;
    env.nats_server_mut().start_again().await;
    let down_for = down.elapsed();
    wait_reports(
        services,
        "every service reconnecting to nats-server",
        Duration::from_secs(60),
        |s| {
            before.iter().all(|(app, b)| {
                !running(s, app)
                    || s.report_of(app)
                        .is_some_and(|r| r.nats_reconnects > b.nats_reconnects)
            })
        },
    )
    .await;
    NatsRestart {
        seen: before
            .iter()
            .filter_map(|(app, b)| {
                let r = services.report_of(app)?;
                Some((
                    app.clone(),
                    r.nats_disconnects - b.nats_disconnects,
                    r.nats_reconnects - b.nats_reconnects,
                ))
            })
            .collect(),
        down_for,
    }
}

async fn consumers_idle(js: &jetstream::Context) -> bool {
    for (stream, durable) in [
        (ORDERS_STREAM, "orders-place"),
        (ORDERS_STREAM, "orders-mark-paid"),
        (PAYMENTS_STREAM, "payments-charge"),
    ] {
        let Ok(stream) = js.get_stream(stream).await else {
            return false;
        };
        match stream.consumer_info(durable).await {
            Ok(info) if info.num_pending == 0 && info.num_ack_pending == 0 => {}
            _ => return false,
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn each_order_is_paid_once_while_services_die_and_servers_restart() {
    idem_tests::require_own_servers();
    let began = Instant::now();
    let n: i64 = env_or("IDEM_PIPELINE_CHAOS_ORDERS", 500);
    let kills: usize = env_or("IDEM_PIPELINE_CHAOS_KILLS", 8.max(n as usize / 500));
    let rate: f64 = env_or(
        "IDEM_PIPELINE_CHAOS_RATE",
        if n > 1000 { 100.0 } else { 40.0 },
    );
    let seed: u64 = env_or(
        "IDEM_PIPELINE_CHAOS_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos() as u64,
    );
    eprintln!(
        "pipeline-chaos: {n} orders, {kills} kills, {rate}/s, IDEM_PIPELINE_CHAOS_SEED={seed}"
    );
    let mut rng = Rng(seed);
    let log_dir = match std::env::var_os("IDEM_PIPELINE_CHAOS_LOG_DIR") {
        Some(dir) => {
            std::fs::create_dir_all(&dir).expect("log dir");
            tempfile::Builder::new()
                .prefix("pipeline-chaos-")
                .tempdir_in(dir)
                .expect("log dir")
                .keep()
        }
        None => tempfile::Builder::new()
            .prefix("idem-pipeline-chaos-")
            .tempdir()
            .expect("log dir")
            .keep(),
    };

    let mut env = TestEnv::start().await;
    let pool = env.pool().await;
    let js = env.jetstream().await;
    // Once here, so that four processes starting together do not race to
    // create the same tables.
    pipeline_example::orders::migrate(&pool)
        .await
        .expect("orders schema");
    pipeline_example::payments::migrate(&pool)
        .await
        .expect("payments schema");
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pgrowlocks")
        .execute(&pool)
        .await
        .expect("pgrowlocks (PostgreSQL contrib) installs");

    let mut services = Services {
        nats_url: env.nats_url().to_owned(),
        database_url: env.database_url().to_owned(),
        log_dir: log_dir.clone(),
        slots: (0..SLOTS.len()).map(|_| None).collect(),
        next_ordinal: 0,
        ended: Vec::new(),
        unexpected: Vec::new(),
    };
    for slot in 0..SLOTS.len() {
        services.spawn(slot);
    }
    pipeline_example::demo::wait_for_streams(&js, Duration::from_secs(60))
        .await
        .expect("the services create their streams");
    wait_reports(
        &mut services,
        "every service reporting",
        Duration::from_secs(60),
        |s| s.reports().len() == SLOTS.len(),
    )
    .await;

    // The fault schedule: every fourth kill aims at a relay, the others at
    // a handler transaction, so that at least three kills in four freeze
    // one whatever the number of kills (a relay's batch and a handler
    // transaction of the same process are rarely open at once: a relay
    // kill that waited for both timed out in 4 runs of 6). Every second
    // relay kill holds its freeze past the duplicate window.
    let mut faults: Vec<Fault> = (0..kills)
        .map(|i| match i % 4 {
            3 => Fault::Kill(Aim::Relay { hold: i % 8 == 3 }),
            _ => Fault::Kill(Aim::Transaction),
        })
        .chain([Fault::RestartPostgres, Fault::RestartNats])
        .collect();
    for i in (1..faults.len()).rev() {
        faults.swap(i, rng.below(i as u64 + 1) as usize);
    }
    eprintln!("pipeline-chaos: schedule {faults:?}");

    // The faults fall within the first two thirds or so of the orders, so
    // that the last one still meets a good part of the flow.
    let spacing = n as u64 / (faults.len() as u64 + 4);
    let dues: Vec<i64> = (0..faults.len() as u64)
        .map(|i| (spacing * (i + 1) + rng.below(spacing / 2 + 1)) as i64)
        .collect();
    // While fault i is due or running, the flow may reach half a spacing
    // past fault i + 1: it goes on while a fault is aimed and struck, and
    // cannot run out before the last fault.
    let half = (spacing as i64 / 2).max(10);
    let cap_for = |i: usize| dues.get(i + 1).map_or(n, |due| due + half);
    let cap = Arc::new(AtomicI64::new(cap_for(0)));
    let publisher = tokio::spawn(publish(
        env.jetstream().await,
        env.pool().await,
        n,
        rate,
        half,
        cap.clone(),
    ));
    let flow_start = Instant::now();

    let mut kill_records = Vec::new();
    let mut passed_over = 0;
    let mut pg = None;
    let mut nats = None;
    // When PostgreSQL or nats-server was down: a service may exit by itself
    // then (one that starts cannot connect), and only then.
    let mut outages: Vec<(Instant, Instant)> = Vec::new();
    for (i, fault) in faults.iter().enumerate() {
        let due = dues[i];
        cap.fetch_max(cap_for(i), Ordering::Relaxed);
        let mut last_progress = (charges(&pool).await.unwrap_or(0), Instant::now());
        loop {
            services.supervise();
            let now = charges(&pool).await.unwrap_or(0);
            if now >= due {
                break;
            }
            if now > last_progress.0 {
                last_progress = (now, Instant::now());
            }
            assert!(
                last_progress.1.elapsed() < STALL_TIMEOUT,
                "no charge for {STALL_TIMEOUT:?} at {now}/{n} before fault {i} ({fault:?}); logs in {}",
                log_dir.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        let at = flow_start.elapsed();
        match *fault {
            Fault::Kill(aim) => {
                // A serving process: one restarted a moment ago may still
                // be starting, and meet the rest of the flow too late.
                let serving: Vec<usize> = (0..SLOTS.len())
                    .filter(|&slot| {
                        services.slots[slot]
                            .as_ref()
                            .is_some_and(|s| s.last().is_some())
                    })
                    .collect();
                assert!(!serving.is_empty(), "no service is serving");
                let first = rng.below(serving.len() as u64) as usize;
                // A target with no work is passed over for the next one.
                let mut record = None;
                for next in 0..serving.len() {
                    let slot = serving[(first + next) % serving.len()];
                    // Orders in flight for the aim to meet: a flow that
                    // reached its cap before the aim began (the fault
                    // before took long, say) would leave it nothing.
                    if let Some(made) = charges(&pool).await {
                        cap.fetch_max(made + half, Ordering::Relaxed);
                    }
                    record = kill(&mut services, &pool, &js, slot, aim).await;
                    if record.is_some() {
                        break;
                    }
                    passed_over += 1;
                    // More orders, for the next target to meet.
                    cap.fetch_add(half, Ordering::Relaxed);
                }
                let record = record.unwrap_or_else(|| {
                    panic!(
                        "no serving service showed {aim:?} within {AIM_TIMEOUT:?}; logs in {}",
                        log_dir.display()
                    )
                });
                eprintln!("pipeline-chaos: {at:.1?} kill {record:?}");
                kill_records.push(record);
            }
            Fault::RestartPostgres => {
                let start = Instant::now();
                let record = restart_postgres(&mut env, &mut services).await;
                outages.push((start, Instant::now()));
                eprintln!("pipeline-chaos: {at:.1?} PostgreSQL restart {record:?}");
                pg = Some(record);
            }
            Fault::RestartNats => {
                let start = Instant::now();
                let record = restart_nats(&mut env, &mut services).await;
                outages.push((start, Instant::now()));
                eprintln!("pipeline-chaos: {at:.1?} nats-server restart {record:?}");
                nats = Some(record);
            }
        }
    }
    let faults_done = flow_start.elapsed();
    cap.store(n, Ordering::Relaxed);

    // Settle: the publisher done, every order paid, the outbox empty, the
    // consumers idle.
    let published = loop {
        services.supervise();
        if publisher.is_finished() {
            break publisher.await.expect("the publisher does not panic");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let settle_deadline = Instant::now() + Duration::from_secs(120);
    loop {
        services.supervise();
        let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE times_paid > 0")
            .fetch_one(&pool)
            .await
            .expect("orders read");
        let pending = idem_runtime::outbox::lag(&pool).await.expect("lag").pending;
        if paid == n && pending == 0 && consumers_idle(&js).await {
            break;
        }
        assert!(
            Instant::now() < settle_deadline,
            "the pipeline did not settle: {paid}/{n} paid, {pending} outbox rows pending; logs in {}",
            log_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let settled = flow_start.elapsed();
    // Stop the services gracefully: each must exit 0. A service restarted
    // late may still be starting, before it handles SIGTERM: wait until
    // each one serves (reports).
    wait_reports(
        &mut services,
        "every service serving",
        Duration::from_secs(60),
        |s| s.reports().len() == SLOTS.len(),
    )
    .await;
    for slot in 0..SLOTS.len() {
        let service = services.slots[slot].take().expect("running");
        let ended = service.sigterm(SIGTERM_GRACE).await.expect("graceful stop");
        assert!(
            ended.status.success(),
            "{} exited {:?} on SIGTERM\n{}",
            ended.app,
            ended.status,
            ended.log_tail
        );
        services.ended.push(ended);
    }

    // ---- Effects: exactly once, end to end.
    let (orders, paid_once, paid_other): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE times_paid = 1),
                count(*) FILTER (WHERE times_paid <> 1) FROM orders",
    )
    .fetch_one(&pool)
    .await
    .expect("orders read");
    let (charge_rows, charged_orders): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT order_id) FROM charges")
            .fetch_one(&pool)
            .await
            .expect("charges read");
    assert_eq!(
        (orders, paid_once, paid_other),
        (n, n, 0),
        "each order exists once and is paid once"
    );
    assert_eq!(
        (charge_rows, charged_orders),
        (n, n),
        "each order is charged once"
    );
    for handler in HANDLERS {
        let claims: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_claims c JOIN idem_handlers h ON h.id = c.handler_id
              WHERE h.name = $1",
        )
        .bind(handler)
        .fetch_one(&pool)
        .await
        .expect("claims read");
        assert_eq!(claims, n, "{handler} claimed each order once");
    }
    let outbox = idem_runtime::outbox::lag(&pool).await.expect("lag").pending;
    assert_eq!(outbox, 0, "the outbox is empty");
    assert!(
        consumers_idle(&js).await,
        "no consumer has anything pending or awaiting ack"
    );
    let dead_letters = match js
        .get_stream(idem_runtime::dead_letter::DEFAULT_STREAM)
        .await
    {
        Ok(mut stream) => {
            stream
                .info()
                .await
                .expect("dead letters info")
                .state
                .messages
        }
        Err(_) => 0,
    };
    assert_eq!(dead_letters, 0, "nothing was dead-lettered");
    let rejected: u64 = services
        .ended
        .iter()
        .filter_map(|e| e.last.as_ref())
        .map(Report::rejected)
        .sum();
    assert_eq!(
        rejected, 0,
        "no service rejected or dead-lettered a message"
    );

    // ---- The streams: what was stored twice was absorbed.
    let mut stored = scan(&js, ORDERS_STREAM).await;
    stored.extend(scan(&js, PAYMENTS_STREAM).await);
    let copies = |subject: &str| -> (usize, usize) {
        let for_subject: Vec<&Vec<u64>> = stored
            .iter()
            .filter(|((s, _), _)| s == subject)
            .map(|(_, seqs)| seqs)
            .collect();
        (
            for_subject.len(),
            for_subject.iter().map(|seqs| seqs.len()).sum(),
        )
    };
    let (placed_orders, placed_messages) = copies("orders.placed");
    let (requested_orders, requested_messages) = copies("payments.requested");
    let (paid_orders, paid_messages) = copies("orders.paid");
    let n_us = n as usize;
    assert_eq!(
        (placed_orders, requested_orders, paid_orders),
        (n_us, n_us, n_us),
        "every order has its three messages in the streams"
    );
    assert!(
        placed_messages >= n_us + published.after_window as usize,
        "the publisher's duplicates after the window are stored: {placed_messages}"
    );
    // Every order's effects were checked above to be exactly once; the
    // orders stored twice are those where the claim did the absorbing.
    let republished = (requested_messages - n_us) + (paid_messages - n_us);

    // ---- Proof that the faults landed.
    // (`IDEM_PIPELINE_CHAOS_KILLS=0`, a measuring run, has no kills to
    // prove; under 4 kills none aims at a relay.)
    let missed: Vec<&Kill> = kill_records.iter().filter(|k| !k.met_work()).collect();
    assert!(missed.is_empty(), "kills that met no work: {missed:?}");
    // Only handler transactions count (a relay's own transaction does not).
    let open = kill_records
        .iter()
        .filter(|k| !k.open_transactions.is_empty())
        .count();
    assert!(
        open * 4 >= kill_records.len() * 3,
        "at least three kills in four froze an open handler transaction: {open} of {}",
        kill_records.len()
    );
    let missed_transaction: Vec<&Kill> = kill_records
        .iter()
        .filter(|k| k.aim == Aim::Transaction && k.open_transactions.is_empty())
        .collect();
    assert!(
        missed_transaction.is_empty(),
        "kills aimed at a handler transaction that froze none: {missed_transaction:#?}"
    );
    // Rows a frozen relay held whose message the stream stored by then:
    // published and acknowledged, not deleted.
    let published_not_deleted: Vec<(&Kill, &HeldRow)> = kill_records
        .iter()
        .flat_map(|k| k.held_rows.iter().map(move |row| (k, row)))
        .filter(|(_, row)| {
            stored[&(row.subject.clone(), row.order)]
                .first()
                .is_some_and(|&seq| seq <= row.stream_last_seq)
        })
        .collect();
    let relay_kills = kill_records
        .iter()
        .filter(|k| matches!(k.aim, Aim::Relay { .. }))
        .count();
    assert!(
        relay_kills == 0 || !published_not_deleted.is_empty(),
        "no relay kill froze a relay between its PubAck and its DELETE: {kill_records:#?}"
    );
    // Every kill that held its relay past the window found such a row (its
    // aim requires one), and each such row was published again after the
    // window by the next relay: stored twice, a copy JetStream could not
    // drop, which only the claims downstream absorb.
    let held_kills = faults
        .iter()
        .filter(|f| **f == Fault::Kill(Aim::Relay { hold: true }))
        .count();
    let held_past_window: Vec<&(&Kill, &HeldRow)> = published_not_deleted
        .iter()
        .filter(|(k, _)| k.aim == Aim::Relay { hold: true })
        .collect();
    for kill in kill_records
        .iter()
        .filter(|k| k.aim == Aim::Relay { hold: true })
    {
        assert!(
            held_past_window.iter().any(|(k, _)| std::ptr::eq(*k, kill)),
            "a relay held past the window held no row the stream had stored: {kill:#?}"
        );
    }
    assert_eq!(
        kill_records
            .iter()
            .filter(|k| k.aim == Aim::Relay { hold: true })
            .count(),
        held_kills,
        "every kill scheduled to hold its relay past the window did"
    );
    let stored_once_only: Vec<&&(&Kill, &HeldRow)> = held_past_window
        .iter()
        .filter(|(_, row)| stored[&(row.subject.clone(), row.order)].len() < 2)
        .collect();
    assert!(
        stored_once_only.is_empty(),
        "a relay frozen past the window left messages the stream stored once only: {stored_once_only:?}"
    );
    let stored_twice_after_hold = held_past_window.len();
    assert!(
        republished >= stored_twice_after_hold && (held_kills == 0 || republished > 0),
        "the copies stored after the window are in the streams: {republished} relay copies, \
         {stored_twice_after_hold} rows held past the window"
    );
    // Absorbed: each copy was delivered and acked (its consumer's ack floor
    // is past it), and its order's effect is still exactly once.
    for (subject, stream, durable) in [
        ("payments.requested", PAYMENTS_STREAM, "payments-charge"),
        ("orders.paid", ORDERS_STREAM, "orders-mark-paid"),
    ] {
        let floor = js
            .get_stream(stream)
            .await
            .expect("stream")
            .consumer_info(durable)
            .await
            .expect("consumer info")
            .ack_floor
            .stream_sequence;
        for ((s, order), seqs) in stored
            .iter()
            .filter(|((s, _), seqs)| s == subject && seqs.len() > 1)
        {
            let last = *seqs.last().expect("stored");
            assert!(
                last <= floor,
                "the copy of {s} for order {order} at sequence {last} was acked ({durable}'s ack floor is {floor})"
            );
            let (times_paid, charges): (i32, i64) = sqlx::query_as(
                "SELECT o.times_paid, (SELECT count(*) FROM charges c WHERE c.order_id = o.id)
                   FROM orders o WHERE o.id = $1",
            )
            .bind(order)
            .fetch_one(&pool)
            .await
            .expect("the order is read");
            assert_eq!(
                (times_paid, charges),
                (1, 1),
                "order {order}, whose {s} was stored {} times, was charged and paid once",
                seqs.len()
            );
        }
    }
    let pg = pg.expect("the PostgreSQL restart ran");
    assert!(pg.failures_while_down > 0 && pg.processed_after > pg.processed_at_restart);
    let nats = nats.expect("the nats-server restart ran");
    assert!(
        !nats.seen.is_empty() && nats.seen.iter().all(|(_, d, r)| *d > 0 && *r > 0),
        "every service saw nats-server go and come back: {nats:?}"
    );

    // A service exits by itself only when a server it needs is gone (at
    // start-up, say); within a few seconds of an outage's end at most.
    for (at, app, tail) in &services.unexpected {
        assert!(
            outages
                .iter()
                .any(|(start, end)| *start <= *at && *at <= *end + Duration::from_secs(10)),
            "{app} exited by itself, away from any server outage:\n{tail}"
        );
    }
    let attempts: Vec<u32> = kill_records.iter().map(|k| k.attempts).collect();
    let killed: Vec<&str> = kill_records.iter().map(|k| k.app.as_str()).collect();
    let pending_at_kills: Vec<i64> = kill_records.iter().map(|k| k.outbox_pending).collect();
    let relay_duplicates: u64 = services
        .ended
        .iter()
        .filter_map(|e| e.last.as_ref())
        .map(|r| r.relay_duplicates)
        .sum();
    let claim_duplicates: u64 = services
        .ended
        .iter()
        .filter_map(|e| e.last.as_ref())
        .map(Report::duplicates)
        .sum();
    eprintln!(
        "pipeline-chaos: done in {:.1?} (flow {:.1?}: faults over by {faults_done:.1?}, settled at {settled:.1?}); \
         {} processes ran ({} killed: {killed:?}; {} exited by themselves); published {published:?}; \
         streams: orders.placed {placed_messages}, payments.requested {requested_messages}, orders.paid {paid_messages} \
         ({republished} relay copies stored twice, absorbed); relay PubAcks flagged duplicate {relay_duplicates}; \
         claims skipped {claim_duplicates} (last reports); freezes per kill {attempts:?}, targets passed over {passed_over}, kills with an open handler transaction {open}/{}, \
         outbox rows pending at each kill {pending_at_kills:?}, \
         rows published and not deleted at a kill {} ({} held past the window, {stored_twice_after_hold} of them stored twice); \
         PostgreSQL down {:.1?} ({} router failures); nats-server down {:.1?}; logs in {}",
        began.elapsed(),
        settled,
        services.ended.len(),
        kill_records.len(),
        services.unexpected.len(),
        kill_records.len(),
        published_not_deleted.len(),
        held_past_window.len(),
        pg.down_for,
        pg.failures_while_down,
        nats.down_for,
        log_dir.display(),
    );
    for (at, app, tail) in &services.unexpected {
        eprintln!(
            "pipeline-chaos: {app} exited by itself at {:.1?}:\n{tail}",
            at.duration_since(began)
        );
    }
    // Passed: the logs are not needed, unless asked for.
    if std::env::var_os("IDEM_PIPELINE_CHAOS_LOG_DIR").is_none() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
}
