//! The pipeline's two services under every fault idem-test injects, each
//! a router with its outbox relay, on one database, written with the kit's
//! public API only: every order written once, charged once and marked paid
//! once, and every message the outboxes queued stored once downstream.
//! About 15 to 30 s on a 2-core machine (100 orders).

use idem_runtime::outbox::Relay;
use idem_test::{Bed, Faults};
use pipeline_example::{OrderPlaced, orders, payments};

const ORDERS: i64 = 100;

async fn both_services(pool: &sqlx::PgPool) -> Result<(), idem_runtime::Error> {
    orders::migrate(pool).await?;
    payments::migrate(pool).await
}

#[idem_test::test(setup = both_services)]
async fn every_order_is_charged_and_paid_once_under_every_fault(bed: Bed) {
    let placed = (1..=ORDERS).map(|order| {
        (
            format!("order-{order}"),
            OrderPlaced {
                order,
                amount: 100 + order,
            },
        )
    });
    let settled = bed
        .run(orders::router().relay(Relay::new()))
        .router(payments::router().relay(Relay::new()))
        .publish_json_with_ids("orders.placed", placed)
        .with_faults(Faults::all())
        .until_settled()
        .await;
    println!("{settled}");
    settled
        .assert_effects("SELECT count(*) FROM orders", ORDERS)
        .assert_effects("SELECT count(*) FROM orders WHERE times_paid = 1", ORDERS)
        .assert_effects("SELECT count(*) FROM charges", ORDERS)
        .assert_no_duplicates("SELECT order_id FROM charges")
        .assert_sum(
            "SELECT sum(amount) FROM charges",
            (101..=100 + ORDERS).sum(),
        )
        .assert_claims("orders.place.v1", ORDERS)
        .assert_claims("payments.charge.v1", ORDERS)
        .assert_claims("orders.mark-paid.v1", ORDERS)
        .assert_published_once("payments.requested", ORDERS as usize)
        .assert_published_once("orders.paid", ORDERS as usize)
        .assert_no_dead_letters();
}
