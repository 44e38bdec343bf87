use idem_runtime::{Handler, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Ping {}

#[idempotent]
async fn ping(_tx: &mut sqlx::PgTransaction<'_>, _ping: Ping) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let delivery = idem_runtime::Delivery::for_test("subject", "STREAM", 1);
    assert_eq!(ping::NAME, "ping");
    assert_eq!(Handler::<()>::name(&ping()), "ping");
    // Without `key = ...` the runtime falls back to `Nats-Msg-Id`, then to the stream sequence.
    assert_eq!(Handler::<()>::message_key(&ping(), &Ping {}, &delivery), None);
}
