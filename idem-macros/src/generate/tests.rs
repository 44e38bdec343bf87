//! What `#[idempotent]` generates for each form of handler: the items, the
//! `Handler` impl, the message key, the batch form and the stored result.

use quote::quote;
use syn::Pat;

use super::key::bind_by_reference;
use crate::expand::idempotent;
use crate::expand::test_util::{assert_tokens_eq, error, expand};

#[test]
fn expands_a_minimal_handler() {
    let expanded = idempotent(
        quote!(),
        quote! {
            async fn credit(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), E> {
                apply(tx, cmd).await
            }
        },
    );
    assert_tokens_eq(
        expanded,
        quote! {
            #[allow(non_camel_case_types)]
            struct credit {}

            #[doc = " Returns the `credit` handler, for `Router::route`. The body as written is `credit::run`."]
            fn credit() -> credit {
                credit {}
            }

            impl ::core::fmt::Debug for credit {
                fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                    f.write_str("credit")
                }
            }

            impl credit {
                /// The handler name stored with each claim in the dedup table.
                pub const NAME: &'static str = "credit";

                /// The handler body as written. The runtime runs it only after a fresh claim.
                pub async fn run(tx: &mut sqlx::PgTransaction<'_>, cmd: Credit) -> Result<(), E> {
                    apply(tx, cmd).await
                }
            }

            // `> >`, not `>>`: the database's `>` is a token of its own.
            impl<__S> ::idem_runtime::handler::Handler<
                __S,
                ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static> > > for credit
            where
                __S: ::core::marker::Send + ::core::marker::Sync + 'static,
            {
                type Payload = Credit;
                type Codec = ::idem_runtime::codec::Json;

                fn name(&self) -> &'static str {
                    Self::NAME
                }

                #[allow(clippy::ignored_unit_patterns)]
                async fn handle(
                    &self,
                    __idem_tx: &mut ::idem_runtime::__private::Transaction<
                        '_,
                        ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static> > >,
                    __idem_payload: Self::Payload,
                    __idem_delivery: &::idem_runtime::Delivery,
                    __idem_state: &__S,
                ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
                    let __idem_result = credit::run(__idem_tx, __idem_payload).await;
                    match ::idem_runtime::error::HandlerResult::into_result(__idem_result) {
                        ::core::result::Result::Ok(_) => ::core::result::Result::Ok(()),
                        ::core::result::Result::Err(__idem_error) => {
                            ::core::result::Result::Err(::idem_runtime::__private::handler_error!(__idem_error))
                        }
                    }
                }
            }
        },
    );
}

#[test]
fn the_database_is_the_one_the_transaction_is_on() {
    for (tx, tx_static) in [
        (
            quote!(&mut sqlx::PgTransaction<'_>),
            quote!(sqlx::PgTransaction<'static>),
        ),
        (
            quote!(&mut sqlx::Transaction<'_, sqlx::Sqlite>),
            quote!(sqlx::Transaction<'static, sqlx::Sqlite>),
        ),
        (quote!(&mut sqlx::PgConnection), quote!(sqlx::PgConnection)),
        // Elided lifetimes too; a `for<'a>` keeps its names.
        (
            quote!(&mut Conn<&Pool, Box<dyn for<'a> Fn(&'a u8)>>),
            quote!(Conn<&'static Pool, Box<dyn for<'a> Fn(&'static u8)>>),
        ),
    ] {
        let db = quote!(::idem_runtime::__private::DatabaseOf<#tx_static>);
        // Plain, batch, and a stored result (for one state): the last two
        // call their other method through the trait, database and all.
        for (args, params, output, state, by_trait) in [
            (
                quote!(),
                quote!(m: M),
                quote!(Result<(), E>),
                quote!(__S),
                false,
            ),
            (
                quote!(batch),
                quote!(m: Vec<M>),
                quote!(Result<(), E>),
                quote!(__S),
                true,
            ),
            (
                quote!(state = App),
                quote!(m: M),
                quote!(Result<R, E>),
                quote!(App),
                true,
            ),
        ] {
            let expanded = expand(
                args.clone(),
                quote!(async fn h(tx: #tx, #params) -> #output {}),
            );
            assert!(
                !expanded.contains("compile_error"),
                "{tx}, {args}: {expanded}"
            );
            let handler = quote!(::idem_runtime::handler::Handler<#state, #db>);
            let tx_param = quote!(__idem_tx: &mut ::idem_runtime::__private::Transaction<'_, #db>);
            let calls = quote!(<Self as #handler>::);
            // Without spaces: `>>` and `> >` are the same tokens.
            let [expanded, handler, tx_param, calls] = [
                expanded,
                handler.to_string(),
                tx_param.to_string(),
                calls.to_string(),
            ]
            .map(|text| text.replace(' ', ""));
            assert!(
                expanded.contains(&format!("{handler}forh")),
                "{handler}: {expanded}"
            );
            assert!(expanded.contains(&tx_param), "{tx_param}: {expanded}");
            assert_eq!(expanded.contains(&calls), by_trait, "{calls}: {expanded}");
        }
    }
}

#[test]
fn name_key_state_delivery_and_attributes() {
    let expanded = expand(
        quote!(
            name = "credit-v1",
            key = format!("{}:{}", meta.subject(), cmd.transfer_id)
        ),
        quote! {
            /// Credits an account.
            #[cfg(feature = "ledger")]
            #[tracing::instrument(skip(tx))]
            pub(crate) async fn credit(
                tx: &mut sqlx::PgTransaction<'_>,
                State(fees): State<Fees>,
                meta: &idem_runtime::Delivery,
                cmd: Credit,
            ) -> Result<(), E> {
                Ok(())
            }
        },
    );
    let cfg = quote!(#[cfg(feature = "ledger")]).to_string();
    let docs = quote!(#[doc = r" Credits an account."]).to_string();
    let instrument = quote!(#[tracing::instrument(skip(tx))]).to_string();

    assert!(expanded.starts_with(&format!("{docs} {cfg} # [allow (non_camel_case_types)]")));
    assert!(expanded.contains("pub (crate) struct credit { }"));
    assert!(expanded.contains("pub (crate) fn credit () -> credit { credit { } }"));
    assert_eq!(expanded.matches(&cfg).count(), 5, "{expanded}");
    assert_eq!(expanded.matches(&docs).count(), 1, "{expanded}");
    assert!(
        expanded.contains(&format!(
            "fresh claim.\"] {instrument} pub async fn run (tx"
        )),
        "{expanded}"
    );
    assert!(expanded.contains("pub const NAME : & 'static str = \"credit-v1\" ;"));
    assert!(
        expanded.contains("State < Fees > : :: idem_runtime :: handler :: FromDelivery < __S >"),
        "{expanded}"
    );
    assert!(
        expanded.contains(
            "credit :: run (__idem_tx , :: idem_runtime :: handler :: FromDelivery :: from_delivery \
             (__idem_delivery , __idem_state) , __idem_delivery , __idem_payload) . await"
        ),
        "{expanded}"
    );

    let message_key = quote! {
        #[allow(unused_variables)]
        fn message_key(
            &self,
            __idem_payload: &Self::Payload,
            __idem_delivery: &::idem_runtime::Delivery,
        ) -> ::core::option::Option<::std::string::String> {
            let cmd = __idem_payload;
            let meta = __idem_delivery;
            ::core::option::Option::Some(
                ::idem_runtime::__private::ToString::to_string(&(format!("{}:{}", meta.subject(), cmd.transfer_id)))
            )
        }
    };
    assert!(expanded.contains(&message_key.to_string()), "{expanded}");
}

#[test]
fn codec_and_crate_arguments() {
    let expanded = expand(
        quote!(codec = raw, crate = ::my_idem),
        quote!(
            async fn h(tx: &mut Tx, bytes: Vec<u8>) -> Result<(), E> {}
        ),
    );
    assert!(
        expanded.contains("type Codec = :: my_idem :: codec :: Raw ;"),
        "{expanded}"
    );
    assert!(!expanded.contains("idem_runtime"), "{expanded}");
    let expanded = expand(
        quote!(codec = my::Cbor),
        quote!(
            async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
        ),
    );
    assert!(expanded.contains("type Codec = my :: Cbor ;"), "{expanded}");
}

#[test]
fn the_default_name_is_the_unraw_fn_name() {
    let expanded = expand(
        quote!(),
        quote!(
            async fn r#move(tx: &mut Tx, m: M) -> Result<(), E> {}
        ),
    );
    assert!(expanded.contains("pub const NAME : & 'static str = \"move\" ;"));
    assert!(expanded.contains("struct r#move { }"));
    assert!(expanded.contains("Returns the `move` handler"));
}

#[test]
fn no_message_key_without_key() {
    let expanded = expand(
        quote!(name = "n"),
        quote!(
            async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
        ),
    );
    assert!(!expanded.contains("message_key"));
}

#[test]
fn the_key_pattern_binds_by_reference() {
    let pattern: Pat = syn::parse_quote! {
        Credit { ref mut a, b: mut c, d: ref e @ Some(mut f), g: (mut h, [ref i, ..]), .. }
    };
    let expected: Pat = syn::parse_quote! {
        Credit { a, b: c, d: e @ Some(f), g: (h, [i, ..]), .. }
    };
    let stripped = bind_by_reference(pattern);
    assert_tokens_eq(quote!(#stripped), quote!(#expected));
    let pattern = bind_by_reference(syn::parse_quote!(mut cmd));
    assert_tokens_eq(quote!(#pattern), quote!(cmd));
}

#[test]
fn a_pattern_payload_and_any_tx_and_delivery_references() {
    let expanded = expand(
        quote!(key = account),
        quote! {
            async fn h(
                _tx: &mut sqlx::PgConnection,
                _: &Delivery,
                Credit { account, .. }: Credit,
            ) -> Result<(), E> {}
        },
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
    assert!(expanded.contains("let Credit { account , .. } = __idem_payload ;"));
    assert!(
        !expanded.contains("= __idem_delivery ;"),
        "a `_` delivery binds nothing: {expanded}"
    );
}

#[test]
fn a_batch_handler_takes_the_batch_and_runs_one_message_as_a_batch_of_one() {
    let expanded = expand(
        quote!(batch, key = |cmd| cmd.id),
        quote!(
            async fn credit_many(
                tx: &mut Tx,
                State(fees): State<Fees>,
                deliveries: &[Delivery],
                cmds: Vec<Credit>,
            ) -> Result<(), E> {
            }
        ),
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
    for expected in [
        "type Payload = Credit ;",
        "const BATCHES : bool = true ;",
        "State < Fees > : :: idem_runtime :: handler :: FromBatch < __S >",
        "< Self as :: idem_runtime :: handler :: Handler < __S , :: idem_runtime :: __private :: \
         DatabaseOf < Tx > >> :: handle_batch (self , __idem_tx , \
         :: std :: vec :: Vec :: from ([__idem_payload]) , :: core :: slice :: from_ref \
         (__idem_delivery) , __idem_state ,) . await",
        "credit_many :: run (__idem_tx , :: idem_runtime :: handler :: FromBatch :: from_batch \
         (__idem_deliveries , __idem_state) , __idem_deliveries , __idem_payloads) . await",
        "let cmd = __idem_payload ;",
    ] {
        assert!(expanded.contains(expected), "{expected}: {expanded}");
    }
    assert!(!expanded.contains("FromDelivery"), "{expanded}");
}

#[test]
fn a_per_message_handler_says_so_in_its_impl() {
    let expanded = expand(
        quote!(per_message),
        quote!(
            async fn credit(tx: &mut Tx, cmd: Credit) -> Result<(), E> {}
        ),
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
    assert!(
        expanded.contains("const PER_MESSAGE : bool = true ;"),
        "{expanded}"
    );
    let plain = expand(
        quote!(),
        quote!(
            async fn credit(tx: &mut Tx, cmd: Credit) -> Result<(), E> {}
        ),
    );
    assert!(!plain.contains("PER_MESSAGE"), "{plain}");
}

#[test]
fn a_key_closure_binds_its_own_names() {
    let expanded = expand(
        quote!(key = |c, d| format!("{}:{}", d.subject(), c.id)),
        quote!(
            async fn h(tx: &mut Tx, delivery: &Delivery, cmd: M) -> Result<(), E> {}
        ),
    );
    assert!(!expanded.contains("compile_error"), "{expanded}");
    assert!(expanded.contains("let c = __idem_payload ; let d = __idem_delivery ;"));
    assert!(!expanded.contains("let cmd = __idem_payload"), "{expanded}");
    assert!(
        error(
            quote!(key = |a, b, c| a.id),
            quote!(
                async fn h(tx: &mut Tx, m: M) -> Result<(), E> {}
            )
        )
        .starts_with("a key closure takes the message, and optionally its delivery")
    );
}

#[test]
fn a_handler_that_returns_a_value_encodes_it_and_a_unit_one_does_not() {
    for output in [quote!(Result<Receipt, E>), quote!(anyhow::Result<Receipt>)] {
        let expanded = expand(
            quote!(),
            quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
        );
        assert!(!expanded.contains("compile_error"), "{output}: {expanded}");
        for expected in [
            "async fn handle_and_encode",
            ":: idem_runtime :: __private :: encode :: < Self :: Codec , _ > (& __idem_value)",
            ". map (:: core :: mem :: drop)",
        ] {
            assert!(expanded.contains(expected), "{expected}: {expanded}");
        }
    }
    for output in [quote!(Result<(), E>), quote!(anyhow::Result<()>)] {
        let expanded = expand(
            quote!(),
            quote!(async fn h(tx: &mut Tx, m: M) -> #output {}),
        );
        assert!(
            !expanded.contains("handle_and_encode"),
            "{output}: {expanded}"
        );
        assert!(!expanded.contains("no_value"), "{output}: {expanded}");
    }
    let expanded = expand(
        quote!(),
        quote!(
            async fn h(tx: &mut Tx, m: M) -> Fallible {}
        ),
    );
    assert!(!expanded.contains("handle_and_encode"), "{expanded}");
    assert!(
        expanded.contains(":: idem_runtime :: __private :: no_value (__idem_value)"),
        "{expanded}"
    );
}
