use idem_runtime::idempotent;
#[allow(non_camel_case_types)]
struct ping {}
/// Returns the `ping` handler, for `Router::route`. The body as written is `ping::run`.
fn ping() -> ping {
    ping {}
}
impl ::core::fmt::Debug for ping {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        f.write_str("ping")
    }
}
impl ping {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "ping";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        _tx: &mut sqlx::PgTransaction<'_>,
        _ping: String,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }
}
impl<
    __S,
> ::idem_runtime::handler::Handler<
    __S,
    ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
> for ping
where
    __S: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    type Payload = String;
    type Codec = ::idem_runtime::codec::Json;
    fn name(&self) -> &'static str {
        Self::NAME
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
        __idem_state: &__S,
    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
        let __idem_result = ping::run(__idem_tx, __idem_payload).await;
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
