//! A pool smaller than the routes' concurrency: messages that wait for a
//! connection get one in the order they asked, whichever route they are on,
//! and none waits while later ones are served, nor is its wait taken for a
//! database that stopped answering.

use std::collections::BTreeMap;
use std::time::Duration;

use idem_runtime::{Delivery, Route, Router, idempotent};
use idem_tests::scenario::*;
use sqlx::postgres::PgPoolOptions;

/// How long each handler holds its connection: long enough that 16
/// messages in flight contend for 10 connections all the time.
const HOLD: Duration = Duration::from_millis(50);

/// Records when it ran (the server's clock, right after the claim), then
/// holds its connection for [`HOLD`].
async fn run_and_hold(
    tx: &mut sqlx::PgTransaction<'_>,
    handler: &str,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO started (handler, seq) VALUES ($1, $2)")
        .bind(handler)
        .bind(d.amount)
        .execute(&mut **tx)
        .await?;
    record_effect(tx, handler, &d, delivery).await?;
    tokio::time::sleep(HOLD).await;
    Ok(())
}

#[idempotent(name = "fair.a")]
async fn route_a(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    run_and_hold(tx, "fair.a", delivery, d).await
}

#[idempotent(name = "fair.b")]
async fn route_b(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    run_and_hold(tx, "fair.b", delivery, d).await
}

/// For each handler, the longest time by which a message ran after a
/// message published after it on the same route had already run: how long,
/// at least, it waited while later ones were served. A route takes its
/// messages in stream order (one per free slot), so a message that runs
/// after a later one waited at least that long for its connection.
async fn longest_overtaken(pool: &sqlx::PgPool) -> BTreeMap<String, (Duration, i64)> {
    let rows: Vec<(String, i64, f64)> = sqlx::query_as(
        "SELECT handler, seq, extract(epoch FROM at)::float8 FROM started ORDER BY handler, seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut longest = BTreeMap::new();
    let mut by_handler: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::new();
    for (handler, seq, at) in rows {
        by_handler.entry(handler).or_default().push((seq, at));
    }
    for (handler, runs) in by_handler {
        // Walking back from the last message: the earliest run of any later one.
        let mut earliest_later = f64::INFINITY;
        let mut worst = (Duration::ZERO, -1);
        for &(seq, at) in runs.iter().rev() {
            let late = at - earliest_later;
            if late > worst.0.as_secs_f64() {
                worst = (Duration::from_secs_f64(late), seq);
            }
            earliest_later = earliest_later.min(at);
        }
        longest.insert(handler, worst);
    }
    longest
}

/// Two routes at 8 in flight on a pool of 10 connections, each with a
/// backlog that keeps it busy for several seconds. Before, each route kept
/// the connections it had for its own next messages, and the messages that
/// had found the pool empty waited in it until the other route's backlog
/// ran out (or for the pool's whole 30 s acquire timeout, under steady
/// load), while hundreds of later messages were served. Now no message is
/// overtaken by more than a moment, and both routes apply each message once.
#[tokio::test]
async fn messages_waiting_for_a_connection_are_served_in_arrival_order_across_routes() {
    /// Messages per route: about 4 s of work for the two routes together.
    const PER_ROUTE: i64 = 400;
    /// How long a message may run after a later one of its route; with
    /// arrival order it is at most about one handler's hold.
    const AT_MOST: Duration = Duration::from_secs(2);
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("FAIRA", Duration::from_secs(120)).await;
    let stream_b = unique_name("FAIRB");
    let subject_b = format!("{stream_b}.deposit");
    create_stream(&js, &stream_b, &subject_b, Duration::from_secs(120)).await;
    sqlx::raw_sql(
        "CREATE TABLE started (handler text NOT NULL, seq bigint NOT NULL,
                               at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&pool)
    .await
    .unwrap();
    for i in 0..PER_ROUTE {
        publish(&js, &subject, &deposit("a", i), Some(&format!("a-{i}"))).await;
        publish(&js, &subject_b, &deposit("b", i), Some(&format!("b-{i}"))).await;
    }
    let small = PgPoolOptions::new()
        .max_connections(10)
        .connect(env.database_url())
        .await
        .unwrap();
    let route = |stream: &str, durable: &str| {
        fast(Route::new(stream, durable))
            .per_message()
            .concurrency(8)
            .ack_wait(Duration::from_secs(60))
    };
    let router = Router::new()
        .route(route(&stream, "a"), route_a)
        .route(route(&stream_b, "b"), route_b);
    let (handle, task) = spawn(router, nats, small);
    wait_all_acked(&js, &stream, "a").await;
    wait_all_acked(&js, &stream_b, "b").await;
    stop(handle.clone(), task).await;

    let longest = longest_overtaken(&pool).await;
    println!("the longest a message ran after a later one of its route: {longest:?}");
    for (handler, (late, seq)) in &longest {
        assert!(
            *late <= AT_MOST,
            "{handler}: message {seq} ran {late:?} after a later message of its route had run"
        );
    }
    for handler in ["fair.a", "fair.b"] {
        assert_eq!(
            ledger(&pool, handler).await,
            Ledger::once_each(PER_ROUTE),
            "{handler}"
        );
    }
    for durable in ["a", "b"] {
        let stats = handle.stats(durable).unwrap();
        assert_eq!(
            (stats.failed(), stats.infrastructure_errors()),
            (0, 0),
            "{durable}: no message failed or waited out the pool's timeout"
        );
        // The runtime's own measure: from asking for a connection to
        // getting one.
        let waited = stats.longest_connection_wait();
        println!("{durable}: the longest wait for a connection {waited:?}");
        assert!(
            waited > Duration::ZERO && waited <= AT_MOST,
            "{durable}: messages waited for connections, never longer than {AT_MOST:?}: {waited:?}"
        );
    }
}

#[idempotent(name = "queued")]
async fn queued(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "queued", &d, delivery).await?;
    tokio::time::sleep(QUEUED_HOLD).await;
    Ok(())
}

/// How long each `queued` handler holds the one connection its messages
/// share: half its 2 s timeout, so that a slow BEGIN or INSERT on a loaded
/// machine does not time it out.
const QUEUED_HOLD: Duration = Duration::from_secs(1);

/// The watchdog gives a transaction three handler timeouts and 5 s (11 s at
/// a 2 s timeout) before it takes the database for gone and settles the
/// message as of unknown outcome. Waiting for a connection is not part of
/// the transaction: 16 messages in flight on one connection, each holding
/// it 1 s, make the last wait about 15 s for its turn, and none may be
/// abandoned, failed or retried for it.
#[tokio::test]
async fn a_message_that_waits_its_turn_for_a_connection_is_not_taken_for_a_silent_database() {
    const MESSAGES: i64 = 16;
    let handler_timeout = Duration::from_secs(2);
    let watchdog = handler_timeout * 3 + Duration::from_secs(5);
    let Scenario {
        env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("QUEUED", Duration::from_secs(120)).await;
    for i in 0..MESSAGES {
        publish(&js, &subject, &deposit("a", i), Some(&format!("q-{i}"))).await;
    }
    // Two connections: one for the router's metrics poll, one turn for
    // messages.
    let small = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(60))
        .connect(env.database_url())
        .await
        .unwrap();
    let route = fast(Route::new(&stream, "c"))
        .per_message()
        .concurrency(MESSAGES as usize)
        .handler_timeout(handler_timeout)
        .ack_wait(Duration::from_secs(60));
    let (handle, task) = spawn(Router::new().route(route, queued), nats, small);
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("c").unwrap();
    let waited = stats.longest_connection_wait();
    assert!(
        waited > watchdog,
        "a message waited longer than the watchdog for its connection ({waited:?}, watchdog {watchdog:?}); else this test shows nothing"
    );
    assert_eq!(
        (
            stats.abandoned_transactions(),
            stats.failed(),
            stats.commit_failed(),
            stats.infrastructure_errors()
        ),
        (0, 0, 0, 0),
        "no transaction abandoned, no message failed: {stats:?}"
    );
    assert_eq!(ledger(&pool, "queued").await, Ledger::once_each(MESSAGES));
    assert_eq!(stats.processed(), MESSAGES as u64, "{stats:?}");
}
