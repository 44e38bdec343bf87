use idem_runtime::idempotent;
type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
#[allow(non_camel_case_types)]
struct transfer {}
#[automatically_derived]
#[doc(hidden)]
#[allow(non_camel_case_types)]
unsafe impl ::core::clone::TrivialClone for transfer {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::clone::Clone for transfer {
    #[inline]
    fn clone(&self) -> transfer {
        *self
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::marker::Copy for transfer {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::fmt::Debug for transfer {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::write_str(f, "transfer")
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::default::Default for transfer {
    #[inline]
    fn default() -> transfer {
        transfer {}
    }
}
/// Returns the `transfer` handler, for `Router::route`. The body as written is `transfer::run`.
fn transfer() -> transfer {
    transfer {}
}
impl transfer {
    /// The handler name stored with each claim in the dedup table.
    pub const NAME: &'static str = "transfer-v1";
    /// The handler body as written. The runtime runs it only after a fresh claim.
    pub async fn run(
        _tx: &mut sqlx::PgTransaction<'_>,
        (transfer_id, mut amount): (String, i64),
    ) -> Result<()> {
        amount -= 1;
        let _ = (transfer_id, amount);
        Ok(())
    }
}
impl ::idem_runtime::Handler for transfer {
    type Payload = (String, i64);
    fn name(&self) -> &'static str {
        Self::NAME
    }
    #[allow(unused_variables)]
    fn message_key(
        &self,
        __idem_payload: &Self::Payload,
    ) -> ::core::option::Option<::std::string::String> {
        let (transfer_id, amount) = __idem_payload;
        ::core::option::Option::Some(
            ::idem_runtime::__private::ToString::to_string(&(transfer_id)),
        )
    }
    fn run_claimed<'a, 'c>(
        &'a self,
        __idem_tx: &'a mut ::idem_runtime::__private::PgTransaction<'c>,
        __idem_payload: Self::Payload,
        __idem_delivery: &'a ::idem_runtime::Delivery,
    ) -> ::idem_runtime::HandlerFuture<'a> {
        ::idem_runtime::__private::Box::pin(async move {
            match transfer::run(__idem_tx, __idem_payload).await {
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
