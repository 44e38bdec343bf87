//! What `#[idempotent]` refuses, with which message and where, and that it
//! reports every problem of one fn together; and the shapes it accepts.

use quote::quote;

use crate::expand::test_util::{error, errors, expand};

#[test]
fn a_bytes_payload_needs_a_codec() {
    for payload in [quote!(Vec<u8>), quote!(bytes::Bytes)] {
        assert!(
            error(
                quote!(),
                quote!(async fn h(tx: &mut Tx, m: #payload) -> Result<(), E> {})
            )
            .starts_with("this payload would be decoded as JSON"),
            "{payload}"
        );
    }
    let expanded = expand(
        quote!(codec = json),
        quote!(
            async fn h(tx: &mut Tx, m: Vec<u8>) -> Result<(), E> {}
        ),
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
}

#[test]
fn rejects_a_non_async_fn() {
    assert_eq!(
        error(
            quote!(),
            quote!(
                fn credit(tx: &mut Tx, m: M) -> Result<(), E> {}
            )
        ),
        "an `#[idempotent]` handler must be async: write `async fn credit`"
    );
}

#[test]
fn rejects_an_item_that_is_not_a_fn() {
    assert!(
        error(
            quote!(),
            quote!(
                struct Credit;
            )
        )
        .starts_with("`#[idempotent]` goes on an `async fn` handler")
    );
}

#[test]
fn rejects_missing_params() {
    assert!(
        error(
            quote!(),
            quote!(
                async fn h() -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler takes the transaction and the message")
    );
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler takes the message as its last parameter")
    );
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(m: M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler takes the transaction first")
    );
}

#[test]
fn rejects_a_tx_that_is_not_a_mut_reference() {
    for tx in [quote!(Tx), quote!(&Tx), quote!(Box<Tx>)] {
        assert_eq!(
            error(
                quote!(),
                quote!(async fn h(tx: #tx, m: M) -> Result<(), E> {})
            ),
            "the first parameter of an `#[idempotent]` handler is the transaction the claim \
             runs in: write `tx: &mut sqlx::PgTransaction<'_>` (PostgreSQL), or \
             `tx: &mut sqlx::Transaction<'_, DB>` for another database",
            "{tx}"
        );
    }
}

/// Which `&mut` types are transactions, and on which database, is rustc's
/// to tell (through `DatabaseOf`), not the macro's.
#[test]
fn accepts_any_mut_reference_as_the_tx() {
    for tx in [
        quote!(&mut sqlx::PgTransaction<'_>),
        quote!(&mut sqlx::Transaction<'_, sqlx::Sqlite>),
        quote!(&mut Transaction<'_, Postgres>),
        quote!(&mut sqlx::PgConnection),
        quote!(&mut (Tx)),
    ] {
        let expanded = expand(
            quote!(),
            quote!(async fn h(tx: #tx, m: M) -> Result<(), E> {}),
        );
        assert!(!expanded.contains("compile_error"), "{tx}: {expanded}");
    }
}

#[test]
fn rejects_a_payload_reference_and_the_message_before_the_delivery() {
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, m: &M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler owns the message")
    );
    assert_eq!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, cmd: Credit, d: &Delivery) -> Result<(), E> {}
            )
        ),
        "an `#[idempotent]` handler takes the message last, after `&Delivery` and \
         `State<T>` (as axum takes the body last): move `cmd : Credit` to the end"
    );
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, d: &mut Delivery, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("only the first parameter of an `#[idempotent]` handler is `&mut`")
    );
}

#[test]
fn takes_any_number_of_parameters_between_tx_and_message() {
    let expanded = expand(
        quote!(),
        quote!(
            async fn h(
                tx: &mut Tx,
                State(a): State<A>,
                d: &Delivery,
                State(b): State<B>,
                m: M,
            ) -> Result<(), E> {
            }
        ),
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
    assert!(expanded.contains("State < A > : :: idem_runtime :: handler :: FromDelivery < __S >"));
    assert!(expanded.contains("State < B > : :: idem_runtime :: handler :: FromDelivery < __S >"));
}

#[test]
fn rejects_a_receiver() {
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(&self, tx: &mut Tx, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler is a free fn, not a method")
    );
}

#[test]
fn rejects_generics_and_where_clauses() {
    assert_eq!(
        errors(
            quote!(),
            quote!(
                async fn h<T>(tx: &mut Tx, m: T) -> Result<(), E>
                where
                    T: Send,
                {
                }
            )
        ),
        [
            "an `#[idempotent]` handler cannot be generic: the runtime decodes each message \
             into one concrete type, so write the concrete types instead",
            "an `#[idempotent]` handler cannot have a `where` clause: remove it",
        ]
    );
    assert!(
        error(
            quote!(),
            quote!(
                async fn h<'c>(tx: &mut Tx<'c>, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler cannot declare lifetimes")
    );
}

#[test]
fn rejects_unsafe_and_extern() {
    assert!(
        error(
            quote!(),
            quote!(
                async unsafe fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler cannot be `unsafe`")
    );
    assert!(
        error(
            quote!(),
            quote!(
                async extern "C" fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("an `#[idempotent]` handler is called by the runtime, not through an ABI")
    );
}

#[test]
fn accepts_any_return_type_and_rejects_a_missing_one() {
    for output in [
        quote!(Result<(), E>),
        quote!(anyhow::Result<()>),
        quote!(::std::result::Result<(), E>),
        quote!(Fallible),
    ] {
        let expanded = expand(
            quote!(),
            quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
        );
        assert!(!expanded.contains("compile_error"), "{output}: {expanded}");
    }
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, m: M) {}
            )
        )
        .ends_with("add `-> Result<(), MyError>` after the parameters")
    );
}

#[test]
fn rejects_a_batch_handler_that_does_not_take_a_batch() {
    assert!(
        error(
            quote!(batch),
            quote!(
                async fn h(tx: &mut Tx, m: Credit) -> Result<(), E> {}
            )
        )
        .starts_with("a batch handler (`#[idempotent(batch)]`) takes the fresh messages")
    );
    assert!(
        error(
            quote!(batch),
            quote!(
                async fn h(tx: &mut Tx, d: &Delivery, m: Vec<M>) -> Result<(), E> {}
            )
        )
        .starts_with("a batch handler takes the deliveries of its messages")
    );
    assert!(
        error(
            quote!(),
            quote!(
                async fn h(tx: &mut Tx, d: &[Delivery], m: M) -> Result<(), E> {}
            )
        )
        .starts_with("only a batch handler (`#[idempotent(batch)]`) takes `&[Delivery]`")
    );
    assert!(
        error(
            quote!(batch, key = cmds.id),
            quote!(
                async fn h(tx: &mut Tx, cmds: Vec<M>) -> Result<(), E> {}
            )
        )
        .starts_with("a batch handler's key is computed for each message of the batch")
    );
}

#[test]
fn a_batch_handler_cannot_return_a_value() {
    assert!(
        error(
            quote!(batch, key = |c| c.id),
            quote!(
                async fn h(tx: &mut Tx, m: Vec<M>) -> Result<Receipt, E> {}
            )
        )
        .starts_with("a batch handler (`#[idempotent(batch)]`) returns `Result<(), E>`")
    );
}

#[test]
fn reports_every_problem_at_once() {
    assert_eq!(
        errors(
            quote!(retries = 3),
            quote!(
                fn h(tx: Tx, m: M) {}
            )
        )
        .len(),
        4,
        "unknown argument, not async, tx not `&mut`, no return type"
    );
}
