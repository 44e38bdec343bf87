//! Stored results and request/reply routes, against real servers.
//!
//! A handler that returns a value has it stored with its claim, in the same
//! transaction. On a JetStream route a duplicate never runs the body, and
//! the stored value stays the first one. On a request/reply route the value
//! is the reply, and a retried request (same `Nats-Msg-Id`) gets the first
//! reply again, byte for byte, with one effect: also when the retry arrives
//! while the first attempt still runs, or when the first reply was lost.
//! Each test checks that its fault happened.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_runtime::fault::{AfterCommit, FaultHooks};
use idem_runtime::{Delivery, Permanent, ReplyRoute, Route, Router, State, idempotent};
use idem_tests::scenario::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::Notify;

/// What the handlers return: `xact` is the id of the transaction that ran
/// the body, so a second run could never produce the same receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    account: String,
    amount: i64,
    xact: i64,
}

async fn receipt_of(
    tx: &mut sqlx::PgTransaction<'_>,
    deposit: &Deposit,
) -> Result<Receipt, sqlx::Error> {
    let xact: i64 = sqlx::query_scalar("SELECT txid_current()")
        .fetch_one(&mut **tx)
        .await?;
    Ok(Receipt {
        account: deposit.account.clone(),
        amount: deposit.amount,
        xact,
    })
}

fn deposit(account: &str, amount: i64) -> Deposit {
    Deposit {
        account: account.to_owned(),
        amount,
    }
}

/// The result column of every claim of `handler`'s message `message_id`
/// (two rows while a generation transition is under way).
async fn stored_rows(pool: &PgPool, handler: &str, message_id: &str) -> Vec<Option<Vec<u8>>> {
    sqlx::query_scalar("SELECT result FROM idem_claims WHERE key = idem_key($1, $2)")
        .bind(handler)
        .bind(message_id)
        .fetch_all(pool)
        .await
        .expect("claims are read")
}

// --- (a) A JetStream route ------------------------------------------------

#[idempotent(name = "stored.deposit.v1")]
async fn deposit_with_receipt(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<Receipt, sqlx::Error> {
    record_effect(tx, deposit_with_receipt::NAME, &d, delivery).await?;
    receipt_of(tx, &d).await
}

#[tokio::test]
async fn a_jetstream_duplicate_runs_once_and_keeps_the_first_stored_result() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("STORED", Duration::from_millis(300)).await;
    let handler = deposit_with_receipt::NAME;

    let router = Router::new().route(Route::new(&stream, "stored"), deposit_with_receipt);
    let (handle, task) = spawn(router, nats, pool.clone());
    let first = publish(&js, &subject, &deposit("alice", 10), Some("payment-1")).await;
    wait_all_acked(&js, &stream, "stored").await;
    let stored_first = idem_runtime::results::stored(&pool, handler, "payment-1")
        .await
        .expect("the stored result is read")
        .expect("a value handler stores its result");
    let receipt: Receipt = serde_json::from_slice(&stored_first).expect("it is the JSON receipt");
    assert_eq!((receipt.account.as_str(), receipt.amount), ("alice", 10));

    // The publisher's retry after JetStream's window: stored again, so the
    // consumer sees the same id twice.
    let mut retry = publish(&js, &subject, &deposit("alice", 10), Some("payment-1")).await;
    while retry.duplicate {
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = publish(&js, &subject, &deposit("alice", 10), Some("payment-1")).await;
    }
    assert_eq!(
        (first.sequence, retry.sequence),
        (1, 2),
        "the same id is stored twice"
    );
    wait_all_acked(&js, &stream, "stored").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("stored").unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
    assert_eq!(ledger(&pool, handler).await, Ledger::once_each(1));
    let stored_after = idem_runtime::results::stored(&pool, handler, "payment-1")
        .await
        .unwrap();
    assert_eq!(
        stored_after.as_ref(),
        Some(&stored_first),
        "the first result stays"
    );
    let rows = stored_rows(&pool, handler, "payment-1").await;
    assert!(!rows.is_empty());
    for row in rows {
        assert_eq!(
            row.as_deref(),
            Some(&stored_first[..]),
            "every claim row holds it"
        );
    }
}

/// When `slow_receipt`'s last call began.
static SLOW_RECEIPT_STARTED: std::sync::Mutex<Option<std::time::Instant>> =
    std::sync::Mutex::new(None);

#[idempotent(name = "stored.slow.v1")]
async fn slow_receipt(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<Receipt, sqlx::Error> {
    *SLOW_RECEIPT_STARTED.lock().unwrap() = Some(std::time::Instant::now());
    record_effect(tx, slow_receipt::NAME, &d, delivery).await?;
    tokio::time::sleep(SLOW_RECEIPT_HOLD).await;
    receipt_of(tx, &d).await
}

/// How long `slow_receipt` takes of its 4 s handler timeout.
const SLOW_RECEIPT_HOLD: Duration = Duration::from_secs(3);

/// Storing what a handler returned counts within its handler timeout, as
/// the retention floor and the watchdog assume (a claiming transaction runs
/// at most the claim's wait, one handler timeout and COMMIT): a handler that
/// takes 3 s of its 4 s, and whose result's UPDATE then hangs (a trigger on
/// the claims table sleeps), fails at its deadline, 4 s after it began, not
/// a statement timeout after the UPDATE began (7 s). Once the trigger is
/// gone, a retry applies the message once and stores its result.
#[tokio::test]
async fn storing_a_result_counts_within_the_handler_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(4);
    let logs = idem_tests::capture_logs();
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("SLOWRESULT", Duration::from_secs(120)).await;
    let handler = slow_receipt::NAME;
    let route = || {
        fast(Route::new(&stream, "c"))
            .per_message()
            .handler_timeout(TIMEOUT)
            .ack_wait(Duration::from_secs(60))
    };
    // On the claims table, and so on each of its partitions.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_result() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$;
         CREATE TRIGGER slow_result BEFORE UPDATE ON idem_claims
           FOR EACH ROW EXECUTE FUNCTION slow_result();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (handle, task) = spawn(
        Router::new().route(route(), slow_receipt),
        nats.clone(),
        pool.clone(),
    );

    publish(&js, &subject, &deposit("slow", 1), Some("slow-1")).await;
    // It happened: the result's UPDATE sleeps in the trigger.
    eventually(
        "the result's UPDATE hangs in the trigger",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event = 'PgSleep'
                    AND query LIKE 'UPDATE idem_claims SET result%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
    let stats = handle.stats("c").unwrap();
    eventually(
        "the message fails at its deadline",
        Duration::from_secs(30),
        || async { stats.failed() >= 1 },
    )
    .await;
    let started = SLOW_RECEIPT_STARTED
        .lock()
        .unwrap()
        .expect("the handler ran");
    let failed_after = started.elapsed();
    eprintln!("the handler began {failed_after:?} before its message failed");
    assert!(
        failed_after < TIMEOUT + Duration::from_secs(2),
        "failed {failed_after:?} after the handler began: past its {TIMEOUT:?} deadline by a statement timeout"
    );
    // The warning follows the count of the failure that was waited for.
    eventually(
        "the message failed as a handler that timed out",
        Duration::from_secs(10),
        async || !logs.matching(&["did not finish within 4s"]).is_empty(),
    )
    .await;

    sqlx::raw_sql("DROP TRIGGER slow_result ON idem_claims")
        .execute(&pool)
        .await
        .unwrap();
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    assert_eq!(ledger(&pool, handler).await, Ledger::once_each(1));
    let stored = idem_runtime::results::stored(&pool, handler, "slow-1")
        .await
        .expect("the stored result is read")
        .expect("the retry stored its result");
    let receipt: Receipt = serde_json::from_slice(&stored).expect("it is the JSON receipt");
    assert_eq!((receipt.account.as_str(), receipt.amount), ("slow", 1));
}

#[tokio::test]
async fn on_a_batch_route_each_message_stores_its_own_result() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("STOREDB", Duration::from_secs(120)).await;
    let handler = deposit_with_receipt::NAME;
    for n in 0..12 {
        publish(
            &js,
            &subject,
            &deposit(&format!("acct-{n}"), n),
            Some(&format!("d-{n}")),
        )
        .await;
    }
    let router = Router::new().route(
        Route::new(&stream, "stored-batch").batch(8),
        deposit_with_receipt,
    );
    let (handle, task) = spawn(router, nats, pool.clone());
    wait_all_acked(&js, &stream, "stored-batch").await;
    stop(handle.clone(), task).await;

    let stats = handle.stats("stored-batch").unwrap();
    assert!(
        stats.largest_batch() > 1,
        "the messages were claimed in batches"
    );
    assert_eq!(ledger(&pool, handler).await, Ledger::once_each(12));
    for n in 0..12 {
        let stored = idem_runtime::results::stored(&pool, handler, &format!("d-{n}"))
            .await
            .unwrap()
            .expect("each message stored its result");
        let receipt: Receipt = serde_json::from_slice(&stored).unwrap();
        assert_eq!(
            (receipt.account, receipt.amount),
            (format!("acct-{n}"), n),
            "message d-{n} stored its own result"
        );
    }
}

// --- Request/reply ---------------------------------------------------------

/// What the request handler shares with its test.
#[derive(Clone, Default)]
struct Orders {
    /// Bodies run.
    calls: Arc<AtomicU32>,
    /// While set, the body waits for `release` after its write.
    hold: Arc<AtomicBool>,
    started: Arc<Notify>,
    release: Arc<Notify>,
    /// The backend of the body that holds.
    backend: Arc<AtomicI32>,
}

const PLACE: &str = "orders.place.v1";

/// Places an order for a known account; an unknown account is a permanent
/// failure, an amount of 13 panics.
#[idempotent(name = "orders.place.v1")]
async fn place(
    tx: &mut sqlx::PgTransaction<'_>,
    State(orders): State<Orders>,
    delivery: &Delivery,
    d: Deposit,
) -> anyhow::Result<Receipt> {
    orders.calls.fetch_add(1, Ordering::SeqCst);
    let known: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM accounts WHERE id = $1)")
        .bind(&d.account)
        .fetch_one(&mut **tx)
        .await?;
    if !known {
        return Err(Permanent::new(format!("unknown account {}", d.account)).into());
    }
    assert_ne!(d.amount, 13, "unlucky amount");
    record_effect(tx, PLACE, &d, delivery).await?;
    if orders.hold.load(Ordering::SeqCst) {
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut **tx)
            .await?;
        orders.backend.store(backend, Ordering::SeqCst);
        orders.started.notify_one();
        orders.release.notified().await;
    }
    Ok(receipt_of(tx, &d).await?)
}

/// What the database holds for the request route of `s`: the effects its
/// handler recorded, and the claims under the route's name (a reply route's
/// claims are keyed by its name, not its handler's).
async fn reply_ledger(s: &Service) -> Ledger {
    let effects = ledger(&s.pool, PLACE).await;
    let claims = ledger(&s.pool, &s.claims_under).await;
    Ledger {
        dedup_rows: claims.dedup_rows,
        ..effects
    }
}

struct Service {
    _env: idem_tests::TestEnv,
    pool: PgPool,
    nats: async_nats::Client,
    subject: String,
    /// What the route's claims are keyed under.
    claims_under: String,
    orders: Orders,
    handle: idem_runtime::RouterHandle,
    task: tokio::task::JoinHandle<Result<(), idem_runtime::Error>>,
}

/// Servers, the tables, an account `alice`, and a router answering
/// `<subject>` with `place`, ready for requests.
async fn service(faults: FaultHooks) -> Service {
    let env = idem_tests::TestEnv::start().await;
    let pool = env.pool().await;
    prepare_database(&pool).await;
    sqlx::raw_sql(
        "CREATE TABLE accounts (id text PRIMARY KEY); INSERT INTO accounts VALUES ('alice')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let nats = env.nats().await;
    let subject = unique_name("orders").replace('_', ".");
    let orders = Orders::default();
    // The error text in Idem-Reason, so that each failure can be told apart.
    let route = ReplyRoute::new(&subject)
        .handler_timeout(Duration::from_secs(20))
        .detailed_reasons();
    let claims_under = route.dedup_name();
    let router = Router::with_state(orders.clone())
        .reply_route(route, place)
        .fault_hooks(faults);
    let (handle, task) = spawn(router, nats.clone(), pool.clone());
    // Ready once a request gets an answer (one without an id: refused).
    eventually(
        "the request route answers",
        Duration::from_secs(30),
        async || {
            matches!(
                tokio::time::timeout(
                    Duration::from_secs(1),
                    nats.request(subject.clone(), Bytes::new())
                )
                .await,
                Ok(Ok(_))
            )
        },
    )
    .await;
    Service {
        _env: env,
        pool,
        nats,
        subject,
        claims_under,
        orders,
        handle,
        task,
    }
}

/// Sends `d` as a request with `id` as its `Nats-Msg-Id` (if any), and
/// returns the reply, or `None` if none came within `wait`.
/// Asks `s` with message id `id`, and expects a reply within 10 s.
async fn ask(s: &Service, id: &str, d: &Deposit) -> async_nats::Message {
    request(&s.nats, &s.subject, Some(id), d, Duration::from_secs(10))
        .await
        .expect("a reply")
}

async fn request(
    nats: &async_nats::Client,
    subject: &str,
    id: Option<&str>,
    d: &Deposit,
    wait: Duration,
) -> Option<async_nats::Message> {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    let payload = Bytes::from(serde_json::to_vec(d).unwrap());
    match tokio::time::timeout(
        wait,
        nats.request_with_headers(subject.to_owned(), headers, payload),
    )
    .await
    {
        Ok(reply) => Some(reply.expect("the request gets a reply")),
        Err(_) => None,
    }
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

#[tokio::test]
async fn a_retried_request_gets_the_first_reply_and_applies_once() {
    let s = service(FaultHooks::default()).await;
    let order = deposit("alice", 25);

    let first = ask(&s, "order-1", &order).await;
    let second = ask(&s, "order-1", &order).await;
    let other = ask(&s, "order-2", &order).await;

    assert_eq!(
        first.payload, second.payload,
        "the retry gets the first reply, byte for byte"
    );
    assert_eq!(first.headers, second.headers);
    assert_eq!(receipt(&first).amount, 25);
    assert_ne!(
        receipt(&other).xact,
        receipt(&first).xact,
        "another id is another request"
    );
    assert_eq!(
        s.orders.calls.load(Ordering::SeqCst),
        2,
        "the body ran once per id"
    );
    assert_eq!(reply_ledger(&s).await, Ledger::once_each(2));
    let stored = stored_rows(&s.pool, &s.claims_under, "order-1").await;
    assert!(
        stored
            .iter()
            .all(|row| row.as_deref() == Some(&first.payload[..]))
    );
    stop(s.handle.clone(), s.task).await;
    let stats = s.handle.stats(&s.subject).unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (2, 1));
}

#[tokio::test]
async fn a_retry_while_the_first_attempt_runs_waits_on_its_claim_then_gets_its_reply() {
    let s = service(FaultHooks::default()).await;
    let order = deposit("alice", 40);
    s.orders.hold.store(true, Ordering::SeqCst);

    let first = tokio::spawn({
        let (nats, subject, order) = (s.nats.clone(), s.subject.clone(), order.clone());
        async move {
            request(
                &nats,
                &subject,
                Some("order-7"),
                &order,
                Duration::from_secs(30),
            )
            .await
        }
    });
    tokio::time::timeout(Duration::from_secs(10), s.orders.started.notified())
        .await
        .expect("the first attempt holds inside its transaction");
    let holder = s.orders.backend.load(Ordering::SeqCst);
    let second = tokio::spawn({
        let (nats, subject, order) = (s.nats.clone(), s.subject.clone(), order.clone());
        async move {
            request(
                &nats,
                &subject,
                Some("order-7"),
                &order,
                Duration::from_secs(30),
            )
            .await
        }
    });
    // The fault: the retry's claim is really waiting on the first attempt's.
    eventually(
        "the retry's claim waits on the first attempt's",
        Duration::from_secs(10),
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))",
            )
            .bind(holder)
            .fetch_one(&s.pool)
            .await
            .unwrap();
            waiting > 0
        },
    )
    .await;
    s.orders.hold.store(false, Ordering::SeqCst);
    s.orders.release.notify_one();

    let first = first.await.unwrap().expect("the first attempt replies");
    let second = second.await.unwrap().expect("the retry replies");
    assert_eq!(
        first.payload, second.payload,
        "both get the first attempt's reply"
    );
    assert_eq!(receipt(&second).amount, 40);
    assert_eq!(
        s.orders.calls.load(Ordering::SeqCst),
        1,
        "the body ran once"
    );
    assert_eq!(reply_ledger(&s).await, Ledger::once_each(1));
    stop(s.handle.clone(), s.task).await;
    let stats = s.handle.stats(&s.subject).unwrap();
    assert_eq!((stats.processed(), stats.duplicates()), (1, 1));
}

#[tokio::test]
async fn a_reply_lost_after_commit_is_recovered_by_the_retry() {
    let dropped = Arc::new(AtomicBool::new(false));
    let faults = FaultHooks::default().after_commit({
        let dropped = dropped.clone();
        move |_: &Delivery| {
            if dropped.swap(true, Ordering::SeqCst) {
                AfterCommit::Ack
            } else {
                AfterCommit::DropWithoutAck
            }
        }
    });
    let s = service(faults).await;
    let order = deposit("alice", 5);

    let lost = request(
        &s.nats,
        &s.subject,
        Some("order-9"),
        &order,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        lost.is_none(),
        "the first reply was dropped after COMMIT: {lost:?}"
    );
    assert_eq!(
        reply_ledger(&s).await,
        Ledger::once_each(1),
        "it had committed"
    );
    let retry = request(
        &s.nats,
        &s.subject,
        Some("order-9"),
        &order,
        Duration::from_secs(10),
    )
    .await
    .expect("the retry gets a reply");
    let stored = idem_runtime::results::stored(&s.pool, &s.claims_under, "order-9")
        .await
        .unwrap()
        .expect("the result is stored");
    assert_eq!(retry.payload, stored, "the retry gets the stored reply");
    assert_eq!(receipt(&retry).amount, 5);
    assert_eq!(
        s.orders.calls.load(Ordering::SeqCst),
        1,
        "the body ran once"
    );
    assert_eq!(reply_ledger(&s).await, Ledger::once_each(1));
    stop(s.handle.clone(), s.task).await;
    assert_eq!(s.handle.stats(&s.subject).unwrap().dropped_by_fault(), 1);
}

#[tokio::test]
async fn failed_requests_get_error_replies_and_commit_nothing() {
    let s = service(FaultHooks::default()).await;

    // No Nats-Msg-Id: refused before anything runs.
    let no_id = request(
        &s.nats,
        &s.subject,
        None,
        &deposit("alice", 1),
        Duration::from_secs(10),
    )
    .await
    .expect("a reply");
    assert_eq!(header(&no_id, "Idem-Error"), Some("permanent"));
    assert!(
        header(&no_id, "Idem-Reason").is_some_and(
            |reason| reason.starts_with("no-message-id: ") && reason.contains("no Nats-Msg-Id")
        ),
        "{no_id:?}"
    );
    assert!(no_id.payload.is_empty());

    // Not JSON: refused before anything runs.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, "garbage-1");
    let garbage = s
        .nats
        .request_with_headers(s.subject.clone(), headers, Bytes::from_static(b"\xff{"))
        .await
        .unwrap();
    assert_eq!(header(&garbage, "Idem-Error"), Some("permanent"));
    assert!(
        header(&garbage, "Idem-Reason").is_some_and(
            |reason| reason.starts_with("undecodable: ") && reason.contains("does not decode")
        ),
        "{:?}",
        header(&garbage, "Idem-Reason")
    );
    assert_eq!(
        s.orders.calls.load(Ordering::SeqCst),
        0,
        "no body ran so far"
    );

    // A permanent error of the handler: nothing committed, nothing stored.
    let order = deposit("bob", 30);
    let refused = ask(&s, "order-b", &order).await;
    assert_eq!(header(&refused, "Idem-Error"), Some("permanent"));
    assert!(
        header(&refused, "Idem-Reason").is_some_and(|reason| reason.starts_with("handler-error: ")
            && reason.contains("unknown account bob")),
        "{:?}",
        header(&refused, "Idem-Reason")
    );
    assert!(
        stored_rows(&s.pool, &s.claims_under, "order-b")
            .await
            .is_empty(),
        "no claim was kept"
    );

    // A panic: rolled back, worth a retry.
    let unlucky = request(
        &s.nats,
        &s.subject,
        Some("order-u"),
        &deposit("alice", 13),
        Duration::from_secs(10),
    )
    .await
    .expect("a reply");
    assert_eq!(header(&unlucky, "Idem-Error"), Some("retry"));
    assert!(
        header(&unlucky, "Idem-Reason").is_some_and(
            |reason| reason.starts_with("handler-panic: ") && reason.contains("panicked")
        ),
        "{:?}",
        header(&unlucky, "Idem-Reason")
    );
    assert!(
        stored_rows(&s.pool, &s.claims_under, "order-u")
            .await
            .is_empty()
    );
    assert_eq!(
        reply_ledger(&s).await,
        Ledger::once_each(0),
        "nothing committed"
    );

    // Nothing was claimed, so once the account exists the same request, with
    // the same id, runs; and its retry gets its reply.
    sqlx::query("INSERT INTO accounts VALUES ('bob')")
        .execute(&s.pool)
        .await
        .unwrap();
    let placed = ask(&s, "order-b", &order).await;
    let again = ask(&s, "order-b", &order).await;
    assert_eq!(receipt(&placed).account, "bob");
    assert_eq!(placed.payload, again.payload);
    assert_eq!(reply_ledger(&s).await, Ledger::once_each(1));
    // bob refused, the panic, bob placed: three bodies.
    assert_eq!(s.orders.calls.load(Ordering::SeqCst), 3);
    stop(s.handle.clone(), s.task).await;
    let stats = s.handle.stats(&s.subject).unwrap();
    assert_eq!(
        (stats.processed(), stats.duplicates(), stats.failed()),
        (1, 1, 2)
    );
}
