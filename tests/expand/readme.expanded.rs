use idem_runtime::{State, idempotent};
use idem_tests::fixtures::{Credit, Fees, LedgerError};
/// Credits an account once per transfer, less the fee.
#[allow(non_camel_case_types)]
pub struct credit {}
/// Returns the `credit` handler, for `Router::route`. The body as written is `credit::run`.
pub fn credit() -> credit {
    credit {}
}
impl ::core::fmt::Debug for credit {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        f.write_str("credit")
    }
}
impl credit {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "ledger.credit.v1";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        tx: &mut sqlx::PgTransaction<'_>,
        State(fees): State<Fees>,
        cmd: Credit,
    ) -> Result<(), LedgerError> {
        let updated = sqlx::query(
                "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
            )
            .bind(cmd.amount - fees.0)
            .bind(cmd.account)
            .execute(&mut **tx)
            .await?;
        if updated.rows_affected() == 0 {
            return Err(LedgerError::UnknownAccount(cmd.account));
        }
        Ok(())
    }
}
impl<
    __S,
> ::idem_runtime::handler::Handler<
    __S,
    ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
> for credit
where
    __S: ::core::marker::Send + ::core::marker::Sync + 'static,
    State<Fees>: ::idem_runtime::handler::FromDelivery<__S>,
{
    type Payload = Credit;
    type Codec = ::idem_runtime::codec::Json;
    fn name(&self) -> &'static str {
        Self::NAME
    }
    #[allow(unused_variables)]
    fn message_key(
        &self,
        __idem_payload: &Self::Payload,
        __idem_delivery: &::idem_runtime::Delivery,
    ) -> ::core::option::Option<::std::string::String> {
        let cmd = __idem_payload;
        ::core::option::Option::Some(
            ::idem_runtime::__private::ToString::to_string(&(cmd.transfer_id)),
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
        __idem_state: &__S,
    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
        let __idem_result = credit::run(
                __idem_tx,
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
