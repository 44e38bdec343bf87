//! `#[derive(FromRef)]` goes on a struct with named fields: a field's name
//! is how the derived impl reaches it.

use idem_runtime::FromRef;

#[derive(Clone, FromRef)]
enum Mode {
    Live,
    Replay,
}

#[derive(Clone, FromRef)]
struct Fees(i64);

fn main() {}
