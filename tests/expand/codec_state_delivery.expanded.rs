use bytes::Bytes;
use idem_runtime::{Delivery, State, idempotent};
use idem_tests::fixtures::Ledger;
#[allow(non_camel_case_types)]
struct archive {}
/// Returns the `archive` handler, for `Router::route`. The body as written is `archive::run`.
fn archive() -> archive {
    archive {}
}
impl ::core::fmt::Debug for archive {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        f.write_str("archive")
    }
}
impl archive {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "archive";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        _tx: &mut sqlx::PgTransaction<'_>,
        delivery: &Delivery,
        State(ledger): State<Ledger>,
        blob: Bytes,
    ) -> anyhow::Result<()> {
        let _ = (delivery.stream_sequence(), ledger.fees.0, blob.len());
        Ok(())
    }
}
impl ::idem_runtime::handler::Handler<
    Ledger,
    ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
> for archive
where
    State<Ledger>: ::idem_runtime::handler::FromDelivery<Ledger>,
{
    type Payload = Bytes;
    type Codec = ::idem_runtime::codec::Raw;
    fn name(&self) -> &'static str {
        Self::NAME
    }
    #[allow(unused_variables)]
    fn message_key(
        &self,
        __idem_payload: &Self::Payload,
        __idem_delivery: &::idem_runtime::Delivery,
    ) -> ::core::option::Option<::std::string::String> {
        let blob = __idem_payload;
        let delivery = __idem_delivery;
        ::core::option::Option::Some(
            ::idem_runtime::__private::ToString::to_string(
                &(::alloc::__export::must_use({
                    ::alloc::fmt::format(
                        format_args!("{0}:{1}", delivery.subject(), blob.len()),
                    )
                })),
            ),
        )
    }
    #[allow(clippy::ignored_unit_patterns)]
    async fn handle(
        &self,
        __idem_tx: &mut ::idem_runtime::__private::Transaction<
            '_,
            ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
        >,
        __idem_payload: Self::Payload,
        __idem_delivery: &::idem_runtime::Delivery,
        __idem_state: &Ledger,
    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
        let __idem_result = archive::run(
                __idem_tx,
                __idem_delivery,
                ::idem_runtime::handler::FromDelivery::from_delivery(
                    __idem_delivery,
                    __idem_state,
                ),
                __idem_payload,
            )
            .await;
        match ::idem_runtime::error::HandlerResult::into_result(__idem_result) {
            ::core::result::Result::Ok(_) => ::core::result::Result::Ok(()),
            ::core::result::Result::Err(__idem_error) => {
                ::core::result::Result::Err({
                    #[allow(unused_imports)]
                    use ::idem_runtime::__private::specialize::{
                        ByChain as _, ByClassify as _, ByDefault as _, ByHeldError as _,
                    };
                    let error = __idem_error;
                    let found = (&&&&::idem_runtime::__private::specialize::ClassOf(
                        &error,
                    ))
                        .idem_class();
                    ::idem_runtime::HandlerError::found(error, found)
                })
            }
        }
    }
}
fn main() {}
