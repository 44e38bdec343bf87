//! The retention floor: the shortest retention under which every duplicate
//! that can still arrive finds its message's claim.
//!
//! A claim is stamped `claimed_at`, the start of the transaction that
//! inserted it (PostgreSQL's `now()`), and is kept for at least the route's
//! [`retention`](crate::Route::retention) after that stamp: the
//! [purge](crate::retention::expiry) drops a claim's generation only once it has been
//! sealed (no claim can still be written into it) for the longest retention
//! any handler asks for. A duplicate that reaches the claim check after its
//! claim is dropped finds no row and is processed again. The
//! floor bounds how long after the stamp a copy of the message can still
//! reach the claim check; at start-up the router refuses a route whose
//! retention is below it.
//!
//! # The terms
//!
//! A message comes back in three ways. Each term says which duplicates it
//! covers.
//!
//! 1. **Redeliveries of the copy that claimed it** (its ack was lost, its
//!    worker died, it was NAKed), counted from the stamp. Their sum is the
//!    *redelivery span*:
//!    - **The claiming transaction.** Its claim may wait on a concurrent
//!      attempt (at most `statement_timeout`, which is the handler timeout),
//!      its handler at most the handler timeout (a batch's handler calls
//!      share one: the batch is cut, rolled back and run one message per
//!      transaction once they have taken it together), and its COMMIT at
//!      most `statement_timeout`: `3 × handler_timeout`, whatever the batch
//!      size. The runtime's watchdog waits as long, plus a margin, before it
//!      stops waiting for a transaction. The claim is
//!      visible only from the COMMIT on. Heartbeats (`+WPI`) hold the
//!      message's lease for as long, so no redelivery comes earlier; without
//!      heartbeats, one that does waits on the claim's lock. Without a
//!      handler timeout the transaction, and its heartbeats, last as long as
//!      the handler does: no bound ([`Unbounded::HandlerTimeout`]).
//!    - **Every later delivery.** JetStream delivers a message at most
//!      `max_deliver + 3` times (the consumer's limit is set 3 above the
//!      route's; see [`RetryPolicy`](crate::RetryPolicy)), and the claiming
//!      delivery is at least the first, so at most `max_deliver + 2` follow.
//!      Each comes at most `ack_wait` after the previous one ended (its ack
//!      was lost or its worker died; a message's heartbeats stop before it
//!      is acked), or one NAK delay after it (a COMMIT whose outcome was
//!      unknown is NAKed with the backoff). The floor counts `ack_wait` for
//!      every gap plus every NAK delay the policy can give (after deliveries
//!      1 to `max_deliver − 1`: `initial × 2^(n−1)`, capped at `max`, each
//!      up to `+jitter`): a little more than any mix of the two can take.
//!      A duplicate's own attempt is its claim check, which finds a
//!      committed row at once. In a batch, the claim statement may wait on
//!      the claims of the batch's other messages (up to the statement
//!      timeout, the handler timeout) before it finds the duplicate, which
//!      is then acked at once, before any handler runs: every gap also
//!      counts that wait.
//! 2. **Replays and late deliveries of a stored copy.** A consumer's ack
//!    floor can be reset (nats-server#8036), a consumer deleted and created
//!    again, or a consumer can be far behind: a stored copy can be delivered
//!    until it ages out, the stream's `max_age` after it was stored, and the
//!    claim was stamped after the first copy was stored. `max_age` 0 keeps
//!    messages forever: no bound ([`Unbounded::StreamMaxAge`]).
//! 3. **Copies that a publisher stores again.** JetStream drops a publish
//!    of the same `Nats-Msg-Id` inside the stream's `duplicate_window`, and
//!    stores one after it as a new copy, whose deliveries (terms 1 and 2)
//!    start up to the publisher-retry horizon after the first copy's. The
//!    horizon ([`Route::publisher_retry_horizon`](crate::Route::publisher_retry_horizon))
//!    adds to the floor when it is longer than the duplicate window, and
//!    counts 0 otherwise. A route that declares none has no bound here
//!    ([`Unbounded::PublisherRetryHorizon`]).
//!
//! ```text
//! floor = copies + max(redelivery span, max_age)
//! ```
//!
//! Every delivery of a copy happens while the stream stores it, within
//! `max_age` of its storage, so with a finite `max_age`, `copies + max_age`
//! bounds every path by itself. The redelivery span is the bound that does
//! not depend on `max_age`: the floor keeps the larger of the two, so that
//! a short `max_age` is not trusted to cut redeliveries short (nor a
//! delivery taken just before its copy ages out to reach its claim check at
//! once), and the span is what remains when an unbounded `max_age` is
//! accepted.
//!
//! # Unbounded terms
//!
//! A route with an unbounded term and a retention is refused unless it
//! accepts that term with
//! [`Route::accept_duplicates_after_retention`](crate::Route::accept_duplicates_after_retention):
//! the term then counts 0, the rest of the floor is still checked, and a
//! duplicate that the term lets arrive after the retention is processed
//! again. A route without a retention keeps its claims forever and is not
//! checked.
//!
//! # Worked example
//!
//! The defaults (`ack_wait` 30 s, `max_deliver` 10, backoff 1 s doubling
//! to 5 min with ±20 % jitter, handler timeout 5 min, per-message mode), a
//! stream with `max_age` 7 days and the default `duplicate_window` of
//! 2 min, and publishers that retry for at most 1 min:
//!
//! | term | value |
//! |---|---|
//! | claiming transaction: 3 × handler_timeout 5m | 15m |
//! | 12 later deliveries × ack_wait 30s | 6m |
//! | NAK backoff 1s+2s+4s+8s+16s+32s+1m 4s+2m 8s+4m 16s = 8m 31s, +20 % jitter | 10m 13.2s |
//! | redelivery span | 31m 13.2s |
//! | stream max_age | 7d |
//! | publisher copies: horizon 1m ≤ duplicate_window 2m | 0 |
//! | floor = 0 + max(31m 13.2s, 7d) | **7d** |
//!
//! A publisher that retries for up to 1 h makes it 7d 1h. A stream that
//! keeps messages forever is refused unless accepted; accepted, the floor is
//! the redelivery span, 31m 13.2s.
//!
//! These are the terms of a route that runs one message per transaction. A
//! route that batches (the default) counts a batch's claim wait (a handler
//! timeout) with each later delivery, since a redelivery may wait for the
//! batch that holds its claim: 12 × (30s + 5m) = 1h 6m, a span of
//! 1h 31m 13.2s. A default route whose retention fits only the
//! per-message floor runs per message (and says so at start-up).
//!
//! ```
//! use std::time::Duration;
//! use idem_runtime::Route;
//! use idem_runtime::async_nats::jetstream::stream;
//!
//! let stream = stream::Config {
//!     max_age: Duration::from_secs(7 * 24 * 3600),
//!     duplicate_window: Duration::from_secs(120),
//!     ..Default::default()
//! };
//! let route = Route::new("LEDGER", "credit")
//!     .per_message()
//!     .publisher_retry_horizon(Duration::from_secs(60));
//! let floor = route.retention_floor(&stream);
//! assert_eq!(floor.value(), Some(Duration::from_secs(7 * 24 * 3600)));
//! assert!(floor.to_string().ends_with("floor = 0 + max(31m 13.2s, 7d) = 7d"), "{floor}");
//!
//! // Batching (the default), each later delivery also counts a batch's claim wait.
//! let batching = Route::new("LEDGER", "credit").publisher_retry_horizon(Duration::from_secs(60));
//! let floor = batching.retention_floor(&stream);
//! assert!(floor.to_string().ends_with("floor = 0 + max(1h 31m 13.2s, 7d) = 7d"), "{floor}");
//! ```
//!
//! # Reply routes
//!
//! A request ([`ReplyRoute`](crate::ReplyRoute)) is not stored anywhere:
//! it comes back only when its client sends it again, with the same id.
//! Its floor has two terms, computed by the same function, from the same
//! transaction bound:
//!
//! 1. **Client retries.** A client sends a request first, and its claim is
//!    stamped when a worker's transaction for it begins, after that. The
//!    *client-retry horizon*
//!    ([`ReplyRoute::client_retry_horizon`](crate::ReplyRoute::client_retry_horizon),
//!    1 h unless declared) bounds how long after its first send a client
//!    may still send it again.
//! 2. **The retry's wait in the worker.** A retry waits for one of the
//!    route's `concurrency` slots behind requests in flight, each of which
//!    holds its slot at most one transaction's longest run, `3 ×
//!    handler_timeout` (the claim, one handler call, COMMIT). Its own
//!    claim may then wait on an attempt of the same request that is still
//!    running; that attempt's claim, once committed, lives a retention
//!    from then, so that wait costs nothing. Without a handler timeout the
//!    wait has no bound ([`Unbounded::HandlerTimeout`]).
//!
//! ```text
//! floor = client-retry horizon + 3 × handler_timeout
//! ```
//!
//! The purge keeps a claim for at least the retention after its stamp, and
//! after its COMMIT (a generation is sealed only once every transaction that
//! wrote into it has ended): the generations add time, never take it away,
//! so the floor counts nothing for them. With the defaults (horizon 1 h,
//! handler timeout 30 s) the floor is 1h 1m 30s, under the default
//! retention of a day ([`ReplyRoute::retention`](crate::ReplyRoute::retention)).
//! Not covered: a retry queued behind more than one round of requests in
//! flight (a backlog deeper than `concurrency`), or a client that retries
//! past the horizon it declared: it runs the request again.
//!
//! # Not covered
//!
//! - A message *held* while the database cannot be used (see the guide's
//!   failure handling) keeps its lease through heartbeats for as long as
//!   that lasts, before its claim check. The purge needs the database too,
//!   but a worker cut off from it while the purge runs elsewhere can hold a
//!   duplicate past the retention.
//! - Clocks: a copy's storage time is the NATS server's, the stamp and the
//!   purge are PostgreSQL's. Skew between them adds to every term.
//! - The floor is computed at start-up from the stream's settings then. A
//!   `max_age` raised later, or a publisher that retries for longer than it
//!   declared, is not seen.
//! - Dead-letter replays are checked when they are replayed
//!   ([`dead_letter::replay`](crate::dead_letter::replay)).

use std::time::Duration;

use crate::error::Error;
use crate::error::retention::{Inputs, Value, times};

pub use crate::error::retention::{RetentionFloor, Unbounded};

/// Computes the retention floor of `inputs`. Pure: the same inputs give the
/// same floor.
pub(crate) fn compute(inputs: Inputs) -> RetentionFloor {
    let transaction = match inputs.handler_timeout {
        Some(timeout) => Value::Bounded(crate::store::transaction::longest(timeout)),
        None if inputs.accepts(Unbounded::HandlerTimeout) => {
            Value::Accepted(Unbounded::HandlerTimeout)
        }
        None => Value::Unbounded(Unbounded::HandlerTimeout),
    };
    let redeliveries = inputs.server_max_deliver.saturating_sub(1);
    // In a batch, a duplicate is acked once the batch's claim statement
    // found it (before any handler runs), which may wait on other messages'
    // claims for up to the statement timeout (the handler timeout).
    let claim_wait = match inputs.handler_timeout {
        Some(timeout) => Value::Bounded(timeout),
        None => transaction,
    };
    let per_redelivery = if inputs.batch > 1 {
        claim_wait
            .counted()
            .map(|wait| inputs.ack_wait.saturating_add(wait))
    } else {
        Some(inputs.ack_wait)
    };
    let nak_total = inputs
        .nak_delays
        .iter()
        .fold(Duration::ZERO, |sum, (delay, count)| {
            sum.saturating_add(times(*delay, *count))
        });
    let nak_with_jitter = with_jitter(nak_total, inputs.jitter);
    let span = match (transaction.counted(), per_redelivery) {
        (Some(transaction), Some(each)) => Some(
            transaction
                .saturating_add(times(each, redeliveries))
                .saturating_add(nak_with_jitter),
        ),
        _ => None,
    };
    let max_age = if !inputs.max_age.is_zero() {
        Value::Bounded(inputs.max_age)
    } else if inputs.accepts(Unbounded::StreamMaxAge) {
        Value::Accepted(Unbounded::StreamMaxAge)
    } else {
        Value::Unbounded(Unbounded::StreamMaxAge)
    };
    let copies = match inputs.publisher_retry_horizon {
        Some(horizon) if horizon > inputs.duplicate_window => Value::Bounded(horizon),
        Some(_) => Value::Bounded(Duration::ZERO),
        None if inputs.accepts(Unbounded::PublisherRetryHorizon) => {
            Value::Accepted(Unbounded::PublisherRetryHorizon)
        }
        None => Value::Unbounded(Unbounded::PublisherRetryHorizon),
    };
    let unbounded: Vec<Unbounded> = [max_age, transaction, copies]
        .iter()
        .filter_map(|value| match value {
            Value::Unbounded(term) => Some(*term),
            _ => None,
        })
        .collect();
    let floor = match (span, max_age.counted(), copies.counted()) {
        (Some(span), Some(max_age), Some(copies)) if unbounded.is_empty() => {
            Some(copies.saturating_add(span.max(max_age)))
        }
        _ => None,
    };
    RetentionFloor {
        inputs,
        transaction,
        redeliveries,
        per_redelivery,
        nak_total,
        nak_with_jitter,
        span,
        max_age,
        copies,
        floor,
        unbounded,
        requests: false,
    }
}

/// The retention floor of a reply route whose handler timeout is
/// `handler_timeout`, whose clients retry for up to `horizon`, and which
/// accepts the unbounded terms in `accepted` (see
/// [Reply routes](self#reply-routes)). The same computation as a JetStream
/// route's, with no redeliveries and no stream: the retry's wait is the
/// claiming-transaction term, the horizon the copies term.
pub(crate) fn for_requests(
    handler_timeout: Option<Duration>,
    horizon: Duration,
    accepted: &[Unbounded],
) -> RetentionFloor {
    let mut accepted = accepted.to_vec();
    // A request is stored nowhere: no max_age to wait out.
    accepted.push(Unbounded::StreamMaxAge);
    let mut floor = compute(Inputs {
        ack_wait: Duration::ZERO,
        max_deliver: 1,
        // Delivered once: no redelivery follows.
        server_max_deliver: 1,
        nak_delays: Vec::new(),
        jitter: 0.0,
        handler_timeout,
        batch: 1,
        max_age: Duration::ZERO,
        // No duplicate window drops a client's retry: the whole horizon
        // counts.
        duplicate_window: Duration::ZERO,
        publisher_retry_horizon: Some(horizon),
        accepted,
    });
    floor.requests = true;
    floor
}

/// `base` stretched by the largest jitter, `1 + jitter` times.
fn with_jitter(base: Duration, jitter: f64) -> Duration {
    if jitter <= 0.0 {
        return base;
    }
    Duration::try_from_secs_f64(base.as_secs_f64() * (1.0 + jitter)).unwrap_or(Duration::MAX)
}

/// Refuses `retention` (of the route named `route`) if it is below `floor`,
/// or `floor` has an unbounded term; `None` keeps claims forever and is
/// never refused.
pub(crate) fn judge(
    route: &str,
    retention: Option<Duration>,
    floor: RetentionFloor,
) -> Result<RetentionFloor, Error> {
    let Some(retention) = retention else {
        return Ok(floor);
    };
    if !floor.unbounded.is_empty() {
        return Err(Error::RetentionFloorUnbounded {
            route: route.to_owned(),
            retention,
            unbounded: floor.unbounded.clone(),
            computation: Box::new(floor),
        });
    }
    match floor.floor {
        Some(value) if retention < value => Err(Error::RetentionBelowFloor {
            route: route.to_owned(),
            retention,
            floor: value,
            computation: Box::new(floor),
        }),
        _ => Ok(floor),
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::stream;

    use crate::error::retention::{Human, decode_duration, encode_duration};
    use crate::route::Route;

    /// The check a route's start-up makes (`bind_consumer` in the router).
    fn check(route: &Route, stream: &stream::Config) -> Result<RetentionFloor, crate::Error> {
        route.judged_floor(stream).map(|(floor, _)| floor)
    }

    /// The check a reply route's start-up makes (`ReplyRoute::validate`).
    fn check_requests(route: &crate::ReplyRoute) -> Result<RetentionFloor, crate::Error> {
        judge(route.subject(), route.retention, route.retention_floor())
    }

    use super::*;
    use crate::RetryPolicy;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// A stream with `max_age` and the default duplicate window.
    fn stream(max_age: Duration) -> stream::Config {
        stream::Config {
            max_age,
            duplicate_window: secs(120),
            ..Default::default()
        }
    }

    /// A per-message route (the floor of batches has a test of its own).
    fn route() -> Route {
        Route::new("S", "c")
            .per_message()
            .publisher_retry_horizon(secs(60))
    }

    #[test]
    fn the_defaults_with_a_week_of_max_age_give_a_week() {
        let floor = route().retention_floor(&stream(7 * DAY));
        // 3 × 5 min + 12 × 30 s + (1 + 2 + ... + 256 s) × 1.2
        let span = secs(900) + secs(360) + Duration::from_millis(613_200);
        assert_eq!(floor.redelivery_span(), Some(span));
        assert_eq!(floor.value(), Some(7 * DAY));
        assert!(floor.unbounded().is_empty());
        assert_eq!(
            floor.to_string(),
            "redeliveries after the claim: claiming transaction (claim wait, 1 handler call, COMMIT) 3 × handler_timeout 5m = 15m \
             + 12 later deliveries (max_deliver 10 + 3 on the server, less the claiming one) × ack_wait 30s = 6m \
             + NAK backoff 1s+2s+4s+8s+16s+32s+1m 4s+2m 8s+4m 16s = 8m 31s, +20 % jitter = 10m 13.2s; span 31m 13.2s; \
             stream max_age 7d (a stored copy can be redelivered or replayed until it ages out); \
             publisher copies: horizon 1m ≤ duplicate_window 2m, so JetStream drops retries = 0; \
             floor = 0 + max(31m 13.2s, 7d) = 7d"
        );
    }

    #[test]
    fn a_max_age_shorter_than_the_span_leaves_the_span() {
        let floor = route().retention_floor(&stream(secs(600)));
        assert_eq!(floor.value(), floor.redelivery_span());
        assert!(
            floor
                .to_string()
                .ends_with("max(31m 13.2s, 10m) = 31m 13.2s")
        );
    }

    #[test]
    fn publisher_retries_past_the_duplicate_window_add_their_horizon() {
        let floor = route()
            .publisher_retry_horizon(secs(3600))
            .retention_floor(&stream(7 * DAY));
        assert_eq!(floor.value(), Some(7 * DAY + secs(3600)));
        assert_eq!(floor.copy_spread(), secs(3600));
        let text = floor.to_string();
        assert!(
            text.contains(
                "horizon 1h > duplicate_window 2m, so a retry is stored as a new copy = 1h"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("floor = 1h + max(31m 13.2s, 7d) = 7d 1h"),
            "{text}"
        );
        // A horizon equal to the window: every retry is dropped.
        let floor = route()
            .publisher_retry_horizon(secs(120))
            .retention_floor(&stream(7 * DAY));
        assert_eq!(floor.value(), Some(7 * DAY));
    }

    #[test]
    fn each_unbounded_term_is_named_and_can_be_accepted() {
        // A stream that keeps messages forever.
        let floor = route().retention_floor(&stream(Duration::ZERO));
        assert_eq!(floor.value(), None);
        assert_eq!(floor.unbounded(), [Unbounded::StreamMaxAge]);
        assert!(floor.to_string().ends_with(
            "stream max_age 0 (kept forever: replays at any time), unbounded; publisher copies: horizon 1m ≤ duplicate_window 2m, so JetStream drops retries = 0; floor unbounded (Unbounded::StreamMaxAge)"
        ));
        let accepted = route()
            .accept_duplicates_after_retention(Unbounded::StreamMaxAge)
            .retention_floor(&stream(Duration::ZERO));
        assert_eq!(accepted.value(), accepted.redelivery_span());
        assert!(
            accepted
                .to_string()
                .ends_with("floor = 0 + 31m 13.2s = 31m 13.2s"),
            "{accepted}"
        );

        // No handler timeout.
        let floor = route()
            .without_handler_timeout()
            .retention_floor(&stream(7 * DAY));
        assert_eq!(floor.unbounded(), [Unbounded::HandlerTimeout]);
        assert_eq!(floor.redelivery_span(), None);
        let accepted = route()
            .without_handler_timeout()
            .accept_duplicates_after_retention(Unbounded::HandlerTimeout)
            .retention_floor(&stream(secs(60)));
        // 12 × 30 s + 613.2 s: the transaction counts 0.
        assert_eq!(accepted.value(), Some(Duration::from_millis(973_200)));

        // No publisher-retry horizon.
        let floor = Route::new("S", "c")
            .per_message()
            .retention_floor(&stream(7 * DAY));
        assert_eq!(floor.unbounded(), [Unbounded::PublisherRetryHorizon]);
        let accepted = Route::new("S", "c")
            .per_message()
            .accept_duplicates_after_retention(Unbounded::PublisherRetryHorizon)
            .retention_floor(&stream(7 * DAY));
        assert_eq!(accepted.value(), Some(7 * DAY));
    }

    #[test]
    fn several_unbounded_terms_are_all_named() {
        let floor = Route::new("S", "c")
            .without_handler_timeout()
            .retention_floor(&stream(Duration::ZERO));
        assert_eq!(
            floor.unbounded(),
            [
                Unbounded::StreamMaxAge,
                Unbounded::HandlerTimeout,
                Unbounded::PublisherRetryHorizon
            ]
        );
        assert!(floor.to_string().ends_with(
            "floor unbounded (Unbounded::StreamMaxAge, Unbounded::HandlerTimeout, Unbounded::PublisherRetryHorizon)"
        ));
    }

    #[test]
    fn batches_count_one_handler_timeout_and_a_batch_transaction_per_redelivery() {
        for batched in [
            route().batch(4),
            route().batch(64),
            Route::new("S", "c").publisher_retry_horizon(secs(60)),
        ] {
            let floor = batched
                .handler_timeout(secs(10))
                .retention_floor(&stream(secs(1)));
            // Whatever the size: transaction 3 × 10 s (the batch's calls
            // share one timeout); 12 × (30 s + a claim wait of 10 s); NAKs
            // 613.2 s.
            assert_eq!(
                floor.value(),
                Some(secs(30) + secs(12 * 40) + Duration::from_millis(613_200))
            );
            assert!(
                floor.to_string().contains(
                    "claiming transaction (claim wait, the batch's handler calls, COMMIT) 3 × handler_timeout 10s = 30s"
                ),
                "{floor}"
            );
        }
        let alone = route()
            .handler_timeout(secs(10))
            .retention_floor(&stream(secs(1)));
        assert_eq!(
            alone.value(),
            Some(secs(30) + secs(12 * 30) + Duration::from_millis(613_200))
        );
    }

    #[test]
    fn a_route_batching_by_default_runs_per_message_where_only_that_floor_fits() {
        let week = stream(7 * DAY);
        let hour = secs(3600);
        let short = |route: Route| route.retention(hour);
        // 31m 13.2s.
        let per_message_floor = route().retention_floor(&stream(secs(1))).value().unwrap();
        let by_default = short(Route::new("S", "c").publisher_retry_horizon(secs(60)));
        // 15m + 12 × (30s + 5m) + 10m 13.2s: the floor without a retention
        // for the default to give way to.
        let batched_floor = Route::new("S", "c")
            .publisher_retry_horizon(secs(60))
            .retention_floor(&stream(secs(1)))
            .value()
            .unwrap();
        assert!(
            per_message_floor < hour && hour < batched_floor,
            "an hour is between the floors: {per_message_floor:?}, {batched_floor:?}"
        );
        let (floor, per_message) = by_default
            .judged_floor(&stream(secs(1)))
            .expect("the per-message floor fits");
        assert!(per_message, "the default gives way");
        assert_eq!(floor.value(), Some(per_message_floor));
        assert_eq!(
            by_default.retention_floor(&stream(secs(1))).value(),
            Some(per_message_floor),
            "the floor a route reports is that of the mode it runs in"
        );
        // A route that chose batches is refused instead.
        let chosen = short(route().adaptive_batch(64));
        assert!(chosen.judged_floor(&stream(secs(1))).is_err());
        // One whose retention covers the batch floor keeps its batches.
        let (_, per_message) = Route::new("S", "c")
            .publisher_retry_horizon(secs(60))
            .retention(7 * DAY)
            .judged_floor(&week)
            .unwrap();
        assert!(!per_message);
    }

    #[test]
    fn one_delivery_without_jitter_has_no_nak_term() {
        let floor = route()
            .retry(RetryPolicy::default().max_deliver(1).jitter(0.0))
            .ack_wait(secs(5))
            .handler_timeout(secs(1))
            .retention_floor(&stream(secs(1)));
        // 3 × 1 s + 3 later deliveries × 5 s.
        assert_eq!(floor.value(), Some(secs(18)));
        let text = floor.to_string();
        assert!(!text.contains("NAK"), "{text}");
        assert!(
            text.contains("3 later deliveries (max_deliver 1 + 3"),
            "{text}"
        );
    }

    #[test]
    fn capped_backoff_is_written_as_runs() {
        let floor = route()
            .retry(RetryPolicy::default().max_deliver(14).jitter(0.0))
            .retention_floor(&stream(DAY));
        assert!(
            floor
                .to_string()
                .contains("NAK backoff 1s+2s+4s+8s+16s+32s+1m 4s+2m 8s+4m 16s+5m×4 = 28m 31s;"),
            "{floor}"
        );
        let many = route()
            .retry(
                RetryPolicy::default()
                    .max_deliver(40)
                    .backoff(Duration::from_millis(1), secs(3600)),
            )
            .retention_floor(&stream(DAY));
        assert!(
            many.to_string()
                .contains("NAK backoff 1ms+2ms+4ms+8ms+…+34m 57.152s+1h×17"),
            "{many}"
        );
    }

    #[test]
    fn huge_settings_saturate_instead_of_overflowing() {
        let floor = route()
            .retry(RetryPolicy::default().max_deliver(u64::MAX))
            .backoff(Duration::MAX, Duration::MAX)
            .retention_floor(&stream(Duration::MAX));
        assert_eq!(floor.value(), Some(Duration::MAX));
        assert!(floor.to_string().ends_with("= forever"), "{floor}");
    }

    #[test]
    fn the_check_refuses_below_the_floor_and_unbounded_floors_only_with_a_retention() {
        let week = stream(7 * DAY);
        route().validate().unwrap();
        check(&route(), &week).expect("no retention: kept forever, not checked");
        check(&route().retention(7 * DAY), &week).expect("at the floor");
        let err = check(&route().retention(DAY), &week).unwrap_err();
        assert!(matches!(err, Error::RetentionBelowFloor { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with("route `c` keeps its claims for 1d (`Route::retention`), below its retention floor of 7d"),
            "{text}"
        );
        assert!(
            text.contains("floor = 0 + max(31m 13.2s, 7d) = 7d"),
            "{text}"
        );
        assert!(
            text.contains("Raise the retention to at least 7d"),
            "{text}"
        );

        let err = check(&route().retention(DAY), &stream(Duration::ZERO)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("the stream keeps messages forever (max_age 0)"),
            "{text}"
        );
        assert!(
            text.contains("Give the stream a max_age, or accept that duplicates arriving after the retention are processed again: `Route::accept_duplicates_after_retention(Unbounded::StreamMaxAge)`"),
            "{text}"
        );
        check(&route(), &stream(Duration::ZERO)).expect("no retention: not checked");
    }

    #[test]
    fn a_reply_route_is_refused_below_its_client_retry_horizon_and_transaction() {
        use crate::ReplyRoute;
        let route = || {
            ReplyRoute::new("orders.place")
                .client_retry_horizon(secs(600))
                .handler_timeout(secs(10))
        };
        // 10 min + 3 × 10 s.
        check_requests(&route().retention(secs(630))).expect("at the floor");
        check_requests(&route().keep_forever()).expect("kept forever: not checked");
        let err = check_requests(&route().retention(secs(600))).unwrap_err();
        assert!(
            matches!(err, Error::RetentionBelowFloor { floor, .. } if floor == secs(630)),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "reply route `orders.place` keeps its claims and stored replies for 10m (`ReplyRoute::retention`, a day unless set), below its retention floor of 10m 30s: \
             a client may still retry a request up to 10m 30s after its claim was made, and a retry that arrives after its claim is purged runs the request again. \
             The floor: client retries: horizon 10m (`ReplyRoute::client_retry_horizon`, from the client's first send) + the retry's wait in the worker, behind requests in flight: \
             one transaction's longest run (claim wait, 1 handler call, COMMIT) 3 × handler_timeout 10s = 30s; floor = 10m + 30s = 10m 30s. \
             Raise the retention to at least 10m 30s, declare a shorter client-retry horizon (`ReplyRoute::client_retry_horizon`) or handler timeout, or keep the claims forever (`ReplyRoute::keep_forever`)"
        );
        let err = check_requests(&route().without_handler_timeout()).unwrap_err();
        assert!(
            matches!(&err, Error::RetentionFloorUnbounded { unbounded, .. } if unbounded == &[Unbounded::HandlerTimeout]),
            "{err}"
        );
        assert!(
            err.to_string().contains(
                "`ReplyRoute::accept_duplicates_after_retention(Unbounded::HandlerTimeout)`"
            ),
            "{err}"
        );
    }

    #[test]
    fn the_worked_example_refusal_reads_as_documented() {
        let route = Route::new("LEDGER", "credit")
            .retention(6 * DAY)
            .publisher_retry_horizon(secs(60));
        let err = check(&route, &stream(7 * DAY)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "route `credit` keeps its claims for 6d (`Route::retention`), below its retention floor of 7d: \
             a duplicate can still arrive up to 7d after its message was processed, and one that arrives after its claim is purged is processed again. \
             The floor: redeliveries after the claim: claiming transaction (claim wait, 1 handler call, COMMIT) 3 × handler_timeout 5m = 15m \
             + 12 later deliveries (max_deliver 10 + 3 on the server, less the claiming one) × ack_wait 30s = 6m \
             + NAK backoff 1s+2s+4s+8s+16s+32s+1m 4s+2m 8s+4m 16s = 8m 31s, +20 % jitter = 10m 13.2s; span 31m 13.2s; \
             stream max_age 7d (a stored copy can be redelivered or replayed until it ages out); \
             publisher copies: horizon 1m ≤ duplicate_window 2m, so JetStream drops retries = 0; \
             floor = 0 + max(31m 13.2s, 7d) = 7d. \
             Raise the retention to at least 7d, or shorten what the floor is made of \
             (the stream's max_age, the retry policy, the handler timeout, the publisher-retry horizon)"
        );
    }

    #[test]
    fn durations_round_trip_through_headers() {
        for duration in [
            Duration::ZERO,
            secs(604_800),
            Duration::from_millis(250),
            Duration::new(3, 1),
        ] {
            assert_eq!(decode_duration(&encode_duration(duration)), Some(duration));
        }
        assert_eq!(encode_duration(Duration::from_millis(1500)), "1.5s");
        for bad in ["", "s", "10", "1.s5", "-1s", "1.0000000001s", "forever"] {
            assert_eq!(decode_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn durations_for_people() {
        let cases = [
            (Duration::ZERO, "0"),
            (Duration::from_nanos(1), "1ms"),
            (Duration::from_millis(250), "250ms"),
            (secs(90), "1m 30s"),
            (Duration::from_millis(613_200), "10m 13.2s"),
            (secs(3600 + 23 * 60), "1h 23m"),
            (7 * DAY + secs(3600), "7d 1h"),
        ];
        for (duration, text) in cases {
            assert_eq!(Human(duration).to_string(), text);
        }
    }
}
