//! One relay cycle, step by step: what it takes, publishes, blames and
//! records. `drain.rs` runs cycles two at a time; `relay.rs` runs them in
//! lanes.
//!
//! # A cycle, step by step
//!
//! One transaction each, on a [`RelaySession`] (PostgreSQL's, MariaDB's;
//! on SQLite a cycle is two short transactions around its publishes, see
//! `store/sqlite/outbox.rs`):
//!
//! 1. **Take** up to `batch_size` rows with `FOR UPDATE SKIP LOCKED` (so
//!    relays never take the same row), and of those the longest prefix that
//!    fits in `max_cycle_bytes` (always the first row): the fresh lane takes
//!    rows that never failed in id order, the retry lane failing rows that
//!    are due, the earliest due first. `BEGIN`, the server-side bound and
//!    the take go in one message (see `store/outbox.rs`).
//! 2. **Publish** them all, in id order, before awaiting the first PubAck
//!    ([`send_rows`]). A row the client refuses, or would panic on (above
//!    `max_payload`, an invalid subject, a header it cannot encode), fails
//!    at once; a publish the client cannot queue (it is disconnected, its
//!    buffer full) leaves it and the rest of the cycle untouched, since each
//!    further send would wait out its own timeout.
//! 3. **Await the PubAcks** ([`await_acks`]), each up to the client's
//!    timeout; but once one has come back, those still missing a second
//!    later (or as long as the last took, if longer) are given up on, if
//!    one of them was published before an acknowledged one: a publish the
//!    server refused for want of permission never gets an answer, and must
//!    not hold up the rows that went through (a stream that is only slow
//!    answers in order, so its missing PubAcks are all after the last one
//!    that came). Once the
//!    client has connected again, those of the lost connection are given
//!    up on too. The PubAcks that came back are counted in the relay's
//!    stats now, before the rows are deleted.
//! 4. **Blame or not** ([`blame`]). A row the client refused is the row's
//!    fault. For the others:
//!    - if the client could not queue a publish, or the connection was
//!      lost while they were out, what did not come back is not the rows'
//!      fault (an answer that did come, such as "no stream", still is,
//!      unless nothing went out);
//!    - else, if nothing went out, ask JetStream whether it answers at all
//!      ([`nats_answers`]); if it does not, NATS is away and nothing is
//!      recorded;
//!    - else each failed row gets `attempts + 1`, its `last_error` and its
//!      own `not_before`.
//!
//!    A lane that lost the connection in two cycles in a row publishes one
//!    row per cycle until one goes through ([`LostConnections`]): a row
//!    over which the server drops the connection then loses it alone, and
//!    is blamed if JetStream answers right after.
//! 5. **Finish**: record the failures, DELETE the acknowledged rows and
//!    COMMIT; the DELETE and the COMMIT in one message, with the next
//!    cycle's take when it runs on the same session.
//!
//! Steps 2 to 4 are [`Cycles::head`] (NATS only, no database), step 5
//! [`Cycles::finished`] after [`RelaySession::advance`].

use std::collections::BTreeMap;
#[cfg(feature = "fault-injection")]
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, publish::PublishAck};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use sqlx::Pool;

use super::stats::{Cycle, Published, RelayStats};
use super::{MAX_SUBJECT_LEN, check_subject, message_headers};
use crate::store::outbox::{Lane, Marks, OutboxStore, RelaySession, Row, Take};

/// A failing row's first back-off; it doubles with each failure.
pub(super) const FIRST_ROW_BACKOFF: Duration = Duration::from_secs(1);

/// How long the PubAcks still missing are waited for after the last
/// answer (or as long as that answer took, if longer).
const STRAGGLER_GRACE: Duration = Duration::from_secs(1);

/// How long [`nats_answers`] waits for JetStream's account info.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest `last_error` recorded on a row.
const MAX_ERROR_LEN: usize = 1024;

#[cfg(feature = "fault-injection")]
pub(super) type AfterPubAcksHook = dyn Fn(&[Published]) -> crate::fault::AfterPubAcks + Send + Sync;

/// Why a relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A fault hook made the relay die after the PubAcks, before its DELETE
    /// (feature `fault-injection`).
    #[error("the relay was crashed by a fault hook after {0} PubAcks, before deleting its rows")]
    InjectedCrash(usize),
    /// The outbox could not be read or written.
    #[error("the outbox relay's database work failed: {0}")]
    Database(#[from] sqlx::Error),
}

/// What a relay's cycles need of it: their limits, its counters, and the
/// fault hook (shared with the relay's clones).
#[derive(Clone)]
pub(super) struct Cycles {
    pub(super) batch_size: usize,
    pub(super) max_cycle_bytes: usize,
    pub(super) max_row_backoff: Duration,
    pub(super) stats: RelayStats,
    #[cfg(feature = "fault-injection")]
    pub(super) after_pubacks: Option<Arc<AfterPubAcksHook>>,
}

/// A row taken, while its publish is out.
pub(super) struct Taken {
    id: i64,
    msg_id: String,
    subject: String,
    attempts: i32,
}

/// The rows a cycle took (step 1), not yet published.
pub(super) struct Open {
    lane: Lane,
    rows: Vec<Row>,
    /// How many the take locked: more than `rows` when the byte limit cut
    /// it (those stay locked until the cycle ends).
    locked: usize,
    limit: usize,
}

impl Open {
    /// The cycle of `rows` taken with `take`; `None` if it took none.
    pub(super) fn of(take: Take, rows: Vec<Row>) -> Option<Open> {
        let &(.., locked) = rows.first()?;
        Some(Open {
            lane: take.lane,
            locked: usize::try_from(locked).unwrap_or(usize::MAX),
            limit: take.limit,
            rows,
        })
    }

    /// The take was full, or cut at `max_cycle_bytes`: more rows may be
    /// waiting.
    pub(super) fn more(&self) -> bool {
        self.locked >= self.limit || self.rows.len() < self.locked
    }

    /// The take was full by count: more rows are likely.
    pub(super) fn full(&self) -> bool {
        self.locked >= self.limit
    }

    /// None of the rows it locked was cut at `max_cycle_bytes`: the next
    /// take may run while this cycle's PubAcks are out, and takes exactly
    /// the rows after these (a row locked but cut would stay locked until
    /// this cycle ends, and be skipped by it).
    pub(super) fn uncut(&self) -> bool {
        self.rows.len() == self.locked
    }
}

/// A cycle whose PubAcks are in (steps 2 to 4 done), before its finish.
pub(super) struct Acked {
    pub(super) lane: Lane,
    /// What it did; `failing` and `nats_away` as they will be recorded.
    pub(super) cycle: Cycle,
    /// The ids of the rows JetStream acknowledged: to delete.
    pub(super) acknowledged: Vec<i64>,
    /// The failures to record on their rows, each with why.
    pub(super) marked: Vec<(Taken, String)>,
    /// Rows its take locked were cut at `max_cycle_bytes`: they stay
    /// locked until its finish commits, so the next take must come after
    /// that, or skip them.
    pub(super) cut: bool,
    /// The fault hook crashed the relay here (feature `fault-injection`).
    pub(super) crashed: bool,
}

impl Acked {
    /// Rows of the cycle failed and stay fresh (not recorded on them: NATS
    /// away, a lost connection, a publish not queued): the next take should
    /// begin with them, so that they keep their place.
    pub(super) fn left_fresh(&self) -> bool {
        self.cycle.failed > self.marked.len()
    }
}

/// What a cycle's publishing left ([`send_rows`]).
struct Sends {
    /// Rows the client refused, or would panic on, each with why: the
    /// row's own fault, whatever NATS does.
    refused: Vec<(Taken, String)>,
    /// Why a publish could not be queued, if one could not: the rows from
    /// it on were not sent.
    unsent: Option<String>,
    /// The rows sent, with their PubAcks to come.
    in_flight: Vec<(Taken, PublishAckFuture)>,
}

/// A cycle's failed rows, each with why, by who answered for it; what
/// [`blame`] leaves of them is recorded on the rows.
struct Failed {
    /// Refused by the client (or it would panic).
    refused: Vec<(Taken, String)>,
    /// Failures the server answered for (no stream, a JetStream error).
    answered: Vec<(Taken, String)>,
    /// Failures it did not answer for (no PubAck in time, given up on).
    unanswered: Vec<(Taken, String)>,
}

impl Cycles {
    /// What a cycle of `lane` takes; `alone` takes a single row, to find
    /// one over which the server drops the connection
    /// ([`LostConnections`]).
    pub(super) fn take(&self, lane: Lane, alone: bool) -> Take {
        Take {
            lane,
            limit: if alone { 1 } else { self.batch_size },
            bytes: self.max_cycle_bytes,
        }
    }

    /// One whole cycle of `lane` on a session of its own (see the module
    /// docs): what [`Relay::relay_batch`](super::Relay::relay_batch) and
    /// the retry lane run.
    pub(super) async fn one<DB: OutboxStore>(
        &self,
        js: &jetstream::Context,
        pool: &Pool<DB>,
        lane: Lane,
        alone: bool,
    ) -> Result<Cycle, RelayError> {
        let mut session = DB::Relay::acquire(pool).await?;
        let take = self.take(lane, alone);
        let Some(open) = Open::of(take, session.take(take).await?) else {
            self.stats.empty_cycle();
            return Ok(Cycle::default());
        };
        let acked = self.head(js, open, alone).await;
        if acked.crashed {
            return Err(self.crash(&mut session, &acked).await);
        }
        let advanced = session
            .advance(Some((&acked.acknowledged, &self.marks(&acked))), None)
            .await;
        advanced.taken?;
        Ok(self.finished(acked))
    }

    /// Steps 2 to 4 of the module docs: publishes the rows, awaits their
    /// PubAcks, counts those that came back, and tells whose fault each
    /// failure is. Speaks to NATS only; the cycle's transaction waits.
    pub(super) async fn head(&self, js: &jetstream::Context, open: Open, alone: bool) -> Acked {
        let lane = open.lane;
        let cut = !open.uncut();
        let mut cycle = Cycle {
            taken: open.rows.len(),
            more: open.more(),
            ..Cycle::default()
        };
        let statistics = js.client().statistics();
        let connects = statistics.connects.load(Ordering::Relaxed);

        let Sends {
            refused,
            unsent,
            in_flight,
        } = send_rows(js, open.rows, &mut cycle).await;
        let acks = await_acks(in_flight, || {
            statistics.connects.load(Ordering::Relaxed) != connects
        })
        .await;
        let (acknowledged, mut failed) = sort_acks(acks, refused, &mut cycle);
        cycle.failed += failed.refused.len() + failed.answered.len() + failed.unanswered.len();
        cycle.reconnected = statistics.connects.load(Ordering::Relaxed) != connects;
        cycle.nats_away = blame(js, &cycle, alone, unsent, &mut failed).await;

        #[cfg(feature = "fault-injection")]
        if let Some(hook) = &self.after_pubacks
            && hook(&cycle.published) == crate::fault::AfterPubAcks::Crash
        {
            return Acked {
                lane,
                cycle,
                acknowledged,
                marked: Vec::new(),
                cut,
                crashed: true,
            };
        }
        // Stored (or dropped as a copy) by JetStream: counted now, so that
        // no subscriber sees a message its relay has not counted yet.
        self.stats.acknowledged(&cycle.published);
        let mut marked = failed.refused;
        marked.extend(failed.answered);
        marked.extend(failed.unanswered);
        cycle.failing = marked.len();
        Acked {
            lane,
            cycle,
            acknowledged,
            marked,
            cut,
            crashed: false,
        }
    }

    /// The failures of `acked` as its finish records them, each with its
    /// own back-off.
    pub(super) fn marks(&self, acked: &Acked) -> Marks {
        Marks {
            ids: acked.marked.iter().map(|(row, _)| row.id).collect(),
            errors: acked.marked.iter().map(|(_, why)| why.clone()).collect(),
            backoffs: acked
                .marked
                .iter()
                .map(|(row, _)| self.row_backoff(row.attempts).as_secs_f64())
                .collect(),
        }
    }

    /// After `acked`'s COMMIT: warns of its failing rows, counts it into the
    /// stats and the metrics, and traces it. Returns what it did.
    pub(super) fn finished(&self, acked: Acked) -> Cycle {
        self.warn_failing(&acked.marked, acked.lane);
        let cycle = acked.cycle;
        self.stats.record_cycle(&cycle);
        tracing::debug!(
            lane = acked.lane.name(),
            taken = cycle.taken,
            published = cycle.published.len(),
            failed = cycle.failed,
            failing = cycle.failing,
            reconnected = cycle.reconnected,
            "outbox cycle"
        );
        cycle
    }

    /// Ends a cycle the fault hook crashed, as a dead process's connection
    /// would: its locks go now.
    pub(super) async fn crash<S: RelaySession<DB>, DB>(
        &self,
        session: &mut S,
        acked: &Acked,
    ) -> RelayError {
        if let Err(error) = session.rollback().await {
            return RelayError::Database(error);
        }
        RelayError::InjectedCrash(acked.cycle.published.len())
    }

    /// A failing row's next wait, after `attempts` earlier failures.
    pub(super) fn row_backoff(&self, attempts: i32) -> Duration {
        let doublings = attempts.clamp(0, 20) as u32;
        FIRST_ROW_BACKOFF
            .saturating_mul(1 << doublings)
            .min(self.max_row_backoff)
    }

    /// One warning per subject and error of the rows a cycle recorded as
    /// failing, naming both.
    fn warn_failing(&self, marked: &[(Taken, String)], lane: Lane) {
        let mut groups: BTreeMap<(&str, &str), (usize, i32)> = BTreeMap::new();
        for (row, why) in marked {
            let group = groups
                .entry((row.subject.as_str(), why.as_str()))
                .or_default();
            group.0 += 1;
            group.1 = group.1.max(row.attempts + 1);
        }
        for ((subject, error), (rows, attempts)) in groups {
            let retry_in_ms = self.row_backoff(attempts - 1).as_millis() as u64;
            tracing::warn!(
                subject,
                error,
                rows,
                attempts,
                retry_in_ms,
                lane = lane.name(),
                "outbox rows failed to publish; each is retried after its own back-off, and the rows after them go on (`idem outbox retry` once the cause is fixed)"
            );
        }
    }
}

/// Cycles in a row of one lane that lost the NATS connection while their
/// publishes were out. After two, the lane publishes one row per cycle
/// until one goes through: if a row makes the server drop the connection,
/// it is then found alone, and blamed (see [`blame`]), instead of cutting
/// the relay off at every cycle.
#[derive(Debug, Default)]
pub(super) struct LostConnections(u32);

impl LostConnections {
    const BEFORE_ALONE: u32 = 2;

    pub(super) fn alone(&self) -> bool {
        self.0 >= Self::BEFORE_ALONE
    }

    pub(super) fn count(&mut self, cycle: &Cycle) {
        if cycle.reconnected && cycle.failing == 0 {
            self.0 += 1;
        } else if cycle.taken > 0 {
            self.0 = 0;
        }
    }
}

/// Step 2, publish: sends every row, in id order, before any PubAck is
/// awaited. A row the client refuses, or would panic on, fails at once;
/// once a publish cannot be queued, the rest of the cycle is left as it
/// is (counted as failed in `cycle`), since each further send would wait
/// out its own timeout.
async fn send_rows(js: &jetstream::Context, rows: Vec<Row>, cycle: &mut Cycle) -> Sends {
    // Refused by the client (or it would panic): the row's own fault,
    // whatever NATS does.
    let mut refused: Vec<(Taken, String)> = Vec::new();
    let mut unsent: Option<String> = None;
    let mut in_flight = Vec::with_capacity(rows.len());
    let taken = rows.len();
    for (sent, (id, msg_id, subject, payload, headers, attempts, _)) in rows.into_iter().enumerate()
    {
        let row = Taken {
            id,
            msg_id,
            subject,
            attempts,
        };
        if check_subject(&row.subject).is_err() {
            refused.push((row, format!("not a valid publish subject (empty, a wildcard, whitespace, or longer than {MAX_SUBJECT_LEN} bytes): it can never be published; delete the row")));
            continue;
        }
        let headers = match message_headers(headers, &row.msg_id) {
            Ok(headers) => headers,
            Err(why) => {
                refused.push((row, why));
                continue;
            }
        };
        let publish = PublishMessage::build()
            .payload(Bytes::from(payload))
            .headers(headers);
        match js.send_publish(row.subject.clone(), publish).await {
            Ok(ack) => in_flight.push((row, ack)),
            Err(error) if error.kind() == PublishErrorKind::MaxPayloadExceeded => {
                refused.push((row, reason(&error)));
            }
            Err(error) => {
                // The client could not queue it: each further send would
                // wait out its own timeout, so the rest stay as they are.
                tracing::warn!(%error, msg_id = row.msg_id, subject = row.subject, "outbox publish not sent; the rest of the cycle waits for the next");
                cycle.failed += taken - sent;
                unsent = Some(format!(
                    "the NATS client could not queue a publish: {error}"
                ));
                break;
            }
        }
    }
    Sends {
        refused,
        unsent,
        in_flight,
    }
}

/// Step 3's PubAcks, sorted: the ids of the rows JetStream acknowledged
/// (each recorded in `cycle` as published), and the failures, with the
/// rows the client `refused`.
fn sort_acks(acks: Acks, refused: Vec<(Taken, String)>, cycle: &mut Cycle) -> (Vec<i64>, Failed) {
    let mut sent = Vec::with_capacity(acks.answered.len());
    let mut answered: Vec<(Taken, String)> = Vec::new();
    let mut unanswered: Vec<(Taken, String)> = Vec::new();
    for (row, ack) in acks.answered {
        match ack {
            Ok(ack) => {
                sent.push(row.id);
                cycle.published.push(Published {
                    msg_id: row.msg_id,
                    subject: row.subject,
                    stream_sequence: ack.sequence,
                    duplicate: ack.duplicate,
                });
            }
            Err(error) => {
                let why = reason(&error);
                match error.kind() {
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                        unanswered.push((row, why));
                    }
                    _ => answered.push((row, why)),
                }
            }
        }
    }
    unanswered.extend(acks.stragglers.into_iter().map(|row| {
        (row, "no PubAck while others of its cycle came back: the relay's NATS user may lack permission to publish to this subject (the server drops a refused publish without an answer), or its stream is slow or has no leader".to_owned())
    }));
    let failed = Failed {
        refused,
        answered,
        unanswered,
    };
    (sent, failed)
}

/// Step 4, whose fault (see the module docs): drops from `failed` what is
/// not the rows' doing, so that it is not recorded on them, and returns
/// why NATS is away, if it is. `unsent` is why a publish could not be
/// queued, if one could not.
async fn blame(
    js: &jetstream::Context,
    cycle: &Cycle,
    alone: bool,
    unsent: Option<String>,
    failed: &mut Failed,
) -> Option<String> {
    let Failed {
        answered,
        unanswered,
        ..
    } = failed;
    let published = !cycle.published.is_empty();
    let failures = !answered.is_empty() || !unanswered.is_empty();
    let mut away = None;
    if let Some(cause) = unsent {
        // The client is clogged or cut off: what did not come back may be
        // its doing.
        away = Some(cause);
        unanswered.clear();
        if !published {
            answered.clear();
        }
    } else if cycle.reconnected && failures {
        // The connection was lost while these were out: what did not come
        // back is NATS's doing, unless this row was published alone after
        // earlier cycles lost it too, and JetStream answers at once after:
        // then the server dropped the connection over this row (a protocol
        // line it would not take, say).
        let answers = nats_answers(js).await;
        if alone && answers.is_ok() {
            for (_, why) in unanswered.iter_mut() {
                *why = "the NATS connection was lost each time this row was published, alone too, and JetStream answered at once after: the server may refuse it (a subject or header too long for it); fix or delete the row".to_owned();
            }
        } else {
            unanswered.clear();
            if !published {
                answered.clear();
                away = Some(match answers {
                    Ok(()) => "the NATS connection was lost during the cycle".to_owned(),
                    Err(cause) => cause,
                });
            }
        }
    } else if !published && failures {
        match probe(js).await {
            Probe::Answers => {}
            // Connected, but JetStream's account info went unanswered,
            // while the server did answer for some of these rows (no
            // stream, say): a NATS user that may not request
            // `$JS.API.INFO` looks like this, and taking the rows' answers
            // for an outage would retake the same head rows for ever. The
            // rows keep their failures; the relay says why it cannot tell.
            Probe::Unanswered(cause) if !answered.is_empty() => {
                // Only what the server answered for is the rows' own fault;
                // what timed out stays as it is.
                unanswered.clear();
                tracing::warn!(
                    cause,
                    "JetStream did not answer the relay's probe, though it answered for the rows that failed: their failures are recorded on them, as when NATS answers. Allow the relay's NATS user to request $JS.API.INFO, so that the relay can tell NATS being away from rows that fail"
                );
            }
            Probe::Away(cause) | Probe::Unanswered(cause) => {
                away = Some(cause);
                answered.clear();
                unanswered.clear();
            }
        }
    }
    away
}

/// What [`await_acks`] found.
struct Acks {
    /// Rows whose PubAck (or error) came back.
    answered: Vec<(Taken, Result<PublishAck, PublishError>)>,
    /// Rows given up on: unanswered once others had come back, or the
    /// connection was re-established meanwhile.
    stragglers: Vec<Taken>,
}

/// How often [`await_acks`] looks whether the connection was
/// re-established.
const RECONNECT_CHECK_EVERY: Duration = Duration::from_millis(100);

/// Awaits the PubAcks of a cycle's publishes. Each waits up to the
/// client's timeout, but the rest are given up on
///
/// - once a publish has been acknowledged and the others are still
///   unanswered [`STRAGGLER_GRACE`] after the last acknowledgement (or as
///   long as it took, if longer), if one of them was published before an
///   acknowledged one: NATS is up, and they are not coming (a publish
///   refused for want of permission gets no answer, while the server
///   answers those after it). When only publishes after the last
///   acknowledged one are missing, the stream may only be slow (it answers
///   in order), and they wait out the client's timeout;
/// - once the client has connected again (`reconnected`): the PubAcks of
///   the lost connection are not coming either.
async fn await_acks(
    in_flight: Vec<(Taken, PublishAckFuture)>,
    reconnected: impl Fn() -> bool,
) -> Acks {
    let started = tokio::time::Instant::now();
    let (rows, acks): (Vec<Taken>, Vec<PublishAckFuture>) = in_flight.into_iter().unzip();
    let mut results: Vec<Option<Result<PublishAck, PublishError>>> =
        rows.iter().map(|_| None).collect();
    let mut pending: FuturesUnordered<_> = acks
        .into_iter()
        .enumerate()
        .map(|(i, ack)| async move { (i, ack.await) })
        .collect();
    let mut give_up_at: Option<tokio::time::Instant> = None;
    // The last publish (in the cycle's order) acknowledged so far.
    let mut latest_acknowledged: Option<usize> = None;
    // Racing the PubAcks (not a transaction) with a timer is safe: a PubAck
    // given up on only leaves its row pending.
    while !pending.is_empty() && !reconnected() {
        let check = tokio::time::Instant::now() + RECONNECT_CHECK_EVERY;
        let until = give_up_at.map_or(check, |at| at.min(check));
        match tokio::time::timeout_at(until, pending.next()).await {
            Ok(Some((i, ack))) => {
                if ack.is_ok() {
                    give_up_at =
                        Some(tokio::time::Instant::now() + started.elapsed().max(STRAGGLER_GRACE));
                    latest_acknowledged = latest_acknowledged.max(Some(i));
                }
                results[i] = Some(ack);
            }
            Ok(None) => break,
            Err(_) if give_up_at.is_some_and(|at| at <= tokio::time::Instant::now()) => {
                // A stream answers its publishes in order: if only rows
                // after the last one acknowledged are missing, the stream
                // is slow (an fsync that stalls), not refusing them; each
                // waits out the client's timeout instead.
                let passed = latest_acknowledged
                    .is_some_and(|latest| results[..latest].iter().any(Option::is_none));
                if passed {
                    break;
                }
                give_up_at = None;
            }
            Err(_) => {}
        }
    }
    let mut acks = Acks {
        answered: Vec::with_capacity(rows.len()),
        stragglers: Vec::new(),
    };
    for (row, result) in rows.into_iter().zip(results) {
        match result {
            Some(ack) => acks.answered.push((row, ack)),
            None => acks.stragglers.push(row),
        }
    }
    acks
}

/// Whether NATS and JetStream answer now: the client is connected and
/// JetStream gives its account info (`$JS.API.INFO`, which the relay's
/// NATS user must be allowed to request) within [`PROBE_TIMEOUT`]. Asked
/// when nothing of a cycle went out, to tell NATS being away (the rows keep
/// their state) from the rows' own failures (recorded on them).
async fn nats_answers(js: &jetstream::Context) -> Result<(), String> {
    match probe(js).await {
        Probe::Answers => Ok(()),
        Probe::Away(cause) | Probe::Unanswered(cause) => Err(cause),
    }
}

/// What [`probe`] found.
enum Probe {
    /// Connected, and JetStream gave its account info.
    Answers,
    /// Not connected, or JetStream answered with an error (no responders:
    /// JetStream is not enabled, or not up yet).
    Away(String),
    /// Connected, but no answer within [`PROBE_TIMEOUT`]: NATS is away
    /// (JetStream without a leader, a connection not yet seen as lost), or
    /// the relay's NATS user may not request `$JS.API.INFO` (the server
    /// drops a request it refuses without an answer).
    Unanswered(String),
}

/// Asks whether NATS and JetStream answer now (see [`nats_answers`]).
async fn probe(js: &jetstream::Context) -> Probe {
    let state = js.client().connection_state();
    if state != State::Connected {
        return Probe::Away(format!("the NATS client is {state}"));
    }
    match tokio::time::timeout(PROBE_TIMEOUT, js.query_account()).await {
        Ok(Ok(_)) => Probe::Answers,
        Ok(Err(error)) => Probe::Away(format!("JetStream's account info failed: {error}")),
        Err(_) => Probe::Unanswered(format!(
            "JetStream did not answer an account info request within {PROBE_TIMEOUT:?} (NATS is away, or the relay's NATS user may not request $JS.API.INFO)"
        )),
    }
}

/// What a failed publish means, for `last_error` and the warnings.
fn reason(error: &PublishError) -> String {
    let hint = match error.kind() {
        PublishErrorKind::StreamNotFound => {
            "no stream stores this subject: create one (or fix the subject), then `idem outbox retry`"
        }
        PublishErrorKind::MaxPayloadExceeded => {
            "larger than the server's max_payload: it cannot be published as it is"
        }
        PublishErrorKind::TimedOut => {
            "the relay's NATS user may lack permission to publish to this subject (the server drops a refused publish without an answer), or its stream has no leader"
        }
        _ => "",
    };
    let mut text = if hint.is_empty() {
        error.to_string()
    } else {
        format!("{error}; {hint}")
    };
    // The server's text goes into a PostgreSQL text column, which takes no
    // NUL: a MARK that failed over one would fail its whole cycle.
    text.retain(|c| c != '\0');
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}
