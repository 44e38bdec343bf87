//! What the demo (`src/bin/pipeline-demo.rs`) and `tests/tests/pipeline.rs`
//! both do: publish orders with duplicates among them, wait until the
//! pipeline has settled, and count its effects.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::RawMessageErrorKind};

use crate::{DUPLICATE_WINDOW, ORDERS_STREAM, OrderPlaced, PAYMENTS_STREAM};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What [`publish_orders`] sent.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    /// Orders (each once, at least).
    pub unique: usize,
    /// `orders.placed` messages published, duplicates included.
    pub published: usize,
    /// Duplicates published inside JetStream's duplicate window.
    pub within_window: usize,
    /// Duplicates published after it (JetStream stores them again).
    pub after_window: usize,
    /// Publishes JetStream acknowledged as duplicates.
    pub dropped_by_jetstream: usize,
}

/// Publishes `orders.placed` for each order in `orders`, with
/// `Nats-Msg-Id: order-<id>` and the `traceparent` of a `shop.place_order`
/// span of its own (none without an OpenTelemetry layer); a tenth of them
/// twice in a row (a publisher retry JetStream drops), and, after the
/// duplicate window, another tenth again (one JetStream stores, and only
/// the claim stops). A retry carries its order's headers, trace included.
pub async fn publish_orders(
    js: &jetstream::Context,
    orders: Range<i64>,
) -> Result<Published, Error> {
    let placed: Vec<OrderPlaced> = orders
        .map(|order| OrderPlaced {
            order,
            amount: 1 + (order * 7).rem_euclid(100),
        })
        .collect();
    let tenth = placed.len().div_ceil(10);
    let mut sent = Published {
        unique: placed.len(),
        published: 0,
        within_window: tenth,
        after_window: tenth,
        dropped_by_jetstream: 0,
    };
    let headers: Vec<async_nats::HeaderMap> = placed
        .iter()
        .map(|order| {
            let mut headers = async_nats::HeaderMap::new();
            let id = format!("order-{}", order.order);
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            tracing::info_span!("shop.place_order", order = order.order)
                .in_scope(|| idem_runtime::observe::trace::inject_current(&mut headers));
            headers
        })
        .collect();
    let mut publish = async |index: usize| -> Result<(), Error> {
        let (order, headers) = (&placed[index], headers[index].clone());
        let payload = serde_json::to_vec(order)?.into();
        let ack = js
            .publish_with_headers("orders.placed", headers, payload)
            .await?
            .await?;
        sent.published += 1;
        sent.dropped_by_jetstream += usize::from(ack.duplicate);
        Ok(())
    };
    // A retry follows its original at once, so that it falls inside the
    // window however slowly the server stores (its fsync per message on a
    // loaded machine can take 200 publishes past a 2 s window).
    for index in 0..placed.len() {
        publish(index).await?;
        if index < tenth {
            publish(index).await?;
        }
    }
    tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_millis(500)).await;
    for index in placed.len() - tenth..placed.len() {
        publish(index).await?;
    }
    Ok(sent)
}

/// The pipeline's effects for a range of orders.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// `orders.placed` messages stored in the stream (publisher retries
    /// after the duplicate window are stored twice).
    pub placed_messages: usize,
    /// Rows in `orders`.
    pub orders: i64,
    /// Orders marked paid exactly once (`times_paid = 1`).
    pub paid_once: i64,
    /// Orders marked paid more than once (must be 0).
    pub paid_twice: i64,
    /// Rows in `charges`.
    pub charges: i64,
    /// Orders with a charge.
    pub charged_orders: i64,
    /// `orders.paid` messages stored in the stream.
    pub paid_messages: usize,
    /// Orders those messages are for.
    pub paid_message_orders: usize,
    /// Outbox rows not yet published.
    pub outbox_pending: i64,
    /// Messages in the dead-letter stream.
    pub dead_letters: u64,
}

impl Tally {
    /// Counts the effects for `orders`.
    pub async fn read(
        js: &jetstream::Context,
        pool: &sqlx::PgPool,
        orders: &Range<i64>,
    ) -> Result<Tally, Error> {
        let (lo, hi) = (orders.start, orders.end);
        let (count, paid_once, paid_twice): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE times_paid = 1),
                    count(*) FILTER (WHERE times_paid > 1)
             FROM orders WHERE id >= $1 AND id < $2",
        )
        .bind(lo)
        .bind(hi)
        .fetch_one(pool)
        .await?;
        let (charges, charged_orders): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT order_id) FROM charges
             WHERE order_id >= $1 AND order_id < $2",
        )
        .bind(lo)
        .bind(hi)
        .fetch_one(pool)
        .await?;
        let placed = stored_per_order(js, "orders.placed", orders).await?;
        let paid = stored_per_order(js, "orders.paid", orders).await?;
        let dead_letters = match js.get_stream("IDEM_DEAD_LETTERS").await {
            Ok(mut stream) => stream.info().await?.state.messages,
            Err(_) => 0,
        };
        Ok(Tally {
            placed_messages: placed.values().sum(),
            orders: count,
            paid_once,
            paid_twice,
            charges,
            charged_orders,
            paid_messages: paid.values().sum(),
            paid_message_orders: paid.len(),
            outbox_pending: idem_runtime::outbox::lag(pool).await?.pending,
            dead_letters,
        })
    }

    /// Exactly once end to end, for `n` orders: each written, charged and
    /// marked paid once, one `orders.paid` each in the stream, nothing left
    /// in the outbox, nothing dead-lettered.
    pub fn exactly_once(&self, n: usize) -> bool {
        let n64 = n as i64;
        self.orders == n64
            && self.paid_once == n64
            && self.paid_twice == 0
            && self.charges == n64
            && self.charged_orders == n64
            && self.paid_messages == n
            && self.paid_message_orders == n
            && self.outbox_pending == 0
            && self.dead_letters == 0
    }
}

/// One hop of an order through the pipeline: a message the streams store
/// for it, and the trace context it carries.
#[derive(Debug, Clone)]
pub struct Hop {
    /// `orders.placed`, `payments.requested` or `orders.paid`.
    pub subject: &'static str,
    /// Its `traceparent` header: the trace, and the span that published it
    /// (the shop's) or queued it (a handler's, through the outbox).
    pub traceparent: Option<String>,
}

/// The first message each subject of the pipeline stores for `order`, in
/// pipeline order, with the trace context it carries.
pub async fn follow(js: &jetstream::Context, order: i64) -> Result<Vec<Hop>, Error> {
    let mut hops = Vec::new();
    for (stream, subject) in [
        (ORDERS_STREAM, "orders.placed"),
        (PAYMENTS_STREAM, "payments.requested"),
        (ORDERS_STREAM, "orders.paid"),
    ] {
        let stream = js.get_stream(stream).await?;
        let mut next = 1;
        let traceparent = loop {
            let message = match stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(subject)
                .send()
                .await
            {
                Ok(message) => message,
                Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {
                    return Err(format!("no {subject} message for order {order}").into());
                }
                Err(error) => return Err(error.into()),
            };
            next = message.sequence + 1;
            if serde_json::from_slice::<ForOrder>(&message.payload)?.order == order {
                break message
                    .headers
                    .get(idem_runtime::observe::trace::TRACEPARENT)
                    .map(|value| value.as_str().to_owned());
            }
        };
        hops.push(Hop {
            subject,
            traceparent,
        });
    }
    Ok(hops)
}

/// The order a pipeline message is for.
#[derive(serde::Deserialize)]
struct ForOrder {
    order: i64,
}

/// How many messages on `subject` (`orders.placed` or `orders.paid`) the
/// stream stores for each order in `orders`.
async fn stored_per_order(
    js: &jetstream::Context,
    subject: &str,
    orders: &Range<i64>,
) -> Result<BTreeMap<i64, usize>, Error> {
    let stream = js.get_stream(ORDERS_STREAM).await?;
    let mut counts = BTreeMap::new();
    let mut next = 1;
    loop {
        let message = match stream
            .raw_message_builder()
            .sequence(next)
            .next_by_subject(subject)
            .send()
            .await
        {
            Ok(message) => message,
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => break,
            Err(error) => return Err(error.into()),
        };
        next = message.sequence + 1;
        let ForOrder { order } = serde_json::from_slice(&message.payload)?;
        if orders.contains(&order) {
            *counts.entry(order).or_default() += 1;
        }
    }
    Ok(counts)
}

/// Waits until the `n` orders in `orders` are paid, the outbox is empty and
/// every consumer of the pipeline has nothing pending or unacked (so that
/// late duplicates have been seen too), or `timeout` passes.
pub async fn wait_settled(
    js: &jetstream::Context,
    pool: &sqlx::PgPool,
    orders: &Range<i64>,
    timeout: Duration,
) -> Result<Tally, Error> {
    let deadline = Instant::now() + timeout;
    loop {
        let tally = Tally::read(js, pool, orders).await?;
        let paid = tally.paid_once + tally.paid_twice == orders.end - orders.start;
        if paid && tally.outbox_pending == 0 && consumers_idle(js).await? {
            return Ok(tally);
        }
        if Instant::now() > deadline {
            return Err(format!("the pipeline did not settle in {timeout:?}: {tally:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn consumers_idle(js: &jetstream::Context) -> Result<bool, Error> {
    for (stream, durable) in [
        (ORDERS_STREAM, "orders-place"),
        (ORDERS_STREAM, "orders-mark-paid"),
        (PAYMENTS_STREAM, "payments-charge"),
    ] {
        let info = js.get_stream(stream).await?.consumer_info(durable).await?;
        if info.num_pending > 0 || info.num_ack_pending > 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits until the services have created their streams.
pub async fn wait_for_streams(js: &jetstream::Context, timeout: Duration) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    for stream in [ORDERS_STREAM, PAYMENTS_STREAM] {
        while js.get_stream(stream).await.is_err() {
            if Instant::now() > deadline {
                return Err(format!(
                    "stream {stream} was not created in {timeout:?}; are the services running?"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}
