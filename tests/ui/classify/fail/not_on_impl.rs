use idem_runtime::{ErrorClass, classify};

#[derive(Debug)]
struct Closed;

#[classify]
fn class(_: &Closed) -> ErrorClass {
    ErrorClass::Permanent
}

fn main() {}
