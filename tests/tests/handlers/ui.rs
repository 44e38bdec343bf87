//! Compile-time behaviour of the macros: what each accepts, and the errors
//! it gives for what it does not. The cases sit under the macro they test
//! (`ui/<macro>/{pass,fail}`), as axum-macros keeps them. Regenerate the
//! `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p idem-tests --test handlers -- ui::`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("ui/idempotent/pass/*.rs");
    t.compile_fail("ui/idempotent/fail/*.rs");
    t.pass("ui/classify/pass/*.rs");
    t.compile_fail("ui/classify/fail/*.rs");
    t.pass("ui/from_ref/pass/*.rs");
    t.compile_fail("ui/from_ref/fail/*.rs");
}
