//! `#[classify]` takes no arguments, goes on an impl of `Classify`, and
//! registers one concrete type.

use idem_runtime::{Classify, ErrorClass, classify};

#[derive(Debug)]
struct Closed;

#[classify(permanent)]
impl Classify for Closed {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

#[derive(Debug)]
struct Frozen;

#[classify]
impl std::fmt::Display for Frozen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("frozen")
    }
}

#[derive(Debug)]
struct Wrapped<E>(E);

#[classify]
impl<E: std::fmt::Debug + Send + Sync + 'static> Classify for Wrapped<E> {
    fn class(&self) -> ErrorClass {
        ErrorClass::Transient
    }
}

fn main() {}
