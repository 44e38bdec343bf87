//! The ledger service under every fault idem-test injects, written with the
//! kit's public API only: every credit applied once, every balance the sum
//! of its unique credits less their fees. About 15 to 25 s on a 2-core
//! machine (200 credits, the faults one after another).

use idem_test::{Bed, Faults};
use ledger_example::{Fees, SUBJECT, credits, prepare_ledger, router};

const CREDITS: usize = 200;
const ACCOUNTS: i64 = 10;

async fn ten_accounts(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    prepare_ledger(pool, ACCOUNTS).await
}

#[idem_test::test(setup = ten_accounts)]
async fn every_credit_is_applied_once_under_every_fault(bed: Bed) {
    let fees = Fees::load(&bed.pool()).await.unwrap();
    let credits = credits(CREDITS, ACCOUNTS);
    let net: i64 = credits
        .iter()
        .map(|c| c.amount - fees.on(c.account, c.amount))
        .sum();
    let charged: i64 = credits.iter().map(|c| fees.on(c.account, c.amount)).sum();
    let settled = bed
        .run(router(fees))
        .publish_json_with_ids(
            SUBJECT,
            credits.iter().map(|c| (c.transfer_id.clone(), c.clone())),
        )
        .with_faults(Faults::all())
        .until_settled()
        .await;
    println!("{settled}");
    settled
        .assert_effects("SELECT count(*) FROM ledger_entries", CREDITS as i64)
        .assert_no_duplicates("SELECT transfer_id FROM ledger_entries")
        .assert_sum("SELECT sum(balance) FROM accounts", net)
        .assert_sum("SELECT sum(fee) FROM ledger_entries", charged)
        .assert_claims("ledger.credit.v1", CREDITS as i64)
        .assert_no_dead_letters();
}
