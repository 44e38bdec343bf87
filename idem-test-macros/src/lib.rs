//! The `#[idem_test::test]` attribute. Depend on `idem-test`, which
//! re-exports it as [`idem_test::test`](https://docs.rs/idem-test).
//!
//! The expansion is a plain `#[test]` fn that calls
//! `idem_test::__private::run`: the runtime, the bed and the set-up live in
//! `idem-test`, so this crate only parses and re-emits.

mod args;
mod expand;

use proc_macro::TokenStream;

/// Turns `async fn name(bed: idem_test::Bed)` into a test with a bed of its
/// own: a nats-server with JetStream and a PostgreSQL with idem's schema,
/// processes of the test's own (or `NATS_URL` / `DATABASE_URL`), stopped
/// when the test ends. The test runs on a multi-thread tokio runtime.
///
/// `setup = path` names an `async fn(&sqlx::PgPool)` returning `()` or a
/// `Result` (its error is shown), run on the test's database before the
/// test: your migrations and reference data.
///
/// Other attributes (`#[should_panic]`, `#[ignore]`) apply as on any test,
/// and the test may return a `Result`.
///
/// ```no_run
/// use idem_test::Bed;
///
/// async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
///     sqlx::raw_sql("CREATE TABLE ledger (transfer_id text, amount bigint)")
///         .execute(pool)
///         .await?;
///     Ok(())
/// }
///
/// #[idem_test::test(setup = migrate)]
/// async fn the_ledger_starts_empty(bed: Bed) {
///     let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
///         .fetch_one(&bed.pool())
///         .await
///         .unwrap();
///     assert_eq!(rows, 0);
/// }
/// # fn main() {}
/// ```
#[proc_macro_attribute]
pub fn test(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::test(args.into(), item.into()).into()
}
