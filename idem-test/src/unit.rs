//! Testing a handler's body without NATS: a transaction on the
//! test database ([`Bed::transaction`](crate::Bed::transaction)), a
//! delivery ([`Delivery::for_test`](idem_runtime::Delivery::for_test)), the
//! body itself (`my_handler::run`, which `#[idempotent]` keeps callable),
//! and what the call queued in the outbox ([`queued`]).
//!
//! ```no_run
//! use idem_runtime::outbox::{Outbox, OutboxError};
//! use idem_runtime::{Delivery, idempotent};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Placed { order: i64 }
//!
//! #[idempotent(name = "orders.place.v1")]
//! async fn place(
//!     tx: &mut sqlx::PgTransaction<'_>,
//!     outbox: Outbox,
//!     placed: Placed,
//! ) -> Result<(), OutboxError> {
//!     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!         .bind(placed.order)
//!         .execute(&mut **tx)
//!         .await?;
//!     outbox.send(tx, "payments.requested", &placed).await?;
//!     Ok(())
//! }
//!
//! # async fn demo(bed: idem_test::Bed) {
//! let mut tx = bed.transaction().await;
//! let delivery = Delivery::for_test("orders.placed", "ORDERS", 7)
//!     .with_header("Nats-Msg-Id", "order-7");
//! let outbox = Outbox::for_delivery(&delivery.for_handler(place::NAME));
//! place::run(&mut tx, outbox, Placed { order: 7 }).await.unwrap();
//!
//! let queued = idem_test::unit::queued(&mut tx).await;
//! assert_eq!(queued.len(), 1);
//! assert_eq!(queued[0].subject, "payments.requested");
//! assert_eq!(queued[0].json::<Placed>().order, 7);
//! // Dropped, the transaction rolls back: nothing is left behind.
//! # }
//! ```

use sqlx::PgConnection;

/// A message a transaction queued in the outbox, not yet published.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Queued {
    /// The `Nats-Msg-Id` it will be published with (derived from the
    /// handler and the message id, so a retry queues the same one).
    pub id: String,
    /// The subject it goes to.
    pub subject: String,
    /// Its payload, encoded.
    pub payload: bytes::Bytes,
    /// Its other headers, as `(name, value)` pairs.
    pub headers: Vec<(String, String)>,
}

impl Queued {
    /// The payload, decoded as JSON.
    ///
    /// # Panics
    ///
    /// If it does not decode as a `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.payload).unwrap_or_else(|e| {
            panic!(
                "idem-test: the outbox message {} to {} does not decode: {e}",
                self.id, self.subject
            )
        })
    }
}

/// The outbox rows the connection's transaction sees, oldest first: in a
/// test's transaction, what the handler call queued (plus what was
/// committed before and not yet published).
///
/// # Panics
///
/// If the outbox cannot be read (idem's schema is missing).
pub async fn queued(tx: &mut PgConnection) -> Vec<Queued> {
    let rows: Vec<(String, String, Vec<u8>, Option<String>)> = sqlx::query_as(
        "SELECT msg_id, subject, payload, headers::text FROM idem_outbox ORDER BY id",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("idem-test: cannot read the outbox: {e}"));
    rows.into_iter()
        .map(|(id, subject, payload, headers)| Queued {
            id,
            subject,
            payload: payload.into(),
            headers: headers
                .and_then(|h| serde_json::from_str::<Vec<(String, String)>>(&h).ok())
                .unwrap_or_default(),
        })
        .collect()
}
