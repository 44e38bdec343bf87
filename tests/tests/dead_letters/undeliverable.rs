//! Messages no handler can take are dead-lettered, never parked: one JetStream
//! gave up on while no router ran, those of routes whose given-up watchers
//! once collided, headers the client cannot parse (not UTF-8, a bare CR), and
//! a message that is not a JetStream delivery.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use idem_runtime::{Delivery, Route, Router, dead_letter, idempotent};
use idem_tests::scenario::*;

/// JetStream stops redelivering a message (the workers that took it kept
/// dying) while no router runs. Its advisory is stored, so a router started
/// later still dead-letters the message: it is never silently parked.
#[tokio::test]
async fn a_message_jetstream_gave_up_on_while_no_router_ran_is_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("GIVENUP", Duration::from_secs(120)).await;
    // A first start creates the consumer (and whatever else idem needs).
    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats.clone(),
        pool.clone(),
    );
    eventually_get_stream(&js, dead_letter::DEFAULT_STREAM).await;
    stop(handle, task).await;

    publish(&js, &subject, &deposit("a", 1), Some("parked-1")).await;
    assert_eq!(exhaust_deliveries(&nats, &stream, "c").await, 4);

    let (handle, task) = spawn(
        Router::new().route(given_up_route(&stream), no_ids),
        nats,
        pool.clone(),
    );
    eventually(
        "the given-up message is dead-lettered",
        Duration::from_secs(30),
        || async { !dead_letters(&js, &stream).await.is_empty() },
    )
    .await;
    stop(handle, task).await;
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(header(&letters[0], "Idem-Failure"), "undeliverable");
    assert_eq!(header(&letters[0], "Idem-Original-Sequence"), "1");
    assert_eq!(ledger(&pool, "no-ids").await.effects, 0);
}

/// Something that is not a JetStream delivery reaches the route's pull
/// (here, a plain message published to the pull's reply inbox). It cannot
/// be deduplicated or redelivered, so it is dead-lettered, not dropped.
#[tokio::test]
async fn a_message_that_is_not_a_jetstream_delivery_is_dead_lettered() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("NOTJS", Duration::from_secs(120)).await;
    // The route's pull requests name the inbox its messages come to.
    let mut pulls = nats
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.c"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), no_ids),
        nats.clone(),
        pool.clone(),
    );
    let pull = tokio::time::timeout(Duration::from_secs(30), pulls.next())
        .await
        .expect("the route pulls")
        .unwrap();
    let inbox = pull.reply.expect("a pull request has a reply inbox");
    nats.publish(inbox, r#"{"account":"stray","amount":1}"#.into())
        .await
        .unwrap();
    nats.flush().await.unwrap();
    eventually(
        "the stray message is dead-lettered",
        Duration::from_secs(30),
        || async { handle.stats("c").unwrap().dead_lettered() == 1 },
    )
    .await;
    stop(handle, task).await;
    let letters = dead_letters_with_failure(&js, "not-a-jetstream-delivery").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(
        &letters[0].payload[..],
        br#"{"account":"stray","amount":1}"#
    );
    assert_eq!(ledger(&pool, "no-ids").await.effects, 0);
}

/// The dead letters with `Idem-Failure: failure`, from any stream.
async fn dead_letters_with_failure(
    js: &jetstream::Context,
    failure: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut dead = js.get_stream(dead_letter::DEFAULT_STREAM).await.unwrap();
    let last = dead.info().await.unwrap().state.last_sequence;
    let mut letters = Vec::new();
    for sequence in 1..=last {
        if let Ok(letter) = dead.get_raw_message(sequence).await
            && header(&letter, "Idem-Failure") == failure
        {
            letters.push(letter);
        }
    }
    letters
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

#[idempotent(name = "plain-too")]
async fn plain_too(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "plain-too", &d, delivery).await
}

// ---------------------------------------------------------------------------
// Two routes whose advisory consumers get the same name.
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

/// Publishes `payload` with a `Nats-Msg-Id` header that is not UTF-8, over a
/// raw connection: no NATS client library would send it.
async fn publish_non_utf8_header(nats_url: &str, subject: &str, payload: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = nats_url.trim_start_matches("nats://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut info = [0u8; 4096];
    let _ = socket.read(&mut info).await.unwrap();
    let header = b"NATS/1.0\r\nNats-Msg-Id: \xff\xfe-not-utf8\r\n\r\n";
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
        "the server took the raw publish"
    );
}

/// A header that is not UTF-8 never reaches the handler: the client drops
/// its connection on it, and every message delivered with it is redelivered
/// too. JetStream stops after the backstop limit, and the router
/// dead-letters what it gave up on, raw headers kept. Nothing is lost: the
/// good message is either processed or dead-lettered beside it and replayed.
#[tokio::test]
async fn a_header_that_is_not_utf8_is_dead_lettered_and_nothing_is_lost() {
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("NONUTF8", Duration::from_secs(120)).await;
    let poison = br#"{"account":"x","amount":1}"#;
    publish_non_utf8_header(env.nats_url(), &subject, poison).await;
    // No Nats-Msg-Id, so that a replay is not caught by JetStream's window.
    publish(&js, &subject, &deposit("a", 2), None).await;
    assert_eq!(
        js.get_stream(&stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        2,
        "both messages are stored"
    );

    // The poison drops the router's connection again and again; the checks
    // below use a connection of their own.
    let js = jetstream::new(env.nats().await);
    let route = Route::new(&stream, "c")
        .ack_wait(Duration::from_secs(1))
        .max_deliver(1);
    let (handle, task) = spawn(Router::new().route(route, plain), nats, pool.clone());
    let stats = handle.stats("c").unwrap();
    let letter_of = |letters: &[jetstream::message::StreamMessage], sequence: &str| {
        letters
            .iter()
            .find(|letter| header(letter, "Idem-Original-Sequence") == sequence)
            .cloned()
    };
    eventually(
        "the poison is dead-lettered, and the good message processed or dead-lettered",
        Duration::from_secs(60),
        || async {
            let letters = dead_letters(&js, &stream).await;
            letter_of(&letters, "1").is_some()
                && (stats.processed() == 1 || letter_of(&letters, "2").is_some())
        },
    )
    .await;

    let letters = dead_letters(&js, &stream).await;
    let letter = letter_of(&letters, "1").unwrap();
    assert_eq!(header(&letter, "Idem-Failure"), "undeliverable");
    assert_eq!(&letter.payload[..], poison);
    use base64::Engine;
    let original_headers = base64::engine::general_purpose::STANDARD
        .decode(header(&letter, "Idem-Original-Headers-Base64"))
        .unwrap();
    assert!(
        original_headers.windows(2).any(|pair| pair == b"\xff\xfe"),
        "the raw header block is kept"
    );
    // Its Nats-Msg-Id is not UTF-8, so the id it would have been
    // deduplicated by cannot be known: the dead letter says so, and a replay
    // is refused unless asked for.
    assert_eq!(header(&letter, "Idem-Message-Id"), "");
    assert_eq!(header(&letter, "Idem-Message-Id-Source"), "unknown");
    let refused = dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, letter.sequence).await;
    assert!(
        matches!(refused, Err(dead_letter::ReplayError::NoMessageId(_))),
        "{refused:?}"
    );
    if let Some(good) = letter_of(&letters, "2") {
        // Redelivered with the poison each time, it ran out of deliveries
        // too; it keeps its id, and replayed, it is processed.
        assert_eq!(
            header(&good, "Idem-Message-Id"),
            stream_position(&js, &stream, 2).await
        );
        dead_letter::replay(&js, dead_letter::DEFAULT_STREAM, good.sequence)
            .await
            .unwrap();
    }
    eventually(
        "the good message is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 1 },
    )
    .await;
    // Known never to have been processed, the poison is replayed under a
    // new id, without the header that made it undeliverable.
    dead_letter::replay_with(
        &js,
        dead_letter::DEFAULT_STREAM,
        letter.sequence,
        dead_letter::ReplayOptions::default().allow_new_message_id(),
    )
    .await
    .unwrap();
    eventually(
        "the replayed poison is processed",
        Duration::from_secs(30),
        || async { stats.processed() == 2 },
    )
    .await;
    stop(handle, task).await;
    assert_eq!(ledger(&pool, "plain").await, Ledger::once_each(2));
}
