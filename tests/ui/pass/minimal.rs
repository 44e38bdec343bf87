use idem_runtime::{Handler, idempotent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Ping {}

#[idempotent]
async fn ping(_tx: &mut sqlx::PgTransaction<'_>, _ping: Ping) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    assert_eq!(ping::NAME, "ping");
    assert_eq!(ping().name(), "ping");
    // Without `key = ...` the runtime falls back to `Nats-Msg-Id`, then to the stream sequence.
    assert_eq!(ping().message_key(&Ping {}), None);
}
