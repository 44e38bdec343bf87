//! idem on a 3-node JetStream cluster: R3 streams and consumers, three
//! workers (in-process routers, each with its own NATS connection to all
//! three nodes and its own PostgreSQL pool) sharing one durable consumer.
//!
//! - the same message reaching two workers is applied once, because the
//!   second waits on the first's claim;
//! - a SIGKILLed stream leader loses nothing and applies nothing twice;
//! - partitioned consumers apply each key's messages in publish order, also
//!   across a redelivery (checked inside each step's transaction).

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_runtime::partition::Partitions;
use idem_runtime::{Delivery, Route, Router, RouterHandle, State, idempotent};
use idem_tests::scenario::*;
use idem_tests::{ClusterEnv, create_idem_streams_r3};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::task::JoinHandle;

const WORKERS: usize = 3;

/// One worker: a router on its own NATS connection (all three URLs) and its
/// own pool, whose connections carry the worker's name as
/// `application_name`, so that `pg_stat_activity` tells the workers apart.
struct Worker {
    name: String,
    handle: RouterHandle,
    task: JoinHandle<Result<(), idem_runtime::Error>>,
}

async fn worker_pool(env: &ClusterEnv, name: &str) -> PgPool {
    let options = PgConnectOptions::from_str(env.postgres().url())
        .expect("the database URL parses")
        .application_name(name);
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("the worker's pool connects")
}

/// Starts `WORKERS` workers; `router(name)` builds each one's router.
async fn start_workers<S: Send + Sync + 'static>(
    env: &ClusterEnv,
    router: impl Fn(&str) -> Router<S>,
) -> Vec<Worker> {
    create_idem_streams_r3(&env.cluster.jetstream().await).await;
    let mut workers = Vec::new();
    for i in 0..WORKERS {
        let name = format!("worker-{i}");
        let router = router(&name);
        let (handle, task) = spawn(
            router,
            env.cluster.client().await,
            worker_pool(env, &name).await,
        );
        workers.push(Worker { name, handle, task });
    }
    workers
}

/// Stops the workers; each must have run until now and returned `Ok`.
async fn stop_workers(workers: Vec<Worker>) {
    for worker in workers {
        let finished_early = worker.task.is_finished();
        worker.handle.shutdown();
        let result = tokio::time::timeout(Duration::from_secs(30), worker.task)
            .await
            .unwrap_or_else(|_| panic!("{} did not shut down within 30 s", worker.name))
            .unwrap_or_else(|e| panic!("{} panicked: {e}", worker.name));
        if let Err(error) = result {
            panic!(
                "{} returned an error{}: {error:?}",
                worker.name,
                if finished_early {
                    " before it was stopped"
                } else {
                    ""
                }
            );
        }
    }
}

fn deposit_json(amount: i64) -> Vec<u8> {
    serde_json::to_vec(&deposit(amount)).expect("deposit encodes")
}

/// A stream on `<name>.deposit` with three replicas.
async fn create_r3_stream(js: &jetstream::Context, name: &str, duplicate_window: Duration) {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.deposit")],
        duplicate_window,
        num_replicas: 3,
        ..Default::default()
    })
    .await
    .expect("the R3 stream is created");
}

fn deposit(amount: i64) -> Deposit {
    Deposit {
        account: "acct-1".into(),
        amount,
    }
}

/// Publishes `id` until JetStream stores it again: a publisher retry after
/// the duplicate window.
async fn publish_after_window(js: &jetstream::Context, subject: &str, id: &str) {
    loop {
        if !publish(js, subject, &deposit(1), Some(id)).await.duplicate {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The message the racing test holds, and what its first attempt saw.
#[derive(Clone)]
struct Race {
    worker: String,
    held: &'static str,
    /// (holder, waiter): the worker whose first attempt held the claim, and
    /// the other worker whose backend waited on it.
    blocked: Arc<Mutex<Vec<(String, String)>>>,
}

#[idempotent(name = "cluster-race")]
async fn cluster_race(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(race): State<Race>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    if delivery.message_id().as_str() == race.held && delivery.delivered() == 1 {
        // Keep the claim's transaction open until a backend of *another*
        // worker waits on it: JetStream redelivered the message (ack_wait
        // expired, no heartbeats) to a second worker, whose claim blocks on
        // the unique key.
        let deadline = Instant::now() + Duration::from_secs(25);
        loop {
            let waiters: Vec<String> = sqlx::query_scalar(
                "SELECT application_name FROM pg_stat_activity
                 WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid))",
            )
            .fetch_all(&mut **tx)
            .await?;
            if let Some(waiter) = waiters.into_iter().find(|w| *w != race.worker) {
                race.blocked
                    .lock()
                    .unwrap()
                    .push((race.worker.clone(), waiter));
                break;
            }
            if Instant::now() > deadline {
                return Err(sqlx::Error::Protocol(
                    "no other worker blocked on the claim within 25 s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    record_effect(tx, "cluster-race", &d, delivery).await
}

/// Three workers share one R3 durable. The stream holds N messages plus
/// copies stored again after the duplicate window, and one message is
/// redelivered to a second worker while its first attempt still holds the
/// claim. Every message is applied once: the copies and the racing
/// redelivery are skipped by the claim, and the racing one waited on it.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn three_workers_share_a_durable_and_the_claim_absorbs_a_redelivery_to_another_worker() {
    const MESSAGES: usize = 60;
    const COPIES: usize = 10;
    let env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.cluster.jetstream().await;
    let stream = unique_name("RACE");
    let subject = format!("{stream}.deposit");
    create_r3_stream(&js, &stream, Duration::from_millis(500)).await;

    let blocked = Arc::new(Mutex::new(Vec::new()));
    let workers = start_workers(&env, |name| {
        Router::with_state(Race {
            worker: name.to_owned(),
            held: "m-30",
            blocked: blocked.clone(),
        })
        .route(
            Route::new(&stream, "workers")
                .ack_wait(Duration::from_secs(1))
                .without_heartbeat()
                .allow_redelivery_while_running()
                .concurrency(4),
            cluster_race,
        )
    })
    .await;
    for i in 0..MESSAGES {
        publish_with_id(&js, &subject, deposit_json(1), &format!("m-{i}")).await;
    }
    for i in 0..COPIES {
        publish_after_window(&js, &subject, &format!("m-{i}")).await;
    }
    wait_all_acked(&js, &stream, "workers").await;
    let leaders = (
        env.cluster.stream_leader(&js, &stream).await,
        env.cluster.consumer_leader(&js, &stream, "workers").await,
    );
    let consumer = consumer_info(&js, &stream, "workers").await;
    assert_eq!(
        consumer.cluster.map(|c| c.replicas.len()),
        Some(2),
        "the route's consumer has the stream's three replicas (a leader and two followers)"
    );
    let stats: Vec<_> = workers
        .iter()
        .map(|w| (w.name.clone(), w.handle.stats("workers").unwrap()))
        .collect();
    stop_workers(workers).await;

    let blocked = blocked.lock().unwrap().clone();
    println!(
        "stream leader n{}, consumer leader n{}",
        leaders.0, leaders.1
    );
    for (name, s) in &stats {
        println!(
            "{name}: received {}, processed {}, duplicates skipped {}, failed {}",
            s.received(),
            s.processed(),
            s.duplicates(),
            s.failed()
        );
    }
    println!("blocked on the claim (holder, waiter): {blocked:?}");
    assert_eq!(
        blocked.len(),
        1,
        "the held message's first attempt saw another worker wait on its claim"
    );
    assert_ne!(blocked[0].0, blocked[0].1);
    let processed: u64 = stats.iter().map(|(_, s)| s.processed()).sum();
    let duplicates: u64 = stats.iter().map(|(_, s)| s.duplicates()).sum();
    let failed: u64 = stats.iter().map(|(_, s)| s.failed()).sum();
    assert_eq!(processed, MESSAGES as u64);
    assert_eq!(failed, 0);
    assert!(
        duplicates > COPIES as u64,
        "the {COPIES} copies and at least one racing redelivery were skipped: {duplicates}"
    );
    assert_eq!(
        ledger(&pool, "cluster-race").await,
        Ledger::once_each(MESSAGES as i64)
    );
}

/// Slow enough that the flow spans a leader election.
#[idempotent(name = "cluster-flow")]
async fn cluster_flow(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_millis(30)).await;
    record_effect(tx, "cluster-flow", &d, delivery).await
}

/// (time, effects applied), each time the count changed.
type Progress = Arc<Mutex<Vec<(Instant, i64)>>>;

/// Samples the effect count every 10 ms, recording each change.
fn watch_progress(pool: PgPool) -> (Progress, JoinHandle<()>) {
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sink = samples.clone();
    let task = tokio::spawn(async move {
        let mut last = -1;
        loop {
            if let Ok(count) = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
                .fetch_one(&pool)
                .await
                && count != last
            {
                last = count;
                sink.lock().unwrap().push((Instant::now(), count));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    (samples, task)
}

/// The longest time without a new effect between `from` and `to`.
fn longest_stall(samples: &[(Instant, i64)], from: Instant, to: Instant) -> Duration {
    let mut previous = from;
    let mut longest = Duration::ZERO;
    for (at, _) in samples.iter().filter(|(at, _)| *at > from && *at <= to) {
        longest = longest.max(*at - previous);
        previous = *at;
    }
    longest.max(to.saturating_duration_since(previous))
}

/// Which node a fault kills.
#[derive(Debug, Clone, Copy)]
enum Leader {
    Stream,
    Consumer,
}

/// SIGKILLs the leader of the stream, or of the consumer, while three
/// workers process (the two leaders are first put on different nodes, so
/// that each fault is measured alone), and restarts it on its store once
/// processing has resumed on the other two nodes. In the end every message
/// is applied once, nothing is pending and the stream lost nothing. Prints
/// how long processing stalled and how many redeliveries the claim absorbed.
async fn leader_killed_mid_flow(fault: Leader) {
    const MESSAGES: i64 = 1000;
    /// Effects applied after the kill that count as "processing resumed".
    const RESUMED: i64 = 50;
    /// Messages published while the node is down.
    const LATE: i64 = 100;
    let mut env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.cluster.jetstream().await;
    let stream = unique_name("FLOW");
    let subject = format!("{stream}.deposit");
    create_r3_stream(&js, &stream, Duration::from_secs(120)).await;
    for i in 0..MESSAGES {
        publish_with_id(&js, &subject, deposit_json(i), &format!("f-{i}")).await;
    }

    let (samples, watcher) = watch_progress(pool.clone());
    let started = Instant::now();
    let workers = start_workers(&env, |_| {
        Router::new().route(
            Route::new(&stream, "workers")
                .ack_wait(Duration::from_secs(2))
                .concurrency(4),
            cluster_flow,
        )
    })
    .await;
    let applied = || samples.lock().unwrap().last().map_or(0, |s| s.1);
    let duplicates = |workers: &[Worker]| -> u64 {
        workers
            .iter()
            .map(|w| w.handle.stats("workers").unwrap().duplicates())
            .sum()
    };
    eventually("the flow began", Duration::from_secs(30), || async {
        applied() > 0
    })
    .await;
    let (stream_leader, consumer_leader) =
        env.cluster.separate_leaders(&js, &stream, "workers").await;
    let node = match fault {
        Leader::Stream => stream_leader,
        Leader::Consumer => consumer_leader,
    };
    eventually(
        "a fifth of the flow applied",
        Duration::from_secs(30),
        || async { applied() >= MESSAGES / 5 },
    )
    .await;
    let applied_at_kill = applied();
    assert!(
        applied_at_kill < MESSAGES / 2,
        "the kill comes mid-flow: {applied_at_kill} of {MESSAGES} already applied"
    );
    let killed_at = Instant::now();
    env.cluster.kill(node);
    // The two surviving nodes elect a new leader and processing resumes
    // without the killed node; both are timed.
    let resumed = async {
        eventually(
            "processing resumed on the surviving nodes",
            Duration::from_secs(25),
            || async { applied() >= applied_at_kill + RESUMED },
        )
        .await;
        Instant::now()
    };
    let elected = async {
        loop {
            let leader = match fault {
                Leader::Stream => env.cluster.stream_leader(&js, &stream).await,
                Leader::Consumer => env.cluster.consumer_leader(&js, &stream, "workers").await,
            };
            if leader != node {
                return killed_at.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (resumed_at, elected_after) = tokio::join!(resumed, async {
        tokio::time::timeout(Duration::from_secs(30), elected)
            .await
            .expect("a new leader is elected within 30 s")
    });
    let stall = longest_stall(&samples.lock().unwrap(), killed_at, resumed_at);
    // Publishing works while the node is down: the stream's leader stores
    // each message with the one remaining replica. A publish whose ack is
    // lost to the reconnect is retried after 2 s rather than the default 10.
    let mut publisher = js.clone();
    publisher.set_timeout(Duration::from_secs(2));
    for i in MESSAGES..MESSAGES + LATE {
        publish_with_id(&publisher, &subject, deposit_json(i), &format!("f-{i}")).await;
    }
    env.cluster.start_again(node).await;
    let restarted_after = killed_at.elapsed();
    let leaders_after = (
        env.cluster.stream_leader(&js, &stream).await,
        env.cluster.consumer_leader(&js, &stream, "workers").await,
    );
    wait_all_acked(&js, &stream, "workers").await;
    env.cluster.wait_stream_replicas_current(&js, &stream).await;
    let all_acked = started.elapsed();
    watcher.abort();
    let absorbed = duplicates(&workers);
    stop_workers(workers).await;

    println!(
        "{fault:?} leader n{node} SIGKILLed at {applied_at_kill}/{MESSAGES} applied \
         (stream leader n{stream_leader}, consumer leader n{consumer_leader}; \
         after the restart n{}, n{}): longest stall {stall:?}; {RESUMED} more applied {:?} \
         after the kill; new leader elected {elected_after:?} after it; {LATE} more \
         published; node restarted {restarted_after:?} after the kill; all {} acked \
         {all_acked:?} after the workers started; redeliveries skipped by the claim: {absorbed}",
        leaders_after.0,
        leaders_after.1,
        resumed_at - killed_at,
        MESSAGES + LATE,
    );
    assert_eq!(
        ledger(&pool, "cluster-flow").await,
        Ledger::once_each(MESSAGES + LATE)
    );
    let info = consumer_info(&js, &stream, "workers").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    let stored = js
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .state
        .messages;
    assert_eq!(
        stored,
        (MESSAGES + LATE) as u64,
        "the stream lost no message"
    );
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn stream_leader_killed_mid_flow_loses_nothing_and_applies_each_message_once() {
    leader_killed_mid_flow(Leader::Stream).await;
}

#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn consumer_leader_killed_mid_flow_loses_nothing_and_applies_each_message_once() {
    leader_killed_mid_flow(Leader::Consumer).await;
}

/// One message of a key: its place in the key's publish order.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Step {
    key: String,
    seq: i64,
}

/// Every key's steps `seq % FAIL_EVERY == FAIL_AT` fail on their first
/// delivery: each is NAKed and redelivered, and the key's next step must
/// wait for it.
const FAIL_EVERY: i64 = 8;
const FAIL_AT: i64 = 3;

/// A step applied out of order: (key, seq, the key's last applied seq it
/// found).
type OutOfOrder = (String, i64, Option<i64>);

/// What the ordered handler shares across the workers (all in this
/// process).
#[derive(Clone)]
struct Ordered {
    worker: String,
    /// Steps whose handler found the key's last applied step was not the
    /// one before.
    out_of_order: Arc<Mutex<Vec<OutOfOrder>>>,
}

#[idempotent(name = "cluster-ordered")]
async fn cluster_ordered(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(ordered): State<Ordered>,
    step: Step,
) -> Result<(), idem_runtime::BoxError> {
    // Give other workers a chance to take the partition's next message.
    tokio::time::sleep(Duration::from_millis(2)).await;
    // The key's steps committed so far (READ COMMITTED: as of now) must end
    // exactly at the one before this: if the previous step were still in
    // flight on another worker, or not yet redelivered, it would be missing.
    let last: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM steps WHERE key = $1")
        .bind(&step.key)
        .fetch_one(&mut **tx)
        .await?;
    let previous = (step.seq > 0).then(|| step.seq - 1);
    if last != previous {
        eprintln!(
            "OUT OF ORDER: {} step {} applied on {} (delivery {}) while the key's last applied step is {last:?}",
            step.key,
            step.seq,
            ordered.worker,
            delivery.delivered()
        );
        ordered
            .out_of_order
            .lock()
            .unwrap()
            .push((step.key.clone(), step.seq, last));
    }
    if step.seq % FAIL_EVERY == FAIL_AT && delivery.delivered() == 1 {
        return Err(idem_runtime::Transient::new("fails on its first delivery").into());
    }
    sqlx::query("INSERT INTO steps (key, seq, worker, delivered) VALUES ($1, $2, $3, $4)")
        .bind(&step.key)
        .bind(step.seq)
        .bind(&ordered.worker)
        .bind(delivery.delivered() as i64)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// With the stream partitioned by key and one single-file consumer per
/// partition, three workers apply each key's messages in publish order,
/// while the partitions spread over the workers. The order is checked in
/// the handler, inside each step's transaction: the key's last committed
/// step must be the one before. Some steps fail on their first delivery,
/// so the order must also hold across their redeliveries.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn partitioned_consumers_apply_each_key_in_publish_order() {
    const PARTITIONS: u32 = 4;
    const KEYS: i64 = 8;
    const STEPS: i64 = 25;
    let env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    sqlx::raw_sql(
        "CREATE TABLE steps (id bigserial PRIMARY KEY, key text NOT NULL, seq bigint NOT NULL,
                             worker text NOT NULL, delivered bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let js = env.cluster.jetstream().await;
    let stream = unique_name("ORDERED");
    let partitions = Partitions::new(format!("{stream}.in.*"), PARTITIONS);
    js.create_stream(stream::Config {
        num_replicas: 3,
        ..partitions.stream_config(&stream)
    })
    .await
    .expect("the partitioned R3 stream is created");
    for seq in 0..STEPS {
        for key in 0..KEYS {
            let step = Step {
                key: format!("k{key}"),
                seq,
            };
            publish_with_id(
                &js,
                &format!("{stream}.in.k{key}"),
                serde_json::to_vec(&step).unwrap(),
                &format!("k{key}-{seq}"),
            )
            .await;
        }
    }

    let out_of_order = Arc::new(Mutex::new(Vec::new()));
    let workers = start_workers(&env, |name| {
        // A failed step comes back after 100 ms, not the default 1 s.
        let routes: Vec<Route> = partitions
            .routes(&stream, "ordered")
            .into_iter()
            .map(|route| route.backoff(Duration::from_millis(100), Duration::from_millis(100)))
            .collect();
        Router::with_state(Ordered {
            worker: name.to_owned(),
            out_of_order: out_of_order.clone(),
        })
        .route_partitions(routes, cluster_ordered)
    })
    .await;
    eventually("every step applied", Duration::from_secs(60), || {
        let (pool, out_of_order) = (pool.clone(), out_of_order.clone());
        async move {
            // Loudly, as soon as it happens.
            let seen = out_of_order.lock().unwrap().clone();
            assert_eq!(
                seen,
                vec![],
                "a step ran before the key's previous step was committed (key, seq, last applied)"
            );
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM steps")
                .fetch_one(&pool)
                .await
                .unwrap()
                == KEYS * STEPS
        }
    })
    .await;
    for partition in 0..PARTITIONS {
        let durable = format!("ordered-p{partition}");
        eventually("the partition is settled", Duration::from_secs(10), || {
            let (js, stream, durable) = (js.clone(), stream.clone(), durable.clone());
            async move {
                let info = consumer_info(&js, &stream, &durable).await;
                info.num_pending == 0 && info.num_ack_pending == 0
            }
        })
        .await;
    }
    let per_worker: Vec<(String, u64)> = workers
        .iter()
        .map(|w| {
            let processed = (0..PARTITIONS)
                .map(|p| {
                    w.handle
                        .stats(&format!("ordered-p{p}"))
                        .unwrap()
                        .processed()
                })
                .sum();
            (w.name.clone(), processed)
        })
        .collect();
    let per_worker_failed: Vec<u64> = workers
        .iter()
        .flat_map(|w| {
            (0..PARTITIONS).map(|p| w.handle.stats(&format!("ordered-p{p}")).unwrap().failed())
        })
        .collect();
    stop_workers(workers).await;

    println!("steps applied per worker: {per_worker:?}");
    assert_eq!(
        out_of_order.lock().unwrap().clone(),
        vec![],
        "every step ran right after the key's previous one was committed (key, seq, last applied)"
    );
    // The redeliveries happened: each failing step was applied on its
    // second delivery, and the workers counted one failure for each.
    let failing = KEYS * (0..STEPS).filter(|seq| seq % FAIL_EVERY == FAIL_AT).count() as i64;
    let (redelivered, first_time): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE delivered = 2 AND seq % $1 = $2),
                count(*) FILTER (WHERE delivered = 1 AND seq % $1 <> $2)
           FROM steps",
    )
    .bind(FAIL_EVERY)
    .bind(FAIL_AT)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (redelivered, first_time),
        (failing, KEYS * STEPS - failing),
        "each failing step was applied on its redelivery, every other one on its first delivery"
    );
    let failed: u64 = per_worker_failed.iter().sum();
    assert_eq!(failed, failing as u64, "each failing step failed once");
    let out_of_order: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT key, previous, seq FROM (
             SELECT key, seq, lag(seq) OVER (PARTITION BY key ORDER BY id) AS previous FROM steps
         ) s WHERE previous IS NOT NULL AND seq <> previous + 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        out_of_order,
        vec![],
        "each key's steps were applied in publish order, each once"
    );
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (key, seq)) FROM steps")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, distinct), (KEYS * STEPS, KEYS * STEPS));
    assert!(
        per_worker.iter().filter(|(_, n)| *n > 0).count() >= 2,
        "the partitions were spread over the workers"
    );
    let used_partitions: i64 = {
        let mut used = std::collections::HashSet::new();
        for partition in 0..PARTITIONS {
            let info = consumer_info(&js, &stream, &format!("ordered-p{partition}")).await;
            if info.delivered.consumer_sequence > 0 {
                used.insert(partition);
            }
        }
        used.len() as i64
    };
    assert!(
        used_partitions >= 2,
        "the keys were spread over the partitions"
    );
}

/// The node a worker is connected to is SIGKILLed, while the consumer's
/// leader lives on another node (which may still count the dead
/// connection's pull request as waiting). A message published once the
/// worker's client has reconnected elsewhere is processed within 1 s of
/// being stored: the pull asks again at once, instead of waiting for
/// missed idle heartbeats.
///
/// Timed from the publish's ack, not from the reconnect: when the stream's
/// leader was on the killed node, the publish itself waits for a new one to
/// be elected (4-6 s here), which says nothing about the pull.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn a_worker_whose_node_died_takes_messages_within_a_second_of_reconnecting() {
    use std::sync::atomic::Ordering;
    let mut env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.cluster.jetstream().await;
    create_idem_streams_r3(&js).await;
    let stream = unique_name("NODEDIED");
    let subject = format!("{stream}.deposit");
    create_r3_stream(&js, &stream, Duration::from_secs(120)).await;
    let nats = env.cluster.client().await;
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        worker_pool(&env, "worker").await,
    );
    publish_with_id(&js, &subject, deposit_json(1), "before").await;
    wait_all_acked(&js, &stream, "c").await;
    let stats = handle.stats("c").unwrap();
    let node = env
        .cluster
        .node_named(&nats.server_info().server_name)
        .expect("the worker is connected to a node of the cluster");
    // The stream's and the consumer's leaders elsewhere, so that both
    // outlive the kill: no election delays the message published after it.
    for _ in 0..10 {
        let stream_on_node = env.cluster.stream_leader(&js, &stream).await == node;
        let consumer_on_node = env.cluster.consumer_leader(&js, &stream, "c").await == node;
        if !stream_on_node && !consumer_on_node {
            break;
        }
        let step_down = if stream_on_node {
            format!("STREAM.LEADER.STEPDOWN.{stream}")
        } else {
            format!("CONSUMER.LEADER.STEPDOWN.{stream}.c")
        };
        let _: Result<jetstream::response::Response<serde_json::Value>, _> =
            js.request(step_down, &serde_json::json!({})).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let leader = env.cluster.consumer_leader(&js, &stream, "c").await;
    assert_ne!(
        leader, node,
        "the consumer's leader is not on the node killed"
    );
    assert_ne!(
        env.cluster.stream_leader(&js, &stream).await,
        node,
        "the stream's leader is not on the node killed"
    );
    env.cluster.wait_stream_replicas_current(&js, &stream).await;
    env.cluster
        .wait_consumer_replicas_current(&js, &stream, "c")
        .await;

    let statistics = nats.statistics();
    let connected_before = statistics.connects.load(Ordering::Relaxed);
    env.cluster.kill(node);
    eventually(
        "the worker's client reconnects to another node",
        Duration::from_secs(30),
        || async { statistics.connects.load(Ordering::Relaxed) > connected_before },
    )
    .await;
    let publisher = jetstream::new(
        async_nats::connect(env.cluster.url(leader))
            .await
            .expect("a client of the consumer leader's node"),
    );
    publish_with_id(&publisher, &subject, deposit_json(2), "after").await;
    let stored = Instant::now();
    eventually(
        "the message published after the reconnect is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 2 },
    )
    .await;
    let taken_after = stored.elapsed();
    println!(
        "n{node} killed; from the message stored after the reconnect to it processed: {taken_after:?}"
    );
    assert!(
        taken_after < Duration::from_secs(1),
        "the worker took a message {taken_after:?} after it was stored (its client had reconnected), not within 1 s"
    );
    handle.shutdown();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the router shuts down within 30 s")
        .unwrap()
        .unwrap();
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(2));
}

/// The consumer's leader steps down (as in a rolling restart) while a
/// worker's pull has two requests open on it: one the server filled, one
/// still waiting. The new leader tells the waiting one `409 Leadership
/// Change`, on its own reply subject, and the route asks the new leader at
/// once: a message published after the change is applied within about a
/// second of being stored.
///
/// Before, every request of a pull shared one reply subject, which the
/// server tracks once: the filled request took the entry along while the
/// other still waited, the new leader told no one, and the route waited
/// for its 3 s silence check: 3.06 s from stored to applied in two runs of
/// this test before the change, 23 to 24 ms in three after.
///
/// The five messages before the step-down set the requests up: the route
/// asks for 4 (concurrency 4) and again when 2 or fewer are owed, and the
/// server serves its waiting requests in turn, so the first request is
/// filled by the fifth message and the second waits with 3 to go. The
/// notices are seen by a tap on the inboxes. Every message is applied once,
/// and no request is left waiting once the worker has stopped.
#[tokio::test]
#[cfg_attr(
    idem_external_servers,
    ignore = "NATS_URL or DATABASE_URL is set: this test runs its own NATS cluster"
)]
async fn a_consumer_leader_change_ends_each_pull_request_and_the_route_asks_the_new_leader_at_once()
{
    use futures_util::StreamExt;
    let env = ClusterEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let js = env.cluster.jetstream().await;
    create_idem_streams_r3(&js).await;
    let stream = unique_name("STEPDOWN");
    let subject = format!("{stream}.deposit");
    create_r3_stream(&js, &stream, Duration::from_secs(120)).await;

    // Every status the server sends to an inbox: (when, subject, status).
    type Statuses = Arc<Mutex<Vec<(Instant, String, String)>>>;
    let statuses: Statuses = Arc::default();
    let tap_client = env.cluster.client().await;
    let mut tap = tap_client.subscribe("_INBOX.>").await.unwrap();
    tap_client.flush().await.unwrap();
    let sink = statuses.clone();
    let tapping = tokio::spawn(async move {
        while let Some(message) = tap.next().await {
            if let Some(status) = message.status {
                sink.lock().unwrap().push((
                    Instant::now(),
                    message.subject.to_string(),
                    format!(
                        "{} {}",
                        status.as_u16(),
                        message.description.unwrap_or_default()
                    ),
                ));
            }
        }
    });

    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c")
                .ack_wait(Duration::from_secs(2))
                .concurrency(4),
            no_ids,
        ),
        env.cluster.client().await,
        worker_pool(&env, "worker").await,
    );
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    for i in 0..5 {
        publish_with_id(&js, &subject, deposit_json(i), &format!("m-{i}")).await;
        eventually(
            "the message is applied",
            Duration::from_secs(30),
            || async { applied().await == i + 1 },
        )
        .await;
    }
    let waiting = consumer_info(&js, &stream, "c").await.num_waiting;
    assert!(waiting >= 1, "a request of the route waits on the leader");

    let leader = env.cluster.consumer_leader(&js, &stream, "c").await;
    let stepped_down = Instant::now();
    let _: Result<jetstream::response::Response<serde_json::Value>, _> = js
        .request(
            format!("CONSUMER.LEADER.STEPDOWN.{stream}.c"),
            &serde_json::json!({}),
        )
        .await;
    let new_leader = loop {
        let now = env.cluster.consumer_leader(&js, &stream, "c").await;
        if now != leader {
            break now;
        }
        assert!(
            stepped_down.elapsed() < Duration::from_secs(30),
            "no new consumer leader within 30 s of the step-down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let elected_after = stepped_down.elapsed();
    publish_with_id(&js, &subject, deposit_json(5), "m-5").await;
    let stored = Instant::now();
    eventually(
        "the message published after the change is applied",
        Duration::from_secs(30),
        || async { applied().await == 6 },
    )
    .await;
    let taken_after = stored.elapsed();
    stop(handle, task).await;
    tapping.abort();

    let notices: Vec<String> = statuses
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, _, status)| *at > stepped_down && status == "409 Leadership Change")
        .map(|(_, subject, _)| subject.clone())
        .collect();
    println!(
        "{waiting} requests waiting on consumer leader n{leader}; stepped down, n{new_leader} \
         elected {elected_after:?} after; notices: {notices:?}; the message stored after the \
         change applied {taken_after:?} after"
    );
    assert!(
        !notices.is_empty(),
        "the new leader told the route's waiting request of the change"
    );
    // Each notice is for one request, on a reply subject of its own.
    let request = |subject: &str| -> Option<(String, u64)> {
        let (inbox, n) = subject.rsplit_once('.')?;
        Some((inbox.to_owned(), n.parse().ok()?))
    };
    let told: std::collections::HashSet<(String, u64)> = notices
        .iter()
        .map(|subject| {
            request(subject)
                .unwrap_or_else(|| panic!("{subject} is not a request's own reply subject"))
        })
        .collect();
    assert_eq!(told.len(), notices.len(), "one notice per request");
    assert!(
        taken_after < Duration::from_millis(1500),
        "the message stored after the change was applied {taken_after:?} after, not within 1.5 s"
    );
    assert_eq!(ledger(&pool, "no-ids").await, Ledger::once_each(6));
    let info = consumer_info(&js, &stream, "c").await;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_waiting),
        (0, 0, 0),
        "nothing pending, and no pull request left on the server"
    );
}
