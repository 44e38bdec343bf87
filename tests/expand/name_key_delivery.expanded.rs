use idem_runtime::idempotent;
pub struct Credit {
    pub transfer_id: String,
    pub account: i64,
    pub amount: i64,
}
impl<'de> serde::Deserialize<'de> for Credit {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Self, D::Error> {
        let (transfer_id, account, amount) = serde::Deserialize::deserialize(
            deserializer,
        )?;
        Ok(Credit {
            transfer_id,
            account,
            amount,
        })
    }
}
/// Credits an account once per transfer.
#[allow(non_camel_case_types)]
pub struct credit {}
#[automatically_derived]
#[doc(hidden)]
#[allow(non_camel_case_types)]
unsafe impl ::core::clone::TrivialClone for credit {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::clone::Clone for credit {
    #[inline]
    fn clone(&self) -> credit {
        *self
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::marker::Copy for credit {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::fmt::Debug for credit {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::write_str(f, "credit")
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::default::Default for credit {
    #[inline]
    fn default() -> credit {
        credit {}
    }
}
/// Returns the `credit` handler, for `Router::route`. The body as written is `credit::run`.
pub fn credit() -> credit {
    credit {}
}
impl credit {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "credit-v1";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        tx: &mut sqlx::PgTransaction<'_>,
        cmd: Credit,
        meta: &idem_runtime::Delivery,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
            .bind(cmd.amount)
            .bind(cmd.account)
            .execute(&mut **tx)
            .await?;
        let _ = meta.stream_sequence();
        Ok(())
    }
}
impl ::idem_runtime::Handler for credit {
    type Payload = Credit;
    fn name(&self) -> &'static str {
        Self::NAME
    }
    #[allow(unused_variables)]
    fn message_key(
        &self,
        __idem_payload: &Self::Payload,
    ) -> ::core::option::Option<::std::string::String> {
        let cmd = __idem_payload;
        ::core::option::Option::Some(
            ::idem_runtime::__private::ToString::to_string(&(cmd.transfer_id)),
        )
    }
    fn run_claimed<'a, 'c>(
        &'a self,
        __idem_tx: &'a mut ::idem_runtime::__private::PgTransaction<'c>,
        __idem_payload: Self::Payload,
        __idem_delivery: &'a ::idem_runtime::Delivery,
    ) -> ::idem_runtime::HandlerFuture<'a> {
        ::idem_runtime::__private::Box::pin(async move {
            match credit::run(__idem_tx, __idem_payload, __idem_delivery).await {
                ::core::result::Result::Ok(_) => {
                    ::core::result::Result::Ok(::idem_runtime::Outcome::Processed)
                }
                ::core::result::Result::Err(__idem_error) => {
                    ::core::result::Result::Err({
                        #[allow(unused_imports)]
                        use ::idem_runtime::__private::specialize::{
                            ByClassify as _, ByDefault as _,
                        };
                        let error = __idem_error;
                        let class = (&::idem_runtime::__private::specialize::ClassOf(
                            &error,
                        ))
                            .idem_class();
                        ::idem_runtime::HandlerError::classified(error, class)
                    })
                }
            }
        })
    }
}
fn main() {}
