use idem_runtime::{Handler, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    transfer_id: String,
    account: i64,
    amount: i64,
}

#[idempotent(name = "credit-v1", key = transfer_id)]
async fn credit(
    _tx: &mut sqlx::PgTransaction<'_>,
    Credit {
        transfer_id,
        account,
        amount,
    }: Credit,
) -> Result<(), sqlx::Error> {
    assert!(!transfer_id.is_empty() && account > 0 && amount != 0);
    Ok(())
}

#[derive(Deserialize)]
struct Transfer(String, i64);

// `mut` bindings are fine: the key sees each binding by reference.
#[idempotent(key = id)]
async fn transfer(
    _tx: &mut sqlx::PgTransaction<'_>,
    Transfer(mut id, amount): Transfer,
) -> Result<(), sqlx::Error> {
    id.push('!');
    assert!(amount != 0);
    Ok(())
}

#[idempotent(key = cmd.account)]
async fn debit(_tx: &mut sqlx::PgTransaction<'_>, mut cmd: Credit) -> Result<(), sqlx::Error> {
    cmd.amount = -cmd.amount;
    Ok(())
}

#[idempotent(key = account)]
async fn audit(
    _tx: &mut sqlx::PgTransaction<'_>,
    Credit { account, .. }: Credit,
) -> Result<(), sqlx::Error> {
    assert!(account > 0);
    Ok(())
}

#[idempotent]
async fn ignore(_tx: &mut sqlx::PgTransaction<'_>, _: Credit) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let delivery = idem_runtime::Delivery::for_test("subject", "STREAM", 1);
    let cmd = Credit {
        transfer_id: "t-1".to_owned(),
        account: 7,
        amount: 100,
    };
    assert_eq!(Handler::<()>::message_key(&credit(), &cmd, &delivery).as_deref(), Some("t-1"));
    assert_eq!(Handler::<()>::message_key(&debit(), &cmd, &delivery).as_deref(), Some("7"));
    assert_eq!(Handler::<()>::message_key(&audit(), &cmd, &delivery).as_deref(), Some("7"));
    assert_eq!(Handler::<()>::message_key(&ignore(), &cmd, &delivery), None);
    let transfer_msg = Transfer("t-2".to_owned(), 5);
    assert_eq!(
        Handler::<()>::message_key(&transfer(), &transfer_msg, &delivery).as_deref(),
        Some("t-2")
    );
}
