//! Attack review: orders of events that break idem's promise ("no message is
//! lost, and no effect is applied twice, whatever fails"), each against real
//! servers. Every test injects its fault, checks that the fault happened, and
//! then asserts the invariant the runtime breaks, so each of them fails
//! against the runtime as reviewed.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::pg_proxy::upstream_of;
use common::*;
use futures_util::StreamExt;
use idem_runtime::{BoxError, Delivery, Permanent, Route, Router, Transient, dead_letter, idempotent};

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.into(),
        amount,
    }
}

/// Quick retries, so the tests wait milliseconds rather than seconds.
fn fast(route: Route) -> Route {
    route.backoff(Duration::from_millis(50), Duration::from_millis(200))
}

/// One delivery allowed, so JetStream's own limit (the route's plus a margin
/// of 3) is 4, reached in about 2 s when nobody settles the message.
fn given_up_route(stream: &str) -> Route {
    fast(Route::new(stream, "c"))
        .max_deliver(1)
        .ack_wait(Duration::from_millis(500))
        .heartbeat_every(Duration::from_millis(150))
}

/// The config of `name`, once the router has created it.
async fn eventually_get_stream(js: &jetstream::Context, name: &str) -> jetstream::stream::Config {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut stream) = js.get_stream(name).await {
            return stream.info().await.unwrap().config.clone();
        }
        assert!(Instant::now() < deadline, "stream {name} never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A subscription to the `MAX_DELIVERIES` advisories of `stream`'s durable
/// `durable`: JetStream says it gave up on a message.
async fn given_up_advisories(
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

/// Takes the deliveries of the durable consumer by hand, never acking them,
/// as a worker would that crashes on each, until JetStream gives up on the
/// message. No router listens meanwhile. (As in hardening.rs.)
async fn exhaust_deliveries(nats: &async_nats::Client, stream: &str, durable: &str) -> i64 {
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
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "JetStream never gave up");
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

/// Publishes `payload` with a raw header block, over a raw connection, so
/// that no client library checks the header.
async fn publish_raw(nats_url: &str, subject: &str, header: &[u8], payload: &[u8]) {
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

async fn stored_messages(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

// ---------------------------------------------------------------------------
// A. A key expression that panics: the message is never dead-lettered, and
//    the given-up watcher of the route dies on it.
// ---------------------------------------------------------------------------

/// How often the key below was computed.
static KEY_CALLS: AtomicUsize = AtomicUsize::new(0);

/// The first 8 bytes of the account: a bug for short accounts.
fn first_eight(account: &str) -> &str {
    KEY_CALLS.fetch_add(1, Ordering::SeqCst);
    &account[..8]
}

#[idempotent(name = "panicky-key", key = first_eight(&d.account))]
async fn panicky_key(
    tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
    delivery: &Delivery,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "panicky-key", &d, delivery).await
}

/// `Pipeline::prepare` runs the handler's key expression outside the
/// `catch_unwind` that guards the handler body. A key that panics kills the
/// message's task before it is settled, on every delivery, until JetStream
/// gives up. The given-up watcher then evaluates the same key
/// (`id_of_raw`), panics too, and its task is gone: the message is never
/// dead-lettered (and nothing else this route gives up on is, from then on).
#[tokio::test]
async fn a_key_that_panics_is_never_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEYPANIC", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), panicky_key),
        nats.clone(),
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    let mut advisories = given_up_advisories(&nats, &stream, "c").await;
    publish(&js, &subject, &deposit("short", 1), Some("kp-1")).await;

    // The fault: every delivery panics in the runtime, so JetStream gives up.
    tokio::time::timeout(Duration::from_secs(30), advisories.next())
        .await
        .expect("JetStream gave up on the message within 30 s")
        .unwrap();
    let stats = handle.stats("c").unwrap();
    assert!(stats.received() >= 4, "delivered 1 + 3 times");
    assert_eq!(stats.processed() + stats.failed(), 0, "never settled");

    // The invariant: a message JetStream gave up on is dead-lettered.
    let deadline = Instant::now() + Duration::from_secs(15);
    while dead_letters(&js, &stream).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = dead_letters(&js, &stream).await;
    let info = consumer_info(&js, &stream, "c").await;
    let received = stats.received() as usize;
    task.abort();
    assert_eq!(
        letters.len(),
        1,
        "lost: JetStream gave up on the message (ack pending {}, pending {}), \
         it was never processed ({:?}) and no dead letter was stored 15 s later; the key \
         panicked {} times for {received} deliveries (the extra one: the given-up watcher)",
        info.num_ack_pending,
        info.num_pending,
        ledger(&pool, "panicky-key").await,
        KEY_CALLS.load(Ordering::SeqCst),
    );
}

// ---------------------------------------------------------------------------
// B. A key with a line break: the dead-letter publish panics.
// ---------------------------------------------------------------------------

#[idempotent(name = "refuses-by-key", key = d.account)]
async fn refuses_by_key(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> Result<(), BoxError> {
    Err(Permanent::new(format!("account {:?} is closed", d.account)).into())
}

/// A message id may hold any character but NUL. A key with a line break
/// ("free text" keys, `{:#?}` keys) passes `MessageId::from_key`, but
/// `dead_letter::publish_letter` puts it in the `Idem-Message-Id` header,
/// and async-nats' `HeaderValue::from(&str)` asserts there is no CR/LF: the
/// settle task panics before the dead letter is published or the message
/// TERMed. It happens on every delivery, then in the given-up watcher.
/// A permanently failing message is never dead-lettered.
#[tokio::test]
async fn a_key_with_a_line_break_is_never_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEYCRLF", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), refuses_by_key),
        nats.clone(),
        pool,
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    let mut advisories = given_up_advisories(&nats, &stream, "c").await;
    publish(&js, &subject, &deposit("line 1\nline 2", 1), None).await;

    let stats = handle.stats("c").unwrap();
    let gave_up = tokio::time::timeout(Duration::from_secs(30), advisories.next()).await;
    assert!(
        stats.failed() >= 1,
        "the handler refused the message (a permanent failure)"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while dead_letters(&js, &stream).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = dead_letters(&js, &stream).await;
    task.abort();
    assert_eq!(
        letters.len(),
        1,
        "a permanently failing message must be dead-lettered; instead: JetStream gave up \
         on it: {}, failed {} times, dead-lettered {} times, no dead letter stored",
        gave_up.is_ok(),
        stats.failed(),
        stats.dead_lettered()
    );
}

// ---------------------------------------------------------------------------
// C. A lower-case `nats-msg-id`: the given-up dead letter records an id the
//    message was never deduplicated by; its replay applies it again.
// ---------------------------------------------------------------------------

#[idempotent(name = "lower-id")]
async fn lower_id(
    tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
    delivery: &Delivery,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "lower-id", &d, delivery).await
}

/// The pipeline reads `Nats-Msg-Id` through async-nats, whose header names
/// are case-sensitive: a message published with `nats-msg-id: X` (as some
/// clients and proxies write it) is deduplicated by its stream position. The
/// given-up watcher (`undeliverable::raw_nats_msg_id`) matches the name
/// case-insensitively and records `X` as the id. The message is committed,
/// its ack lost, and JetStream gives up on it; the operator replays the dead
/// letter, `replay` publishes it under `Nats-Msg-Id: X`, the claim on `X` is
/// fresh, and the deposit is applied a second time.
#[tokio::test]
async fn a_lower_case_nats_msg_id_makes_a_given_up_replay_apply_twice() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LOWERID", Duration::from_millis(500)).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("nats-msg-id", "order-77");
    js.publish_with_headers(
        subject.clone(),
        headers,
        serde_json::to_vec(&deposit("a", 5)).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    // The first worker commits, then "dies" before its ack.
    let committed = Arc::new(AtomicU64::new(0));
    let hook_committed = committed.clone();
    let router = Router::new()
        .route(given_up_route(&stream), lower_id)
        .fault_hooks(
            idem_runtime::fault::FaultHooks::default().after_commit(move |_| {
                hook_committed.fetch_add(1, Ordering::SeqCst);
                idem_runtime::fault::AfterCommit::DropWithoutAck
            }),
        );
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    eventually("the message committed", Duration::from_secs(30), || async {
        committed.load(Ordering::SeqCst) == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "lower-id").await, Ledger::once_each(1));
    let deduplicated_by: String =
        sqlx::query_scalar("SELECT message_id FROM idem_processed_messages WHERE handler = 'lower-id'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        deduplicated_by,
        stream_position(&js, &stream, 1).await,
        "the pipeline deduplicated it by its stream position"
    );

    // Later workers keep dying on it until JetStream gives up.
    exhaust_deliveries(&nats, &stream, "c").await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), lower_id),
        nats,
        pool.clone(),
    );
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    let letters = dead_letters(&js, &stream).await;
    let recorded = header(&letters[0], "Idem-Message-Id");

    // Past the stream's duplicate window (500 ms), the replay is stored and
    // only the claim can tell that it was processed.
    tokio::time::sleep(Duration::from_millis(700)).await;
    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letters[0].sequence)
        .await
        .expect("the replay is stored");
    let stats = handle.stats("c").unwrap();
    eventually("the replay is settled", Duration::from_secs(30), || async {
        stats.processed() + stats.duplicates() == 1
    })
    .await;
    stop(handle, task).await;
    assert_eq!(
        ledger(&pool, "lower-id").await,
        Ledger::once_each(1),
        "applied twice: the message was deduplicated by {deduplicated_by:?}, its dead letter \
         recorded {recorded:?}, and the replay was deduplicated by that"
    );
}

// ---------------------------------------------------------------------------
// D. A COMMIT that never gets an answer (network partition): the message is
//    heartbeated forever, and the route's slot with it.
// ---------------------------------------------------------------------------

/// A TCP proxy that, once armed, swallows the next simple query that
/// commits and from then on forwards nothing on that connection in either
/// direction, while keeping both sockets open: what a client sees when the
/// network drops every packet after its COMMIT reached the server's host
/// (no RST, no FIN; sqlx sets no TCP keepalive).
struct Blackhole {
    addr: std::net::SocketAddr,
    armed: Arc<AtomicBool>,
    swallowed: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Blackhole {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let swallowed = Arc::new(AtomicUsize::new(0));
        let (accept_armed, accept_swallowed) = (armed.clone(), swallowed.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (armed, swallowed) = (accept_armed.clone(), accept_swallowed.clone());
                tokio::spawn(async move {
                    if let Ok(server) = tokio::net::TcpStream::connect(upstream).await {
                        blackhole_relay(client, server, armed, swallowed).await;
                    }
                });
            }
        });
        Self {
            addr,
            armed,
            swallowed,
            accept,
        }
    }

    fn url_for(&self, database_url: &str) -> String {
        let (scheme, rest) = database_url.split_once("://").unwrap();
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let userinfo = authority
            .rsplit_once('@')
            .map(|(userinfo, _)| format!("{userinfo}@"))
            .unwrap_or_default();
        format!("{scheme}://{userinfo}{}/{path}", self.addr)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn blackhole_relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    armed: Arc<AtomicBool>,
    swallowed: Arc<AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let frozen = Arc::new(AtomicBool::new(false));
    let up_frozen = frozen.clone();
    let upstream = async move {
        // The untyped start: negotiation requests, then the startup message.
        loop {
            let length = client_read.read_u32().await?;
            let mut body = vec![0; length as usize - 4];
            client_read.read_exact(&mut body).await?;
            server_write.write_u32(length).await?;
            server_write.write_all(&body).await?;
            let code = u32::from_be_bytes(body[..4].try_into().unwrap_or([0; 4]));
            if ![80_877_103, 80_877_104].contains(&code) {
                break;
            }
        }
        loop {
            let kind = client_read.read_u8().await?;
            let length = client_read.read_u32().await?;
            let mut body = vec![0; length as usize - 4];
            client_read.read_exact(&mut body).await?;
            let is_commit = kind == b'Q'
                && body
                    .to_ascii_uppercase()
                    .windows(6)
                    .any(|window| window == b"COMMIT");
            if is_commit && armed.swap(false, Ordering::SeqCst) {
                up_frozen.store(true, Ordering::SeqCst);
                swallowed.fetch_add(1, Ordering::SeqCst);
                // Keep every socket open, forward nothing, forever.
                std::future::pending::<()>().await;
            }
            server_write.write_u8(kind).await?;
            server_write.write_u32(length).await?;
            server_write.write_all(&body).await?;
        }
        #[allow(unreachable_code)]
        std::io::Result::Ok(())
    };
    let downstream = async move {
        let mut buffer = vec![0; 64 * 1024];
        loop {
            let read = server_read.read(&mut buffer).await?;
            if frozen.load(Ordering::SeqCst) {
                // Neither the server's answers nor its closing reach the
                // client.
                std::future::pending::<()>().await;
            }
            if read == 0 {
                return std::io::Result::Ok(());
            }
            client_write.write_all(&buffer[..read]).await?;
        }
    };
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}

#[idempotent(name = "partitioned")]
async fn partitioned(
    tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
    delivery: &Delivery,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "partitioned", &d, delivery).await
}

/// BEGIN, the claim and COMMIT run with no client-side bound (by design:
/// "no timer or select! is ever held around BEGIN or COMMIT"), and sqlx sets
/// no TCP keepalive. When the answer to a COMMIT never comes (a partition,
/// a frozen host), the message's task waits forever while the route's
/// heartbeats keep its lease: JetStream never redelivers it, the
/// server-side `idle_in_transaction_session_timeout` rolls its claim back,
/// and nobody ever processes it. With `concurrency(1)` the whole route
/// stops: the next message is never taken either.
#[tokio::test]
async fn a_commit_that_is_never_answered_leaves_the_message_leased_forever() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("PARTITION", Duration::from_secs(120)).await;
    let proxy = Blackhole::start(upstream_of(env.database_url())).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .unwrap();
    proxy.armed.store(true, Ordering::SeqCst);
    let acks = AckLog::start(&nats, &stream).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c"))
                .handler_timeout(Duration::from_secs(1))
                .ack_wait(Duration::from_secs(2))
                .concurrency(1),
            partitioned,
        ),
        nats,
        proxied,
    );
    publish(&js, &subject, &deposit("a", 1), Some("cut-1")).await;
    publish(&js, &subject, &deposit("b", 1), Some("cut-2")).await;
    eventually(
        "the first COMMIT went into the partition",
        Duration::from_secs(30),
        || async { proxy.swallowed.load(Ordering::SeqCst) == 1 },
    )
    .await;

    // Ten times ack_wait, and the server ended the orphaned backend (after
    // the handler timeout plus 1 s) long ago.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = consumer_info(&js, &stream, "c").await;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        if Instant::now() >= deadline {
            let stats = handle.stats("c").unwrap();
            let claims: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_processed_messages WHERE handler = 'partitioned'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            task.abort();
            panic!(
                "stuck: 20 s after the partition neither message is settled: pending {}, ack \
                 pending {}, redelivered {}; processed {}, failed {}; claims committed {claims}; \
                 effects {:?}; on the wire: {} +WPI, {} +ACK, {} -NAK",
                info.num_pending,
                info.num_ack_pending,
                info.num_redelivered,
                stats.processed(),
                stats.failed(),
                ledger(&pool, "partitioned").await,
                acks.count("+WPI"),
                acks.count("") + acks.count("+ACK"),
                acks.count("-NAK"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "partitioned").await, Ledger::once_each(2));
}

// ---------------------------------------------------------------------------
// E. Shutdown while NATS is away: `run` never returns.
// ---------------------------------------------------------------------------

#[idempotent(name = "slow-forever")]
async fn slow_forever(_tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> Result<(), sqlx::Error> {
    std::future::pending::<()>().await;
    Ok(())
}

/// While NATS is away, async-nats stops draining its command channel
/// (2048 entries) until it reconnects, and `publish` waits for room. The
/// route's heartbeats (one `+WPI` per leased message per tick) fill it. At
/// shutdown, `pull::hand_back` NAKs what the pull fetched and did not start,
/// outside any bound: `run` hangs for as long as NATS is away, although it
/// promises to return "within the grace period plus a few seconds".
#[tokio::test]
async fn shutdown_while_nats_is_away_returns_within_the_grace_period() {
    let Scenario {
        mut env,
        pool,
        nats: _nats,
        js,
        stream,
        subject,
    } = scenario("NATSAWAY", Duration::from_secs(120)).await;
    for i in 0..200 {
        publish(&js, &subject, &deposit("a", i), Some(&format!("away-{i}"))).await;
    }
    let router_client = env.nats().await;
    let (handle, task) = spawn(
        Router::new()
            .route(
                Route::new(&stream, "c")
                    .batch(50)
                    .concurrency(2)
                    .ack_wait(Duration::from_secs(30))
                    .heartbeat_every(Duration::from_millis(10)),
                slow_forever,
            )
            .shutdown_grace(Duration::from_secs(1)),
        router_client,
        pool,
    );
    let stats = handle.stats("c").unwrap();
    eventually(
        "two batches run and more messages wait in the pull",
        Duration::from_secs(30),
        || async { stats.received() >= 100 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let info = consumer_info(&js, &stream, "c").await;
    assert!(
        info.num_ack_pending > 100,
        "messages were fetched beyond the two running batches: {}",
        info.num_ack_pending
    );

    // The fault: NATS goes away, and stays away.
    env.nats_server_mut().kill();
    tokio::time::sleep(Duration::from_secs(3)).await;

    handle.shutdown();
    let mut task = task;
    let returned = tokio::time::timeout(Duration::from_secs(20), &mut task).await;
    if returned.is_err() {
        // What it waits for: NATS. Once it is back, `run` returns.
        env.nats_server_mut().start_again().await;
        let then = tokio::time::timeout(Duration::from_secs(20), &mut task).await;
        panic!(
            "run did not return 20 s after shutdown with a 1 s grace period while NATS was \
             away; it returned once NATS was back: {}",
            then.is_ok()
        );
    }
}

// ---------------------------------------------------------------------------
// F. A header value with a bare CR: every worker that receives it goes deaf.
// ---------------------------------------------------------------------------

#[idempotent(name = "plain")]
async fn plain(
    tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
    delivery: &Delivery,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain", &d, delivery).await
}

/// async-nats parses a header value line by line and then builds a
/// `HeaderValue` from it with `From<String>`, which asserts there is no CR:
/// a value with a bare CR inside (`a\rb`) panics the client's connection
/// task. Unlike a header that is not UTF-8 (the connection is dropped and
/// re-made, and the server's backstop ends it), the client is now dead for
/// good, and the router does not notice: `run` keeps running, its pull
/// reopens and fails forever, and no message of any route is processed or
/// dead-lettered again. Redelivered after ack_wait, the poison does the same
/// to the next worker.
#[tokio::test]
async fn a_header_with_a_bare_cr_does_not_stop_the_router() {
    let Scenario {
        env,
        pool,
        nats: _nats,
        js,
        stream,
        subject,
    } = scenario("BARECR", Duration::from_secs(120)).await;
    publish_raw(
        env.nats_url(),
        &subject,
        b"NATS/1.0\r\nX-Note: a\rb\r\n\r\n",
        br#"{"account":"poison","amount":1}"#,
    )
    .await;
    publish(&js, &subject, &deposit("good", 2), Some("good-1")).await;
    assert_eq!(stored_messages(&js, &stream).await, 2, "both are stored");

    // The router gets a client of its own; the checks use the scenario's.
    let router_client = env.nats().await;
    let (handle, task) = spawn(
        Router::new().route(
            Route::new(&stream, "c")
                .ack_wait(Duration::from_secs(1))
                .max_deliver(1),
            plain,
        ),
        router_client.clone(),
        pool.clone(),
    );
    let stats = handle.stats("c").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.processed() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client_alive = router_client.flush().await.is_ok();
    let still_running = !task.is_finished();
    let letters = dead_letters(&js, &stream).await.len();
    task.abort();
    assert!(
        stats.processed() == 1,
        "the good message was not processed in 30 s: the router's NATS client is alive: \
         {client_alive}, the router still runs: {still_running}, received {}, dead letters {letters}",
        stats.received()
    );
}

// ---------------------------------------------------------------------------
// G. A failure before the handler that can never clear is held forever.
// ---------------------------------------------------------------------------

/// `Begin::new` puts the handler timeout into `SET LOCAL statement_timeout`
/// in milliseconds; PostgreSQL takes at most i32::MAX (about 24.8 days).
/// A route with a longer timeout passes `Route::validate`, then every BEGIN
/// fails (22023). Failures before the handler are "the database's fault":
/// the message is held, the route paused, no delivery used up, nothing
/// dead-lettered, forever.
#[tokio::test]
async fn a_begin_that_can_never_succeed_is_not_held_forever() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LONGTIMEOUT", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).handler_timeout(Duration::from_secs(25 * 24 * 3600)),
            plain,
        ),
        nats,
        pool.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("long-1")).await;
    let stats = handle.stats("c").unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.processed() + stats.dead_lettered() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = consumer_info(&js, &stream, "c").await;
    task.abort();
    assert!(
        stats.processed() + stats.dead_lettered() == 1,
        "stuck: after 15 s the message is neither processed nor dead-lettered; {} \
         infrastructure errors, redelivered {}, ack pending {}",
        stats.infrastructure_errors(),
        info.num_redelivered,
        info.num_ack_pending
    );
}

// ---------------------------------------------------------------------------
// H. A handler that commits by itself: half its work is acked as done.
// ---------------------------------------------------------------------------

/// "Commit in chunks": a handler that ends the transaction with a raw
/// `COMMIT` (and opens another), then fails before its second chunk.
#[idempotent(name = "chunked")]
async fn chunked(
    tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
    delivery: &Delivery,
) -> Result<(), BoxError> {
    record_effect(tx, "chunked-1", &d, delivery).await?;
    sqlx::raw_sql("COMMIT; BEGIN").execute(&mut **tx).await?;
    if delivery.delivered() == 1 {
        return Err(Transient::new("the second chunk failed").into());
    }
    record_effect(tx, "chunked-2", &d, delivery).await?;
    Ok(())
}

/// `HandlerError::ClaimLost` promises that a handler that ends the
/// transaction itself ("a raw COMMIT or ROLLBACK") is caught at COMMIT. The
/// check only counts the claim row, which a raw COMMIT has made permanent,
/// so it never fires for a raw COMMIT; and when the handler then fails, the
/// redelivery finds the claim and is acked as a duplicate: the second half
/// of the work is never done, and nothing is dead-lettered.
#[tokio::test]
async fn a_handler_that_commits_by_itself_is_not_acked_half_done() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("CHUNKED", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("chunk-1")).await;
    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), chunked),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert!(stats.failed() >= 1, "the first delivery failed after its raw COMMIT");
    let first = ledger(&pool, "chunked-1").await.effects;
    let second = ledger(&pool, "chunked-2").await.effects;
    let letters = dead_letters(&js, &stream).await.len();
    assert!(
        second == 1 || letters == 1,
        "acked half done: first chunk applied {first}, second chunk {second}, dead letters \
         {letters}, acked as a duplicate {} time(s)",
        stats.duplicates()
    );
}

// ---------------------------------------------------------------------------
// I. One message whose claim can never succeed stops its whole route.
// ---------------------------------------------------------------------------

/// Every failure of the claim is taken for "the database could not be
/// used", whatever its SQLSTATE. In a database whose encoding is not UTF-8
/// (LATIN1 here, still common in old installations), a message id with a
/// character LATIN1 lacks fails the claim with 22P05 on every try: that one
/// message is held forever, and it pauses its route, so no other message is
/// taken either. Nothing is dead-lettered.
#[tokio::test]
async fn one_message_whose_claim_always_fails_does_not_stop_its_route() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("LATIN1", Duration::from_secs(120)).await;
    sqlx::query(
        "CREATE DATABASE legacy TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let url = env.database_url();
    let legacy_url = format!("{}/legacy", &url[..url.rfind('/').unwrap()]);
    let legacy = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&legacy_url)
        .await
        .unwrap();
    prepare_database(&legacy).await;

    let (handle, task) = spawn(
        Router::new().route(fast(Route::new(&stream, "c")), plain),
        nats,
        legacy.clone(),
    );
    publish(&js, &subject, &deposit("a", 1), Some("заказ-1")).await;
    let stats = handle.stats("c").unwrap();
    eventually(
        "the claim of the first message failed again and again",
        Duration::from_secs(30),
        || async { stats.infrastructure_errors() >= 5 },
    )
    .await;
    publish(&js, &subject, &deposit("b", 2), Some("order-2")).await;

    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.processed() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = consumer_info(&js, &stream, "c").await;
    let letters = dead_letters(&js, &stream).await.len();
    task.abort();
    assert!(
        stats.processed() == 1 && letters == 1,
        "the route stopped on one message: processed {}, dead letters {letters}, {} failed \
         claims, pending {} (never delivered), ack pending {}",
        stats.processed(),
        stats.infrastructure_errors(),
        info.num_pending,
        info.num_ack_pending
    );
}

// ---------------------------------------------------------------------------
// J. Two routes whose advisory consumers get the same name.
// ---------------------------------------------------------------------------

/// The given-up watcher's durable is `idem-given-up-{stream}-{durable}`;
/// stream and durable names may both hold `-`, so stream `S-A` with durable
/// `c` and stream `S` with durable `A-c` get the same consumer. Bound second,
/// the other route's `create_consumer` silently rewrites its filter
/// (create-or-update): the advisories of the first route match no consumer
/// of the work-queue stream, sit there, and its given-up messages are never
/// dead-lettered.
#[tokio::test]
async fn routes_whose_watcher_names_collide_still_dead_letter_what_jetstream_gave_up_on() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("COLLIDE", Duration::from_secs(120)).await;
    let first_stream = format!("{stream}-A");
    let first_subject = format!("{first_stream}.deposit");
    create_stream(&js, &first_stream, &first_subject, Duration::from_secs(120)).await;
    let router = || {
        Router::new()
            .route(given_up_route(&first_stream), plain)
            .route(
                fast(Route::new(&stream, "A-c"))
                    .max_deliver(1)
                    .ack_wait(Duration::from_millis(500)),
                plain,
            )
    };
    let (handle, task) = spawn(router(), nats.clone(), pool.clone());
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    stop(handle, task).await;

    publish(&js, &first_subject, &deposit("a", 1), Some("collide-1")).await;
    exhaust_deliveries(&nats, &first_stream, "c").await;

    let (handle, task) = spawn(router(), nats, pool);
    let deadline = Instant::now() + Duration::from_secs(20);
    while dead_letters(&js, &first_stream).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = dead_letters(&js, &first_stream).await.len();
    let watcher = format!("idem-given-up-{first_stream}-c");
    let mut advisories = js
        .get_stream("IDEM_ADVISORIES")
        .await
        .unwrap();
    let waiting = advisories.info().await.unwrap().state.messages;
    let filter = advisories
        .consumer_info(&watcher)
        .await
        .unwrap()
        .config
        .filter_subject
        .clone();
    stop(handle, task).await;
    assert_eq!(
        letters,
        1,
        "never dead-lettered: JetStream gave up on the message of {first_stream}/c, its advisory \
         waits in the advisory stream ({waiting} stored), and the consumer {watcher} now filters \
         {filter:?}"
    );
}

// ---------------------------------------------------------------------------
// K. A dead-letter stream that does not keep what it is sent.
// ---------------------------------------------------------------------------

#[idempotent(name = "always-refuses")]
async fn always_refuses(_tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> Result<(), BoxError> {
    Err(Permanent::new("this handler refuses everything").into())
}

/// `dead_letter::ensure_stream` only checks that some stream captures a
/// route's own dead-letter subject. An interest-retention stream with no
/// consumer acknowledges the publish and keeps nothing; the runtime takes
/// the PubAck for "stored" and TERMs the original. The message is gone:
/// not processed, no dead letter anywhere.
#[tokio::test]
async fn a_dead_letter_is_stored_before_its_message_is_terminated() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("INTEREST", Duration::from_secs(120)).await;
    let dead_stream = format!("{stream}_DEAD");
    js.create_stream(jetstream::stream::Config {
        name: dead_stream.clone(),
        subjects: vec![format!("{dead_stream}.>")],
        retention: jetstream::stream::RetentionPolicy::Interest,
        ..Default::default()
    })
    .await
    .unwrap();
    let (handle, task) = spawn(
        Router::new().route(
            fast(Route::new(&stream, "c")).dead_letter_subject(format!("{dead_stream}.letters")),
            always_refuses,
        ),
        nats,
        pool,
    );
    publish(&js, &subject, &deposit("a", 1), Some("refused-1")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(stats.dead_lettered(), 1, "the runtime took it as dead-lettered and TERMed it");
    let kept = js
        .get_stream(&dead_stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(
        kept, 1,
        "lost: TERMed after a dead-letter publish that the stream acknowledged and did not keep"
    );
}
