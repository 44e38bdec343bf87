use idem_runtime::{Delivery, Handler, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Ping {
    from: String,
}

// Attributes other than docs and `cfg` stay on the body, `ping::run`.
#[idempotent]
#[tracing::instrument(name = "ping", skip_all, fields(seq = meta.stream_sequence()))]
async fn ping(
    _tx: &mut sqlx::PgTransaction<'_>,
    meta: &idem_runtime::Delivery,
    ping: Ping) -> Result<(), sqlx::Error> {
    tracing::info!(
        from = ping.from,
        seq = meta.stream_sequence(),
        attempt = meta.delivered(),
        id = meta.message_id().as_str(),
        "ping"
    );
    Ok(())
}

// Any `&` type and any pattern work for the delivery.
#[idempotent(name = "pong-v1", key = pong.from)]
async fn pong(
    _tx: &mut sqlx::PgTransaction<'_>,
    _: &Delivery,
    pong: Ping) -> Result<(), sqlx::Error> {
    drop(pong);
    Ok(())
}

fn main() {
    let delivery = idem_runtime::Delivery::for_test("subject", "STREAM", 1);
    assert_eq!(Handler::<()>::name(&ping()), "ping");
    let pong_msg = Ping {
        from: "a".to_owned(),
    };
    assert_eq!(Handler::<()>::message_key(&pong(), &pong_msg, &delivery).as_deref(), Some("a"));
}
