//! The path of one message through the runtime (private). A maintainer's
//! map: each step below is one function, in the order a message meets them.
//!
//! # A JetStream message, one per transaction
//!
//! 1. **Pull.** [`pull::pull_until_shutdown`] keeps one long-lived pull per
//!    route and hands each message to its route's [`Pipeline`] as a slot of
//!    the route's concurrency frees up.
//! 2. **Take.** [`Pipeline::process`] counts it and reads its JetStream
//!    metadata into a [`Delivery`](crate::Delivery)
//!    ([`Pipeline::delivery_of`]; a message without any is dead-lettered).
//!    A dead-letter replay meant for another route is acked unrun
//!    ([`Pipeline::skip_replay_for_another`]).
//! 3. **Lease.** From here until it is settled, the message is kept leased
//!    by progress heartbeats ([`heartbeat::Heartbeats::lease`]), so that
//!    ack_wait does not expire under a slow handler.
//! 4. **Prepare.** [`Pipeline::prepare`] resolves the id it is
//!    deduplicated by and decodes the payload; bad input is a
//!    [`RejectedMessage`](crate::RejectedMessage), dead-lettered at once.
//! 5. **Decide.** [`Pipeline::decide`]: past its delivery limit, the
//!    message is checked for an attempt that committed
//!    ([`Pipeline::past_limit`]); otherwise it is run.
//! 6. **Claim and transact.** [`Pipeline::transact_with_retries`] runs
//!    [`Pipeline::transact`]: BEGIN, the claim as the transaction's first
//!    statement (`store/claim.rs`, `store/transaction.rs`), the handler
//!    ([`Pipeline::run_handler`], watched by [`Pipeline::watched`]), its
//!    stored result, then the checked COMMIT. A claim that finds the message
//!    processed rolls back: a duplicate. Errors worth an immediate retry are
//!    retried here, in process.
//! 7. **Hold.** When the database cannot be used before the handler runs,
//!    the message is not to blame: it is held, leased, and retried
//!    ([`Pipeline::hold_for_database`]), and the route pauses
//!    ([`health::Health`]).
//! 8. **Settle.** [`Pipeline::settle`] ends every path in exactly one of:
//!    ack after the commit or for a duplicate ([`ack::ack`]), NAK with the
//!    retry policy's backoff ([`ack::nak`]), or a stored dead letter
//!    ([`Pipeline::dead_letter`]) then TERM ([`ack::term`]).
//!
//! # The other paths
//!
//! - [`batch`]: many messages claimed in one statement and committed once
//!   ([`Pipeline::process_batch`]); a batch that fails is run again one
//!   message per transaction, through the steps above.
//! - [`reply`]: a request on a reply route takes the same steps with
//!   [`Mode::Answer`](crate::reply::Mode): the caller gets an answer
//!   instead of an ack.
//! - [`undeliverable`]: messages JetStream gave up on (their deliveries ran
//!   out), dead-lettered from its advisories.
//! - [`start`]: how the router starts a route: its pipeline
//!   ([`Pipeline::new`]), its pull, and its watcher of advisories.

pub(crate) mod ack;
pub(crate) mod batch;
pub(crate) mod health;
pub(crate) mod heartbeat;
pub(crate) mod pipeline;
pub(crate) mod pull;
pub(crate) mod pull_books;
pub(crate) mod pull_stream;
pub(crate) mod reply;
pub(crate) mod sizing;
pub(crate) mod start;
pub(crate) mod undeliverable;

#[cfg(doc)]
use pipeline::Pipeline;
