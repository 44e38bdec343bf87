//! The example test of issue 21, in a crate of its own: a credit is
//! applied once whatever fails. About 5 to 10 s on a 2-core machine.

use idem_test::{Bed, Faults};
use testing_example as my_service;

fn credits(n: usize) -> impl Iterator<Item = my_service::Credit> {
    (0..n).map(|i| my_service::Credit {
        transfer_id: format!("t-{i}"),
        account: 1 + i as i64 % 7,
        amount: 10,
    })
}

#[idem_test::test(setup = my_service::migrate)]
async fn a_credit_is_applied_once_whatever_fails(bed: Bed) {
    let router = my_service::router();
    bed.run(router)
        .publish_json("ledger.credit", credits(500))
        .with_faults(Faults::all())
        .until_settled()
        .await
        .assert_effects("SELECT count(*) FROM ledger", 500)
        .assert_no_duplicates("SELECT transfer_id FROM ledger")
        .assert_sum("SELECT sum(amount) FROM ledger", 5000)
        .assert_claims("ledger.credit.v1", 500)
        .assert_no_dead_letters();
}
