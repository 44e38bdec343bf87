//! The kill run: the chaos suite's kill mode, with a worker process on a
//! database other than the chaos suite's (SQLite, MariaDB), written once and
//! run on each ([`kill_run`]; `tests/tests/sqlite/kills.rs`,
//! `tests/tests/mariadb/kills.rs`).
//!
//! The worker credits accounts from a stream while messages are published
//! at a steady rate, and the test SIGKILLs it again and again, starting a
//! new one each time, and SIGKILLs and restarts nats-server once. A last
//! worker drains the stream and is stopped with SIGTERM. Then:
//!
//! - the ledger holds one row per message, with the expected balances, and
//!   idem one claim per message;
//! - the consumer has nothing pending and nothing awaiting ack, and nothing
//!   was dead-lettered;
//! - the last worker exited 0 after journaling `stopped`.
//!
//! # Proof that the faults landed
//!
//! - **Kills with transactions open:** every other kill is aimed: SIGUSR2
//!   makes the worker's next handler call journal `paused` after `begin`
//!   and sleep inside its transaction, and the test kills it there. A kill
//!   landed when the killed worker journaled `begin` without `committed`
//!   for a message that a later worker applied. Every aimed kill must have
//!   landed. The others strike wherever a random delay falls.
//! - **A kill between COMMIT and ack:** once per run, SIGUSR1 makes the
//!   worker hold its next commit before the ack (it journals `held`), and
//!   the test kills it there. The message's ledger row must be that
//!   worker's, and the ack tap must have seen a later delivery of it acked:
//!   the claim absorbed the redelivery of committed work.
//! - **nats-server crash:** the server's process is another after the
//!   restart, the crash met traffic (it stays down half a second, and a
//!   publish was under way meanwhile), and the ledger grows after it. (That
//!   it caught a delivery between the server and the worker is not
//!   checked.)
//!
//! The worker (`src/bin/sqlite_worker.rs`, `src/bin/mariadb_worker.rs`)
//! journals as [`crate::worker_process`] reads, keeps its business rows in
//! `ledger (msg_id, account, amount, pid)` and `balances (account,
//! balance)`, and takes `NATS_URL`, `DATABASE_URL`, `STREAM`, `DURABLE`,
//! `ACK_WAIT_MS` and `BATCH`.
//!
//! `IDEM_CHAOS_SEED` replays a run's random delays.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ack_events::{AckKind, AckLog};
use crate::scenario::{create_stream, dead_letters, wait_all_acked};
use crate::seeded::{Rng, seed};
use crate::worker_process::{Ended, Worker};
use crate::{NatsServer, init_tracing, unique_name};
use async_nats::jetstream;

/// The database a kill run's workers share, as the test reaches it.
pub trait KillDatabase {
    /// The test's own connections to it.
    type Pool: LedgerReads;
    /// The workers' `DATABASE_URL`.
    fn url(&self) -> String;
    /// Opens the test's connections, once the first worker has made the
    /// database and its tables.
    fn pool(&self) -> impl Future<Output = Self::Pool> + Send;
}

/// What the run reads of the workers' tables.
pub trait LedgerReads: Send + Sync {
    /// The ledger's rows (0 while it cannot be read).
    fn rows(&self) -> impl Future<Output = u64> + Send;
    /// Each message's rows, with the pid that wrote each.
    fn ledger(&self) -> impl Future<Output = HashMap<String, Vec<u32>>> + Send;
    /// Each account's balance.
    fn balances(&self) -> impl Future<Output = HashMap<i64, i64>> + Send;
    /// The claims of `handler`.
    fn claims(&self, handler: &str) -> impl Future<Output = u64> + Send;
}

/// [`LedgerReads`] on a pool of each database: the same SQL.
macro_rules! ledger_reads {
    ($pool:ty) => {
        impl LedgerReads for $pool {
            async fn rows(&self) -> u64 {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
                    .fetch_one(self)
                    .await
                    .map_or(0, |rows| rows as u64)
            }

            async fn ledger(&self) -> HashMap<String, Vec<u32>> {
                let rows: Vec<(String, i64)> = sqlx::query_as("SELECT msg_id, pid FROM ledger")
                    .fetch_all(self)
                    .await
                    .unwrap_or_default();
                let mut ledger: HashMap<String, Vec<u32>> = HashMap::new();
                for (id, pid) in rows {
                    ledger.entry(id).or_default().push(pid as u32);
                }
                ledger
            }

            async fn balances(&self) -> HashMap<i64, i64> {
                sqlx::query_as("SELECT account, balance FROM balances")
                    .fetch_all(self)
                    .await
                    .expect("balances read")
                    .into_iter()
                    .collect()
            }

            async fn claims(&self, handler: &str) -> u64 {
                idem_runtime::status::handlers(self)
                    .await
                    .expect("status reads")
                    .into_iter()
                    .find(|row| row.name == handler)
                    .expect("the handler is registered")
                    .claims
            }
        }
    };
}

ledger_reads!(sqlx::SqlitePool);
ledger_reads!(sqlx::MySqlPool);

/// A worker binary and the names it was built with.
pub struct KillWorker {
    /// The binary (`env!("CARGO_BIN_EXE_<name>")`).
    pub binary: &'static str,
    /// Its handler's name (`#[idempotent(name = ..)]` in the binary).
    pub handler: &'static str,
    /// Its durable consumer.
    pub durable: &'static str,
}
const MESSAGES: u64 = 600;
/// Published per second: slow enough that every kill meets messages in
/// flight, and the run lasts through all of them.
const RATE: f64 = 60.0;
const KILLS: u64 = 8;
const ACCOUNTS: u64 = 8;

/// Message `i`: its id, account and amount.
fn credit(i: u64) -> (String, u64, i64) {
    (format!("k-{i}"), i % ACCOUNTS, i as i64 + 1)
}

/// Publishes every message at [`RATE`], retrying each (under its id, so a
/// publish stored after all is dropped as a duplicate) while nats-server is
/// away. Returns each id's stream sequence, and when each publish began and
/// was acknowledged.
async fn publish_all(
    js: jetstream::Context,
    subject: String,
) -> (HashMap<String, u64>, Vec<(Instant, Instant)>) {
    let started = Instant::now();
    let mut sequences = HashMap::new();
    let mut spans = Vec::new();
    for i in 0..MESSAGES {
        let due = started + Duration::from_secs_f64(i as f64 / RATE);
        tokio::time::sleep_until(due.into()).await;
        let (id, account, amount) = credit(i);
        let payload =
            serde_json::to_vec(&serde_json::json!({"account": account, "amount": amount}))
                .expect("a credit encodes");
        let began = Instant::now();
        let deadline = began + Duration::from_secs(60);
        let sequence = loop {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            let acked = match js
                .publish_with_headers(subject.clone(), headers, payload.clone().into())
                .await
            {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match acked {
                Ok(ack) => break ack.sequence,
                Err(error) => assert!(
                    Instant::now() < deadline,
                    "publish of {id} not acknowledged within 60 s: {error}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        spans.push((began, Instant::now()));
        sequences.insert(id, sequence);
    }
    (sequences, spans)
}

/// Waits until the ledger holds `target` rows; errs with the worker's log
/// if it stalls.
async fn wait_for_rows(pool: &impl LedgerReads, target: u64, worker: &Worker) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while pool.rows().await < target {
        assert!(
            Instant::now() < deadline,
            "the ledger did not reach {target} rows within 60 s (it has {})\n{}",
            pool.rows().await,
            worker.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `worker`, once it has journaled `started` (its signal handlers are set:
/// SIGUSR1's and SIGUSR2's default actions would kill it).
async fn started(mut worker: Worker) -> Worker {
    worker
        .wait_for("start", Duration::from_secs(60), |_| true)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", worker.log_tail(30)));
    worker
}

/// One run of `worker` on `database`: `batch` is the worker's `BATCH`
/// setting.
pub async fn kill_run(worker: KillWorker, database: &impl KillDatabase, batch: &str) {
    let KillWorker {
        binary,
        handler,
        durable,
    } = worker;
    init_tracing();
    let seed = seed();
    eprintln!("IDEM_CHAOS_SEED={seed}");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().expect("a temp dir for the workers' logs");
    let mut nats = NatsServer::start().await;
    let client = nats.client().await;
    let js = jetstream::new(client.clone());
    let stream = unique_name("KILLRUN");
    let subject = format!("{stream}.credit");
    create_stream(&js, &stream, &subject, Duration::from_secs(120)).await;
    let acks = AckLog::start(nats.client().await, &stream, || false).await;
    let env: Vec<(String, String)> = [
        ("NATS_URL", nats.url().to_owned()),
        ("DATABASE_URL", database.url()),
        ("STREAM", stream.clone()),
        ("DURABLE", durable.to_owned()),
        ("ACK_WAIT_MS", "2000".to_owned()),
        ("BATCH", batch.to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let logs = dir.path();
    let publisher = tokio::spawn(publish_all(js.clone(), subject));
    // The test's own reader, once the first worker has made the tables.
    let mut ordinal = 1;
    let mut worker = started(Worker::spawn(Path::new(binary), ordinal, &env, logs)).await;
    let pool = database.pool().await;

    let mut killed: Vec<Ended> = Vec::new();
    let mut aimed = Vec::new();
    let mut held: Option<(u32, String)> = None;
    let mut nats_down = None;
    for kill in 0..KILLS {
        wait_for_rows(&pool, (kill + 1) * MESSAGES / (KILLS + 2), &worker).await;
        if kill == 2 {
            // Down for half a second: the publisher and the worker are
            // certain to meet it (it restarts in about 30 ms).
            let before = nats.pid();
            nats.kill();
            let killed_at = Instant::now();
            tokio::time::sleep(Duration::from_millis(500)).await;
            nats_down = Some((killed_at, Instant::now()));
            nats.start_again().await;
            assert_ne!(nats.pid(), before, "nats-server is a new process");
            let rows_then = pool.rows().await;
            wait_for_rows(&pool, rows_then + 10, &worker).await;
        }
        if kill == KILLS / 2 {
            worker.hold_next_commit();
            let (id, _) = worker
                .wait_for_held(Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", worker.log_tail(30)));
            held = Some((worker.pid(), id));
        } else if kill % 2 == 0 {
            let id = worker
                .pause_next_transaction(Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", worker.log_tail(30)));
            aimed.push((worker.pid(), id));
        } else {
            tokio::time::sleep(rng.millis(0, 300)).await;
        }
        let ended = worker.sigkill();
        assert!(
            ended.was_sigkilled(),
            "worker #{} was SIGKILLed",
            ended.ordinal
        );
        killed.push(ended);
        ordinal += 1;
        worker = started(Worker::spawn(Path::new(binary), ordinal, &env, logs)).await;
    }

    let (sequences, publishes) = publisher.await.expect("the publisher does not panic");
    wait_for_rows(&pool, MESSAGES, &worker).await;
    wait_all_acked(&js, &stream, durable).await;
    let (last, _) = worker
        .sigterm(Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        last.status.success() && last.stopped.is_some(),
        "the last worker stopped gracefully: {:?}",
        last.status
    );

    // Exactly once.
    let ledger = pool.ledger().await;
    let doubled: Vec<_> = ledger.iter().filter(|(_, pids)| pids.len() > 1).collect();
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    assert_eq!(ledger.len() as u64, MESSAGES, "every message applied");
    let mut expected: HashMap<i64, i64> = HashMap::new();
    for i in 0..MESSAGES {
        let (_, account, amount) = credit(i);
        *expected.entry(account as i64).or_default() += amount;
    }
    assert_eq!(pool.balances().await, expected, "the balances add up");
    assert_eq!(
        pool.claims(handler).await,
        MESSAGES,
        "one claim per message"
    );
    assert!(
        dead_letters(&js, &stream).await.is_empty(),
        "nothing dead-lettered"
    );

    // The faults landed.
    let (killed_at, restarted_at) = nats_down.expect("nats-server was crashed");
    assert!(
        publishes
            .iter()
            .any(|(began, acked)| *began < restarted_at && *acked > killed_at),
        "nats-server's crash met traffic: a publish was under way while it was down"
    );
    let landed = aimed
        .iter()
        .filter(|(pid, id)| {
            let journal = &killed
                .iter()
                .find(|ended| ended.pid == *pid)
                .unwrap()
                .journal;
            !journal.committed.contains(id)
                && ledger.get(id).is_some_and(|pids| !pids.contains(pid))
        })
        .count();
    eprintln!(
        "{} kills, {} aimed, {landed} landed in an open transaction",
        killed.len(),
        aimed.len()
    );
    assert_eq!(
        landed,
        aimed.len(),
        "every aimed kill struck an open transaction"
    );
    let (held_pid, held_id) = held.expect("one kill was held between COMMIT and ack");
    assert_eq!(
        ledger.get(&held_id),
        Some(&vec![held_pid]),
        "the held message was committed, once, by the worker killed before its ack"
    );
    let sequence = sequences[&held_id];
    let acked = acks.of(sequence, AckKind::Ack);
    assert!(
        !acked.is_empty(),
        "a redelivery of the held message (stream sequence {sequence}) was acked"
    );
    // What each killed worker left open was applied by a later one.
    let lost: Vec<&String> = killed
        .iter()
        .flat_map(|ended| ended.journal.open())
        .filter(|id| !ledger.contains_key(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "begun by a killed worker, never applied: {lost:?}"
    );
}
