use idem_runtime::idempotent;
#[allow(non_camel_case_types)]
struct ping {}
#[automatically_derived]
#[doc(hidden)]
#[allow(non_camel_case_types)]
unsafe impl ::core::clone::TrivialClone for ping {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::clone::Clone for ping {
    #[inline]
    fn clone(&self) -> ping {
        *self
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::marker::Copy for ping {}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::fmt::Debug for ping {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::write_str(f, "ping")
    }
}
#[automatically_derived]
#[allow(non_camel_case_types)]
impl ::core::default::Default for ping {
    #[inline]
    fn default() -> ping {
        ping {}
    }
}
/// Returns the `ping` handler, for `Router::route`. The body as written is `ping::run`.
fn ping() -> ping {
    ping {}
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
impl ::idem_runtime::Handler for ping {
    type Payload = String;
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn run_claimed<'a, 'c>(
        &'a self,
        __idem_tx: &'a mut ::idem_runtime::__private::PgTransaction<'c>,
        __idem_payload: Self::Payload,
        __idem_delivery: &'a ::idem_runtime::Delivery,
    ) -> ::idem_runtime::HandlerFuture<'a> {
        ::idem_runtime::__private::Box::pin(async move {
            match ping::run(__idem_tx, __idem_payload).await {
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
