//! Compile-time behaviour of `#[idempotent]`: what it accepts, and the
//! errors it gives for what it does not. Regenerate the `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p idem-tests --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/fail/*.rs");
}
