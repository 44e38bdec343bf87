//! `#[derive(FromRef)]`: every field of the state, by its type, and the
//! whole state itself.

use std::sync::Arc;

use idem_runtime::FromRef;

#[derive(Clone, FromRef)]
struct App {
    fees: Fees,
    config: Arc<Config>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Fees(i64);

struct Config {
    currency: &'static str,
}

fn main() {
    let app = App {
        fees: Fees(1),
        config: Arc::new(Config { currency: "EUR" }),
    };
    assert_eq!(Fees::from_ref(&app), Fees(1));
    assert_eq!(<Arc<Config>>::from_ref(&app).currency, "EUR");
    assert_eq!(App::from_ref(&app).fees, Fees(1));
}
