//! Fixtures shared by the scenarios of every feature's tests: a business
//! table that records every effect (with no unique key, so a double-apply
//! would show), stream set-up, publishing, running routers in the
//! background, reading dead letters and acks back, and the small handlers
//! and routes many tests use.
//!
//! ```no_run
//! use idem_tests::scenario::*;
//!
//! # async fn demo() {
//! let Scenario { env: _env, pool, nats, js, stream, subject } =
//!     scenario("orders", std::time::Duration::from_secs(60)).await;
//! publish(&js, &subject, &deposit("alice", 10), Some("dep-1")).await;
//! let router = idem_runtime::Router::new().route(fast(idem_runtime::Route::new(&stream, "c")), plain);
//! let (handle, task) = spawn(router, nats, pool.clone());
//! wait_all_acked(&js, &stream, "c").await;
//! stop(handle, task).await;
//! assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(1));
//! # }
//! ```

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use idem_runtime::{Delivery, Route, Router, RouterHandle, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::task::JoinHandle;

// The harness's helpers every scenario uses, so that `use
// idem_tests::scenario::*` is the one import a test needs.
pub use crate::{consumer_info, eventually, unique_name};

/// A deposit: the payload every scenario publishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deposit {
    /// The account credited.
    pub account: String,
    /// The amount, in cents.
    pub amount: i64,
}

/// What a scenario starts with: servers, a prepared database, a client, and
/// a fresh stream that stores `<stream>.deposit`.
pub struct Scenario {
    /// The servers; they stop when it drops.
    pub env: crate::TestEnv,
    /// A pool on the prepared database.
    pub pool: PgPool,
    /// A NATS client.
    pub nats: async_nats::Client,
    /// A JetStream context on that client.
    pub js: jetstream::Context,
    /// The stream's name, unique to the test.
    pub stream: String,
    /// `<stream>.deposit`, the subject the stream stores.
    pub subject: String,
}

/// Starts a [`Scenario`] whose stream has the given publish-dedup window.
pub async fn scenario(prefix: &str, duplicate_window: Duration) -> Scenario {
    let env = crate::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let js = jetstream::new(nats.clone());
    let stream = crate::unique_name(prefix);
    let subject = format!("{stream}.deposit");
    create_stream(&js, &stream, &subject, duplicate_window).await;
    Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    }
}

/// Creates the business table and installs the idem schema.
pub async fn prepare_database(pool: &PgPool) {
    idem_runtime::schema::migrate(pool)
        .await
        .expect("idem migrations apply");
    sqlx::raw_sql(
        "CREATE TABLE effects (
             handler    text   NOT NULL,
             message_id text   NOT NULL,
             account    text   NOT NULL,
             amount     bigint NOT NULL,
             delivered  bigint NOT NULL
         )",
    )
    .execute(pool)
    .await
    .expect("business table is created");
}

/// The business write every test handler does: one row per applied effect.
pub async fn record_effect(
    tx: &mut sqlx::PgTransaction<'_>,
    handler: &str,
    deposit: &Deposit,
    delivery: &Delivery,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO effects (handler, message_id, account, amount, delivered) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(handler)
    .bind(delivery.message_id().as_str())
    .bind(&deposit.account)
    .bind(deposit.amount)
    .bind(delivery.delivered() as i64)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What the database holds for one handler.
#[derive(Debug, PartialEq, Eq)]
pub struct Ledger {
    /// Effect rows.
    pub effects: i64,
    /// Distinct message ids among them.
    pub distinct_messages: i64,
    /// Dedup rows for the handler.
    pub dedup_rows: i64,
}

impl Ledger {
    /// Exactly once: `n` effects, all of distinct messages, and `n` claims.
    pub fn once_each(n: i64) -> Ledger {
        Ledger {
            effects: n,
            distinct_messages: n,
            dedup_rows: n,
        }
    }
}

/// What the database holds for `handler`.
pub async fn ledger(pool: &PgPool, handler: &str) -> Ledger {
    let (effects, distinct_messages): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT message_id) FROM effects WHERE handler = $1",
    )
    .bind(handler)
    .fetch_one(pool)
    .await
    .expect("effects are counted");
    let dedup_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_processed WHERE handler = $1")
            .bind(handler)
            .fetch_one(pool)
            .await
            .expect("dedup rows are counted");
    Ledger {
        effects,
        distinct_messages,
        dedup_rows,
    }
}

/// A stream on `subject` with the given publish-dedup window.
pub async fn create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    duplicate_window: Duration,
) {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![subject.to_owned()],
        duplicate_window,
        ..Default::default()
    })
    .await
    .expect("stream is created");
}

/// Publishes `deposit`, with `msg_id` as `Nats-Msg-Id` if given, and returns
/// the server's PubAck.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    deposit: &Deposit,
    msg_id: Option<&str>,
) -> jetstream::publish::PublishAck {
    let payload = serde_json::to_vec(deposit).expect("deposit encodes").into();
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    js.publish_with_headers(subject.to_owned(), headers, payload)
        .await
        .expect("publish is sent")
        .await
        .expect("publish is acknowledged")
}

/// Publishes `payload` with `id` as `Nats-Msg-Id` (for a cluster), retrying for up to 20 s
/// while no stream leader answers (just after the stream was created, the
/// subject's interest may not have reached every node yet; during an
/// election there is no leader). The id makes a retry of a publish that was
/// stored after all a duplicate JetStream drops.
pub async fn publish_with_id(js: &jetstream::Context, subject: &str, payload: Vec<u8>, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
        let acked = match js
            .publish_with_headers(subject.to_owned(), headers, payload.clone().into())
            .await
        {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match acked {
            Ok(_) => return,
            Err(error) => assert!(
                Instant::now() < deadline,
                "publish of {id} to {subject} not acknowledged within 20 s: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `router` in the background until its handle shuts it down.
pub fn spawn<S: Send + Sync + 'static>(
    router: Router<S>,
    nats: async_nats::Client,
    pool: PgPool,
) -> (RouterHandle, JoinHandle<Result<(), idem_runtime::Error>>) {
    let handle = router.handle();
    let task = tokio::spawn(router.run_until(nats, pool, std::future::pending()));
    (handle, task)
}

/// Stops a router and checks it shut down cleanly.
pub async fn stop(handle: RouterHandle, task: JoinHandle<Result<(), idem_runtime::Error>>) {
    handle.shutdown();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the router shuts down within 30 s")
        .expect("the router task does not panic")
        .expect("the router returns Ok");
}

/// Waits until JetStream has every message of the consumer acked: none
/// pending, none awaiting ack, and the ack floor at the stream's last message.
pub async fn wait_all_acked(js: &jetstream::Context, stream: &str, durable: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let last_seq = js
            .get_stream(stream)
            .await
            .expect("stream exists")
            .info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
        // The router creates the consumer once it starts.
        let Ok(info) = js
            .get_stream(stream)
            .await
            .expect("stream exists")
            .consumer_info(durable)
            .await
        else {
            assert!(
                tokio::time::Instant::now() < deadline,
                "consumer {durable} was not created within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        if info.num_pending == 0
            && info.num_ack_pending == 0
            && info.ack_floor.stream_sequence >= last_seq
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumer {durable} did not ack everything within 60 s: pending {}, ack pending {}, ack floor {} of {last_seq}",
            info.num_pending,
            info.num_ack_pending,
            info.ack_floor.stream_sequence
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `pulls` pull requests wait on consumer `durable` (its
/// routes are running and asking for messages), for up to 30 s. The first
/// router to start makes the consumer.
pub async fn wait_pulling(js: &jetstream::Context, stream: &str, durable: &str, pulls: usize) {
    eventually(
        &format!("{pulls} pull requests wait on {durable}"),
        Duration::from_secs(30),
        || async {
            let Ok(stream) = js.get_stream_no_info(stream).await else {
                return false;
            };
            stream
                .consumer_info(durable)
                .await
                .is_ok_and(|info| info.num_waiting >= pulls)
        },
    )
    .await;
}

/// Waits until the (filtered) consumer `durable` has taken `messages`
/// messages and settled all of them: nothing pending, nothing awaiting ack.
/// For a consumer that sees only part of its stream, where the ack floor
/// never reaches the stream's last message.
pub async fn wait_consumer_settled(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
    messages: u64,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(info) = js
            .get_stream(stream)
            .await
            .expect("stream exists")
            .consumer_info(durable)
            .await
            && info.num_pending == 0
            && info.num_ack_pending == 0
            && info.delivered.consumer_sequence >= messages
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumer {durable} did not settle {messages} messages within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The dead letters of `stream`'s messages, in order, from the default
/// dead-letter stream.
pub async fn dead_letters(
    js: &jetstream::Context,
    stream: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let Ok(mut dead) = js
        .get_stream(idem_runtime::dead_letter::DEFAULT_STREAM)
        .await
    else {
        return Vec::new();
    };
    let last = dead
        .info()
        .await
        .expect("dead-letter stream info")
        .state
        .last_sequence;
    let mut letters = Vec::new();
    for sequence in 1..=last {
        let Ok(letter) = dead.get_raw_message(sequence).await else {
            continue;
        };
        if header(&letter, "Idem-Original-Stream") == stream {
            letters.push(letter);
        }
    }
    letters
}

/// A header of a stored message, or "" when absent.
pub fn header(message: &jetstream::message::StreamMessage, name: &str) -> String {
    message
        .headers
        .get(name)
        .map(|value| value.as_str().to_owned())
        .unwrap_or_default()
}

/// Everything the workers told JetStream about each delivery of one stream
/// (`+ACK`, `-NAK`, `+WPI`, `+TERM`, ...), in the order the server got it,
/// seen by a plain subscriber on the ack subjects.
pub struct AckLog {
    entries: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
    task: JoinHandle<()>,
}

impl AckLog {
    /// Starts listening to the acks of `stream`'s consumers.
    pub async fn start(nats: &async_nats::Client, stream: &str) -> AckLog {
        use futures_util::StreamExt;
        // `$JS.ACK.<stream>.<consumer>...`, or with a domain and account
        // hash in front in the newer format: filtered by token below.
        let mut acks = nats
            .subscribe("$JS.ACK.>")
            .await
            .expect("subscribed to the ack subjects");
        let stream = stream.to_owned();
        nats.flush().await.expect("the subscription is in place");
        let entries = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = entries.clone();
        let task = tokio::spawn(async move {
            while let Some(ack) = acks.next().await {
                if !ack.subject.split('.').any(|token| token == stream) {
                    continue;
                }
                let kind = String::from_utf8_lossy(&ack.payload)
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                sink.lock().unwrap().push((ack.subject.to_string(), kind));
            }
        });
        AckLog { entries, task }
    }

    /// The deliveries that got a progress heartbeat after they were settled
    /// (acked, NAKed or terminated): each as its ack subject and its log.
    pub fn heartbeats_after_settling(&self) -> Vec<(String, Vec<String>)> {
        let entries = self.entries.lock().unwrap();
        let mut per_delivery: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (subject, kind) in entries.iter() {
            per_delivery.entry(subject).or_default().push(kind.clone());
        }
        per_delivery
            .into_iter()
            .filter(|(_, kinds)| {
                let settled = kinds
                    .iter()
                    .position(|kind| kind != "+WPI")
                    .unwrap_or(kinds.len());
                kinds[settled..].iter().any(|kind| kind == "+WPI")
            })
            .map(|(subject, kinds)| (subject.to_owned(), kinds))
            .collect()
    }

    /// How many messages of each kind were seen.
    pub fn count(&self, kind: &str) -> usize {
        self.entries
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k)| k == kind)
            .count()
    }
}

impl Drop for AckLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The id a message without `Nats-Msg-Id` is deduplicated by: its stream,
/// sequence, and the time JetStream stored it, in Unix nanoseconds.
pub async fn stream_position(js: &jetstream::Context, stream: &str, sequence: u64) -> String {
    let stored = js
        .get_stream(stream)
        .await
        .expect("stream exists")
        .get_raw_message(sequence)
        .await
        .expect("the message is stored");
    format!("{stream}:{sequence}:{}", stored.time.unix_timestamp_nanos())
}

/// Subscribes to JetStream's advisory that it gave up on a message of
/// `durable` (max deliveries reached), flushed so that none is missed.
pub async fn given_up_advisories(
    nats: &async_nats::Client,
    stream: &str,
    durable: &str,
) -> async_nats::Subscriber {
    let advisories = nats
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"
        ))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    advisories
}

/// Takes the deliveries of the durable consumer by hand, never acking them
/// (ack_wait runs out, as if the worker died on each), until JetStream gives
/// up on the message. No router may listen meanwhile. Returns the last
/// delivery count seen.
pub async fn exhaust_deliveries(nats: &async_nats::Client, stream: &str, durable: &str) -> i64 {
    use futures_util::StreamExt;
    let mut advisories = given_up_advisories(nats, stream, durable).await;
    let js = jetstream::new(nats.clone());
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream(stream)
        .await
        .unwrap()
        .get_consumer(durable)
        .await
        .unwrap();
    let mut delivered = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "JetStream never gave up"
        );
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .unwrap();
        if let Some(Ok(message)) = batch.next().await {
            delivered = message.info().unwrap().delivered;
        }
        if let Ok(Some(_)) =
            tokio::time::timeout(Duration::from_millis(10), advisories.next()).await
        {
            return delivered;
        }
    }
}

/// A [`Deposit`] of `amount` to `account`.
pub fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.into(),
        amount,
    }
}

/// Quick retries, so the tests wait milliseconds rather than seconds.
pub fn fast(route: Route) -> Route {
    route.backoff(Duration::from_millis(50), Duration::from_millis(200))
}

/// The route for the tests where JetStream gives up: one delivery allowed,
/// so JetStream's own limit (the route's plus a margin of 3) is 4.
pub fn given_up_route(stream: &str) -> Route {
    fast(Route::new(stream, "c"))
        .max_deliver(1)
        .ack_wait(Duration::from_millis(500))
        .heartbeat_every(Duration::from_millis(150))
}

/// The config of `name`, once the router has created it.
pub async fn eventually_get_stream(
    js: &jetstream::Context,
    name: &str,
) -> jetstream::stream::Config {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut stream) = js.get_stream(name).await {
            return stream.info().await.unwrap().config.clone();
        }
        assert!(Instant::now() < deadline, "stream {name} never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes `payload` with a raw header block, over a raw connection, so
/// that no client library checks the header.
pub async fn publish_raw(nats_url: &str, subject: &str, header: &[u8], payload: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = nats_url.trim_start_matches("nats://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut info = [0u8; 4096];
    let _ = socket.read(&mut info).await.unwrap();
    let mut frame = format!(
        "CONNECT {{\"verbose\":false,\"headers\":true,\"protocol\":1}}\r\nHPUB {subject} {} {}\r\n",
        header.len(),
        header.len() + payload.len()
    )
    .into_bytes();
    frame.extend_from_slice(header);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(b"\r\nPING\r\n");
    socket.write_all(&frame).await.unwrap();
    let mut pong = [0u8; 64];
    let read = socket.read(&mut pong).await.unwrap();
    assert!(
        String::from_utf8_lossy(&pong[..read]).contains("PONG"),
        "the server took the raw publish: {}",
        String::from_utf8_lossy(&pong[..read])
    );
}

/// A handler that records each effect as handler `plain` ([`record_effect`]).
#[idempotent(name = "plain")]
pub async fn plain(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain", &d, delivery).await
}

/// A handler that records each effect as handler `no-ids` ([`record_effect`]).
#[idempotent(name = "no-ids")]
pub async fn no_ids(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "no-ids", &d, delivery).await
}

/// A handler that records each effect as handler `ids` ([`record_effect`]).
#[idempotent(name = "ids")]
pub async fn ids(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "ids", &d, delivery).await
}

/// The message ids a handler has run for: it misbehaves on the first run
/// of each.
#[derive(Clone, Default)]
pub struct FirstRuns(pub Arc<Mutex<HashSet<String>>>);

impl FirstRuns {
    /// Records a run of `delivery`'s message: whether it is the first.
    pub fn first(&self, delivery: &Delivery) -> bool {
        self.0
            .lock()
            .unwrap()
            .insert(delivery.message_id().to_string())
    }
}

/// A URL for a second connection to the same database as `tx`.
pub async fn database_url(tx: &mut sqlx::PgTransaction<'_>) -> String {
    let (port, database): (i32, String) =
        sqlx::query_as("SELECT current_setting('port')::int, current_database()")
            .fetch_one(&mut **tx)
            .await
            .unwrap();
    format!("postgres://postgres@127.0.0.1:{port}/{database}")
}

/// Replays dead letter `sequence` until JetStream stores it: refused while
/// the server still remembers its id (it forgets ids on a timer, which a
/// loaded machine can run late), as an operator would try again.
pub async fn replay_until_stored(
    js: &async_nats::jetstream::Context,
    sequence: u64,
) -> async_nats::jetstream::publish::PublishAck {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match idem_runtime::dead_letter::replay(
            js,
            idem_runtime::dead_letter::DEFAULT_STREAM,
            sequence,
        )
        .await
        {
            Ok(replay) => return replay,
            Err(idem_runtime::dead_letter::ReplayError::InsideDuplicateWindow) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "JetStream kept refusing the replay of {sequence} as a duplicate"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("replay failed: {error}"),
        }
    }
}
