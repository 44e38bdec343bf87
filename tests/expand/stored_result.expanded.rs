use idem_runtime::idempotent;
pub struct Place {
    order: i64,
}
pub struct Receipt {
    order: i64,
}
/// Places an order; the receipt is stored with the claim.
#[allow(non_camel_case_types)]
pub struct place {}
/// Returns the `place` handler, for `Router::route`. The body as written is `place::run`.
pub fn place() -> place {
    place {}
}
impl ::core::fmt::Debug for place {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        f.write_str("place")
    }
}
impl place {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "orders.place.v1";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        _tx: &mut sqlx::PgTransaction<'_>,
        cmd: Place,
    ) -> Result<Receipt, sqlx::Error> {
        Ok(Receipt { order: cmd.order })
    }
}
impl<
    __S,
> ::idem_runtime::handler::Handler<
    __S,
    ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
> for place
where
    __S: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    type Payload = Place;
    type Codec = ::idem_runtime::codec::Json;
    fn name(&self) -> &'static str {
        Self::NAME
    }
    async fn handle(
        &self,
        __idem_tx: &mut ::idem_runtime::__private::Transaction<
            '_,
            ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
        >,
        __idem_payload: Self::Payload,
        __idem_delivery: &::idem_runtime::Delivery,
        __idem_state: &__S,
    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
        <Self as ::idem_runtime::handler::Handler<
            __S,
            ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
        >>::handle_and_encode(
                self,
                __idem_tx,
                __idem_payload,
                __idem_delivery,
                __idem_state,
            )
            .await
            .map(::core::mem::drop)
    }
    async fn handle_and_encode(
        &self,
        __idem_tx: &mut ::idem_runtime::__private::Transaction<
            '_,
            ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
        >,
        __idem_payload: Self::Payload,
        __idem_delivery: &::idem_runtime::Delivery,
        __idem_state: &__S,
    ) -> ::core::result::Result<
        ::core::option::Option<::idem_runtime::codec::Bytes>,
        ::idem_runtime::HandlerError,
    > {
        let __idem_result = place::run(__idem_tx, __idem_payload).await;
        match ::idem_runtime::error::HandlerResult::into_result(__idem_result) {
            ::core::result::Result::Ok(__idem_value) => {
                ::idem_runtime::__private::encode::<Self::Codec, _>(&__idem_value)
            }
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
