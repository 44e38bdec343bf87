//! Day-two mode (`day_two_accidents_*`): ordinary operational accidents
//! while traffic flows, each shown to have happened, in an order drawn from
//! the seed, and after each one, proof that everything makes progress
//! again within a stated bound.
//!
//! The worker runs the chaos worker's day-two profile
//! (`src/bin/chaos_worker/day_two.rs`): the credit route (which also queues a
//! notice per credit in the outbox), a second route on the credit subject
//! that dedups by the payload's `ref` (the *mirror*), a request/reply route
//! for orders whose claims expire (so the router's purge rotates and expires
//! claim generations all along), and an outbox relay in batches of 8. Beside
//! the credits the test publishes, a client sends order requests (10 a
//! second; every fourth one again with the same id once answered, as a
//! client that lost the reply does; a request that gets no answer is retried
//! with its id for 2 s, then given up; it is sent only while the client is
//! connected, since async-nats would send what it buffered during an outage
//! after the reconnect, past that horizon), and a writer in the same database
//! queues outbox rows of its own (20 transactions a second), as an HTTP
//! endpoint would.
//!
//! # The accidents
//!
//! | accident | what the test does | how it checks that it happened |
//! |---|---|---|
//! | `subject` | a deploy: the credit handler starts queueing a copy of each notice for a subject no stream stores (a flag in `dt_flags`); the stream is created later | a relay batch's worth (8) of rows for the subject are pending, and JetStream has no stream for it |
//! | `payload` | 8 (the route's concurrency) undecodable messages, each 64 to 448 B under `max_payload` with its headers, then credits behind them | JetStream stored them, and both routes' consumers delivered them |
//! | `purge` | the purge's session is terminated between two steps of an expiry (`pg_terminate_backend`), where it waits on a lock the test holds: between the `DETACH` and the `DROP` (quick mode), or inside the `DETACH`, or between the `DROP` and forgetting the generation (long mode, in turn) | the backend held the purge's advisory lock and was blocked by the test's session in that statement; the generation's state after the kill is read from the catalog |
//! | `foreign` | a transaction left open in another database of the server (`BEGIN; SELECT txid_current()`), and an idle-in-transaction session in this one, held for longer than two generations, so rotations fall due | both sessions are `idle in transaction` in `pg_stat_activity` |
//! | `rename` | a rolling deploy renames the order handler (`chaos-place.v1` ↔ `.v2`): a worker with the new name starts, both serve, then the old one gets SIGTERM | both versions answered requests during the overlap, and the client retried some meanwhile |
//! | `replay` | the mirror fails permanently on three credits that the credit route applies; after the fix, the mirror's dead letters are replayed | the three dead letters are the mirror's, and the credit route applied those credits |
//! | `nats` | nats-server is SIGKILLed and kept down for longer than the relay's back-off (5 s), while the writer keeps queuing, faster, then restarted on its store | the worker's client reports the disconnect and the reconnect |
//!
//! # Liveness
//!
//! A watch samples every 100 ms what each part has done: the ledger (the
//! credit route), the mirror's rows, the order requests answered, the
//! messages the relay got stored, and the purge's state. The purge makes
//! progress when a rotation or the end of a transition happens while nothing
//! is overdue (no generation sealed longer than the retention plus a
//! generation plus 2 s) or left half done by an interrupted expiry (no
//! partition detached or half-detached, no generation without its
//! partition). After each accident ends, every part must make
//! progress within the bound (15 s; the purge within two generations plus
//! 2 s); while an accident stands (the subject without a stream, the foreign
//! transaction, the overlap of a rename; and during the NATS outage, the
//! purge, which does not need NATS), every part must keep making progress,
//! its longest gap within the bound. The test prints a table of these times
//! for each accident.
//!
//! Each accident also has its own check: the rows that waited for the new
//! stream are stored, the near-limit messages are dead-lettered by both
//! routes, the interrupted generation is cleaned up, no order ran twice, the
//! replayed dead letters are applied by the mirror and by no other route,
//! and PostgreSQL's notification queue did not grow while NATS was away.
//!
//! At the end, as in the other modes: every credit applied exactly once by
//! the credit route and the mirror; one notice per credit and one message
//! per writer row stored downstream, each once; every order answered ran
//! its body once (and a retry got the first reply, byte for byte); the
//! dead-letter stream holds exactly the accidents' dead letters; nothing
//! pending in either consumer or the outbox; the purge healthy; and no
//! order request given up while no accident stood (from a retry horizon
//! before one began until the order route made progress after it ended).
//!
//! # Modes
//!
//! Quick by default (2,000 credits, each accident once; about a minute),
//! which CI runs:
//!
//! ```sh
//! cargo nextest run -p idem-tests --test chaos day_two
//! ```
//!
//! The long mode (about 15 minutes):
//!
//! ```sh
//! IDEM_CHAOS_MESSAGES=20000 IDEM_CHAOS_DAY_TWO_ROUNDS=3 IDEM_CHAOS_FOREIGN_HOLD_S=180 \
//!   IDEM_CHAOS_NATS_AWAY_S=60 cargo test -p idem-tests --test chaos -- --nocapture day_two
//! ```
//!
//! Knobs: `IDEM_CHAOS_DAY_TWO_ROUNDS` (each accident this many times,
//! default 1), `IDEM_CHAOS_ACCIDENTS` (a comma-separated subset, by the
//! names above, to run one accident alone), `IDEM_CHAOS_FOREIGN_HOLD_S` (how
//! long the foreign transaction stays open), `IDEM_CHAOS_NATS_AWAY_S` (how
//! long nats-server stays down, default 8), `IDEM_CHAOS_PURGE_KILL` (where
//! the first purge kill strikes: `before-drop`, the default, `in-detach` or
//! `after-drop`; later rounds take the next), `IDEM_CHAOS_LIVENESS_BOUND_S`
//! (default 15); `IDEM_CHAOS_MESSAGES` (default 2,000), `IDEM_CHAOS_RATE`
//! (default 120 a second), `IDEM_CHAOS_SEED`, `IDEM_CHAOS_LOG_DIR` and
//! `IDEM_CHAOS_WORKER_LOG` as in the other modes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use idem_runtime::dead_letter::{self, Filter};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::{JoinHandle, JoinSet};

use super::{
    Expected, Fault, FaultDriver, HANDLER, Rng, Route, SIGTERM_GRACE, Setup, credit_ref, drive,
    env_or, message_id, place, seed,
};

/// The mirror route's durable and handler (`src/bin/chaos_worker/day_two.rs`).
const MIRROR_DURABLE: &str = "chaos-mirror";
const MIRROR_HANDLER: &str = "chaos-mirror-v1";
/// The order route's retention: the only handler with one, so the purge's.
const RETENTION: Duration = Duration::from_secs(4);
/// The worker's concurrency per route (`CHAOS_CONCURRENCY`, set by `setup`).
const CONCURRENCY: u64 = 8;
/// The relay's rows per cycle (`CHAOS_RELAY_BATCH`).
const RELAY_BATCH: i64 = 8;
/// `Relay`'s default longest back-off, which the NATS outage outlasts.
const RELAY_MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Credits the mirror dead-letters per replay accident.
const FROZEN_PER_REPLAY: u64 = 3;
/// The order client: a request every 100 ms, each attempt waits 1 s for its
/// reply, and a request is retried (same id) for 2 s before it is given up.
/// The order route's retention (4 s) outlasts that, plus three of its
/// handler timeouts (the worker's default, 500 ms): its retention floor.
const REQUEST_EVERY: Duration = Duration::from_millis(100);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
const CLIENT_RETRY_HORIZON: Duration = Duration::from_secs(2);
/// The writer's pace, and its pace while NATS is away.
const SIDE_EVERY: Duration = Duration::from_millis(50);
const SIDE_BURST_EVERY: Duration = Duration::from_millis(2);
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// The purge's session advisory lock (`PURGE_LOCK` in `store/purge.rs`).
const PURGE_LOCK: i64 = 0x6964_656d_5f65_7870;

/// An ordinary operational accident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Accident {
    /// A subject deployed before its stream.
    UnstoredSubject,
    /// Undecodable messages near `max_payload`, and valid ones behind them.
    NearMaxPayload,
    /// The purge's session terminated between two steps of an expiry.
    PurgeKilled,
    /// A transaction left open in another database, and one idle in this
    /// one, while rotations fall due.
    ForeignTransaction,
    /// The order handler renamed in a rolling deploy.
    RollingRename,
    /// A dead letter replayed while another route shares its subject.
    SharedReplay,
    /// nats-server away for longer than the relay's back-off.
    NatsAway,
}

const ACCIDENTS: [Accident; 7] = [
    Accident::UnstoredSubject,
    Accident::NearMaxPayload,
    Accident::PurgeKilled,
    Accident::ForeignTransaction,
    Accident::RollingRename,
    Accident::SharedReplay,
    Accident::NatsAway,
];

impl Accident {
    fn name(self) -> &'static str {
        match self {
            Accident::UnstoredSubject => "subject",
            Accident::NearMaxPayload => "payload",
            Accident::PurgeKilled => "purge",
            Accident::ForeignTransaction => "foreign",
            Accident::RollingRename => "rename",
            Accident::SharedReplay => "replay",
            Accident::NatsAway => "nats",
        }
    }

    fn parse(name: &str) -> Accident {
        ACCIDENTS
            .into_iter()
            .find(|a| a.name() == name.trim())
            .unwrap_or_else(|| {
                panic!(
                    "IDEM_CHAOS_ACCIDENTS: unknown accident {name:?}; the accidents are {:?}",
                    ACCIDENTS.map(Accident::name)
                )
            })
    }
}

/// What must keep making progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Part {
    /// The credit route: ledger rows.
    Credit,
    /// The mirror route: its rows.
    Mirror,
    /// The order route: requests answered.
    Orders,
    /// The outbox relay: messages stored downstream.
    Relay,
    /// The purge: rotations and ended transitions, nothing overdue.
    Purge,
}

const PARTS: [Part; 5] = [
    Part::Credit,
    Part::Mirror,
    Part::Orders,
    Part::Relay,
    Part::Purge,
];

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Credit => "credit",
            Part::Mirror => "mirror",
            Part::Orders => "orders",
            Part::Relay => "relay",
            Part::Purge => "purge",
        }
    }
}

/// The mode's settings, from the environment.
#[derive(Debug, Clone)]
struct Knobs {
    rounds: usize,
    accidents: Vec<Accident>,
    /// How soon every part but the purge must make progress.
    bound: Duration,
    /// How soon the purge must: two generations (a rotation and the end of
    /// its transition fall within one) plus 2 s.
    purge_bound: Duration,
    foreign_hold: Duration,
    nats_away: Duration,
    /// Where the first purge kill strikes (an index into [`KILL_POINTS`]).
    first_kill_point: usize,
}

impl Knobs {
    fn from_env() -> Knobs {
        let generation = idem_runtime::expiry::generation_length(RETENTION);
        let purge_bound = generation * 2 + Duration::from_secs(2);
        let accidents = match std::env::var("IDEM_CHAOS_ACCIDENTS") {
            Ok(list) => list.split(',').map(Accident::parse).collect(),
            Err(_) => ACCIDENTS.to_vec(),
        };
        Knobs {
            rounds: env_or("IDEM_CHAOS_DAY_TWO_ROUNDS", 1),
            accidents,
            bound: Duration::from_secs(env_or("IDEM_CHAOS_LIVENESS_BOUND_S", 15)),
            purge_bound,
            // Long enough for a transition stuck from the next rotation on
            // to show as a gap well past the purge's bound.
            foreign_hold: Duration::from_secs(env_or(
                "IDEM_CHAOS_FOREIGN_HOLD_S",
                (purge_bound + Duration::from_secs(4)).as_secs(),
            )),
            first_kill_point: match std::env::var("IDEM_CHAOS_PURGE_KILL").as_deref() {
                Err(_) | Ok("before-drop") => 0,
                Ok("in-detach") => 1,
                Ok("after-drop") => 2,
                Ok(other) => {
                    panic!("IDEM_CHAOS_PURGE_KILL={other:?}: before-drop, in-detach or after-drop")
                }
            },
            nats_away: Duration::from_secs(env_or(
                "IDEM_CHAOS_NATS_AWAY_S",
                (RELAY_MAX_BACKOFF + Duration::from_secs(3)).as_secs(),
            )),
        }
    }

    fn bound(&self, part: Part) -> Duration {
        match part {
            Part::Purge => self.purge_bound,
            _ => self.bound,
        }
    }

    /// A generation sealed longer ago than this is overdue.
    fn overdue_after() -> Duration {
        RETENTION + idem_runtime::expiry::generation_length(RETENTION) + Duration::from_secs(2)
    }
}

/// Subjects and streams of the mode, derived from the run's stream.
#[derive(Debug, Clone)]
struct Names {
    stream: String,
    /// Stores the credit notices and the writer's rows.
    out_stream: String,
    out_subject: String,
    side_subject: String,
    place_subject: String,
}

impl Names {
    fn of(stream: &str) -> Names {
        Names {
            stream: stream.to_owned(),
            out_stream: format!("{stream}_OUT"),
            out_subject: format!("{stream}.credited"),
            side_subject: format!("{stream}.side"),
            place_subject: format!("{stream}.place"),
        }
    }

    /// Round `round`'s subject deployed before its stream, and the stream.
    fn audit(&self, round: usize) -> (String, String) {
        (
            format!("{}.audit{round}", self.stream),
            format!("{}_AUDIT{round}", self.stream),
        )
    }
}

/// The mode's traffic, streams and watch, kept in the run's [`Setup`].
pub struct Context {
    knobs: Knobs,
    names: Names,
    requester: Arc<Requester>,
    side: Arc<SideWriter>,
    watch: Arc<Watch>,
    tasks: Vec<JoinHandle<()>>,
    /// The other database of the server, for the foreign transaction.
    foreign: PgConnectOptions,
    max_payload: usize,
    /// The order handler's version the workers run now.
    place_version: u8,
    /// How many times each accident has run.
    rounds: HashMap<Accident, usize>,
    /// The credits the run publishes.
    messages: u64,
    rng: Rng,
}

impl Context {
    async fn start(setup: &Setup, knobs: Knobs, rng: Rng, messages: u64) -> Context {
        let names = Names::of(&setup.stream);
        setup
            .js
            .create_stream(stream::Config {
                name: names.out_stream.clone(),
                subjects: vec![names.out_subject.clone(), names.side_subject.clone()],
                storage: stream::StorageType::File,
                // Longer than any run: a relay's republish is dropped here,
                // so the stream holds each message once.
                duplicate_window: Duration::from_secs(3600),
                ..Default::default()
            })
            .await
            .expect("the downstream stream is created");
        sqlx::query("CREATE DATABASE dt_foreign")
            .execute(&setup.pool)
            .await
            .expect("the foreign database is created");
        // The NOTIFY trigger on, as for relays in other processes: the
        // workers' relays then LISTEN, so that NATS being away checks that
        // they keep reading their notifications (off, nothing notifies).
        // The schema first, which the workers would apply.
        idem_runtime::schema::migrate(&setup.pool)
            .await
            .expect("the schema is applied");
        sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_notify")
            .execute(&setup.pool)
            .await
            .expect("the outbox's NOTIFY trigger is enabled");
        let nats = setup.env.nats().await;
        let max_payload = nats.server_info().max_payload;
        let requester = Arc::new(Requester::new(nats, names.place_subject.clone()));
        let side = Arc::new(SideWriter::new(
            setup.pool.clone(),
            names.side_subject.clone(),
        ));
        let watch = Arc::new(Watch::default());
        let tasks = vec![
            tokio::spawn(requester.clone().run()),
            tokio::spawn(side.clone().run()),
            tokio::spawn(watch.clone().run(
                setup.pool.clone(),
                setup.js.clone(),
                names.out_stream.clone(),
                requester.clone(),
            )),
        ];
        Context {
            knobs,
            names,
            requester,
            side,
            watch,
            tasks,
            foreign: setup
                .pool
                .connect_options()
                .as_ref()
                .clone()
                .database("dt_foreign"),
            max_payload,
            place_version: 1,
            rounds: HashMap::new(),
            messages,
            rng,
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

// ---------------------------------------------------------------------------
// The watch: what each part has done, sampled.

/// What the parts had done at one moment.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    credit: i64,
    mirror: i64,
    orders: u64,
    /// Messages in the downstream stream; `None` while NATS cannot say.
    relay: Option<u64>,
    purge: PurgeState,
}

/// The purge's state: the claims generations, and what an interrupted or
/// stopped purge leaves.
#[derive(Debug, Clone, PartialEq)]
struct PurgeState {
    current: i32,
    transition: bool,
    /// Generations sealed longer ago than [`Knobs::overdue_after`].
    overdue: i64,
    /// What an expiry cut short leaves: claim partitions not (or not
    /// fully) attached, and generations whose partition is gone.
    leftover: i64,
}

impl PurgeState {
    fn healthy(&self) -> bool {
        self.overdue == 0 && self.leftover == 0
    }
}

#[derive(Default)]
struct Watch {
    state: Mutex<WatchState>,
    stop: AtomicBool,
}

#[derive(Default)]
struct WatchState {
    /// When each part was seen to make progress.
    progress: HashMap<Part, Vec<Instant>>,
    last: Option<Sample>,
    /// The downstream stream's last known count.
    relay_seen: u64,
}

impl Watch {
    async fn run(
        self: Arc<Self>,
        pool: PgPool,
        js: jetstream::Context,
        out_stream: String,
        requester: Arc<Requester>,
    ) {
        let mut ticks = tokio::time::interval(SAMPLE_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            // Before the first worker made the tables, there is nothing to see.
            if let Some(sample) = sample(&pool, &js, &out_stream, &requester).await {
                self.observe(Instant::now(), sample);
            }
        }
    }

    fn observe(&self, at: Instant, sample: Sample) {
        let mut state = self.state.lock().expect("watch lock");
        let mut moved = Vec::new();
        if let Some(prev) = &state.last {
            if sample.credit > prev.credit {
                moved.push(Part::Credit);
            }
            if sample.mirror > prev.mirror {
                moved.push(Part::Mirror);
            }
            if sample.orders > prev.orders {
                moved.push(Part::Orders);
            }
            if sample.relay.is_some_and(|n| n > state.relay_seen) {
                moved.push(Part::Relay);
            }
            let (now, before) = (&sample.purge, &prev.purge);
            let stepped = (now.current, now.transition) != (before.current, before.transition);
            let recovered = now.healthy() && !before.healthy();
            if now.healthy() && (stepped || recovered) {
                moved.push(Part::Purge);
            }
        }
        for part in moved {
            state.progress.entry(part).or_default().push(at);
        }
        if let Some(n) = sample.relay {
            state.relay_seen = state.relay_seen.max(n);
        }
        state.last = Some(sample);
    }

    fn last(&self) -> Option<Sample> {
        self.state.lock().expect("watch lock").last.clone()
    }

    /// How long after `since` `part` first made progress.
    fn first_after(&self, part: Part, since: Instant) -> Option<Duration> {
        let state = self.state.lock().expect("watch lock");
        state
            .progress
            .get(&part)?
            .iter()
            .find(|&&at| at > since)
            .map(|&at| at - since)
    }

    /// When `part` last made progress at or before `at`, if it ever did.
    fn last_at_or_before(&self, part: Part, at: Instant) -> Option<Instant> {
        let state = self.state.lock().expect("watch lock");
        state
            .progress
            .get(&part)?
            .iter()
            .rev()
            .find(|&&when| when <= at)
            .copied()
    }

    /// The longest `part` went without progress from `from` to `to`.
    fn longest_gap(&self, part: Part, from: Instant, to: Instant) -> Duration {
        let state = self.state.lock().expect("watch lock");
        let mut last = from;
        let mut longest = Duration::ZERO;
        for &at in state.progress.get(&part).into_iter().flatten() {
            if at <= from {
                continue;
            }
            if at > to {
                break;
            }
            longest = longest.max(at - last);
            last = at;
        }
        longest.max(to.saturating_duration_since(last))
    }
}

async fn sample(
    pool: &PgPool,
    js: &jetstream::Context,
    out_stream: &str,
    requester: &Requester,
) -> Option<Sample> {
    let row: (i64, i64, i32, bool, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM chaos_ledger),
                (SELECT count(*) FROM dt_mirror),
                s.current_gen, s.transition,
                (SELECT count(*) FROM idem_generations g
                  WHERE g.sealed_at <= now() - $1::bigint * interval '1 millisecond'),
                (SELECT count(*) FROM pg_class c
                  WHERE c.relkind = 'r' AND c.relname ~ '^idem_claims_g[0-9]+$'
                    AND NOT EXISTS (SELECT FROM pg_inherits i
                                     WHERE i.inhrelid = c.oid AND NOT i.inhdetachpending))
                + (SELECT count(*) FROM idem_generations g
                    WHERE to_regclass('idem_claims_g' || g.gen) IS NULL)
           FROM idem_dedup_state s",
    )
    .bind(Knobs::overdue_after().as_millis() as i64)
    .fetch_one(pool)
    .await
    .ok()?;
    let relay = async {
        let mut stream = js.get_stream(out_stream).await.ok()?;
        Some(stream.info().await.ok()?.state.messages)
    };
    let relay = tokio::time::timeout(Duration::from_secs(1), relay)
        .await
        .ok()
        .flatten();
    Some(Sample {
        credit: row.0,
        mirror: row.1,
        orders: requester.replied.load(Ordering::Relaxed),
        relay,
        purge: PurgeState {
            current: row.2,
            transition: row.3,
            overdue: row.4,
            leftover: row.5,
        },
    })
}

// ---------------------------------------------------------------------------
// The order client.

/// How one order request went.
#[derive(Debug, Clone)]
struct RequestRecord {
    order: u64,
    /// When it was first sent.
    sent: Instant,
    attempts: u32,
    outcome: Outcome,
    /// The first successful reply.
    reply: Option<Bytes>,
    /// The deliberate retry after that reply ("it was lost"): its reply, or
    /// why it got none.
    retry: Option<Result<Bytes, Outcome>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Replied,
    /// No answer within the client's retry horizon: the client gave up.
    Abandoned(String),
    /// `Idem-Error: permanent`.
    Refused(String),
}

/// Sends order requests and retries them, as a client that keeps one id
/// per request does, within its retry horizon.
struct Requester {
    nats: async_nats::Client,
    subject: String,
    stop: AtomicBool,
    /// Requests answered (first replies).
    replied: AtomicU64,
    /// Deliberate retries of answered requests.
    forced_retries: AtomicU64,
    records: Mutex<Vec<RequestRecord>>,
}

impl Requester {
    fn new(nats: async_nats::Client, subject: String) -> Requester {
        Requester {
            nats,
            subject,
            stop: AtomicBool::new(false),
            replied: AtomicU64::new(0),
            forced_retries: AtomicU64::new(0),
            records: Mutex::default(),
        }
    }

    async fn run(self: Arc<Self>) {
        let mut requests = JoinSet::new();
        let mut ticks = tokio::time::interval(REQUEST_EVERY);
        let mut order = 0;
        while !self.stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            order += 1;
            requests.spawn(self.clone().request(order));
            while requests.try_join_next().is_some() {}
        }
        while requests.join_next().await.is_some() {}
    }

    async fn request(self: Arc<Self>, order: u64) {
        let id = format!("order-{order}");
        let body = Bytes::from(
            serde_json::to_vec(&serde_json::json!({ "order": order, "amount": 10 + order % 90 }))
                .expect("a request encodes"),
        );
        let sent = Instant::now();
        let mut record = RequestRecord {
            order,
            sent,
            attempts: 0,
            outcome: Outcome::Replied,
            reply: None,
            retry: None,
        };
        match self
            .until_answered(&id, &body, sent, &mut record.attempts)
            .await
        {
            Ok(reply) => {
                self.replied.fetch_add(1, Ordering::Relaxed);
                record.reply = Some(reply);
                if order.is_multiple_of(4) {
                    // The reply was lost, as far as this client knows.
                    self.forced_retries.fetch_add(1, Ordering::Relaxed);
                    record.retry = Some(
                        self.until_answered(&id, &body, sent, &mut record.attempts)
                            .await,
                    );
                }
            }
            Err(outcome) => record.outcome = outcome,
        }
        self.records.lock().expect("records lock").push(record);
    }

    /// Sends the request until it is answered or refused, or the retry
    /// horizon (from `sent`) passes.
    async fn until_answered(
        &self,
        id: &str,
        body: &Bytes,
        sent: Instant,
        attempts: &mut u32,
    ) -> Result<Bytes, Outcome> {
        loop {
            // async-nats keeps what is sent while it is disconnected and
            // sends it once it reconnects, which after an outage is later
            // than the horizon the route's retention counts on. A client
            // that keeps its horizon sends only while connected.
            while self.nats.connection_state() != async_nats::connection::State::Connected {
                if sent.elapsed() + Duration::from_millis(200) >= CLIENT_RETRY_HORIZON {
                    return Err(Outcome::Abandoned(
                        "not connected to NATS within the retry horizon".to_owned(),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            *attempts += 1;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
            let asked = tokio::time::timeout(
                REQUEST_TIMEOUT,
                self.nats
                    .request_with_headers(self.subject.clone(), headers, body.clone()),
            )
            .await;
            let why = match asked {
                Ok(Ok(reply)) => {
                    let header = |name: &str| {
                        reply
                            .headers
                            .as_ref()
                            .and_then(|h| h.get(name))
                            .map(|v| v.as_str().to_owned())
                    };
                    match header("Idem-Error").as_deref() {
                        None => return Ok(reply.payload),
                        Some("retry") => format!("retry: {:?}", header("Idem-Reason")),
                        Some(other) => {
                            return Err(Outcome::Refused(format!(
                                "{other}: {:?}",
                                header("Idem-Reason")
                            )));
                        }
                    }
                }
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no reply within {REQUEST_TIMEOUT:?}"),
            };
            if sent.elapsed() + Duration::from_millis(200) >= CLIENT_RETRY_HORIZON {
                return Err(Outcome::Abandoned(why));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn records(&self) -> Vec<RequestRecord> {
        self.records.lock().expect("records lock").clone()
    }
}

// ---------------------------------------------------------------------------
// The writer beside the handlers.

/// Queues outbox rows in transactions of its own, as an HTTP endpoint of
/// the service would: `side-<n>`, one per transaction.
struct SideWriter {
    pool: PgPool,
    subject: String,
    stop: AtomicBool,
    burst: AtomicBool,
    committed: AtomicU64,
}

impl SideWriter {
    fn new(pool: PgPool, subject: String) -> SideWriter {
        SideWriter {
            pool,
            subject,
            stop: AtomicBool::new(false),
            burst: AtomicBool::new(false),
            committed: AtomicU64::new(0),
        }
    }

    async fn run(self: Arc<Self>) {
        while !self.stop.load(Ordering::Relaxed) {
            let n = self.committed.load(Ordering::Relaxed);
            match self.write(n).await {
                Ok(()) => self.committed.store(n + 1, Ordering::Relaxed),
                // Before the worker made the outbox; the same id again then.
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
            let every = if self.burst.load(Ordering::Relaxed) {
                SIDE_BURST_EVERY
            } else {
                SIDE_EVERY
            };
            tokio::time::sleep(every).await;
        }
    }

    async fn write(&self, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let mut tx = self.pool.begin().await?;
        idem_runtime::outbox::enqueue(
            &mut tx,
            &side_id(n),
            &self.subject,
            format!("{{\"side\":{n}}}").as_bytes(),
            &async_nats::HeaderMap::new(),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

fn side_id(n: u64) -> String {
    format!("side-{n}")
}

// ---------------------------------------------------------------------------
// What each accident did and cost.

/// One accident as it happened.
#[derive(Debug, Clone)]
pub struct Record {
    accident: Accident,
    round: usize,
    /// When it began, into the run.
    at: Duration,
    began: Instant,
    ended: Instant,
    /// What it did, and the proof that it landed.
    landed: String,
    /// While it stood: each part's longest gap without progress (`None`:
    /// none at all).
    during: Vec<(Part, Option<Duration>)>,
    /// After it ended: how long until each part made progress.
    after: Vec<(Part, Option<Duration>)>,
    /// Its own checks: what, and how long after it ended it held.
    own: Vec<(String, Option<Duration>)>,
    /// The invariants and bounds it broke.
    broke: Vec<String>,
}

impl Record {
    fn new(accident: Accident, round: usize, at: Duration) -> Record {
        let now = Instant::now();
        Record {
            accident,
            round,
            at,
            began: now,
            ended: now,
            landed: String::new(),
            during: Vec::new(),
            after: Vec::new(),
            own: Vec::new(),
            broke: Vec::new(),
        }
    }
}

/// The accidents of a run.
#[derive(Debug, Default)]
pub struct Tally {
    records: Vec<Record>,
}

impl Tally {
    /// What each accident cost, for people.
    fn table(&self, knobs: &Knobs) -> String {
        let secs = |d: &Option<Duration>| match d {
            Some(d) => format!("{:.1} s", d.as_secs_f64()),
            None => "**none**".to_owned(),
        };
        let mut table = format!(
            "day-two: time to progress after each accident (bound {:.0} s; the purge {:.0} s), \
             and while it stood the longest gap without progress\n\
             | # | at | accident | lasted | credit | mirror | orders | relay | purge | its own checks | what happened |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
            knobs.bound.as_secs_f64(),
            knobs.purge_bound.as_secs_f64()
        );
        for (k, r) in self.records.iter().enumerate() {
            let cell = |part: Part| {
                let after = r
                    .after
                    .iter()
                    .find(|(p, _)| *p == part)
                    .map(|(_, d)| secs(d));
                let during = r
                    .during
                    .iter()
                    .find(|(p, _)| *p == part)
                    .map(|(_, d)| secs(d));
                match (after, during) {
                    (Some(a), Some(d)) => format!("{a} (during: {d})"),
                    (Some(a), None) => a,
                    (None, Some(d)) => format!("(during: {d})"),
                    (None, None) => "-".to_owned(),
                }
            };
            let own: Vec<String> = r
                .own
                .iter()
                .map(|(what, d)| format!("{what}: {}", secs(d)))
                .collect();
            let _ = writeln!(
                table,
                "| {k} | {:.1} s | {} {} | {:.1} s | {} | {} | {} | {} | {} | {} | {}{} |",
                r.at.as_secs_f64(),
                r.accident.name(),
                r.round,
                (r.ended - r.began).as_secs_f64(),
                cell(Part::Credit),
                cell(Part::Mirror),
                cell(Part::Orders),
                cell(Part::Relay),
                cell(Part::Purge),
                own.join("; "),
                r.landed,
                if r.broke.is_empty() {
                    String::new()
                } else {
                    format!(" **BROKE: {}**", r.broke.join("; "))
                }
            );
        }
        table
    }
}

// ---------------------------------------------------------------------------
// The accidents.

impl FaultDriver<'_> {
    fn day_two(&mut self) -> &mut Context {
        self.setup
            .day_two
            .as_mut()
            .expect("the day-two mode's context")
    }

    /// Runs one accident, measures what every part did while it stood and
    /// after it ended, and fails the run if it broke anything.
    pub(crate) async fn accident(&mut self, accident: Accident) {
        let round = {
            let rounds = self.day_two().rounds.entry(accident).or_default();
            *rounds += 1;
            *rounds - 1
        };
        let mut r = Record::new(accident, round, self.started.elapsed());
        self.let_more_through(64);
        match accident {
            Accident::UnstoredSubject => self.unstored_subject(&mut r).await,
            Accident::NearMaxPayload => self.near_max_payload(&mut r).await,
            Accident::PurgeKilled => self.purge_killed(&mut r).await,
            Accident::ForeignTransaction => self.foreign_transaction(&mut r).await,
            Accident::RollingRename => self.rolling_rename(&mut r).await,
            Accident::SharedReplay => self.shared_replay(&mut r).await,
            Accident::NatsAway => self.nats_away(&mut r).await,
        }
        self.after(&mut r).await;
        eprintln!(
            "chaos: day-two {} {}: {}; after: {:?}; own: {:?}{}",
            accident.name(),
            round,
            r.landed,
            r.after,
            r.own,
            if r.broke.is_empty() {
                String::new()
            } else {
                format!("; BROKE: {:?}", r.broke)
            }
        );
        let broke = r.broke.clone();
        self.tally.day_two.records.push(r);
        if !broke.is_empty() {
            let knobs = self.day_two().knobs.clone();
            let table = self.tally.day_two.table(&knobs);
            self.fail(&format!(
                "day-two: the accident `{}` broke:\n  {}\n{table}",
                accident.name(),
                broke.join("\n  ")
            ))
            .await;
        }
    }

    /// Lets credits flow for `at_least`, and then until every part of
    /// `parts` has made progress in its last second or later (progress
    /// only at the start is a part not yet stopped), or `at_most` passed;
    /// then records each part's longest gap while the accident stood.
    async fn hold(
        &mut self,
        r: &mut Record,
        parts: &[Part],
        at_least: Duration,
        at_most: Duration,
    ) {
        let watch = self.day_two().watch.clone();
        let late = r.began + at_least.saturating_sub(Duration::from_secs(1));
        loop {
            self.keep_credits_coming().await;
            let held = r.began.elapsed();
            let all = parts.iter().all(|&p| watch.first_after(p, late).is_some());
            if held >= at_most || (held >= at_least && all) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.measure_during(r, parts);
    }

    /// Lets a few more credits through (about 20 a second at this pace), so
    /// that the routes have work while an accident is measured. Fails the
    /// run if the publisher has run out: a route without work cannot show
    /// progress, so the mode needs more credits (`IDEM_CHAOS_MESSAGES`).
    async fn keep_credits_coming(&mut self) {
        let total = self.day_two().messages;
        if self.published.load(Ordering::Relaxed) >= total {
            self.fail(&format!(
                "all {total} credits are published while an accident is still measured: the routes \
                 have no more work to show progress with; run with more IDEM_CHAOS_MESSAGES"
            ))
            .await;
        }
        self.let_more_through(2);
    }

    /// Each part's longest gap without progress from `r.began` until now,
    /// checked against its bound.
    fn measure_during(&mut self, r: &mut Record, parts: &[Part]) {
        let (watch, knobs) = {
            let ctx = self.day_two();
            (ctx.watch.clone(), ctx.knobs.clone())
        };
        let now = Instant::now();
        for &part in parts {
            let gap = watch
                .first_after(part, r.began)
                .map(|_| watch.longest_gap(part, r.began, now));
            // No progress yet in the window is a stall only once the part
            // has gone longer than its bound since its last progress before
            // the accident: a purge that rotates every two seconds may not
            // have rotated in the two seconds of a rename's overlap. How
            // soon it moves after the accident is checked by `after`.
            let stalled = match gap {
                Some(g) => g > knobs.bound(part),
                None => {
                    let since = watch.last_at_or_before(part, r.began).unwrap_or(r.began);
                    now - since > knobs.bound(part)
                }
            };
            if stalled {
                r.broke.push(format!(
                    "liveness: while it stood, {} made no progress for {} (bound {:?})",
                    part.name(),
                    match gap {
                        Some(g) => format!("{g:.1?}"),
                        None => format!("its whole {:.1?}", now - r.began),
                    },
                    knobs.bound(part)
                ));
            }
            r.during.push((part, gap));
        }
    }

    /// After the accident ended: how soon each part made progress again.
    async fn after(&mut self, r: &mut Record) {
        let (watch, knobs) = {
            let ctx = self.day_two();
            (ctx.watch.clone(), ctx.knobs.clone())
        };
        let longest = knobs.bound.max(knobs.purge_bound) + Duration::from_millis(500);
        loop {
            self.keep_credits_coming().await;
            let all = PARTS
                .iter()
                .all(|&p| watch.first_after(p, r.ended).is_some());
            if all || r.ended.elapsed() > longest {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for part in PARTS {
            let took = watch.first_after(part, r.ended);
            if took.is_none_or(|t| t > knobs.bound(part)) {
                r.broke.push(format!(
                    "liveness: {} made no progress within {:?} after it ended{}",
                    part.name(),
                    knobs.bound(part),
                    match took {
                        Some(t) => format!(" (it took {t:.1?})"),
                        None => format!(
                            " (last seen: {:?})",
                            watch.last().map(|s| match part {
                                Part::Purge => format!("{:?}", s.purge),
                                _ => format!("{s:?}"),
                            })
                        ),
                    }
                ));
            }
            r.after.push((part, took));
        }
    }

    /// Waits up to `within` after `r.ended` for `check` (which returns what
    /// it saw), recording how long it took as the accident's own check
    /// `what`, or breaking it.
    async fn own_check<F>(&mut self, r: &mut Record, what: &str, within: Duration, mut check: F)
    where
        F: AsyncFnMut() -> Result<(), String>,
    {
        let mut last = String::new();
        let took = loop {
            self.keep_credits_coming().await;
            match check().await {
                Ok(()) => break Some(r.ended.elapsed()),
                Err(seen) => last = seen,
            }
            if r.ended.elapsed() > within {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        if took.is_none() {
            r.broke
                .push(format!("{what}: not within {within:?} ({last})"));
        }
        r.own.push((what.to_owned(), took));
    }

    /// A deploy ships a subject before its stream: the credit handler
    /// queues a copy of each notice for it. The relay must keep publishing
    /// everything else meanwhile, and the rows for the subject must go out
    /// once the stream exists.
    async fn unstored_subject(&mut self, r: &mut Record) {
        let (subject, stream_name) = self.day_two().names.audit(r.round);
        let (pool, js) = (self.setup.pool.clone(), self.setup.js.clone());
        let failed_before = self.worker().last().relay_failed;
        sqlx::query(
            "INSERT INTO dt_flags (name, value) VALUES ('audit_subject', $1)
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
        )
        .bind(&subject)
        .execute(&pool)
        .await
        .expect("the flag is set");
        // Landed: a relay batch's worth of rows for it wait, and no stream
        // stores it.
        let deadline = Instant::now() + Duration::from_secs(30);
        let pending = loop {
            self.let_more_through(4);
            let pending: i64 =
                sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE subject = $1")
                    .bind(&subject)
                    .fetch_one(&pool)
                    .await
                    .expect("the outbox is read");
            if pending >= RELAY_BATCH {
                break pending;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "the handler queued only {pending} rows for {subject} in 30 s"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if js.stream_by_subject(subject.clone()).await.is_ok() {
            self.fail(&format!("a stream stores {subject} already"))
                .await;
        }
        r.began = Instant::now();
        let bound = self.day_two().knobs.bound;
        self.hold(
            r,
            &PARTS,
            Duration::from_secs(3),
            bound + Duration::from_secs(1),
        )
        .await;
        let failed_after = self.worker().last().relay_failed;
        let stuck: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE subject = $1")
            .bind(&subject)
            .fetch_one(&pool)
            .await
            .expect("the outbox is read");
        // The stream, created later.
        js.create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("the late stream is created");
        r.ended = Instant::now();
        r.landed = format!(
            "{pending} rows for {subject} pending with no stream for it ({stuck} when it was \
             created {:.1?} later); relay publishes failed {failed_before} -> {failed_after}",
            r.ended - r.began
        );
        // Everything queued for it so far must get stored.
        let queued: i64 =
            sqlx::query_scalar("SELECT count(*) FROM dt_audit_queued WHERE subject = $1")
                .bind(&subject)
                .fetch_one(&pool)
                .await
                .expect("the queued copies are counted");
        self.own_check(r, "waiting rows stored", bound, async || {
            let stored = match js.get_stream(&stream_name).await {
                Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
                Err(_) => 0,
            };
            if stored as i64 >= queued {
                Ok(())
            } else {
                Err(format!("{stored} of {queued} stored"))
            }
        })
        .await;
    }

    /// Undecodable messages within a few hundred bytes of `max_payload`, as
    /// many as the routes run at once, then credits behind them: both
    /// routes must dead-letter them and go on.
    async fn near_max_payload(&mut self, r: &mut Record) {
        let (max_payload, round) = (self.day_two().max_payload, r.round);
        let js = self.setup.js.clone();
        let mut stored = Vec::new();
        let mut sizes = Vec::new();
        for k in 0..CONCURRENCY {
            let id = format!("dt-big-{round}-{k}");
            // The wire size async-nats checks: the header block, then the
            // payload.
            let headers_len = "NATS/1.0\r\n".len() + "Nats-Msg-Id: ".len() + id.len() + 4;
            let under = self.day_two().rng.between(64, 448) as usize;
            let payload = Bytes::from(vec![b'~'; max_payload - headers_len - under]);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            let ack = match js
                .publish_with_headers(self.setup.subject.clone(), headers, payload)
                .await
            {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match ack {
                Ok(ack) => stored.push((id, ack.sequence)),
                Err(e) => self.fail(&format!("publishing {id} failed: {e}")).await,
            }
            sizes.push(max_payload - under);
        }
        self.let_more_through(64);
        r.began = Instant::now();
        // Landed: both routes took them.
        let last_seq = stored.iter().map(|(_, seq)| *seq).max().unwrap_or(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let credit = delivered_past(&js, &self.setup.stream, super::DURABLE, last_seq).await;
            let mirror = delivered_past(&js, &self.setup.stream, MIRROR_DURABLE, last_seq).await;
            if credit && mirror {
                break;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "the routes were not delivered the messages near max_payload (up to stream \
                     sequence {last_seq}) within 30 s: credit {credit}, mirror {mirror}"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        r.ended = Instant::now();
        let report = self.worker().last();
        r.landed = format!(
            "{} undecodable messages of {}..{} B with headers (max_payload {max_payload}), \
             stream sequences {}..{last_seq}, delivered to both routes; dead-letter publishes \
             failed so far: credit {}, mirror {}",
            stored.len(),
            sizes.iter().min().unwrap_or(&0),
            sizes.iter().max().unwrap_or(&0),
            stored.first().map_or(0, |(_, seq)| *seq),
            report.dead_letter_failed,
            report.mirror_dead_letter_failed
        );
        let ids: HashSet<String> = stored.into_iter().map(|(id, _)| id).collect();
        let bound = self.day_two().knobs.bound;
        self.own_check(r, "dead-lettered by both routes", bound, async || {
            let letters = dead_letters_of(&js, &ids).await;
            let by = |handler: &str| letters.iter().filter(|(h, _, _)| h == handler).count();
            let (credit, mirror) = (by(HANDLER), by(MIRROR_HANDLER));
            if credit == ids.len() && mirror == ids.len() {
                Ok(())
            } else {
                Err(format!(
                    "dead letters: credit {credit}, mirror {mirror} of {}",
                    ids.len()
                ))
            }
        })
        .await;
    }

    /// The purge's session is terminated between two steps of an expiry,
    /// where it waits on a lock the test holds. The next runs must finish
    /// or undo what it left, and expiry go on.
    async fn purge_killed(&mut self, r: &mut Record) {
        let first = self.day_two().knobs.first_kill_point;
        let point = KILL_POINTS[(first + r.round) % KILL_POINTS.len()];
        let pool = self.setup.pool.clone();
        // The generation the purge expires next: the oldest sealed one still
        // attached, not due for a second yet (so the lock is there first).
        let deadline = Instant::now() + RETENTION * 3 + Duration::from_secs(10);
        let generation = loop {
            let generation: Option<i32> = sqlx::query_scalar(
                "SELECT g.gen FROM idem_generations g
                   JOIN pg_inherits i ON i.inhrelid = to_regclass('idem_claims_g' || g.gen)
                                     AND i.inhparent = 'idem_claims'::regclass
                                     AND NOT i.inhdetachpending
                  WHERE g.sealed_at IS NOT NULL
                    AND g.sealed_at > now() - $1::bigint * interval '1 millisecond'
                  ORDER BY g.gen LIMIT 1",
            )
            .bind((RETENTION - Duration::from_secs(1)).as_millis() as i64)
            .fetch_optional(&pool)
            .await
            .expect("the generations are read")
            .flatten();
            if let Some(generation) = generation {
                break generation;
            }
            if Instant::now() > deadline {
                self.fail("no claims generation was sealed to expire").await;
            }
            self.let_more_through(2);
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let partition = format!("idem_claims_g{generation}");
        let mut first = blocker(&pool, "day-two-purge-blocker").await;
        let first_pid = backend_pid(&mut first).await;
        match point {
            KillPoint::BeforeDrop | KillPoint::InDetach => {
                lock_in_transaction(
                    &mut first,
                    &format!("LOCK TABLE {partition} IN ACCESS SHARE MODE"),
                )
                .await
            }
            KillPoint::AfterDrop => {
                lock_in_transaction(
                    &mut first,
                    &format!(
                        "SELECT gen FROM idem_generations WHERE gen = {generation} FOR UPDATE"
                    ),
                )
                .await
            }
        }
        let waited = Instant::now();
        let wait_for = RETENTION + Duration::from_secs(15);
        let (purge_pid, mut statement) = match blocked_purge(&pool, first_pid, wait_for).await {
            Ok(found) => found,
            Err(e) => self.fail(&e).await,
        };
        r.began = Instant::now();
        let mut holders = vec![first];
        if point == KillPoint::BeforeDrop {
            // The DETACH waits for the first lock. A second session queues
            // its own behind the DETACH, so it holds the table the moment
            // the DETACH is done, and the DROP waits for it.
            let mut second = blocker(&pool, "day-two-purge-blocker-2").await;
            let second_pid = backend_pid(&mut second).await;
            let lock = format!("LOCK TABLE {partition} IN ACCESS SHARE MODE");
            let queued = tokio::spawn(async move {
                lock_in_transaction(&mut second, &lock).await;
                second
            });
            if let Err(e) = wait_blocked(&pool, second_pid, purge_pid, Duration::from_secs(4)).await
            {
                self.fail(&format!(
                    "the second lock did not queue behind the purge: {e}"
                ))
                .await;
            }
            let mut first = holders.pop().expect("the first holder");
            rollback(&mut first).await;
            let second = match tokio::time::timeout(Duration::from_secs(5), queued).await {
                Ok(Ok(second)) => second,
                other => {
                    self.fail(&format!("the second lock was not granted: {other:?}"))
                        .await
                }
            };
            holders.push(second);
            match blocked_purge(&pool, second_pid, Duration::from_secs(4)).await {
                Ok((pid, next)) if pid == purge_pid => statement = next,
                Ok((pid, _)) => self.fail(&format!("another purge ({pid}) waits")).await,
                Err(e) => self.fail(&e).await,
            }
        }
        let before = partition_state(&pool, generation).await;
        let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(purge_pid)
            .fetch_one(&pool)
            .await
            .expect("pg_terminate_backend runs");
        let gone = Instant::now() + Duration::from_secs(5);
        while backend_alive(&pool, purge_pid).await && Instant::now() < gone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = partition_state(&pool, generation).await;
        for mut holder in holders {
            rollback(&mut holder).await;
            let _ = holder.close().await;
        }
        r.ended = Instant::now();
        if !terminated {
            r.broke.push(format!(
                "the purge backend {purge_pid} could not be terminated"
            ));
        }
        r.landed = format!(
            "{point:?}: purge backend {purge_pid} (holding the purge lock) reached the test's lock \
             {:.1?} after it was taken and was terminated waiting in `{statement}`; generation \
             {generation} was {before}, left {after}",
            r.began - waited
        );
        let purge_bound = self.day_two().knobs.purge_bound;
        self.own_check(
            r,
            "interrupted generation cleaned up",
            purge_bound,
            async || {
                let state = partition_state(&pool, generation).await;
                if state == "gone" {
                    Ok(())
                } else {
                    Err(format!("generation {generation} is {state}"))
                }
            },
        )
        .await;
    }

    /// A transaction left open in another database of the server and an
    /// idle one in this database, for longer than two generations: the
    /// purge must go on rotating, and everything else go on.
    async fn foreign_transaction(&mut self, r: &mut Record) {
        let (foreign_options, hold, watch) = {
            let ctx = self.day_two();
            (
                ctx.foreign.clone(),
                ctx.knobs.foreign_hold,
                ctx.watch.clone(),
            )
        };
        let pool = self.setup.pool.clone();
        let mut foreign =
            PgConnection::connect_with(&foreign_options.application_name("day-two-foreign"))
                .await
                .expect("the foreign database answers");
        sqlx::raw_sql("BEGIN; SELECT txid_current()")
            .execute(&mut foreign)
            .await
            .expect("the foreign transaction begins");
        let mut local = blocker(&pool, "day-two-idle-psql").await;
        sqlx::raw_sql("BEGIN; SELECT count(*) FROM chaos_accounts")
            .execute(&mut local)
            .await
            .expect("the idle transaction begins");
        let sessions: Vec<(i32, String, String)> = sqlx::query_as(
            "SELECT pid, datname::text, state FROM pg_stat_activity
              WHERE application_name IN ('day-two-foreign', 'day-two-idle-psql') ORDER BY datname",
        )
        .fetch_all(&pool)
        .await
        .expect("pg_stat_activity is read");
        if sessions.len() != 2 || sessions.iter().any(|(_, _, s)| s != "idle in transaction") {
            self.fail(&format!(
                "the foreign and idle sessions are not both idle in transaction: {sessions:?}"
            ))
            .await;
        }
        let purge_before = watch.last().map(|s| s.purge);
        r.began = Instant::now();
        self.hold(r, &PARTS, hold, hold).await;
        let purge_after = watch.last().map(|s| s.purge);
        let (claim_rows, claims): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT (key, handler_id)) FROM idem_claims")
                .fetch_one(&pool)
                .await
                .expect("the claims are counted");
        let log = self.worker().log_tail(100_000);
        let named: Vec<i32> = sessions
            .iter()
            .map(|(pid, _, _)| *pid)
            .filter(|pid| log.contains(&pid.to_string()))
            .collect();
        sqlx::raw_sql("COMMIT")
            .execute(&mut foreign)
            .await
            .expect("the foreign commit");
        sqlx::raw_sql("COMMIT")
            .execute(&mut local)
            .await
            .expect("the idle commit");
        let _ = foreign.close().await;
        let _ = local.close().await;
        r.ended = Instant::now();
        let generation = idem_runtime::expiry::generation_length(RETENTION);
        if hold < generation * 2 {
            r.broke.push(format!(
                "held {hold:?}, under two generations ({generation:?}): no rotation was due"
            ));
        }
        r.landed = format!(
            "sessions {sessions:?} idle in transaction for {:.1?} (a generation lasts \
             {generation:?}); purge {purge_before:?} -> {purge_after:?}; claims table \
             {claim_rows} rows for {claims} claims; the worker's log names the sessions' pids: \
             {named:?}",
            r.ended - r.began
        );
    }

    /// A rolling deploy renames the order handler: a worker with the new
    /// name starts, both serve requests (and the client's retries) for a
    /// while, then the old one gets SIGTERM. No order may run twice.
    async fn rolling_rename(&mut self, r: &mut Record) {
        let (requester, old) = {
            let ctx = self.day_two();
            (ctx.requester.clone(), ctx.place_version)
        };
        let new = 3 - old;
        for (k, v) in &mut self.setup.worker_env {
            if k == "CHAOS_PLACE_VERSION" {
                *v = new.to_string();
            }
        }
        let pool = self.setup.pool.clone();
        let runs_before = order_runs(&pool).await;
        let old_before = self.worker().last();
        let retries_before = requester.forced_retries.load(Ordering::Relaxed);
        self.tally.workers_started += 1;
        let fresh = self.setup.start_worker(self.tally.workers_started).await;
        r.began = Instant::now();
        // The overlap: both versions answer, and the client retries.
        let deadline = r.began + Duration::from_secs(20);
        loop {
            self.let_more_through(2);
            let (a, b) = (self.worker().last(), fresh.last());
            let both = a.place_processed > old_before.place_processed + 2
                && b.place_processed + b.place_duplicates > 2;
            let retried = requester.forced_retries.load(Ordering::Relaxed) >= retries_before + 2;
            if both && retried && r.began.elapsed() > Duration::from_secs(2) {
                break;
            }
            if Instant::now() > deadline {
                let log = fresh.log_tail(30);
                self.fail(&format!(
                    "the two versions did not both serve orders within 20 s: old {a:?}, new {b:?}\n{log}"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.measure_during(r, &PARTS);
        let runs_overlap = order_runs(&pool).await;
        let retries = requester.forced_retries.load(Ordering::Relaxed) - retries_before;
        // The old version goes.
        let old_worker = self.worker.replace(fresh).expect("a worker is running");
        let ordinals = (old_worker.ordinal, self.worker().ordinal);
        match old_worker.sigterm(SIGTERM_GRACE).await {
            Ok((ended, _)) => {
                if ended.status.code() != Some(0) {
                    r.broke
                        .push(format!("the old worker exited {}", ended.status));
                }
                self.tally.ended.push(ended);
            }
            Err(e) => r.broke.push(e),
        }
        self.day_two().place_version = new;
        r.ended = Instant::now();
        let diff = |before: &BTreeMap<String, i64>, after: &BTreeMap<String, i64>| {
            after
                .iter()
                .map(|(h, n)| format!("{h} +{}", n - before.get(h).copied().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        r.landed = format!(
            "worker #{} (chaos-place.v{old}) and #{} (.v{new}) both ran orders for {:.1?}: {}; \
             {retries} client retries meanwhile",
            ordinals.0,
            ordinals.1,
            r.ended - r.began,
            diff(&runs_before, &runs_overlap)
        );
        let twice: Vec<(i64, i64, Vec<String>)> = sqlx::query_as(
            "SELECT order_id, count(*), array_agg(handler ORDER BY applied_at) FROM dt_orders
              GROUP BY order_id HAVING count(*) > 1 ORDER BY order_id",
        )
        .fetch_all(&pool)
        .await
        .expect("the orders are read");
        if !twice.is_empty() {
            r.broke.push(format!(
                "exactly once: {} orders ran more than once (order, runs, handlers; first 10): {:?}",
                twice.len(),
                &twice[..twice.len().min(10)]
            ));
        }
    }

    /// The mirror fails permanently on credits the credit route applies;
    /// after the fix its dead letters are replayed. The mirror must apply
    /// them once, and the credit route, which shares the subject, not again.
    async fn shared_replay(&mut self, r: &mut Record) {
        let (pool, js) = (self.setup.pool.clone(), self.setup.js.clone());
        let published = self.published.load(Ordering::Relaxed);
        let from = self.gate.load(Ordering::Relaxed).max(published) + 2;
        let frozen: Vec<u64> = (from..from + FROZEN_PER_REPLAY).collect();
        let refs: Vec<String> = frozen.iter().map(|&i| credit_ref(i)).collect();
        let ids: Vec<String> = frozen.iter().map(|&i| message_id(i)).collect();
        sqlx::query("INSERT INTO dt_frozen SELECT unnest($1::text[])")
            .bind(&refs)
            .execute(&pool)
            .await
            .expect("the credits are frozen in the mirror");
        self.let_more_through(from + FROZEN_PER_REPLAY + 16 - published);
        // Landed: the mirror dead-lettered them, the credit route applied them.
        let deadline = Instant::now() + Duration::from_secs(30);
        let wanted: HashSet<String> = refs.iter().cloned().collect();
        let letters = loop {
            let letters = dead_letters_of(&js, &wanted).await;
            let applied: i64 =
                sqlx::query_scalar("SELECT count(*) FROM chaos_ledger WHERE message_id = ANY($1)")
                    .bind(&ids)
                    .fetch_one(&pool)
                    .await
                    .expect("the ledger is read");
            let mirror: Vec<_> = letters
                .iter()
                .filter(|(h, _, _)| h == MIRROR_HANDLER)
                .cloned()
                .collect();
            if mirror.len() as u64 == FROZEN_PER_REPLAY && applied as u64 == FROZEN_PER_REPLAY {
                break mirror;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "within 30 s the mirror dead-lettered {letters:?} of {refs:?}, and the credit \
                     route applied {applied} of {ids:?}"
                ))
                .await;
            }
            self.let_more_through(4);
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        r.began = Instant::now();
        // The fix, then the replay.
        sqlx::query("DELETE FROM dt_frozen WHERE ref = ANY($1)")
            .bind(&refs)
            .execute(&pool)
            .await
            .expect("the credits are thawed");
        let mut replays = Vec::new();
        for (_, _, sequence) in &letters {
            match dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, *sequence).await {
                Ok(ack) => replays.push((ack.stream.clone(), ack.sequence)),
                Err(e) => r
                    .broke
                    .push(format!("replaying dead letter {sequence} failed: {e}")),
            }
        }
        r.ended = Instant::now();
        r.landed = format!(
            "the mirror dead-lettered {refs:?} (dead letters {:?}), which the credit route \
             applied as {ids:?}; replayed to {replays:?}",
            letters.iter().map(|(_, _, s)| *s).collect::<Vec<_>>()
        );
        let bound = self.day_two().knobs.bound;
        self.own_check(r, "mirror applied the replays", bound, async || {
            let rows: i64 =
                sqlx::query_scalar("SELECT count(*) FROM dt_mirror WHERE ref = ANY($1)")
                    .bind(&refs)
                    .fetch_one(&pool)
                    .await
                    .expect("the mirror is read");
            if rows as u64 >= FROZEN_PER_REPLAY {
                Ok(())
            } else {
                Err(format!("{rows} of {FROZEN_PER_REPLAY} applied"))
            }
        })
        .await;
        // The credit route has taken the replays too (its ack floor is past
        // them): it must not have applied them again.
        let stream = self.setup.stream.clone();
        let last = replays
            .iter()
            .filter(|(s, _)| *s == stream)
            .map(|(_, seq)| *seq)
            .max();
        if let Some(last) = last {
            self.own_check(r, "credit route settled the replays", bound, async || {
                let floor = ack_floor(&js, &stream, super::DURABLE).await;
                if floor >= last {
                    Ok(())
                } else {
                    Err(format!("credit ack floor {floor}, replays up to {last}"))
                }
            })
            .await;
        }
        let again: Vec<(String, i64)> = sqlx::query_as(
            "SELECT message_id, count(*) FROM chaos_ledger
              WHERE message_id = ANY($1) OR message_id = ANY($2)
              GROUP BY message_id HAVING message_id = ANY($1) OR count(*) > 1",
        )
        .bind(&refs)
        .bind(&ids)
        .fetch_all(&pool)
        .await
        .expect("the ledger is read");
        if !again.is_empty() {
            r.broke.push(format!(
                "exactly once: the credit route applied the mirror's replayed dead letters again \
                 (ledger rows by message id): {again:?}"
            ));
        }
    }

    /// nats-server is SIGKILLed and stays down longer than the relay's
    /// back-off, while the writer keeps queuing (faster); then it is
    /// restarted on its store. PostgreSQL's notification queue, which every
    /// database of the server shares, must not fill meanwhile.
    async fn nats_away(&mut self, r: &mut Record) {
        let (side, away) = {
            let ctx = self.day_two();
            (ctx.side.clone(), ctx.knobs.nats_away)
        };
        let pool = self.setup.pool.clone();
        let before = self.worker().last();
        let side_before = side.committed.load(Ordering::Relaxed);
        let pid = self.setup.env.nats_server().pid();
        let usage_before = notification_queue_usage(&pool).await;
        let backlog_before = listen_backlog(&pool).await;
        side.burst.store(true, Ordering::Relaxed);
        self.setup.env.nats_server_mut().kill();
        r.began = Instant::now();
        let mut usage = vec![usage_before];
        while r.began.elapsed() < away {
            tokio::time::sleep(Duration::from_millis(250)).await;
            usage.push(notification_queue_usage(&pool).await);
        }
        let backlog = listen_backlog(&pool).await;
        side.burst.store(false, Ordering::Relaxed);
        let side_queued = side.committed.load(Ordering::Relaxed) - side_before;
        self.measure_during(r, &[Part::Purge]);
        self.setup.env.nats_server_mut().start_again().await;
        assert_ne!(pid, self.setup.env.nats_server().pid(), "a new nats-server");
        r.ended = Instant::now();
        let seen = self
            .worker()
            .wait_for(
                "see NATS disconnect and reconnect",
                Duration::from_secs(30),
                |w| {
                    w.nats_disconnects > before.nats_disconnects
                        && w.nats_reconnects > before.nats_reconnects
                },
            )
            .await;
        if let Err(e) = seen {
            self.fail(&e).await;
        }
        let after = self.worker().last();
        // Rises of the usage while NATS was away: each is a page of
        // notifications nobody read.
        let mut rises = 0;
        let mut high = usage[0];
        for &u in &usage[1..] {
            if u > high {
                rises += 1;
                high = u;
            }
        }
        let last = *usage.last().expect("samples");
        r.landed = format!(
            "nats-server down {:.1?} (the relay backs off up to {RELAY_MAX_BACKOFF:?}); the worker \
             saw the disconnect and the reconnect; {side_queued} writer rows queued meanwhile; \
             relay publishes failed {} -> {}; unread on the relay's LISTEN connection \
             {backlog_before:?} -> {backlog:?} bytes; notification queue usage \
             {usage_before:.2e} -> {last:.2e} ({rises} rises in {} samples)",
            r.ended - r.began,
            before.relay_failed,
            after.relay_failed,
            usage.len()
        );
        // A notification is 22 bytes on the wire: 8 KiB is some 370 of
        // them, left unread by a relay that waits for NATS.
        if let (Some(before), Some(after)) = (backlog_before, backlog)
            && after > before + 8 * 1024
        {
            r.broke.push(format!(
                "notifications piled up unread while NATS was away: {before} -> {after} bytes on \
                 the relay's LISTEN connection ({side_queued} notifying transactions meanwhile); \
                 once the server's queue, shared by every database, fills, every notifying \
                 COMMIT fails"
            ));
        }
        if rises >= 2 && last > usage_before {
            r.broke.push(format!(
                "the notification queue grew while NATS was away: {usage_before:.2e} -> {last:.2e}, \
                 {rises} rises (samples {usage:?})"
            ));
        }
    }

    /// Stops the order client and the writer, and waits until what they and
    /// the accidents left has settled: the outbox empty, the mirror's
    /// consumer drained, every late stream's rows stored.
    pub(crate) async fn settle_day_two(&mut self) {
        let (requester, side, tasks) = {
            let ctx = self.day_two();
            (
                ctx.requester.clone(),
                ctx.side.clone(),
                std::mem::take(&mut ctx.tasks),
            )
        };
        requester.stop.store(true, Ordering::Relaxed);
        side.stop.store(true, Ordering::Relaxed);
        let mut tasks = tasks.into_iter();
        let (requests, writer, watch) = (tasks.next(), tasks.next(), tasks.next());
        for task in [requests, writer].into_iter().flatten() {
            let _ = task.await;
        }
        let pool = self.setup.pool.clone();
        let js = self.setup.js.clone();
        let stream = self.setup.stream.clone();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let lag = idem_runtime::outbox::lag(&pool).await.map(|l| l.pending);
            let mirror = consumer_drained(&js, &stream, MIRROR_DURABLE).await;
            if lag.as_ref().is_ok_and(|&p| p == 0) && mirror.as_ref().is_ok_and(|&d| d) {
                break;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "day-two did not settle within 60 s: outbox pending {lag:?}, mirror drained {mirror:?}"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let watch_handle = self.day_two().watch.clone();
        watch_handle.stop.store(true, Ordering::Relaxed);
        if let Some(watch) = watch {
            let _ = watch.await;
        }
    }
}

/// Where the purge's session is terminated, in the order the rounds take
/// them.
const KILL_POINTS: [KillPoint; 3] = [
    KillPoint::BeforeDrop,
    KillPoint::InDetach,
    KillPoint::AfterDrop,
];

/// Where the purge's session is terminated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillPoint {
    /// The DETACH done, the DROP waiting.
    BeforeDrop,
    /// Inside `DETACH ... CONCURRENTLY`, after its first transaction.
    InDetach,
    /// The DROP done, the generation not yet forgotten (today's purge does
    /// both in one transaction, so the kill undoes the DROP).
    AfterDrop,
}

/// A session of the test's own, named so it shows in `pg_stat_activity`.
async fn blocker(pool: &PgPool, name: &str) -> PgConnection {
    PgConnection::connect_with(
        &pool
            .connect_options()
            .as_ref()
            .clone()
            .application_name(name),
    )
    .await
    .expect("a session of the test's own")
}

async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .expect("pg_backend_pid")
}

/// `BEGIN`, then `statement`, which takes a lock the transaction keeps.
async fn lock_in_transaction(conn: &mut PgConnection, statement: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("BEGIN; {statement}")))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("`{statement}` failed: {e}"));
}

async fn rollback(conn: &mut PgConnection) {
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
}

/// The purge backend that `holder` blocks, and the statement it waits in:
/// a backend blocked by `holder` that holds the purge's advisory lock.
async fn blocked_purge(
    pool: &PgPool,
    holder: i32,
    within: Duration,
) -> Result<(i32, String), String> {
    let deadline = Instant::now() + within;
    loop {
        let found: Option<(i32, String)> = sqlx::query_as(
            "SELECT a.pid, a.query FROM pg_stat_activity a
              WHERE $1 = ANY (pg_blocking_pids(a.pid))
                AND EXISTS (SELECT FROM pg_locks l
                             WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                               AND ((l.classid::bigint << 32) | l.objid::bigint) = $2)",
        )
        .bind(holder)
        .bind(PURGE_LOCK)
        .fetch_optional(pool)
        .await
        .map_err(|e| format!("pg_stat_activity: {e}"))?;
        if let Some(found) = found {
            return Ok(found);
        }
        if Instant::now() > deadline {
            let waiting: Vec<(i32, String, Option<String>)> = sqlx::query_as(
                "SELECT pid, query, wait_event_type FROM pg_stat_activity WHERE state = 'active'",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            return Err(format!(
                "no purge waited on the lock of backend {holder} within {within:?}; active: {waiting:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until backend `waiter` is blocked by backend `by`.
async fn wait_blocked(pool: &PgPool, waiter: i32, by: i32, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let blocked: bool = sqlx::query_scalar("SELECT $2 = ANY (pg_blocking_pids($1))")
            .bind(waiter)
            .bind(by)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
        if blocked {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "backend {waiter} was not blocked by {by} within {within:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn backend_alive(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .unwrap_or(false)
}

/// Generation `generation`'s partition as the catalog has it, and whether
/// the purge still knows the generation.
async fn partition_state(pool: &PgPool, generation: i32) -> String {
    let (table, attached, pending, known): (bool, bool, bool, bool) = sqlx::query_as(
        "SELECT to_regclass($1) IS NOT NULL,
                EXISTS (SELECT FROM pg_inherits WHERE inhrelid = to_regclass($1)),
                EXISTS (SELECT FROM pg_inherits WHERE inhrelid = to_regclass($1) AND inhdetachpending),
                EXISTS (SELECT FROM idem_generations WHERE gen = $2)",
    )
    .bind(format!("idem_claims_g{generation}"))
    .bind(generation)
    .fetch_one(pool)
    .await
    .expect("the catalog is read");
    let partition = match (table, attached, pending) {
        (false, _, _) => "dropped",
        (true, true, true) => "detach pending",
        (true, true, false) => "attached",
        (true, false, _) => "detached, not dropped",
    };
    match (table, known) {
        (false, false) => "gone".to_owned(),
        (_, true) => format!("{partition}, still a known generation"),
        (true, false) => format!("{partition}, no longer a known generation"),
    }
}

/// Notifications sent to the relays' LISTEN sessions and not read yet:
/// the bytes queued on both ends of each such session's TCP connection (the
/// server's send queue and the worker's receive queue, from
/// `/proc/net/tcp`). `None` if no session is listening.
async fn listen_backlog(pool: &PgPool) -> Option<u64> {
    let sessions: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT client_port, inet_server_port() FROM pg_stat_activity
          WHERE query ILIKE 'LISTEN %' AND client_port IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .ok()?;
    if sessions.is_empty() {
        return None;
    }
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    let port = |address: &str| u16::from_str_radix(address.rsplit(':').next()?, 16).ok();
    let mut queued = 0;
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(remote), Some(queues)) =
            (fields.get(1), fields.get(2), fields.get(4))
        else {
            continue;
        };
        let (Some(local), Some(remote)) = (port(local), port(remote)) else {
            continue;
        };
        let (tx, rx) = queues.split_once(':').unwrap_or(("0", "0"));
        let hex = |v: &str| u64::from_str_radix(v, 16).unwrap_or(0);
        let (local, remote) = (i32::from(local), i32::from(remote));
        for &(client, server) in &sessions {
            // The worker's end holds what it has not read; the server's end
            // what it could not send yet.
            if (local, remote) == (client, server) {
                queued += hex(rx);
            } else if (local, remote) == (server, client) {
                queued += hex(tx);
            }
        }
    }
    Some(queued)
}

async fn notification_queue_usage(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT pg_notification_queue_usage()")
        .fetch_one(pool)
        .await
        .expect("pg_notification_queue_usage")
}

/// Runs of each order handler so far.
async fn order_runs(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT handler, count(*) FROM dt_orders GROUP BY handler")
        .fetch_all(pool)
        .await
        .expect("the orders are read")
        .into_iter()
        .collect()
}

/// Whether `durable` has delivered stream sequence `seq` (or later).
async fn delivered_past(js: &jetstream::Context, stream: &str, durable: &str, seq: u64) -> bool {
    match js.get_stream_no_info(stream).await {
        Ok(s) => s
            .consumer_info(durable)
            .await
            .is_ok_and(|info| info.delivered.stream_sequence >= seq),
        Err(_) => false,
    }
}

async fn ack_floor(js: &jetstream::Context, stream: &str, durable: &str) -> u64 {
    match js.get_stream_no_info(stream).await {
        Ok(s) => s
            .consumer_info(durable)
            .await
            .map_or(0, |info| info.ack_floor.stream_sequence),
        Err(_) => 0,
    }
}

async fn consumer_drained(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
) -> Result<bool, String> {
    let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let last = s
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .last_sequence;
    let info = s.consumer_info(durable).await.map_err(|e| e.to_string())?;
    Ok(
        info.num_pending == 0
            && info.num_ack_pending == 0
            && info.ack_floor.stream_sequence >= last,
    )
}

/// The dead letters whose message id is in `ids`: (handler, message id,
/// sequence).
async fn dead_letters_of(
    js: &jetstream::Context,
    ids: &HashSet<String>,
) -> Vec<(String, String, u64)> {
    match dead_letter::list(js, dead_letter::DEFAULT_STREAM, &Filter::new()).await {
        Ok(letters) => letters
            .into_iter()
            .filter_map(|l| {
                let id = l.message_id()?.to_owned();
                ids.contains(&id)
                    .then(|| (l.handler().unwrap_or_default().to_owned(), id, l.sequence))
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Every message of `stream`: its subject and `Nats-Msg-Id`, in order.
async fn stream_ids(
    js: &jetstream::Context,
    stream: &str,
) -> Result<Vec<(String, String)>, String> {
    let mut handle = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let total = handle
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .messages;
    let consumer = handle
        .create_consumer(pull::OrderedConfig::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    while (ids.len() as u64) < total {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next()).await;
        let message = match next {
            Ok(Some(Ok(m))) => m,
            other => {
                return Err(format!(
                    "reading {stream}: {other:?} after {} of {total}",
                    ids.len()
                ));
            }
        };
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        ids.push((message.subject.to_string(), id));
    }
    Ok(ids)
}

/// Each id of `ids` that is not exactly once in `stored`, and each stored
/// id that is not in `ids`.
fn exactly_once(what: &str, ids: &HashSet<String>, stored: &[String]) -> Option<String> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for id in stored {
        *seen.entry(id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| (*id, *n))
        .take(10)
        .collect();
    let missing: Vec<_> = ids
        .iter()
        .filter(|id| !seen.contains_key(id.as_str()))
        .take(10)
        .collect();
    let foreign: Vec<_> = seen
        .keys()
        .filter(|id| !ids.contains(**id))
        .take(10)
        .collect();
    (!twice.is_empty() || !missing.is_empty() || !foreign.is_empty()).then(|| {
        format!(
            "{what}: {} stored for {} expected; twice: {twice:?}; missing: {missing:?}; unexpected: {foreign:?}",
            stored.len(),
            ids.len()
        )
    })
}

/// What [`when_given_up`] says of a request sent while no accident stood.
const QUIET: &str = "while no accident stood";

/// When a request that was given up was sent: before the first worker
/// answered, while an accident stood (from a client-retry horizon before it
/// began until the order route made progress after it ended), or
/// [`QUIET`].
fn when_given_up(sent: Instant, first_answered: Option<Instant>, accidents: &[Record]) -> String {
    if first_answered.is_none_or(|first| sent < first) {
        return "before the first worker answered".to_owned();
    }
    accidents
        .iter()
        .find(|r| {
            let recovered = r
                .after
                .iter()
                .find(|(part, _)| *part == Part::Orders)
                .and_then(|(_, took)| *took)
                .unwrap_or(Duration::MAX);
            sent + CLIENT_RETRY_HORIZON >= r.began
                && r.ended.checked_add(recovered).is_none_or(|at| sent <= at)
        })
        .map_or_else(
            || QUIET.to_owned(),
            |r| format!("{} {}", r.accident.name(), r.round),
        )
}

/// The end state beyond the ledger: the mirror, the downstream streams, the
/// orders, the dead letters and the purge. Returns every violation.
async fn check_end(
    setup: &Setup,
    messages: u64,
    ctx: &Context,
    accidents: &[Record],
) -> Vec<String> {
    let (pool, js) = (&setup.pool, &setup.js);
    let mut violations = Vec::new();
    // The mirror: every credit once, by its ref.
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT ref) FROM dt_mirror")
            .fetch_one(pool)
            .await
            .expect("the mirror is read");
    let strays: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dt_mirror WHERE ref NOT IN (SELECT 'r-' || i FROM generate_series(0, $1 - 1) i)",
    )
    .bind(messages as i64)
    .fetch_one(pool)
    .await
    .expect("the mirror is read");
    if rows != messages as i64 || distinct != messages as i64 || strays != 0 {
        violations.push(format!(
            "mirror: {rows} rows, {distinct} distinct refs, {strays} for no credit; expected {messages}"
        ));
    }
    match consumer_drained(js, &setup.stream, MIRROR_DURABLE).await {
        Ok(true) => {}
        other => violations.push(format!("the mirror's consumer still has work: {other:?}")),
    }
    // Downstream: one notice per credit, one message per writer row, one
    // per copy queued for a late stream; each stored once.
    match stream_ids(js, &ctx.names.out_stream).await {
        Ok(stored) => {
            let of = |subject: &str| -> Vec<String> {
                stored
                    .iter()
                    .filter(|(s, _)| s == subject)
                    .map(|(_, id)| id.clone())
                    .collect()
            };
            let notices = of(&ctx.names.out_subject);
            let distinct: HashSet<&String> = notices.iter().collect();
            if notices.len() as u64 != messages || distinct.len() as u64 != messages {
                violations.push(format!(
                    "credit notices: {} stored, {} distinct, for {messages} credits",
                    notices.len(),
                    distinct.len()
                ));
            }
            let side: HashSet<String> = (0..ctx.side.committed.load(Ordering::Relaxed))
                .map(side_id)
                .collect();
            violations.extend(exactly_once(
                "writer rows",
                &side,
                &of(&ctx.names.side_subject),
            ));
        }
        Err(e) => violations.push(format!("the downstream stream cannot be read: {e}")),
    }
    for round in 0..ctx
        .rounds
        .get(&Accident::UnstoredSubject)
        .copied()
        .unwrap_or(0)
    {
        let (subject, stream_name) = ctx.names.audit(round);
        let queued: HashSet<String> = sqlx::query_scalar::<_, String>(
            "SELECT msg_id FROM dt_audit_queued WHERE subject = $1",
        )
        .bind(&subject)
        .fetch_all(pool)
        .await
        .expect("the queued copies are read")
        .into_iter()
        .collect();
        match stream_ids(js, &stream_name).await {
            Ok(stored) => {
                let ids: Vec<String> = stored.into_iter().map(|(_, id)| id).collect();
                violations.extend(exactly_once(
                    &format!("copies for {subject}"),
                    &queued,
                    &ids,
                ));
            }
            Err(e) => violations.push(format!("{stream_name} cannot be read: {e}")),
        }
    }
    // Orders: a body ran once for each order answered, none twice, and a
    // retry got the first reply.
    let runs: HashMap<i64, Vec<(String, i64)>> = {
        let mut runs: HashMap<i64, Vec<(String, i64)>> = HashMap::new();
        for (order, handler, txid) in
            sqlx::query_as::<_, (i64, String, i64)>("SELECT order_id, handler, txid FROM dt_orders")
                .fetch_all(pool)
                .await
                .expect("the orders are read")
        {
            runs.entry(order).or_default().push((handler, txid));
        }
        runs
    };
    let records = ctx.requester.records();
    let mut problems = Vec::new();
    let (mut answered, mut abandoned, mut retried, mut refused) = (0, 0, 0, 0);
    // Requests given up, by when they were sent (and one reason each).
    let mut given_up: BTreeMap<String, (u64, String)> = BTreeMap::new();
    let first_answered = records
        .iter()
        .filter(|r| r.outcome == Outcome::Replied)
        .map(|r| r.sent)
        .min();
    for record in &records {
        let ran = runs
            .get(&(record.order as i64))
            .map_or(&[][..], Vec::as_slice);
        match &record.outcome {
            Outcome::Replied => {
                answered += 1;
                let reply: Option<serde_json::Value> = record
                    .reply
                    .as_ref()
                    .and_then(|b| serde_json::from_slice(b).ok());
                let txid = reply.as_ref().and_then(|v| v["txid"].as_i64());
                if ran.len() != 1 || ran.first().map(|(_, t)| *t) != txid {
                    problems.push(format!(
                        "order {}: replied {reply:?}, ran {ran:?}",
                        record.order
                    ));
                }
            }
            Outcome::Abandoned(why) => {
                abandoned += 1;
                let when = when_given_up(record.sent, first_answered, accidents);
                let entry = given_up.entry(when).or_insert((0, why.clone()));
                entry.0 += 1;
                if ran.len() > 1 {
                    problems.push(format!("order {} (given up): ran {ran:?}", record.order));
                }
            }
            // A retry whose claim expired is refused (`permanent`), which is
            // right if the body ran once; any other refusal is not.
            Outcome::Refused(why) => {
                refused += 1;
                if ran.len() != 1 {
                    problems.push(format!(
                        "order {} refused ({why}), ran {ran:?}",
                        record.order
                    ));
                }
            }
        }
        if let Some(retry) = &record.retry {
            retried += 1;
            match retry {
                Ok(bytes) if Some(bytes) == record.reply.as_ref() => {}
                Ok(bytes) => problems.push(format!(
                    "order {}: the retry got another reply: {:?}, first {:?}",
                    record.order,
                    String::from_utf8_lossy(bytes),
                    record
                        .reply
                        .as_ref()
                        .map(|b| String::from_utf8_lossy(b).into_owned())
                )),
                Err(Outcome::Abandoned(_)) => {}
                Err(Outcome::Refused(_)) if ran.len() == 1 => refused += 1,
                Err(other) => problems.push(format!(
                    "order {}: the retry got {other:?}, ran {ran:?}",
                    record.order
                )),
            }
        }
    }
    let unasked: Vec<_> = runs
        .keys()
        .filter(|o| **o <= 0 || **o as usize > records.len())
        .collect();
    if !unasked.is_empty() {
        problems.push(format!("orders never asked for ran: {unasked:?}"));
    }
    eprintln!(
        "chaos: day-two orders: {} requests, {answered} answered, {abandoned} given up, {retried} \
         retried after their reply, {refused} refused after running once, {} bodies run; given \
         up by when they were sent: {given_up:?}",
        records.len(),
        runs.values().map(Vec::len).sum::<usize>()
    );
    if let Some((n, why)) = given_up.get(QUIET) {
        problems.push(format!(
            "liveness: {n} order requests sent while no accident stood were given up after \
             {CLIENT_RETRY_HORIZON:?} of retries (one said: {why})"
        ));
    }
    if !problems.is_empty() {
        violations.push(format!(
            "orders ({} problems, first 10):\n    {}",
            problems.len(),
            problems
                .iter()
                .take(10)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n    ")
        ));
    }
    // Dead letters: exactly the accidents'.
    match dead_letter::list(js, dead_letter::DEFAULT_STREAM, &Filter::new()).await {
        Ok(letters) => {
            let mut kinds: BTreeMap<(String, String), u64> = BTreeMap::new();
            for l in &letters {
                *kinds
                    .entry((
                        l.handler().unwrap_or_default().to_owned(),
                        l.failure().unwrap_or_default().to_owned(),
                    ))
                    .or_default() += 1;
            }
            let big = CONCURRENCY
                * ctx
                    .rounds
                    .get(&Accident::NearMaxPayload)
                    .copied()
                    .unwrap_or(0) as u64;
            let frozen = FROZEN_PER_REPLAY
                * ctx
                    .rounds
                    .get(&Accident::SharedReplay)
                    .copied()
                    .unwrap_or(0) as u64;
            let mut expected: BTreeMap<(String, String), u64> = BTreeMap::new();
            if big > 0 {
                expected.insert((HANDLER.to_owned(), "undecodable".to_owned()), big);
                expected.insert((MIRROR_HANDLER.to_owned(), "undecodable".to_owned()), big);
            }
            if frozen > 0 {
                expected.insert((MIRROR_HANDLER.to_owned(), "permanent".to_owned()), frozen);
            }
            if kinds != expected {
                violations.push(format!(
                    "dead letters by (handler, failure): {kinds:?}, expected {expected:?}"
                ));
            }
        }
        Err(e) => {
            if ctx.rounds.contains_key(&Accident::NearMaxPayload)
                || ctx.rounds.contains_key(&Accident::SharedReplay)
            {
                violations.push(format!("the dead letters cannot be listed: {e}"));
            }
        }
    }
    // The purge: nothing overdue, nothing left half done.
    match ctx.watch.last() {
        Some(sample) if sample.purge.healthy() => {}
        other => violations.push(format!("the purge is not healthy at the end: {other:?}")),
    }
    violations
}

/// Runs the day-two mode.
pub async fn run(test: &str) {
    let started = Instant::now();
    let knobs = Knobs::from_env();
    let messages: u64 = env_or("IDEM_CHAOS_MESSAGES", 2_000);
    let rate: f64 = env_or("IDEM_CHAOS_RATE", 120.0);
    let seed = seed();
    let mut rng = Rng(seed);
    let mut schedule: Vec<Fault> = (0..knobs.rounds)
        .flat_map(|_| knobs.accidents.iter().map(|&a| Fault::DayTwo(a)))
        .collect();
    rng.shuffle(&mut schedule);
    eprintln!(
        "chaos: day-two: {messages} credits at {rate:.0}/s, accidents {:?}, seed {seed} (replay \
         with IDEM_CHAOS_SEED={seed}); liveness bound {:?}, the purge's {:?}",
        schedule
            .iter()
            .map(|f| match f {
                Fault::DayTwo(a) => a.name(),
                _ => "?",
            })
            .collect::<Vec<_>>(),
        knobs.bound,
        knobs.purge_bound
    );
    let Some(mut setup) = super::setup(test, &[("CHAOS_PROFILE", "day-two")], Route::Direct).await
    else {
        return;
    };
    let names = Names::of(&setup.stream);
    for (k, v) in [
        ("CHAOS_OUT_SUBJECT", names.out_subject.clone()),
        ("CHAOS_PLACE_SUBJECT", names.place_subject.clone()),
        ("CHAOS_PLACE_VERSION", "1".to_owned()),
        (
            "CHAOS_PLACE_RETENTION_MS",
            RETENTION.as_millis().to_string(),
        ),
        (
            "CHAOS_PLACE_RETRY_HORIZON_MS",
            CLIENT_RETRY_HORIZON.as_millis().to_string(),
        ),
        ("CHAOS_RELAY_BATCH", RELAY_BATCH.to_string()),
        ("CHAOS_MIRROR_DURABLE", MIRROR_DURABLE.to_owned()),
    ] {
        setup.worker_env.push((k.to_owned(), v));
    }
    let context = Context::start(&setup, knobs.clone(), Rng(rng.next_u64()), messages).await;
    setup.day_two = Some(context);
    let mut expected = Expected::for_messages(messages);
    let count = |a: Accident| schedule.iter().filter(|f| **f == Fault::DayTwo(a)).count() as u64;
    expected.dead_letters = 2 * CONCURRENCY * count(Accident::NearMaxPayload)
        + FROZEN_PER_REPLAY * count(Accident::SharedReplay);
    // The accidents are placed over the first three quarters of the
    // credits: the rest keep the routes busy while the last ones are
    // measured.
    let (schedule, spacing) = place(messages - messages / 4, schedule, &mut rng);
    let (finished, published, faults_done) =
        drive(&mut setup, &expected, rate, rng, &schedule, spacing).await;
    let context = setup.day_two.as_ref().expect("the day-two context");
    let table = finished.tally.day_two.table(&context.knobs);
    let end = check_end(&setup, messages, context, &finished.tally.day_two.records).await;
    let totals = finished.tally.totals();
    eprintln!(
        "{table}chaos: day-two: {messages} credits in {:.1?} (accidents done at {faults_done:.1?}; \
         published in {:.1?}); workers started {}; writer rows {}; credit route: processed {}, \
         duplicates {}, rejected {}, dead-lettered {}; consumer {:?}",
        started.elapsed(),
        published.took,
        finished.tally.workers_started,
        context.side.committed.load(Ordering::Relaxed),
        totals.processed,
        totals.duplicates,
        totals.rejected,
        totals.dead_lettered,
        finished.consumer
    );
    let mut violations = finished.violations.clone();
    violations.extend(end);
    if !finished.consumer.is_drained() {
        violations.push(format!(
            "the credit route's consumer still has work: {:?}",
            finished.consumer
        ));
    }
    assert!(
        violations.is_empty(),
        "day-two: the end state is wrong:\n  {}",
        violations.join("\n  ")
    );
    assert_eq!(
        finished.tally.day_two.records.len(),
        knobs.rounds * knobs.accidents.len(),
        "every accident happened"
    );
}
