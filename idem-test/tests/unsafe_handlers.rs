//! The mutation check: three handlers that are not safe, each the way real
//! handlers go wrong. Each must fail under the kit, with a message that
//! names the fault that broke it; a test here passes only when it does.
//! `a_safe_handler_passes_under_every_fault` (tests/faults.rs) is the
//! control: the kit does not fail everything.
//!
//! Each run takes one fault, the one that breaks its handler, and 20
//! messages: 3 to 5 s each.

use std::panic::{AssertUnwindSafe, catch_unwind};

use idem_runtime::{Delivery, Route, Router, State, idempotent};
use idem_test::{Bed, Fault, Settled};
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
         CREATE TABLE http_calls (message_id text NOT NULL, payment text NOT NULL);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A route that creates its stream, as services here do.
fn route(durable: &str) -> Route {
    Route::new("PAYMENTS", durable)
        .filter_subject("payments.requested")
        .create_stream(async_nats::jetstream::stream::Config {
            name: "PAYMENTS".into(),
            subjects: vec!["payments.>".into()],
            ..Default::default()
        })
}

/// What a failed assertion said, as the test's output shows it.
fn failure_of(assertion: impl FnOnce()) -> String {
    let panic = catch_unwind(AssertUnwindSafe(assertion))
        .expect_err("the kit must fail this handler, but every assertion held");
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

// --- 1. A side effect outside the transaction ------------------------------

/// Calls the payment provider (a row written on a connection of its own,
/// standing in for an HTTP call), then records the charge in its
/// transaction. A rollback cannot take the call back.
#[idempotent(name = "payments.charge-and-call.v1")]
async fn charge_and_call(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    State(provider): State<sqlx::PgPool>,
    payment: Payment,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO http_calls (message_id, payment) VALUES ($1, $2)")
        .bind(delivery.message_id().as_str())
        .bind(&payment.payment)
        .execute(&provider)
        .await?;
    sqlx::query("INSERT INTO charges (payment, amount) VALUES ($1, $2)")
        .bind(&payment.payment)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idem_test::test(setup = migrate)]
async fn a_side_effect_outside_the_transaction_fails_under_handler_failure(bed: Bed) {
    let router = Router::with_state(bed.pool()).route(route("charge"), charge_and_call);
    let settled: Settled<'_> = bed
        .run(router)
        .publish_json("payments.requested", payments(20))
        .with_faults(Fault::HandlerFailure)
        .until_settled()
        .await;
    // Idem's side is right: one claim, one charge per payment.
    settled
        .assert_claims("payments.charge-and-call.v1", 20)
        .assert_effects("SELECT count(*) FROM charges", 20)
        .assert_no_dead_letters();
    // The provider was called again for each message the fault hit.
    let failure = failure_of(|| {
        settled.assert_no_duplicates("SELECT message_id FROM http_calls");
    });
    assert!(
        failure.contains("keys more than once")
            && failure.contains("2 times; hit by handler-failure")
            && failure.contains("under: handler-failure"),
        "the failure names the fault and its messages:\n{failure}"
    );
}

// --- 2. A key taken from the delivery count --------------------------------

/// Keyed by the payment and the delivery count: a redelivery is a new key,
/// so the claim of the first delivery does not stop it.
#[idempotent(
    name = "payments.charge-by-attempt.v1",
    key = format!("{}/{}", payment.payment, delivery.delivered())
)]
async fn charge_by_attempt(
    tx: &mut sqlx::PgTransaction<'_>,
    delivery: &Delivery,
    payment: Payment,
) -> Result<(), sqlx::Error> {
    let _ = delivery;
    sqlx::query("INSERT INTO charges (payment, amount) VALUES ($1, $2)")
        .bind(&payment.payment)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idem_test::test(setup = migrate)]
async fn a_key_from_the_delivery_count_fails_under_crash_before_ack(bed: Bed) {
    let router = Router::new().route(route("charge"), charge_by_attempt);
    let settled = bed
        .run(router)
        .publish_json("payments.requested", payments(20))
        .with_faults(Fault::CrashBeforeAck)
        .until_settled()
        .await;
    let failure = failure_of(|| {
        settled.assert_effects("SELECT count(*) FROM charges", 20);
    });
    assert!(
        failure.contains("effects `SELECT count(*) FROM charges` is 22, expected 20 (2 more)")
            && failure.contains("under: crash-before-ack")
            && failure.contains("/1, p-"),
        "the failure names the fault and its messages:\n{failure}"
    );
}

// --- 3. A core NATS publish instead of the outbox --------------------------

/// Tells the shop the payment went through with a core NATS publish from
/// inside the transaction: sent whether or not the transaction commits,
/// and again by every retry.
#[idempotent(name = "payments.charge-and-notify.v1")]
async fn charge_and_notify(
    tx: &mut sqlx::PgTransaction<'_>,
    State(nats): State<async_nats::Client>,
    payment: Payment,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    sqlx::query("INSERT INTO charges (payment, amount) VALUES ($1, $2)")
        .bind(&payment.payment)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    nats.publish("notices.charged", serde_json::to_vec(&payment)?.into())
        .await?;
    nats.flush().await?;
    Ok(())
}

#[idem_test::test(setup = migrate)]
async fn a_core_nats_publish_fails_under_handler_failure(bed: Bed) {
    let router = Router::with_state(bed.nats()).route(route("charge"), charge_and_notify);
    let settled = bed
        .run(router)
        .publish_json("payments.requested", payments(20))
        .capture("notices.>")
        .with_faults(Fault::HandlerFailure)
        .until_settled()
        .await;
    settled.assert_effects("SELECT count(*) FROM charges", 20);
    let failure = failure_of(|| {
        settled.assert_published_once("notices.>", 20);
    });
    assert!(
        failure.contains("messages sent more than once")
            && failure.contains("under: handler-failure"),
        "the failure names the fault and its messages:\n{failure}"
    );
}
