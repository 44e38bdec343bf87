use idem_runtime::idempotent;
use serde::Deserialize;

#[derive(Deserialize)]
struct Credit {
    account: i64,
}

#[idempotent]
struct Debit {
    account: i64,
}

fn main() {}
