//! The handler API against real servers: application state, handlers
//! written by hand, codecs, keys that see the delivery, and error classes
//! that survive being wrapped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use idem_runtime::codec::Json;
use idem_runtime::{
    Classify, Delivery, ErrorClass, FromRef, Handler, HandlerError, Permanent, Route, Router,
    State, classify, idempotent,
};
use idem_tests::scenario::*;

// --- State ---------------------------------------------------------------

/// The application state of the state test: a fee, and a counter of calls
/// that the test reads back.
#[derive(Clone, FromRef)]
struct Bank {
    fee: Fee,
    calls: Calls,
}

#[derive(Clone, Copy)]
struct Fee(i64);

#[derive(Clone, Default)]
struct Calls(Arc<AtomicU32>);

#[idempotent(name = "state-fee")]
async fn charge_fee(
    tx: &mut sqlx::PgTransaction<'_>,
    State(Fee(fee)): State<Fee>,
    delivery: &Delivery,
    State(calls): State<Calls>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    calls.0.fetch_add(1, Ordering::SeqCst);
    record_effect(
        tx,
        "state-fee",
        &deposit(&d.account, d.amount - fee),
        delivery,
    )
    .await
}

#[idempotent(name = "state-whole")]
async fn whole_state(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(bank): State<Bank>,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    bank.calls.0.fetch_add(1, Ordering::SeqCst);
    record_effect(
        tx,
        "state-whole",
        &deposit(&d.account, bank.fee.0),
        delivery,
    )
    .await
}

/// Two handlers take the router's state, one a part of it and one the whole:
/// both see the values the router was given, and no `static` is involved.
#[tokio::test]
async fn handlers_take_the_routers_state_whole_and_in_parts() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("STATE", Duration::from_secs(120)).await;
    for i in 0..3 {
        publish(&js, &subject, &deposit("a", 100), Some(&format!("s-{i}"))).await;
    }
    let bank = Bank {
        fee: Fee(7),
        calls: Calls::default(),
    };
    let (handle, task) = spawn(
        Router::with_state(bank.clone())
            .route(Route::new(&stream, "fee"), charge_fee)
            .route(Route::new(&stream, "whole"), whole_state),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "fee").await;
    wait_all_acked(&js, &stream, "whole").await;
    stop(handle, task).await;

    assert_eq!(
        bank.calls.0.load(Ordering::SeqCst),
        6,
        "the state's counter"
    );
    let amounts: Vec<(String, i64)> =
        sqlx::query_as("SELECT handler, amount FROM effects ORDER BY handler, message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let expected: Vec<(String, i64)> = [("state-fee", 93); 3]
        .into_iter()
        .chain([("state-whole", 7); 3])
        .map(|(handler, amount)| (handler.to_owned(), amount))
        .collect();
    assert_eq!(amounts, expected);
    assert_eq!(ledger(&pool, "state-fee").await, Ledger::once_each(3));
    assert_eq!(ledger(&pool, "state-whole").await, Ledger::once_each(3));
}

// --- A handler written by hand --------------------------------------------

struct CreditByHand;

impl Handler<Calls> for CreditByHand {
    type Payload = Deposit;
    type Codec = Json;

    fn name(&self) -> &'static str {
        "by-hand"
    }

    fn message_key(&self, payload: &Deposit, _delivery: &Delivery) -> Option<String> {
        Some(payload.account.clone())
    }

    async fn handle(
        &self,
        tx: &mut sqlx::PgTransaction<'_>,
        d: Deposit,
        delivery: &Delivery,
        calls: &Calls,
    ) -> Result<(), HandlerError> {
        calls.0.fetch_add(1, Ordering::SeqCst);
        if d.account == "refused" {
            return Err(Permanent::new("refused by hand").into());
        }
        record_effect(tx, "by-hand", &d, delivery).await?;
        Ok(())
    }
}

/// A handler written by hand gets the same claim as a macro one: duplicates
/// by its key are skipped, and its errors are classed. Per message, so that
/// the body's runs are exactly the fresh messages' (a batch's fallback runs
/// a failed batch's messages again).
#[tokio::test]
async fn a_handler_written_by_hand_is_claimed_like_any() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("BYHAND", Duration::from_secs(120)).await;
    for (i, account) in ["a", "b", "a", "refused", "b"].iter().enumerate() {
        publish(&js, &subject, &deposit(account, 1), Some(&format!("h-{i}"))).await;
    }
    let calls = Calls::default();
    let (handle, task) = spawn(
        Router::with_state(calls.clone())
            .route(fast(Route::new(&stream, "c")).per_message(), CreditByHand),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let stats = handle.stats("c").unwrap();
    assert_eq!(
        (stats.processed(), stats.duplicates(), stats.dead_lettered()),
        (2, 2, 1)
    );
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        3,
        "the body never ran for a duplicate"
    );
    let letters = dead_letters(&js, &stream).await;
    assert_eq!(header(&letters[0], "Idem-Failure"), "permanent");
    assert_eq!(header(&letters[0], "Idem-Message-Id"), "refused");
    assert_eq!(ledger(&pool, "by-hand").await, Ledger::once_each(2));
}

// --- Codecs --------------------------------------------------------------------

#[idempotent(name = "raw-bytes", codec = raw)]
async fn store_bytes(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    bytes: Bytes,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO blobs (message_id, body) VALUES ($1, $2)")
        .bind(delivery.message_id().as_str())
        .bind(bytes.as_ref())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(name = "raw-text", codec = raw)]
async fn store_text(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    text: String,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO blobs (message_id, body) VALUES ($1, $2)")
        .bind(delivery.message_id().as_str())
        .bind(text.as_bytes())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoCredit {
    #[prost(string, tag = "1")]
    transfer_id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

#[idempotent(name = "proto", codec = protobuf, key = cmd.transfer_id)]
async fn store_proto(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    cmd: ProtoCredit,
) -> Result<(), sqlx::Error> {
    record_effect(
        tx,
        "proto",
        &deposit(&cmd.transfer_id, cmd.amount),
        delivery,
    )
    .await
}

/// Publishes raw `payload` with `Nats-Msg-Id` `id` to `subject`.
async fn publish_raw(js: &jetstream::Context, subject: &str, payload: Vec<u8>, id: &str) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    js.publish_with_headers(subject.to_owned(), headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Raw bytes arrive as they were published (not as a JSON array), text is
/// checked for UTF-8, protobuf decodes through prost; a payload its codec
/// cannot decode is dead-lettered with its `Nats-Msg-Id`.
#[tokio::test]
async fn codecs_decode_what_they_should_and_dead_letter_the_rest() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("CODECS", Duration::from_secs(120)).await;
    sqlx::query("CREATE TABLE blobs (message_id text NOT NULL, body bytea NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    js.update_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let (bytes_subject, text_subject, proto_subject) = (
        format!("{stream}.bytes"),
        format!("{stream}.text"),
        format!("{stream}.proto"),
    );
    let binary = vec![0xff, 0x00, 0x5b, 0x31, 0x5d];
    publish_raw(&js, &bytes_subject, binary.clone(), "bytes-1").await;
    publish_raw(&js, &text_subject, "grüße".as_bytes().to_vec(), "text-1").await;
    publish_raw(&js, &text_subject, vec![0xff, 0xfe], "text-not-utf8").await;
    let credit = ProtoCredit {
        transfer_id: "t-9".into(),
        amount: 42,
    };
    publish_raw(
        &js,
        &proto_subject,
        prost::Message::encode_to_vec(&credit),
        "proto-1",
    )
    .await;
    publish_raw(&js, &proto_subject, b"\xff\xff\xff".to_vec(), "proto-bad").await;

    let (handle, task) = spawn(
        Router::new()
            .route(
                Route::new(&stream, "bytes").filter_subject(&bytes_subject),
                store_bytes,
            )
            .route(
                Route::new(&stream, "text").filter_subject(&text_subject),
                store_text,
            )
            .route(
                Route::new(&stream, "proto").filter_subject(&proto_subject),
                store_proto,
            ),
        nats,
        pool.clone(),
    );
    for (durable, messages) in [("bytes", 1), ("text", 2), ("proto", 2)] {
        wait_consumer_settled(&js, &stream, durable, messages).await;
    }
    stop(handle, task).await;

    let blobs: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT message_id, body FROM blobs ORDER BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        blobs,
        [
            ("bytes-1".to_owned(), binary),
            ("text-1".to_owned(), "grüße".as_bytes().to_vec())
        ]
    );
    let effects: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT message_id, account, amount FROM effects")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects, [("t-9".to_owned(), "t-9".to_owned(), 42)]);
    let letters = dead_letters(&js, &stream).await;
    let mut rejected: Vec<(String, String)> = letters
        .iter()
        .map(|letter| {
            assert_eq!(header(letter, "Idem-Failure"), "undecodable");
            (
                header(letter, "Idem-Message-Id"),
                header(letter, "Idem-Error"),
            )
        })
        .collect();
    rejected.sort();
    assert_eq!(rejected.len(), 2);
    assert_eq!(rejected[0].0, "proto-bad");
    assert!(
        rejected[0].1.contains("does not decode as protobuf"),
        "{rejected:?}"
    );
    assert_eq!(rejected[1].0, "text-not-utf8");
    assert!(
        rejected[1].1.contains("does not decode as UTF-8 text"),
        "{rejected:?}"
    );
}

// --- Keys that see the delivery -------------------------------------------------

#[idempotent(name = "per-subject", key = format!("{}/{}", delivery.subject(), d.account))]
async fn per_subject(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    d: Deposit,
) -> Result<(), sqlx::Error> {
    record_effect(tx, "per-subject", &d, delivery).await
}

/// A key can use the delivery: here the subject, so the same account on two
/// subjects is two messages, and on one subject, one.
#[tokio::test]
async fn a_key_can_see_the_delivery() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject: _subject,
    } = scenario("KEYDELIVERY", Duration::from_secs(120)).await;
    js.update_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    for (i, (tail, account)) in [("eu", "a"), ("us", "a"), ("eu", "a"), ("eu", "b")]
        .iter()
        .enumerate()
    {
        let subject = format!("{stream}.{tail}");
        publish(&js, &subject, &deposit(account, 1), Some(&format!("k-{i}"))).await;
    }
    let (handle, task) = spawn(
        Router::new().route(Route::new(&stream, "c"), per_subject),
        nats,
        pool.clone(),
    );
    wait_all_acked(&js, &stream, "c").await;
    stop(handle.clone(), task).await;
    let mut ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    ids.sort();
    assert_eq!(
        ids,
        [
            format!("{stream}.eu/a"),
            format!("{stream}.eu/b"),
            format!("{stream}.us/a")
        ]
    );
    assert_eq!(handle.stats("c").unwrap().duplicates(), 1);
}

// --- Error classes that survive wrapping --------------------------------------

/// A `Classify` type, registered so that it is found inside other errors.
#[derive(Debug, thiserror::Error)]
#[error("account {0} is frozen")]
struct Frozen(String);

#[classify]
impl Classify for Frozen {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// A wrapper whose `source()` is the `Frozen` error.
#[derive(Debug, thiserror::Error)]
enum ServiceError {
    #[error("the ledger refused the deposit")]
    Ledger(#[source] Frozen),
}

type ServiceResult<T> = Result<T, ServiceError>;

#[idempotent(name = "anyhow-permanent")]
async fn anyhow_permanent(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> anyhow::Result<()> {
    Err(
        anyhow::Error::new(Permanent::new(format!("{} is closed", d.account)))
            .context("depositing"),
    )
}

#[idempotent(name = "anyhow-classified")]
async fn anyhow_classified(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> anyhow::Result<()> {
    Err(anyhow::Error::new(Frozen(d.account)).context("depositing"))
}

#[idempotent(name = "boxed-classified")]
async fn boxed_classified(
    _tx: &mut sqlx::PgTransaction<'_>,
    d: Deposit,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    Err(Box::new(Frozen(d.account)))
}

#[idempotent(name = "wrapped-classified")]
async fn wrapped_classified(_tx: &mut sqlx::PgTransaction<'_>, d: Deposit) -> ServiceResult<()> {
    Err(ServiceError::Ledger(Frozen(d.account)))
}

#[idempotent(name = "anyhow-sqlx")]
async fn anyhow_sqlx(tx: &mut sqlx::PgTransaction<'_>, _d: Deposit) -> anyhow::Result<()> {
    // A real 22012 from the server, wrapped: class 22 is permanent.
    sqlx::query("SELECT 1 / 0").execute(&mut **tx).await?;
    Ok(())
}

/// Counts the calls of the unclassified handler.
#[derive(Clone, Default)]
struct Attempts(Arc<AtomicU32>);

#[idempotent(name = "anyhow-plain")]
async fn anyhow_plain(
    tx: &mut sqlx::PgTransaction<'_>,
    State(attempts): State<Attempts>,
    delivery: &Delivery,
    d: Deposit,
) -> anyhow::Result<()> {
    if attempts.0.fetch_add(1, Ordering::SeqCst) == 0 {
        anyhow::bail!("no class anywhere: transient, so retried");
    }
    record_effect(tx, "anyhow-plain", &d, delivery).await?;
    Ok(())
}

/// The class of a handler's error is found wherever it is: at the root of
/// an `anyhow::Error` with context, in a `Box<dyn Error>`, in a wrapper's
/// `source()` (a registered `Classify` type), behind a `Result` alias, and
/// in a database error inside anyhow. Each permanent one is dead-lettered
/// on its first delivery; one with no class is retried.
#[tokio::test]
async fn error_classes_survive_wrapping() {
    let Scenario {
        env: _env,
        pool,
        nats,
        js,
        stream,
        subject,
    } = scenario("CLASSES", Duration::from_secs(120)).await;
    publish(&js, &subject, &deposit("a", 1), Some("classes-1")).await;
    let attempts = Attempts::default();
    let routes = [
        "anyhow-permanent",
        "anyhow-classified",
        "boxed-classified",
        "wrapped-classified",
        "anyhow-sqlx",
    ];
    let router = Router::with_state(attempts.clone())
        .route(fast(Route::new(&stream, routes[0])), anyhow_permanent)
        .route(fast(Route::new(&stream, routes[1])), anyhow_classified)
        .route(fast(Route::new(&stream, routes[2])), boxed_classified)
        .route(fast(Route::new(&stream, routes[3])), wrapped_classified)
        .route(fast(Route::new(&stream, routes[4])), anyhow_sqlx)
        .route(fast(Route::new(&stream, "plain")), anyhow_plain);
    let (handle, task) = spawn(router, nats, pool.clone());
    for durable in routes.iter().chain(&["plain"]) {
        wait_all_acked(&js, &stream, durable).await;
    }
    stop(handle.clone(), task).await;

    let letters = dead_letters(&js, &stream).await;
    let mut by_handler: Vec<(String, String, String)> = letters
        .iter()
        .map(|letter| {
            (
                header(letter, "Idem-Handler"),
                header(letter, "Idem-Failure"),
                header(letter, "Idem-Delivered"),
            )
        })
        .collect();
    by_handler.sort();
    let mut expected: Vec<(String, String, String)> = routes
        .iter()
        .map(|name| ((*name).to_owned(), "permanent".to_owned(), "1".to_owned()))
        .collect();
    expected.sort();
    assert_eq!(by_handler, expected, "each permanent on its first delivery");
    let sqlx_letter = letters
        .iter()
        .find(|letter| header(letter, "Idem-Handler") == "anyhow-sqlx")
        .unwrap();
    assert!(header(sqlx_letter, "Idem-Error").contains("SQLSTATE 22012"));
    assert_eq!(attempts.0.load(Ordering::SeqCst), 2, "retried once");
    assert_eq!(handle.stats("plain").unwrap().failed(), 1);
    assert_eq!(ledger(&pool, "anyhow-plain").await, Ledger::once_each(1));
}
