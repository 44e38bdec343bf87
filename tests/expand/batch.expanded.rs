use idem_runtime::{Delivery, State, idempotent};
use idem_tests::fixtures::{Credit, Fees};
/// Credits the accounts of a batch, less the fee, with one statement.
#[allow(non_camel_case_types)]
pub struct credit_many {}
/// Returns the `credit_many` handler, for `Router::route`. The body as written is `credit_many::run`.
pub fn credit_many() -> credit_many {
    credit_many {}
}
impl ::core::fmt::Debug for credit_many {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        f.write_str("credit_many")
    }
}
impl credit_many {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "ledger.credit_many.v1";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        tx: &mut sqlx::PgTransaction<'_>,
        State(fees): State<Fees>,
        deliveries: &[Delivery],
        cmds: Vec<Credit>,
    ) -> Result<(), sqlx::Error> {
        let accounts: Vec<i64> = cmds.iter().map(|cmd| cmd.account).collect();
        let amounts: Vec<i64> = cmds.iter().map(|cmd| cmd.amount - fees.0).collect();
        let _ = deliveries;
        sqlx::query(
                "UPDATE accounts SET balance = balance + c.amount
         FROM (SELECT account, sum(amount) AS amount
                 FROM unnest($1::int8[], $2::int8[]) AS m(account, amount) GROUP BY account) AS c
         WHERE id = c.account",
            )
            .bind(&accounts)
            .bind(&amounts)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}
impl<
    __S,
> ::idem_runtime::handler::Handler<
    __S,
    ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
> for credit_many
where
    __S: ::core::marker::Send + ::core::marker::Sync + 'static,
    State<Fees>: ::idem_runtime::handler::FromBatch<__S>,
{
    type Payload = Credit;
    type Codec = ::idem_runtime::codec::Json;
    const BATCHES: bool = true;
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
        >>::handle_batch(
                self,
                __idem_tx,
                ::std::vec::Vec::from([__idem_payload]),
                ::core::slice::from_ref(__idem_delivery),
                __idem_state,
            )
            .await
    }
    #[allow(clippy::ignored_unit_patterns)]
    async fn handle_batch(
        &self,
        __idem_tx: &mut ::idem_runtime::__private::Transaction<
            '_,
            ::idem_runtime::__private::DatabaseOf<sqlx::PgTransaction<'static>>,
        >,
        __idem_payloads: ::std::vec::Vec<Self::Payload>,
        __idem_deliveries: &[::idem_runtime::Delivery],
        __idem_state: &__S,
    ) -> ::core::result::Result<(), ::idem_runtime::HandlerError> {
        let __idem_result = credit_many::run(
                __idem_tx,
                ::idem_runtime::handler::FromBatch::from_batch(
                    __idem_deliveries,
                    __idem_state,
                ),
                __idem_deliveries,
                __idem_payloads,
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
