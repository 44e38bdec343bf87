//! Attack review: orders of events that broke idem's promise ("no message is
//! lost, and no effect is applied twice, whatever fails") in a review of the
//! hardened runtime, each against real servers. Every test injects its
//! fault, checks that the fault happened, and asserts the invariant; each
//! failed against the runtime as reviewed, and passes since its fix.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::pg_proxy::{PgProxy, upstream_of};
use common::*;
use idem_runtime::{
    BoxError, Delivery, Permanent, Route, Router, Transient, dead_letter, idempotent,
};

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

/// How often the key below was computed. A `static`, not router state: a
/// `key = ...` expression sees the payload and the delivery, not the state.
static KEY_CALLS: AtomicUsize = AtomicUsize::new(0);

/// The first 8 bytes of the account: a bug for short accounts.
fn first_eight(account: &str) -> &str {
    KEY_CALLS.fetch_add(1, Ordering::SeqCst);
    &account[..8]
}

#[idempotent(name = "panicky-key", key = first_eight(&d.account))]
async fn panicky_key(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "panicky-key", &d, delivery).await
}

/// A key expression that panics once killed the message's task before it
/// was settled, on every delivery, until JetStream gave up; the given-up
/// watcher then panicked on the same key and died. Now the key runs under
/// `catch_unwind`: the message is dead-lettered on its first delivery
/// (`bad-message-id`, the panic's text in `Idem-Error`), and the route, and
/// its watcher, go on.
#[tokio::test]
async fn a_key_that_panics_is_dead_lettered_at_once() {
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
    publish(&js, &subject, &deposit("short", 1), Some("kp-1")).await;
    publish(&js, &subject, &deposit("long enough", 1), Some("kp-2")).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    assert!(
        KEY_CALLS.load(Ordering::SeqCst) >= 2,
        "the key ran, and panicked once"
    );
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.received(), stats.processed()),
        (2, 1),
        "delivered once each"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "bad-message-id");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "kp-1");
    assert!(header(&letters[0], "Idem-Error").contains("the handler's key panicked"));
    assert_eq!(ledger(&pool, "panicky-key").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// B. A key with a line break: the dead-letter publish panics.
// ---------------------------------------------------------------------------

#[idempotent(name = "refuses-by-key", key = d.account)]
async fn refuses_by_key(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> Result<(), BoxError> {
    Err(Permanent::new(format!("account {:?} is closed", d.account)).into())
}

/// A key with a line break ("free text" keys, `{:#?}` keys) once passed as a
/// message id, and the dead letter's `Idem-Message-Id` header then panicked
/// in async-nats, on every delivery. Now an id with a line break is refused
/// when it is resolved: the message is dead-lettered on its first delivery
/// as `bad-message-id` (its dead letter carries the id it could be
/// deduplicated by before the key, its stream position).
#[tokio::test]
async fn a_key_with_a_line_break_is_dead_lettered_at_once() {
    let Scenario {
        env: _env,
        pool: _pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("KEYCRLF", Duration::from_secs(120)).await;
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), refuses_by_key),
        nats.clone(),
        _pool,
    );
    publish(&js, &subject, &deposit("line 1\nline 2", 1), None).await;
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.received(), stats.rejected(), stats.dead_lettered()),
        (1, 1, 1)
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "bad-message-id");
    assert!(header(&letters[0], "Idem-Error").contains("line break"));
    assert_eq!(
        header(&letters[0], "Idem-Message-Id-Source"),
        "stream-position"
    );
}

// ---------------------------------------------------------------------------
// C. A lower-case `nats-msg-id`: the given-up dead letter records an id the
//    message was never deduplicated by; its replay applies it again.
// ---------------------------------------------------------------------------

#[idempotent(name = "lower-id")]
async fn lower_id(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
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
    let deduplicated_by = stream_position(&js, &stream, 1).await;
    let by_stream_position: bool = sqlx::query_scalar(
        "SELECT key = idem_key('lower-id', $1) FROM idem_processed WHERE handler = 'lower-id'",
    )
    .bind(&deduplicated_by)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        by_stream_position,
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

#[idempotent(name = "partitioned")]
async fn partitioned(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
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
    // The proxy swallows the COMMIT and from then on forwards nothing on
    // that connection, keeping both sockets open (`PgProxy`'s blackhole).
    let proxy = PgProxy::start(upstream_of(env.database_url())).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxy.url_for(env.database_url()))
        .await
        .unwrap();
    proxy.blackhole_next_commit();
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
        || async { proxy.swallowed() == 1 },
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
                "SELECT count(*) FROM idem_processed WHERE handler = 'partitioned'",
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
    // Batches hold what had arrived when they formed (a first batch may
    // hold one message, and never ends), so wait for what matters: some
    // messages held by running batches, and at least a batch's worth more
    // fetched and waiting in the pull, which shutdown must hand back.
    eventually(
        "batches run and more messages wait in the pull",
        Duration::from_secs(30),
        || async {
            let held = stats.received();
            // (The consumer exists once a message is received.)
            held >= 1
                && consumer_info(&js, &stream, "c")
                    .await
                    .num_ack_pending
                    .saturating_sub(held as usize)
                    >= 50
        },
    )
    .await;

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
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain", &d, delivery).await
}

/// async-nats parses a header value line by line and builds a `HeaderValue`
/// with `From<String>`, which asserts there is no CR: a value with a bare CR
/// inside (`a\rb`) panics the client's connection task, for good. The router
/// once went on "running" with a dead client, processing nothing, forever.
/// Now it notices and `run` returns `Error::NatsClientGone`, so that the
/// process is restarted; each worker the poison reaches stops the same way
/// until JetStream gives up on it, and the given-up watcher (which parses
/// header blocks without panicking) dead-letters it. The good message
/// published after it is processed once.
#[tokio::test]
async fn a_header_with_a_bare_cr_stops_the_router_loudly_and_is_dead_lettered() {
    let Scenario {
        env,
        pool,
        nats: _nats,
        js,
        stream,
        subject,
    } = scenario("BARECR", Duration::from_millis(500)).await;
    publish_raw(
        env.nats_url(),
        &subject,
        b"NATS/1.0\r\nX-Note: a\rb\r\n\r\n",
        br#"{"account":"poison","amount":1}"#,
    )
    .await;
    publish(&js, &subject, &deposit("good", 2), Some("good-1")).await;
    assert_eq!(stored_messages(&js, &stream).await, 2, "both are stored");

    // A supervisor: each run gets a client of its own and is restarted when
    // it stops, as systemd or Kubernetes would.
    let route = || {
        Route::new(&stream, "c")
            .ack_wait(Duration::from_secs(1))
            .max_deliver(1)
    };
    let mut clients_lost = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        assert!(
            Instant::now() < deadline,
            "the poison was never dead-lettered"
        );
        let router = Router::new().route(route(), plain);
        let handle = router.handle();
        let run =
            tokio::spawn(router.run_until(env.nats().await, pool.clone(), std::future::pending()));
        // Settled: the poison dead-lettered, and the good message processed
        // or (its deliveries used up beside the poison) dead-lettered too.
        let settled = async {
            loop {
                let letters = dead_letters(&js, &stream).await;
                let lettered = |sequence: &str| {
                    letters
                        .iter()
                        .any(|letter| header(letter, "Idem-Original-Sequence") == sequence)
                };
                let good_done = ledger(&pool, "plain").await.effects == 1 || lettered("2");
                if lettered("1") && good_done {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::select! {
            ended = run => {
                match ended.unwrap() {
                    Err(idem_runtime::Error::NatsClientGone) => clients_lost += 1,
                    other => panic!("the router stopped otherwise: {other:?}"),
                }
            }
            _ = settled => {
                // A good message dead-lettered beside the poison is replayed,
                // under its own id, and processed once.
                let letters = dead_letters(&js, &stream).await;
                if let Some(good) = letters
                    .iter()
                    .find(|letter| header(letter, "Idem-Original-Sequence") == "2")
                {
                    assert_eq!(header(good, "Idem-Message-Id"), "good-1");
                    dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, good.sequence)
                        .await
                        .unwrap();
                    eventually("the replay is processed", Duration::from_secs(30), || async {
                        ledger(&pool, "plain").await.effects == 1
                    })
                    .await;
                }
                handle.shutdown();
                break;
            }
        }
    }
    assert!(clients_lost >= 1, "the poison did stop a client");
    let letters = dead_letters(&js, &stream).await;
    let poison = letters
        .iter()
        .find(|letter| header(letter, "Idem-Original-Sequence") == "1")
        .unwrap();
    assert_eq!(header(poison, "Idem-Failure"), "undeliverable");
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(1));
}

// ---------------------------------------------------------------------------
// G. A failure before the handler that can never clear is held forever.
// ---------------------------------------------------------------------------

/// `Begin::new` puts the handler timeout into `SET LOCAL statement_timeout`
/// in milliseconds; PostgreSQL takes at most i32::MAX (about 24.8 days). A
/// longer timeout once passed `Route::validate`, then every BEGIN failed and
/// every message was held forever. Now it is refused at start-up.
#[tokio::test]
async fn a_handler_timeout_postgresql_cannot_take_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js: _js,
        stream,
        subject: _subject,
    } = scenario("LONGTIMEOUT", Duration::from_secs(120)).await;
    let error = Router::new()
        .route(
            fast(Route::new(&stream, "c")).handler_timeout(Duration::from_secs(25 * 24 * 3600)),
            plain,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::Config { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("about 24.8 days"), "{error}");
}

// ---------------------------------------------------------------------------
// H. A handler that commits by itself: half its work is acked as done.
// ---------------------------------------------------------------------------

/// "Commit in chunks": a handler that ends the transaction with a raw
/// `COMMIT` (and opens another), then fails before its second chunk.
#[idempotent(name = "chunked")]
async fn chunked(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
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
    assert!(
        stats.failed() >= 1,
        "the first delivery failed after its raw COMMIT"
    );
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

/// Every failure of the claim was once taken for "the database could not be
/// used", whatever its SQLSTATE. In a database whose encoding is not UTF-8
/// (LATIN1 here, still common in old installations), a message id with a
/// character LATIN1 lacks fails the claim with 22P05 on every try: that one
/// message was held forever and paused its route. Now a claim's failure is
/// classed by its SQLSTATE: a data exception is this message's, so it is
/// dead-lettered, and the next message flows.
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
        "the claim of the first message failed",
        Duration::from_secs(30),
        || async { stats.failed() >= 1 },
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
        "the route stopped on one message: processed {}, dead letters {letters}, {} held \
         claims, pending {} (never delivered), ack pending {}",
        stats.processed(),
        stats.infrastructure_errors(),
        info.num_pending,
        info.num_ack_pending
    );
    assert_eq!(
        stats.infrastructure_errors(),
        0,
        "never taken for an outage"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert!(header(&letters[0], "Idem-Error").contains("22P05"));
}

#[idempotent(name = "plain-too")]
async fn plain_too(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain-too", &d, delivery).await
}

// ---------------------------------------------------------------------------
// J. Two routes whose advisory consumers get the same name.
// ---------------------------------------------------------------------------

/// The given-up watcher's durable was `idem-given-up-{stream}-{durable}`;
/// stream and durable names may both hold `-`, so stream `S-A` with durable
/// `c` and stream `S` with durable `A-c` got the same consumer, and the
/// second route's `create_consumer` silently rewrote its filter: the first
/// route's given-up messages were never dead-lettered. The name now starts
/// with the stream's length, which makes it unique per (stream, durable).
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
                plain_too,
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
    let watcher = format!("idem-given-up-{}-{first_stream}-c", first_stream.len());
    let mut advisories = js.get_stream("IDEM_ADVISORIES").await.unwrap();
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
        letters, 1,
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

/// `dead_letter::ensure_stream` once only checked that some stream captures
/// a route's own dead-letter subject. An interest-retention stream with no
/// consumer acknowledges the publish and keeps nothing; the runtime took the
/// PubAck for "stored" and TERMed the original: gone, with no dead letter
/// anywhere. Now such a stream is refused at start-up.
#[tokio::test]
async fn a_dead_letter_stream_that_keeps_nothing_is_refused_at_startup() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
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
    let error = Router::new()
        .route(
            fast(Route::new(&stream, "c")).dead_letter_subject(format!("{dead_stream}.letters")),
            always_refuses,
        )
        .run_until(nats, pool, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(error, idem_runtime::Error::DeadLetterStreamRetention { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("interest retention"), "{error}");
}
