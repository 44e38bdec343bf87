//! Request/reply routes under production's ordinary accidents, against real
//! servers: a rolling rename of the handler (two versions answering one
//! subject), a retention shorter than the clients retry, a reply too large
//! for NATS, error reasons sent to any requester, and the retention a route
//! gets when it sets none. Each test checks that its accident happened.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_runtime::{
    Delivery, Error, Permanent, ReplyRoute, Router, RouterHandle, State, idempotent,
};
use idem_tests::scenario::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::task::JoinHandle;

/// What every handler here returns: `xact` is the transaction that ran the
/// body, so a second run never produces the same reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    account: String,
    amount: i64,
    xact: i64,
    /// `amount` bytes when the account is `big`, to make a large reply.
    pad: String,
}

/// Bodies run, per handler version.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicU32>);

impl Calls {
    fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The effect name both versions record under, so that one ledger counts
/// the effects of the route whatever version ran it.
const EFFECT: &str = "orders.place";

async fn body(
    tx: &mut sqlx::PgTransaction<'_>,
    calls: &Calls,
    delivery: &Delivery,
    d: Deposit,
) -> anyhow::Result<Receipt> {
    calls.0.fetch_add(1, Ordering::SeqCst);
    if d.account == "bob" {
        return Err(
            Permanent::new(format!("unknown account {} (secret detail)", d.account)).into(),
        );
    }
    record_effect(tx, EFFECT, &d, delivery).await?;
    let xact: i64 = sqlx::query_scalar("SELECT txid_current()")
        .fetch_one(&mut **tx)
        .await?;
    let pad = if d.account == "big" {
        "x".repeat(usize::try_from(d.amount).unwrap())
    } else {
        String::new()
    };
    Ok(Receipt {
        account: d.account,
        amount: d.amount,
        xact,
        pad,
    })
}

/// Version 1 of the handler.
#[idempotent(name = "orders.place.v1")]
async fn place_v1(
    tx: &mut sqlx::PgTransaction<'_>,
    State(calls): State<Calls>,
    delivery: &Delivery,
    d: Deposit,
) -> anyhow::Result<Receipt> {
    body(tx, &calls, delivery, d).await
}

/// Version 2: the same body under a new name, as a rolling deploy ships it.
#[idempotent(name = "orders.place.v2")]
async fn place_v2(
    tx: &mut sqlx::PgTransaction<'_>,
    State(calls): State<Calls>,
    delivery: &Delivery,
    d: Deposit,
) -> anyhow::Result<Receipt> {
    body(tx, &calls, delivery, d).await
}

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.to_owned(),
        amount,
    }
}

/// Servers, the tables, and a subject for the route.
struct Env {
    _env: idem_tests::TestEnv,
    pool: PgPool,
    nats: async_nats::Client,
    subject: String,
}

async fn env() -> Env {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    let nats = env.nats().await;
    let subject = unique_name("orders").replace('_', ".");
    Env {
        _env: env,
        pool,
        nats,
        subject,
    }
}

/// A router running in the background, with its calls counter.
struct Running {
    calls: Calls,
    handle: RouterHandle,
    task: JoinHandle<Result<(), Error>>,
}

fn run_v1(e: &Env, route: ReplyRoute) -> Running {
    let calls = Calls::default();
    let router = Router::with_state(calls.clone()).reply_route(route, place_v1);
    let (handle, task) = spawn(router, e.nats.clone(), e.pool.clone());
    Running {
        calls,
        handle,
        task,
    }
}

fn run_v2(e: &Env, route: ReplyRoute) -> Running {
    let calls = Calls::default();
    let router = Router::with_state(calls.clone()).reply_route(route, place_v2);
    let (handle, task) = spawn(router, e.nats.clone(), e.pool.clone());
    Running {
        calls,
        handle,
        task,
    }
}

/// Waits until every router in `routers` has taken a request on the
/// subject: requests without a message id, refused before anything runs,
/// until each has counted one.
async fn wait_serving(e: &Env, routers: &[&Running]) {
    eventually(
        "every router has taken a request",
        Duration::from_secs(30),
        async || {
            let _ = tokio::time::timeout(
                Duration::from_millis(500),
                e.nats.request(e.subject.clone(), Bytes::new()),
            )
            .await;
            routers.iter().all(|running| {
                running
                    .handle
                    .stats(&e.subject)
                    .is_some_and(|stats| stats.received() > 0)
            })
        },
    )
    .await;
}

/// Sends `d` with `id` as its `Nats-Msg-Id`; the reply, or `None` if none
/// came within `wait`.
async fn request(e: &Env, id: &str, d: &Deposit, wait: Duration) -> Option<async_nats::Message> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    let payload = Bytes::from(serde_json::to_vec(d).unwrap());
    match tokio::time::timeout(
        wait,
        e.nats
            .request_with_headers(e.subject.clone(), headers, payload),
    )
    .await
    {
        Ok(Ok(reply)) => Some(reply),
        Ok(Err(error)) if error.kind() == async_nats::RequestErrorKind::TimedOut => None,
        Ok(Err(error)) => panic!("the request fails: {error}"),
        Err(_) => None,
    }
}

async fn ask(e: &Env, id: &str, d: &Deposit) -> async_nats::Message {
    request(e, id, d, Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("no reply to {id} within 10 s"))
}

fn header<'m>(reply: &'m async_nats::Message, name: &str) -> Option<&'m str> {
    reply
        .headers
        .as_ref()
        .and_then(|headers| headers.get(name))
        .map(|value| value.as_str())
}

fn receipt(reply: &async_nats::Message) -> Receipt {
    assert_eq!(header(reply, "Idem-Error"), None, "{reply:?}");
    serde_json::from_slice(&reply.payload).expect("the reply is the JSON receipt")
}

/// Effect rows per message id, of every version.
async fn effects(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT message_id, count(*) FROM effects WHERE handler = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(EFFECT)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Claims, of any handler name.
async fn claims(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_processed")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The router's start-up error, which must come within 10 s.
async fn refused(running: Running) -> Error {
    match tokio::time::timeout(Duration::from_secs(10), running.task).await {
        Ok(ended) => ended
            .expect("the router task does not panic")
            .expect_err("the router refuses to start"),
        Err(_) => {
            running.handle.shutdown();
            panic!("the router started instead of refusing");
        }
    }
}

// --- A rolling rename (finding 8) ------------------------------------------

#[tokio::test]
async fn two_versions_of_a_handler_on_one_subject_run_each_request_once() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    let v2 = run_v2(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1, &v2]).await;

    let mut first = Vec::new();
    for n in 0..20 {
        first.push(ask(&e, &format!("order-{n}"), &deposit("alice", n)).await);
    }
    // Every client retries once, with the same id.
    let mut other_replies = Vec::new();
    for (n, reply) in first.iter().enumerate() {
        assert_eq!(receipt(reply).amount, n as i64);
        let again = ask(&e, &format!("order-{n}"), &deposit("alice", n as i64)).await;
        if again.payload != reply.payload {
            other_replies.push(n);
        }
    }

    let ran = (v1.calls.get(), v2.calls.get());
    stop(v1.handle, v1.task).await;
    stop(v2.handle, v2.task).await;
    let applied = effects(&e.pool).await;
    let claimed = claims(&e.pool).await;
    assert!(
        applied.len() == 20 && applied.iter().all(|(_, count)| *count == 1),
        "each request applied once, not once per version: {} effects for {} requests, {claimed} claims, {ran:?} bodies run (v1, v2): {applied:?}",
        applied.iter().map(|(_, count)| count).sum::<i64>(),
        applied.len()
    );
    assert_eq!(ran.0 + ran.1, 20, "one body per request (v1, v2) = {ran:?}");
    assert_eq!(claimed, 20, "one claim per request");
    assert_eq!(
        other_replies,
        Vec::<usize>::new(),
        "every retry got its first reply"
    );
    // The overlap was real: both versions answered requests.
    assert!(ran.0 > 0 && ran.1 > 0, "both versions served: {ran:?}");
}

#[tokio::test]
async fn a_retry_that_lands_on_the_renamed_handler_gets_the_first_reply() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let first = ask(&e, "order-42", &deposit("alice", 42)).await;
    assert_eq!(receipt(&first).amount, 42);
    stop(v1.handle, v1.task).await;

    // The deploy replaced v1 by v2; the client's retry (it never saw the
    // reply, say) now reaches v2.
    let v2 = run_v2(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v2]).await;
    let retry = ask(&e, "order-42", &deposit("alice", 42)).await;
    let v2_ran = v2.calls.get();
    stop(v2.handle, v2.task).await;

    assert_eq!(
        retry.payload, first.payload,
        "the retry gets v1's reply, byte for byte"
    );
    assert_eq!(v2_ran, 0, "v2 did not run the request again");
    assert_eq!(effects(&e.pool).await, [("order-42".to_owned(), 1)]);
}

#[tokio::test]
async fn two_reply_routes_of_one_router_on_overlapping_subjects_are_refused() {
    let e = env().await;
    let calls = Calls::default();
    let router = Router::with_state(calls)
        .reply_route(ReplyRoute::new(format!("{}.eu", e.subject)), place_v1)
        .reply_route(ReplyRoute::new(format!("{}.*", e.subject)), place_v2);
    let (handle, task) = spawn(router, e.nats.clone(), e.pool.clone());
    let error = refused(Running {
        calls: Calls::default(),
        handle,
        task,
    })
    .await;
    let text = error.to_string();
    assert!(
        matches!(error, Error::Config { .. }) && text.contains("overlap"),
        "{text}"
    );
}

// --- Retention (finding 9, item 12) -----------------------------------------

#[tokio::test]
async fn a_reply_retention_below_its_floor_is_refused_at_start_up() {
    let e = env().await;
    let running = run_v1(
        &e,
        ReplyRoute::new(&e.subject).retention(Duration::from_secs(10)),
    );
    let error = refused(running).await;
    let text = error.to_string();
    // The default horizon (1 h) plus 3 × the default handler timeout (30 s).
    assert!(
        matches!(&error, Error::RetentionBelowFloor { floor, .. } if *floor == Duration::from_secs(3690)),
        "{text}"
    );
    assert!(
        text.contains("ReplyRoute::retention") && text.contains("ReplyRoute::client_retry_horizon"),
        "{text}"
    );
    let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_handlers")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(registered, 0, "a refused route registers no retention");
}

#[tokio::test]
async fn a_reply_route_without_a_retention_keeps_its_claims_a_day() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let registered: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT name, (extract(epoch FROM retention))::bigint FROM idem_handlers")
            .fetch_all(&e.pool)
            .await
            .unwrap();
    stop(v1.handle, v1.task).await;
    assert_eq!(registered.len(), 1, "{registered:?}");
    assert_eq!(
        registered[0].1,
        Some(86_400),
        "a finite default retention: {registered:?}"
    );
}

// --- Replies too large for NATS (item 12) ---------------------------------

/// Over the 1 MiB `max_payload` of the test server.
const TOO_BIG: i64 = 1_200_000;

#[tokio::test]
async fn a_reply_larger_than_max_payload_is_refused_before_commit() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let max_payload = e.nats.server_info().max_payload;
    assert!((TOO_BIG as usize) > max_payload, "{max_payload}");

    let big = request(
        &e,
        "big-1",
        &deposit("big", TOO_BIG),
        Duration::from_secs(10),
    )
    .await;
    let after = ask(&e, "small-1", &deposit("alice", 1)).await;
    let ran = v1.calls.get();
    stop(v1.handle, v1.task).await;

    let applied = effects(&e.pool).await;
    let claimed = claims(&e.pool).await;
    let big = big.unwrap_or_else(|| {
        panic!("the client gets an answer, not a timeout (effects {applied:?}, {claimed} claims)")
    });
    assert_eq!(header(&big, "Idem-Error"), Some("permanent"), "{big:?}");
    assert_eq!(
        header(&big, "Idem-Reason"),
        Some("reply-too-large"),
        "{big:?}"
    );
    assert_eq!(ran, 2, "the body ran (and was rolled back), then the next");
    assert_eq!(
        applied,
        [("small-1".to_owned(), 1)],
        "nothing of the big one committed"
    );
    assert_eq!(claimed, 1, "no claim kept for it");
    assert_eq!(receipt(&after).amount, 1, "the route goes on");
}

#[tokio::test]
async fn a_stored_reply_too_large_to_send_is_answered_with_an_error() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let first = ask(&e, "order-s", &deposit("alice", 3)).await;
    assert_eq!(receipt(&first).amount, 3);
    // A reply stored when it still fitted (a server with a larger
    // max_payload, an older idem): make the stored one too large.
    let updated = sqlx::query("UPDATE idem_claims SET result = $1")
        .bind(vec![b'x'; TOO_BIG as usize])
        .execute(&e.pool)
        .await
        .unwrap()
        .rows_affected();
    assert!(updated >= 1, "the claim holds the stored reply");

    let retry = request(&e, "order-s", &deposit("alice", 3), Duration::from_secs(10)).await;
    let ran = v1.calls.get();
    stop(v1.handle, v1.task).await;
    let retry = retry
        .unwrap_or_else(|| panic!("the client gets an answer, not a timeout ({ran} bodies run)"));
    assert_eq!(header(&retry, "Idem-Error"), Some("permanent"), "{retry:?}");
    assert_eq!(
        header(&retry, "Idem-Reason"),
        Some("reply-too-large"),
        "{retry:?}"
    );
    assert!(retry.payload.is_empty());
    assert_eq!(ran, 1, "the retry did not run the body");
    assert_eq!(effects(&e.pool).await, [("order-s".to_owned(), 1)]);
}

// --- Idem-Reason (item 12) ---------------------------------------------------

#[tokio::test]
async fn idem_reason_is_a_short_class_by_default() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let refused = ask(&e, "order-b", &deposit("bob", 5)).await;
    let no_id = tokio::time::timeout(
        Duration::from_secs(10),
        e.nats.request(
            e.subject.clone(),
            Bytes::from(serde_json::to_vec(&deposit("alice", 1)).unwrap()),
        ),
    )
    .await
    .expect("a reply")
    .unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, "garbage-1");
    let garbage = e
        .nats
        .request_with_headers(e.subject.clone(), headers, Bytes::from_static(b"\xff{"))
        .await
        .unwrap();
    stop(v1.handle, v1.task).await;

    assert_eq!(header(&refused, "Idem-Error"), Some("permanent"));
    assert_eq!(
        header(&refused, "Idem-Reason"),
        Some("handler-error"),
        "the handler's error text is not sent: {refused:?}"
    );
    assert_eq!(header(&no_id, "Idem-Reason"), Some("no-message-id"));
    assert_eq!(header(&garbage, "Idem-Reason"), Some("undecodable"));
}

// --- Retries in any order (blind spot) ----------------------------------------

#[tokio::test]
async fn an_earlier_id_retried_after_a_later_one_gets_its_own_reply() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    let a = ask(&e, "order-a", &deposit("alice", 1)).await;
    let b = ask(&e, "order-b2", &deposit("alice", 2)).await;
    let a_again = ask(&e, "order-a", &deposit("alice", 1)).await;
    let b_again = ask(&e, "order-b2", &deposit("alice", 2)).await;
    let ran = v1.calls.get();
    stop(v1.handle, v1.task).await;

    assert_ne!(a.payload, b.payload);
    assert_eq!(a_again.payload, a.payload, "A's reply, byte for byte");
    assert_eq!(b_again.payload, b.payload, "B's reply, byte for byte");
    assert_eq!((receipt(&a).amount, receipt(&b).amount), (1, 2));
    assert_eq!(ran, 2, "each body ran once");
    assert_eq!(
        effects(&e.pool).await,
        [("order-a".to_owned(), 1), ("order-b2".to_owned(), 1)]
    );
}

#[tokio::test]
async fn idem_reason_carries_the_error_text_only_on_a_route_that_asks() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject).detailed_reasons());
    wait_serving(&e, &[&v1]).await;
    let refused = ask(&e, "order-b", &deposit("bob", 5)).await;
    stop(v1.handle, v1.task).await;
    assert_eq!(header(&refused, "Idem-Error"), Some("permanent"));
    assert_eq!(
        header(&refused, "Idem-Reason"),
        Some("handler-error: the handler failed: unknown account bob (secret detail)"),
        "the class, then the text"
    );
}

// --- Retention and the client-retry horizon (finding 9) ----------------------

#[tokio::test]
async fn a_retry_within_the_horizon_gets_the_stored_reply_and_one_after_the_retention_runs_again() {
    let e = env().await;
    // Floor: horizon 1 s + 3 × handler timeout 1 s = 4 s.
    let route = ReplyRoute::new(&e.subject)
        .client_retry_horizon(Duration::from_secs(1))
        .handler_timeout(Duration::from_secs(1))
        .retention(Duration::from_secs(4));
    assert_eq!(
        route.retention_floor().value(),
        Some(Duration::from_secs(4))
    );
    let claims_under = route.dedup_name();
    let v1 = run_v1(&e, route);
    wait_serving(&e, &[&v1]).await;

    let sent = std::time::Instant::now();
    let first = ask(&e, "order-h", &deposit("alice", 7)).await;
    // Three retries, 200 ms apart: within the horizon on a quiet machine,
    // and in any case within the retention, which is what keeps the claim
    // (a slow machine may stretch them past the 1 s horizon, never past
    // the 4 s retention without this failing).
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let retry = ask(&e, "order-h", &deposit("alice", 7)).await;
        assert_eq!(
            retry.payload, first.payload,
            "within the horizon: the stored reply"
        );
    }
    let retried_within = sent.elapsed();
    assert!(
        retried_within < Duration::from_secs(4),
        "the retries came within the retention: {retried_within:?}"
    );
    assert_eq!(v1.calls.get(), 1, "within the horizon the body ran once");

    // The purge beside the router drops the claim, a retention or more after
    // it was made.
    let key_rows = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idem_claims WHERE key = idem_key($1, 'order-h')")
            .bind(&claims_under)
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    assert!(key_rows().await > 0, "the claim is under the route's name");
    eventually("the claims expire", Duration::from_secs(60), async || {
        key_rows().await == 0
    })
    .await;
    let expired_after = sent.elapsed();
    assert!(
        expired_after >= Duration::from_secs(4),
        "kept at least the retention: {expired_after:?}"
    );

    // Past the retention the id is new again: the documented behaviour.
    let late = ask(&e, "order-h", &deposit("alice", 7)).await;
    let ran = v1.calls.get();
    stop(v1.handle, v1.task).await;
    assert_ne!(
        receipt(&late).xact,
        receipt(&first).xact,
        "a retry after the retention runs again"
    );
    assert_eq!(ran, 2);
    assert_eq!(effects(&e.pool).await, [("order-h".to_owned(), 2)]);
}

#[tokio::test]
async fn keep_forever_registers_no_retention() {
    let e = env().await;
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject).keep_forever());
    wait_serving(&e, &[&v1]).await;
    let registered: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT name, (extract(epoch FROM retention))::bigint FROM idem_handlers")
            .fetch_all(&e.pool)
            .await
            .unwrap();
    stop(v1.handle, v1.task).await;
    assert_eq!(registered, [(format!("reply:{}", e.subject), None)]);
}

// --- The upgrade: claims keyed by the handler's name before -------------------

/// Log lines written while it is the default subscriber of the test's
/// thread (a `#[tokio::test]` runs every task on it).
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test]
async fn claims_an_earlier_version_keyed_by_the_handler_name_are_warned_about() {
    let e = env().await;
    // What an earlier idem registered for this reply route.
    sqlx::query("INSERT INTO idem_handlers (name) VALUES ('orders.place.v1')")
        .execute(&e.pool)
        .await
        .unwrap();
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let v1 = run_v1(&e, ReplyRoute::new(&e.subject));
    wait_serving(&e, &[&v1]).await;
    stop(v1.handle, v1.task).await;
    let logs = captured.text();
    assert!(
        logs.contains("the handler name `orders.place.v1` is registered in idem_handlers")
            && logs.contains(&format!("keys them under `reply:{}`", e.subject)),
        "{logs}"
    );

    // A route that has never run under the handler's name is not warned.
    let fresh = env().await;
    let quiet = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let quiet = quiet.clone();
            move || quiet.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let v1 = run_v1(&fresh, ReplyRoute::new(&fresh.subject));
    wait_serving(&fresh, &[&v1]).await;
    stop(v1.handle, v1.task).await;
    assert!(
        !quiet.text().contains("is registered in idem_handlers"),
        "{}",
        quiet.text()
    );
}
