//! Cluster mode: three worker processes (`chaos_worker`, each connected
//! with all three nodes' URLs) share one durable consumer, R3 like its
//! stream, on a 3-node JetStream cluster (`idem_tests::NatsCluster`), while
//! the test SIGKILLs the stream's leader and restarts it on its store,
//! later the consumer's leader likewise, SIGKILLs workers at random and
//! starts new ones, and restarts PostgreSQL once (immediate shutdown).
//!
//! Faults come one at a time, placed by progress as in kill mode, and a
//! leader kill ends only once the node is back and every replica of the
//! stream and of the consumer is current again, so no fault meets a cluster
//! still short of a node.
//!
//! # Proof that each fault landed
//!
//! - **Leader kills:** the leaders of the stream and of the consumer are
//!   first put on different nodes (so one kill takes one leader), the node
//!   to kill is read as the leader just before the SIGKILL, and afterwards a
//!   leader on another, live node must be elected.
//! - **Worker kills:** the worker is killed once its journal shows a
//!   transaction begun and not committed; after the kill that transaction
//!   must still be uncommitted in its journal (or its last report must show
//!   work in flight). Over the run, at least one kill must have left a
//!   transaction open whose message another worker applied later.
//! - **Idle workers** are measured, not asserted: a worker whose node died
//!   can take no message for seconds after its client reconnected (its pull
//!   is re-issued on a missed heartbeat), so a worker kill picks, from a
//!   random start, the first worker that begins a transaction.
//! - **PostgreSQL restart:** the workers' own router counters (failed,
//!   retried, commit failed, held) must move while it is down, and their
//!   probes must see it come back.
//!
//! # What each fault cost
//!
//! The test prints a table at the end. For each fault, *stall* is the
//! longest gap between two committed messages (the ledger's `applied_at`,
//! written in the transaction) from the fault until the next one, and
//! *absorbed* is how many redeliveries the workers' claims skipped as
//! duplicates (their `Stats::duplicates`) in that time, and *worker idle*
//! the longest a single worker took no message while the others applied at
//! least 20 a second. The row before the
//! first fault is the baseline of the same run. Figures are printed, not
//! asserted: speed is not the invariant.
//!
//! # Modes
//!
//! Quick by default (3,000 messages, 4 worker kills; about a minute; CI runs
//! it). The long mode, with the suite's knobs:
//!
//! ```sh
//! IDEM_CHAOS_MESSAGES=100000 cargo test -p idem-tests --test chaos -- --nocapture cluster
//! ```
//!
//! `IDEM_CHAOS_KILLS` sets the worker kills (default 4, or one per 10,000
//! messages if more), `IDEM_CHAOS_CLUSTER_BATCH` the workers' `Route::batch`
//! (default 1: per-message mode); `IDEM_CHAOS_RATE`, `IDEM_CHAOS_SEED`,
//! `IDEM_CHAOS_LOG_DIR` and `IDEM_CHAOS_WORKER_LOG` work as in the other
//! modes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, stream};
use idem_tests::{ClusterEnv, create_idem_streams_r3, unique_name};
use sqlx::PgPool;

use super::{
    ConsumerState, DURABLE, Expected, LogDir, Published, Rng, SIGTERM_GRACE, STALL_TIMEOUT,
    START_TIMEOUT, check_ledger, consumer_state, env_or, ledger_rows, place, publish_all,
    publish_rate, read_ledger, seed,
};
use idem_tests::worker_process::{Ended, Report, Worker};

/// Worker processes sharing the durable.
const WORKERS: usize = 3;
/// Rows the ledger must grow by after a leader kill, with the node still
/// down, before it is restarted: processing resumed without it.
const RESUMED: i64 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClusterFault {
    /// SIGKILL one worker, at random, with a transaction open; start another.
    KillWorker,
    /// SIGKILL the node that leads the stream; restart it on its store.
    KillStreamLeader,
    /// SIGKILL the node that leads the consumer; restart it on its store.
    KillConsumerLeader,
    /// Immediate shutdown of PostgreSQL, then start it again.
    RestartPostgres,
}

/// One fault as it happened.
struct FaultRecord {
    fault: ClusterFault,
    /// When it struck, into the run.
    at: Duration,
    /// When it struck, in seconds since the Unix epoch (comparable with the
    /// ledger's `applied_at`: PostgreSQL runs on this machine).
    at_epoch: f64,
    /// The workers' duplicates skipped so far, when it struck.
    duplicates_before: u64,
    /// What it did, and the proof that it landed.
    detail: String,
}

/// `num_replicas: 3` stream and three workers on a 3-node cluster.
struct ClusterRun {
    env: ClusterEnv,
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    subject: String,
    worker_env: Vec<(String, String)>,
    logs: LogDir,
    /// One slot per worker process; `None` only between a kill and the
    /// start of its successor.
    workers: Vec<Option<Worker>>,
    ended: Vec<Ended>,
    workers_started: usize,
    rng: Rng,
    /// How far the publisher may go.
    gate: Arc<AtomicU64>,
    published: Arc<AtomicU64>,
    faults: Vec<FaultRecord>,
    started: Instant,
    /// Per slot: since when the worker's `received` has not moved.
    received: Vec<Spell>,
    /// Spells of a worker taking no message for more than [`IDLE`] s while
    /// the others applied messages: from, to (epoch seconds), the worker.
    idle: Vec<(f64, f64, usize)>,
}

/// A worker that takes no message for this long (seconds) while the
/// others apply [`IDLE_ROWS_PER_SECOND`] messages a second on average has a
/// stalled pull: messages were flowing, and none came to it.
const IDLE: f64 = 2.0;
const IDLE_ROWS_PER_SECOND: f64 = 20.0;

/// Since when a worker has taken no message.
#[derive(Debug, Clone, Copy, Default)]
struct Spell {
    ordinal: usize,
    received: u64,
    /// Epoch seconds.
    since: f64,
    /// The ledger's rows then.
    rows: i64,
}

fn epoch_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The longest gap between two consecutive commits (`commits` sorted, in
/// epoch seconds) within `from..to`: the part of a gap before `from` went
/// to the fault before, the part after `to` to the next one. (The next
/// fault strikes only once the ledger has grown past its mark, so a fault's
/// stall is over by then.)
fn longest_gap(commits: &[f64], from: f64, to: f64) -> f64 {
    commits
        .windows(2)
        .filter(|w| w[1] > from && w[0] < to)
        .map(|w| w[1].min(to) - w[0].max(from))
        .fold(0.0, f64::max)
}

/// Kill mode's order on a cluster: `kills` worker kills, with the stream
/// leader's kill a quarter of the way in, the PostgreSQL restart halfway
/// and the consumer leader's kill three quarters in.
fn cluster_schedule(messages: u64, kills: usize, rng: &mut Rng) -> (Vec<(u64, ClusterFault)>, u64) {
    let mut faults = vec![ClusterFault::KillWorker; kills];
    let total = kills + 3;
    faults.insert(total / 4, ClusterFault::KillStreamLeader);
    faults.insert(total / 2, ClusterFault::RestartPostgres);
    faults.insert(total * 3 / 4, ClusterFault::KillConsumerLeader);
    place(messages, faults, rng)
}

impl ClusterRun {
    async fn start(test: &str, batch: usize, seed: u64) -> ClusterRun {
        idem_tests::require_own_servers();
        let env = ClusterEnv::start().await;
        let pool = env.pool().await;
        // A short timeout, so that a request lost with a dead node is
        // retried soon.
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(2))
            .build(env.cluster.client().await);
        create_idem_streams_r3(&js).await;
        let stream = unique_name("chaos");
        let subject = format!("{stream}.credit");
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("the R3 stream is created");
        let worker_env = vec![
            ("NATS_URL".into(), env.cluster.url_list()),
            ("DATABASE_URL".into(), env.postgres().url().to_owned()),
            ("CHAOS_STREAM".into(), stream.clone()),
            ("CHAOS_DURABLE".into(), DURABLE.into()),
            ("CHAOS_ACK_WAIT_MS".into(), "2000".into()),
            ("CHAOS_CONCURRENCY".into(), "8".into()),
            ("CHAOS_BATCH".into(), batch.to_string()),
            // 5 ms inside each transaction, so that a kill finds some open.
            ("CHAOS_HANDLER_DELAY_MS".into(), "5".into()),
            (
                "RUST_LOG".into(),
                env_or("IDEM_CHAOS_WORKER_LOG", "warn,idem_runtime=info".to_owned()),
            ),
            ("RUST_BACKTRACE".into(), "1".into()),
        ];
        ClusterRun {
            env,
            pool,
            js,
            stream,
            subject,
            worker_env,
            logs: LogDir::new(test),
            workers: (0..WORKERS).map(|_| None).collect(),
            ended: Vec::new(),
            workers_started: 0,
            rng: Rng(seed),
            gate: Arc::new(AtomicU64::new(0)),
            published: Arc::new(AtomicU64::new(0)),
            faults: Vec::new(),
            started: Instant::now(),
            received: vec![Spell::default(); WORKERS],
            idle: Vec::new(),
        }
    }

    /// Starts a worker in `slot` and waits for its `started` line.
    async fn start_worker(&mut self, slot: usize) {
        self.workers_started += 1;
        let mut worker = Worker::spawn(
            super::CHAOS_WORKER.as_ref(),
            self.workers_started,
            &self.worker_env,
            self.logs.path(),
        );
        if let Err(e) = worker
            .wait_for("print its started line", START_TIMEOUT, |_| true)
            .await
        {
            self.fail(&format!("{e}\n{}", worker.log_tail(40))).await;
        }
        self.workers[slot] = Some(worker);
    }

    /// Samples each worker's `received` against the ledger's `rows`: a
    /// worker whose count does not move while the others apply messages
    /// has work it does not take. Called on every poll of the ledger.
    fn sample_idle(&mut self, rows: i64) {
        let now = epoch_now();
        for slot in 0..WORKERS {
            let Some(worker) = &self.workers[slot] else {
                continue;
            };
            let (ordinal, received) = (worker.ordinal, worker.last().received);
            let spell = self.received[slot];
            if ordinal != spell.ordinal || received != spell.received {
                self.close_idle(slot, now, rows);
                self.received[slot] = Spell {
                    ordinal,
                    received,
                    since: now,
                    rows,
                };
            }
        }
    }

    /// Ends slot `slot`'s spell, recording it if it lasted more than
    /// [`IDLE`] s while the others kept applying messages.
    fn close_idle(&mut self, slot: usize, now: f64, rows: i64) {
        let spell = self.received[slot];
        let lasted = now - spell.since;
        if spell.ordinal != 0
            && lasted > IDLE
            && (rows - spell.rows) as f64 >= IDLE_ROWS_PER_SECOND * lasted
        {
            self.idle.push((spell.since, now, spell.ordinal));
        }
    }

    fn live(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().flatten()
    }

    /// A counter summed over every worker so far: the ended ones' last (or
    /// final) reports, and the live ones' latest.
    fn total(&self, counter: impl Fn(&Report) -> u64) -> u64 {
        let ended: u64 = self
            .ended
            .iter()
            .map(|e| counter(e.stopped.as_ref().unwrap_or(&e.last)))
            .sum();
        ended + self.live().map(|w| counter(&w.last())).sum::<u64>()
    }

    /// Panics with `what` and what helps to understand it.
    async fn fail(&self, what: &str) -> ! {
        let consumer = tokio::time::timeout(
            Duration::from_secs(10),
            consumer_state(&self.js, &self.stream),
        )
        .await;
        let rows = tokio::time::timeout(Duration::from_secs(10), ledger_rows(&self.pool)).await;
        let workers: Vec<String> = self
            .live()
            .map(|w| format!("worker #{}: {:?}\n{}", w.ordinal, w.last(), w.log_tail(20)))
            .collect();
        panic!(
            "{what}\n  published so far: {}\n  ledger rows: {rows:?}\n  consumer: {consumer:?}\n  \
             faults so far: {:?}\n{}\n{}",
            self.published.load(Ordering::Relaxed),
            self.faults.iter().map(|f| f.fault).collect::<Vec<_>>(),
            workers.join("\n"),
            self.env.cluster.log_tails()
        );
    }

    /// Which worker ended on its own, if one did.
    fn worker_ended(&mut self) -> Option<String> {
        self.workers.iter_mut().flatten().find_map(|worker| {
            let status = worker.exited()?;
            Some(format!(
                "worker #{} ended on its own ({status})",
                worker.ordinal
            ))
        })
    }

    fn let_more_through(&self, more: u64) {
        self.gate.fetch_max(
            self.published.load(Ordering::Relaxed) + more,
            Ordering::Relaxed,
        );
    }

    /// Waits until the ledger holds `rows` rows, failing if a worker ends on
    /// its own or the ledger stops growing for [`STALL_TIMEOUT`].
    async fn wait_for_rows(&mut self, rows: i64) {
        let mut last = (ledger_rows(&self.pool).await, Instant::now());
        loop {
            let now = ledger_rows(&self.pool).await;
            if now >= rows {
                return;
            }
            if let Some(what) = self.worker_ended() {
                self.fail(&format!("{what} while rows were due")).await;
            }
            self.sample_idle(now);
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > STALL_TIMEOUT {
                self.fail(&format!(
                    "no progress for {STALL_TIMEOUT:?}: the ledger is stuck at {now} rows, waiting for {rows}"
                ))
                .await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs the faults in order; the publisher may run half a spacing ahead
    /// of the next one (see `FaultDriver::run`).
    async fn run(&mut self, faults: &[(u64, ClusterFault)], spacing: u64) {
        for (k, &(at, fault)) in faults.iter().enumerate() {
            self.gate.store(at + spacing / 2, Ordering::Relaxed);
            self.wait_for_rows(at as i64).await;
            tokio::time::sleep(self.rng.millis(0, 300)).await;
            eprintln!(
                "chaos-cluster: {:.1?}: fault {}/{}, {fault:?}, due at {at} rows",
                self.started.elapsed(),
                k + 1,
                faults.len()
            );
            let record = FaultRecord {
                fault,
                at: self.started.elapsed(),
                at_epoch: epoch_now(),
                duplicates_before: self.total(|r| r.duplicates),
                detail: String::new(),
            };
            let detail = match fault {
                ClusterFault::KillWorker => self.kill_worker().await,
                ClusterFault::KillStreamLeader | ClusterFault::KillConsumerLeader => {
                    self.kill_leader(fault).await
                }
                ClusterFault::RestartPostgres => self.restart_postgres().await,
            };
            eprintln!("chaos-cluster:   {detail}");
            self.faults.push(FaultRecord { detail, ..record });
        }
        self.gate.store(u64::MAX, Ordering::Relaxed);
    }

    /// SIGKILLs a worker chosen at random as soon as its journal shows a
    /// transaction open, and starts another in its place.
    async fn kill_worker(&mut self) -> String {
        // A worker at random, or, if it takes no work (its pull can stall
        // for a while after its node died: see `idle`), the next one.
        let first = self.rng.between(0, WORKERS as u64 - 1) as usize;
        self.let_more_through(32);
        let tried_since = Instant::now();
        let (slot, open) = 'found: loop {
            for k in 0..WORKERS {
                let slot = (first + k) % WORKERS;
                let worker = self.workers[slot]
                    .as_mut()
                    .expect("every slot has a worker");
                if let Ok(id) = worker
                    .wait_for_open_transaction(Duration::from_secs(2))
                    .await
                {
                    break 'found (slot, id);
                }
                self.let_more_through(32);
            }
            if tried_since.elapsed() > Duration::from_secs(30) {
                self.fail("no worker began a transaction within 30 s").await;
            }
        };
        let worker = self.workers[slot].take().expect("every slot has a worker");
        let ended = worker.sigkill();
        assert!(
            ended.was_sigkilled(),
            "worker #{} ended with {} rather than by our SIGKILL",
            ended.ordinal,
            ended.status
        );
        // The message we waited for is still begun and not committed in
        // the journal of the dead worker (its last stats line can be 10 ms
        // old, the journal is not).
        let caught_open = ended.journal.open().any(|id| *id == open);
        assert!(
            caught_open || ended.last.in_flight > 0,
            "worker #{} had work in flight when it was killed: {open} committed before the kill, \
             and its last report shows nothing in flight: {:?}",
            ended.ordinal,
            ended.last
        );
        let detail = format!(
            "worker #{} (pid {}) SIGKILLed with {} in flight ({} open in its journal, {}; its last \
             report: {} in flight)",
            ended.ordinal,
            ended.pid,
            open,
            ended.journal.open().count(),
            if caught_open {
                "it among them"
            } else {
                "committed just before"
            },
            ended.last.in_flight,
        );
        self.ended.push(ended);
        // Now and then, leave the durable to two workers for a moment.
        if self.rng.between(0, 2) == 0 {
            tokio::time::sleep(self.rng.millis(100, 1000)).await;
        }
        self.start_worker(slot).await;
        detail
    }

    /// SIGKILLs the node that leads the stream (or the consumer), with the
    /// other leader elsewhere; waits until another node is elected and
    /// processing goes on without it; restarts it on its store and waits
    /// until every replica is current.
    async fn kill_leader(&mut self, fault: ClusterFault) -> String {
        self.let_more_through(64);
        let rows_at_kill = ledger_rows(&self.pool).await;
        let (mut node, mut other) = (0, 0);
        let mut separated = false;
        for _ in 0..5 {
            let (stream_leader, consumer_leader) = self
                .env
                .cluster
                .separate_leaders(&self.js, &self.stream, DURABLE)
                .await;
            (node, other) = match fault {
                ClusterFault::KillStreamLeader => (stream_leader, consumer_leader),
                _ => (consumer_leader, stream_leader),
            };
            // Read again at the last moment: the node killed is the leader.
            if self.leader(fault).await == node {
                separated = true;
                break;
            }
        }
        assert!(separated, "the {fault:?} leader kept moving");
        let killed_at = Instant::now();
        self.env.cluster.kill(node);
        let elected = loop {
            let leader = self.leader(fault).await;
            if leader != node {
                break leader;
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(60),
                "no new {fault:?} leader within 60 s of killing n{node}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let elected_after = killed_at.elapsed();
        assert!(
            elected != node && self.env.cluster.is_running(elected),
            "the {fault:?} leadership moved to a live node: n{elected}"
        );
        self.let_more_through(RESUMED as u64 * 2);
        self.wait_for_rows(rows_at_kill + RESUMED).await;
        let down_for = killed_at.elapsed();
        self.env.cluster.start_again(node).await;
        let cluster = &self.env.cluster;
        cluster
            .wait_stream_replicas_current(&self.js, &self.stream)
            .await;
        cluster
            .wait_consumer_replicas_current(&self.js, &self.stream, DURABLE)
            .await;
        format!(
            "n{node} SIGKILLed as leader (the other leader on n{other}); n{elected} elected after \
             {elected_after:.1?}; down {down_for:.1?} ({RESUMED} rows applied without it); \
             restarted on its store and caught up {:.1?} after the kill",
            killed_at.elapsed()
        )
    }

    /// The node that leads the stream, or the consumer, as `fault` names.
    async fn leader(&self, fault: ClusterFault) -> usize {
        let cluster = &self.env.cluster;
        match fault {
            ClusterFault::KillStreamLeader => cluster.stream_leader(&self.js, &self.stream).await,
            _ => {
                cluster
                    .consumer_leader(&self.js, &self.stream, DURABLE)
                    .await
            }
        }
    }

    /// Stops PostgreSQL with an immediate shutdown until the workers' own
    /// routers have met the outage, then starts it again.
    async fn restart_postgres(&mut self) -> String {
        let failures = |r: &Report| r.router_failures();
        let before = self.total(failures);
        let recoveries_before = self.total(|r| r.pg_recoveries);
        let pid = self.env.postgres().pid();
        let stopped = Instant::now();
        self.env.postgres_mut().stop_immediate().await;
        self.let_more_through(32);
        let down_at_least = self.rng.millis(300, 1500);
        while self.total(failures) <= before {
            if stopped.elapsed() > Duration::from_secs(30) {
                self.fail("no worker's router met the PostgreSQL outage within 30 s")
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(down_at_least.saturating_sub(stopped.elapsed())).await;
        let down_for = stopped.elapsed();
        self.env.postgres_mut().start_again().await;
        assert_ne!(pid, self.env.postgres().pid(), "a new postmaster");
        while self.total(|r| r.pg_recoveries) <= recoveries_before {
            if stopped.elapsed() > Duration::from_secs(60) {
                self.fail("no worker's probe saw PostgreSQL come back within 60 s")
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = self.total(failures);
        assert!(after > before, "the routers met the outage");
        format!(
            "PostgreSQL down {down_for:.1?}; the routers' failed + retried + commit failed + held \
             went {before} -> {after}; their probes saw it come back"
        )
    }

    /// Waits until the consumer has acked everything, with every worker
    /// alive, then stops them with SIGTERM (each must exit 0).
    async fn drain_and_stop(&mut self, messages: u64) -> ConsumerState {
        let deadline = Instant::now() + Duration::from_secs(60 + messages / 200);
        let mut last_note = Instant::now();
        loop {
            let state = consumer_state(&self.js, &self.stream).await;
            let rows = ledger_rows(&self.pool).await;
            self.sample_idle(rows);
            if let Ok(state) = &state
                && state.messages >= messages
                && state.is_drained()
            {
                break;
            }
            if let Some(what) = self.worker_ended() {
                self.fail(&format!("{what} before the consumer drained"))
                    .await;
            }
            if Instant::now() > deadline {
                self.fail(&format!("the consumer did not drain: {state:?}"))
                    .await;
            }
            if last_note.elapsed() > Duration::from_secs(10) {
                eprintln!(
                    "chaos-cluster: draining: consumer {state:?}, ledger {} rows",
                    ledger_rows(&self.pool).await
                );
                last_note = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let rows = ledger_rows(&self.pool).await;
        for slot in 0..WORKERS {
            self.close_idle(slot, epoch_now(), rows);
            let worker = self.workers[slot].take().expect("every slot has a worker");
            let (ended, _) = worker.sigterm(SIGTERM_GRACE).await.unwrap_or_else(|e| {
                panic!("{e}");
            });
            assert_eq!(
                ended.status.code(),
                Some(0),
                "worker #{} exits 0 on SIGTERM",
                ended.ordinal
            );
            self.ended.push(ended);
        }
        consumer_state(&self.js, &self.stream)
            .await
            .expect("the consumer is readable")
    }

    /// Every commit's `applied_at`, in epoch seconds, sorted.
    async fn commit_times(&self) -> Vec<f64> {
        sqlx::query_scalar(
            "SELECT extract(epoch FROM applied_at)::float8 FROM chaos_ledger ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await
        .expect("the commit times are read")
    }
}

/// One row of the per-fault table.
struct Cost {
    label: String,
    at: Option<Duration>,
    stall: f64,
    absorbed: u64,
    /// The longest spell a worker took nothing while the others worked,
    /// begun in this window: seconds, and which worker.
    idle: Option<(f64, usize)>,
    detail: String,
}

/// The longest idle spell (see [`ClusterRun::sample_idle`]) that became
/// one (passed [`IDLE`] s) in `from..to`: a worker briefly without a
/// message when a fault strikes is stalled by that fault.
fn longest_idle(idle: &[(f64, f64, usize)], from: f64, to: f64) -> Option<(f64, usize)> {
    idle.iter()
        .filter(|(since, _, _)| (from..to).contains(&(since + IDLE)))
        .map(|&(since, until, worker)| (until - since, worker))
        .max_by(|a, b| a.0.total_cmp(&b.0))
}

async fn cluster_chaos(test: &str) {
    let started = Instant::now();
    let messages: u64 = env_or("IDEM_CHAOS_MESSAGES", 3_000);
    let kills: usize = env_or("IDEM_CHAOS_KILLS", 4.max(messages as usize / 10_000));
    let batch: usize = env_or("IDEM_CHAOS_CLUSTER_BATCH", 1);
    let rate = publish_rate(messages);
    let seed = seed();
    eprintln!(
        "chaos-cluster: {messages} messages, 3 workers (batch {batch}), {kills} worker kills, \
         stream and consumer leader kills, a PostgreSQL restart; publish rate {rate:.0}/s; \
         seed {seed} (replay with IDEM_CHAOS_SEED={seed})"
    );
    let mut run = ClusterRun::start(test, batch, seed).await;
    let expected = Expected::for_messages(messages);
    let (faults, spacing) = cluster_schedule(messages, kills, &mut run.rng);
    let publisher = tokio::spawn(publish_all(
        run.js.clone(),
        run.subject.clone(),
        messages,
        rate,
        run.gate.clone(),
        run.published.clone(),
    ));
    for slot in 0..WORKERS {
        run.start_worker(slot).await;
    }
    run.started = Instant::now();
    let first_commit = epoch_now();
    run.run(&faults, spacing).await;
    let faults_done = run.started.elapsed();
    let published: Published = publisher.await.expect("the publisher finished");
    let consumer = run.drain_and_stop(messages).await;
    let drained_at = epoch_now();
    let violations = check_ledger(&run.pool, &run.js, &expected).await;
    let ledger = read_ledger(&run.pool).await;
    let commits = run.commit_times().await;
    let final_duplicates = run.total(|r| r.duplicates);

    // The cost of each fault: from it to the next (the last: to the drain).
    let mut costs = vec![Cost {
        label: "(none: before the first fault)".into(),
        at: None,
        stall: longest_gap(
            &commits,
            first_commit,
            run.faults.first().map_or(drained_at, |f| f.at_epoch),
        ),
        absorbed: run.faults.first().map_or(0, |f| f.duplicates_before),
        idle: longest_idle(
            &run.idle,
            first_commit,
            run.faults.first().map_or(drained_at, |f| f.at_epoch),
        ),
        detail: String::new(),
    }];
    for (k, fault) in run.faults.iter().enumerate() {
        let next = run.faults.get(k + 1);
        costs.push(Cost {
            label: format!("{:?}", fault.fault),
            at: Some(fault.at),
            stall: longest_gap(
                &commits,
                fault.at_epoch,
                next.map_or(drained_at, |n| n.at_epoch),
            ),
            absorbed: next.map_or(final_duplicates, |n| n.duplicates_before)
                - fault.duplicates_before,
            idle: longest_idle(
                &run.idle,
                fault.at_epoch,
                next.map_or(drained_at, |n| n.at_epoch),
            ),
            detail: fault.detail.clone(),
        });
    }
    // Kills whose open transactions another worker applied later.
    let kills_with_open_work = run
        .ended
        .iter()
        .filter(|e| e.was_sigkilled())
        .filter(|e| {
            e.journal
                .open()
                .any(|id| ledger.get(id).is_some_and(|row| row.worker_pid != e.pid))
        })
        .count();
    let totals = Report {
        processed: run.total(|r| r.processed),
        duplicates: final_duplicates,
        failed: run.total(|r| r.failed),
        commit_failed: run.total(|r| r.commit_failed),
        retried_in_process: run.total(|r| r.retried_in_process),
        rejected: run.total(|r| r.rejected),
        dead_lettered: run.total(|r| r.dead_lettered),
        nats_disconnects: run.total(|r| r.nats_disconnects),
        startup_failures: run.total(|r| r.startup_failures),
        batches: run.total(|r| r.batches),
        ..Report::default()
    };
    let mut table = String::from(
        "chaos-cluster: what each fault cost (stall: longest gap between two commits from the \
         fault to the next; absorbed: redeliveries the claims skipped meanwhile; worker idle: \
         the longest a worker took no message while the others applied some)\n\
         | # | at | fault | stall | absorbed | worker idle | what happened |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for (k, cost) in costs.iter().enumerate() {
        table.push_str(&format!(
            "| {k} | {} | {} | {:.2} s | {} | {} | {} |\n",
            cost.at
                .map_or("-".to_owned(), |at| format!("{:.1} s", at.as_secs_f64())),
            cost.label,
            cost.stall,
            cost.absorbed,
            cost.idle.map_or("-".to_owned(), |(secs, worker)| format!(
                "{secs:.1} s (#{worker})"
            )),
            cost.detail
        ));
    }
    eprintln!(
        "{table}chaos-cluster: {messages} messages in {:.1?} (faults done at {faults_done:.1?}; \
         published in {:.1?}, {} retries, {} JetStream duplicates)\n\
         chaos-cluster: workers started {}, {} kills left open transactions another worker applied\n\
         chaos-cluster: totals: processed {}, duplicates skipped {}, failed {}, commit failed {}, \
         retried in process {}, batches {}, rejected {}, dead-lettered {}, NATS disconnects {}, \
         start-ups retried {}\nchaos-cluster: consumer {consumer:?}",
        started.elapsed(),
        published.took,
        published.retries,
        published.duplicates,
        run.workers_started,
        kills_with_open_work,
        totals.processed,
        totals.duplicates,
        totals.failed,
        totals.commit_failed,
        totals.retried_in_process,
        totals.batches,
        totals.rejected,
        totals.dead_lettered,
        totals.nats_disconnects,
        totals.startup_failures,
    );

    assert!(
        violations.is_empty(),
        "exactly-once violated:\n  {}",
        violations.join("\n  ")
    );
    // A publish retried across a leader election may be stored twice if
    // the new leader had not yet seen the first; the claim absorbs it.
    assert!(
        consumer.is_drained() && consumer.messages >= messages,
        "the consumer still has work, or the stream lost messages: {consumer:?}"
    );
    assert_eq!(
        (totals.rejected, totals.dead_lettered),
        (0, 0),
        "no message was rejected or dead-lettered"
    );
    let count = |fault| run.faults.iter().filter(|f| f.fault == fault).count();
    assert_eq!(
        (
            count(ClusterFault::KillWorker),
            count(ClusterFault::KillStreamLeader),
            count(ClusterFault::KillConsumerLeader),
            count(ClusterFault::RestartPostgres)
        ),
        (kills, 1, 1, 1),
        "every fault of the schedule was done"
    );
    assert!(
        kills_with_open_work >= 1,
        "at least one worker kill left a transaction open that another worker applied"
    );
    if batch > 1 {
        assert!(totals.batches > 0, "batch mode committed batches");
    }
}

/// Three workers share an R3 durable on a 3-node cluster while the stream's
/// leader and later the consumer's leader are SIGKILLed and restarted on
/// their stores, workers are SIGKILLed at random, and PostgreSQL restarts:
/// every message is applied exactly once, nothing is left pending.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test crashes its servers"
)]
async fn cluster_leader_worker_and_postgres_faults_apply_every_message_once() {
    cluster_chaos("cluster").await;
}
