use idem_runtime::{Handler, Route, Router, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Transfer {
    id: String,
}

// The payload may be named like its handler, and so may any local: the
// handler's name stays a plain fn in the value namespace.
#[idempotent(key = transfer.id)]
async fn transfer(
    _tx: &mut sqlx::PgTransaction<'_>,
    transfer: Transfer,
) -> Result<(), sqlx::Error> {
    let transfer_id = transfer.id;
    assert!(!transfer_id.is_empty());
    Ok(())
}

#[idempotent(name = "type-v1")]
async fn r#type(_tx: &mut sqlx::PgTransaction<'_>, _: Transfer) -> Result<(), sqlx::Error> {
    Ok(())
}

// `cfg` removes every generated item, so nothing refers to a missing `run`.
#[idempotent]
#[cfg(any())]
async fn never(_tx: &mut sqlx::PgTransaction<'_>, _: Transfer) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(name = "always-v1")]
#[cfg(unix)]
async fn always(_tx: &mut sqlx::PgTransaction<'_>, _: Transfer) -> Result<(), sqlx::Error> {
    Ok(())
}

mod handlers {
    use serde::Deserialize;

    #[derive(Deserialize)]
    pub struct Refund {}

    /// Visible outside its module, like the fn it was written as.
    #[idempotent_alias::idempotent(name = "refund-v1")]
    pub async fn refund(_tx: &mut sqlx::PgTransaction<'_>, _: Refund) -> Result<(), sqlx::Error> {
        Ok(())
    }

    mod idempotent_alias {
        pub use idem_runtime::idempotent;
    }
}

fn main() {
    let delivery = idem_runtime::Delivery::for_test("subject", "STREAM", 1);
    let transfer_msg = Transfer {
        id: "t-1".to_owned(),
    };
    let key = Handler::<()>::message_key(&transfer(), &transfer_msg, &delivery);
    let transfer = key.as_deref();
    assert_eq!(transfer, Some("t-1"));

    assert_eq!(r#type::NAME, "type-v1");
    assert_eq!(always::NAME, "always-v1");
    assert_eq!(handlers::refund::NAME, "refund-v1");
    let _copy: handlers::refund = handlers::refund();

    let _router = Router::new()
        .route(Route::new("S", "refund"), handlers::refund)
        .route(Route::new("S", "type"), r#type)
        .route(Route::new("S", "always"), always);
}
