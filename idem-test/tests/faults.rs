//! The control for the mutation check, and the kit on each kind of route:
//! safe handlers pass under the faults, and every fault is shown to have
//! happened (`until_settled` fails otherwise).
//!
//! Costs, on a 2-core machine: every fault, 60 messages, 6 to 8 s; the
//! message faults on a per-message route or a batch handler 7 to 10 s; the
//! outbox and reply run 9 to 10 s; the unit helpers 2 s (the servers).

use idem_runtime::outbox::{Outbox, OutboxError, Relay};
use idem_runtime::{Delivery, ReplyRoute, Route, Router, idempotent};
use idem_test::{Bed, Fault, Faults};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Payment {
    payment: String,
    amount: i64,
}

fn payments(n: usize) -> impl Iterator<Item = Payment> {
    (0..n).map(|i| Payment {
        payment: format!("p-{i}"),
        amount: 10 + i as i64,
    })
}

async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE charges (payment text NOT NULL, amount bigint NOT NULL);
         CREATE TABLE receipts (payment text NOT NULL, number bigint NOT NULL);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

fn route(durable: &str) -> Route {
    Route::new("PAYMENTS", durable)
        .filter_subject("payments.requested")
        .create_stream(async_nats::jetstream::stream::Config {
            name: "PAYMENTS".into(),
            subjects: vec!["payments.>".into()],
            ..Default::default()
        })
}

/// Keyed by the payment; every write in its transaction.
#[idempotent(name = "payments.charge.v1", key = payment.payment)]
async fn charge(tx: &mut sqlx::PgTransaction<'_>, payment: Payment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO charges (payment, amount) VALUES ($1, $2)")
        .bind(&payment.payment)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// 10 + 11 + ... + 69.
const SUM: i64 = (10 + 69) * 60 / 2;

#[idem_test::test(setup = migrate)]
async fn a_safe_handler_passes_under_every_fault(bed: Bed) {
    let settled = bed
        .run(Router::new().route(route("charge"), charge))
        .publish_json("payments.requested", payments(60))
        .with_faults(Faults::all())
        .until_settled()
        .await;
    println!("{settled}");
    settled
        .assert_effects("SELECT count(*) FROM charges", 60)
        .assert_no_duplicates("SELECT payment FROM charges")
        .assert_sum("SELECT sum(amount) FROM charges", SUM)
        .assert_claims("payments.charge.v1", 60)
        .assert_no_dead_letters();
}

#[idem_test::test(setup = migrate)]
async fn a_per_message_route_passes_under_the_message_faults(bed: Bed) {
    let faults = Faults::all()
        .without(Fault::PostgresRestart)
        .without(Fault::NatsRestart);
    bed.run(Router::new().route(route("charge").per_message(), charge))
        .publish_json("payments.requested", payments(30))
        .with_faults(faults)
        .until_settled()
        .await
        .assert_effects("SELECT count(*) FROM charges", 30)
        .assert_no_duplicates("SELECT payment FROM charges")
        .assert_claims("payments.charge.v1", 30)
        .assert_no_dead_letters();
}

/// Charges a batch's fresh payments with one statement.
#[idempotent(name = "payments.charge-many.v1", key = |payment| payment.payment, batch)]
async fn charge_many(
    tx: &mut sqlx::PgTransaction<'_>,
    payments: Vec<Payment>,
) -> Result<(), sqlx::Error> {
    let names: Vec<String> = payments.iter().map(|p| p.payment.clone()).collect();
    let amounts: Vec<i64> = payments.iter().map(|p| p.amount).collect();
    sqlx::query(
        "INSERT INTO charges (payment, amount) SELECT * FROM unnest($1::text[], $2::int8[])",
    )
    .bind(&names)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[idem_test::test(setup = migrate)]
async fn a_batch_handler_passes_under_the_message_faults(bed: Bed) {
    let faults = Faults::all()
        .without(Fault::PostgresRestart)
        .without(Fault::NatsRestart);
    bed.run(Router::new().route(route("charge").batch(8), charge_many))
        .publish_json("payments.requested", payments(60))
        .with_faults(faults)
        .until_settled()
        .await
        .assert_effects("SELECT count(*) FROM charges", 60)
        .assert_no_duplicates("SELECT payment FROM charges")
        .assert_sum("SELECT sum(amount) FROM charges", SUM)
        .assert_claims("payments.charge-many.v1", 60)
        .assert_no_dead_letters();
}

/// Duplicate-after-window publishes the first two payments again, and
/// dead-letter-replay wants two payments too: with four, the two faults
/// would meet on one payment if the plan let them (its late copy applied
/// before the original was dead-lettered, or dead-lettered a second time).
/// The plan gives dead-letter-replay only to payments that are not copied
/// late, so both faults still happen, each on its own two payments, and
/// the run passes.
#[idem_test::test(setup = migrate)]
async fn a_late_copy_and_a_dead_letter_replay_never_meet_on_one_message(bed: Bed) {
    let faults = Faults::none()
        .with(Fault::DuplicateAfterWindow)
        .with(Fault::DeadLetterReplay)
        .messages_each(2);
    let settled = bed
        .run(Router::new().route(route("charge").batch(8), charge_many))
        .publish_json("payments.requested", payments(4))
        .with_faults(faults)
        .until_settled()
        .await;
    println!("{settled}");
    settled
        .assert_effects("SELECT count(*) FROM charges", 4)
        .assert_no_duplicates("SELECT payment FROM charges")
        .assert_claims("payments.charge-many.v1", 4)
        .assert_no_dead_letters();
}

/// Charges, and queues a receipt through the outbox.
#[idempotent(name = "payments.charge-with-receipt.v1", key = payment.payment)]
async fn charge_with_receipt(
    tx: &mut sqlx::PgTransaction<'_>,
    outbox: Outbox,
    payment: Payment,
) -> Result<(), OutboxError> {
    sqlx::query("INSERT INTO charges (payment, amount) VALUES ($1, $2)")
        .bind(&payment.payment)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    outbox.send(tx, "receipts.sent", &payment).await?;
    Ok(())
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    payment: String,
    number: i64,
}

/// Answers a request for a receipt number: the next one, stored with the
/// claim, so a retried request gets the same number.
#[idempotent(name = "receipts.number.v1", key = payment.payment)]
async fn number(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    payment: Payment,
) -> Result<Receipt, sqlx::Error> {
    let _ = delivery;
    let number: i64 = sqlx::query_scalar(
        "INSERT INTO receipts (payment, number)
         SELECT $1, coalesce(max(number), 0) + 1 FROM receipts RETURNING number",
    )
    .bind(&payment.payment)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Receipt {
        payment: payment.payment,
        number,
    })
}

#[idem_test::test(setup = migrate)]
async fn an_outbox_handler_and_a_reply_route_pass_under_faults(bed: Bed) {
    let faults = Faults::none()
        .with(Fault::HandlerFailure)
        .with(Fault::CrashBeforeAck)
        .with(Fault::AmbiguousCommit);
    let router = Router::new()
        .route(route("charge"), charge_with_receipt)
        .reply_route(ReplyRoute::new("numbers.next"), number)
        .relay(Relay::new());
    bed.run(router)
        .publish_json("payments.requested", payments(20))
        .request_json("numbers.next", payments(10))
        .capture("receipts.>")
        .with_faults(faults)
        .until_settled()
        .await
        .assert_effects("SELECT count(*) FROM charges", 20)
        .assert_published_once("receipts.sent", 20)
        .assert_effects("SELECT count(*) FROM receipts", 10)
        .assert_replies_identical()
        .assert_no_dead_letters();
}

#[idem_test::test(setup = migrate)]
async fn a_handler_body_runs_on_a_test_transaction_and_shows_what_it_queued(bed: Bed) {
    let mut tx = bed.transaction().await;
    let delivery = Delivery::for_test("payments.requested", "PAYMENTS", 7)
        .with_header("Nats-Msg-Id", "p-7")
        .for_handler(charge_with_receipt::NAME);
    let payment = Payment {
        payment: "p-7".into(),
        amount: 70,
    };
    charge_with_receipt::run(&mut tx, Outbox::for_delivery(&delivery), payment)
        .await
        .unwrap();
    let queued = idem_test::unit::queued(&mut tx).await;
    assert_eq!(queued.len(), 1);
    assert_eq!(queued[0].subject, "receipts.sent");
    assert_eq!(queued[0].json::<Payment>().amount, 70);
    let retry = Outbox::<idem_runtime::codec::Json>::for_delivery(&delivery);
    assert_eq!(queued[0].id, retry.next_id(), "a retry queues the same id");
    tx.rollback().await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
        .fetch_one(&bed.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "the rollback took the queued message back");
}
