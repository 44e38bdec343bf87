//! The per-message faults, as runtime hooks, and the journal of what each
//! one did to which message: the evidence a report cites and the check
//! that every fault landed.
//!
//! A message is known by its handler and its message id (the id its claim
//! uses). The first time a handler's delivery of a message is seen
//! ([`Plan::on_delivery`]), the message may be given one per-message fault,
//! round robin over the faults that still want messages of that handler;
//! but crash-before-ack, which acts only after a COMMIT of the message's
//! own, is given to the first messages without a fault that commit
//! ([`Plan::after_commit`]). Given at first sight, it could go to a message
//! whose batch's COMMIT another fault then cuts (ambiguous-commit): the
//! batch commits unheard, the message is then acked as processed, and the
//! fault never acts. The fault then acts once, at its point of the path:
//!
//! | fault | hook | what it does |
//! |---|---|---|
//! | handler-failure | after the handler | fails the call (transient) |
//! | dead-letter-replay | after the handler | fails the call (permanent) |
//! | ambiguous-commit | after the handler | arms the proxy to cut the next COMMIT |
//! | redelivery-during-attempt | after the handler | holds the call until the redelivery arrives |
//! | crash-before-ack | after COMMIT | drops the message unacked |

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::Delivery;
use idem_runtime::error::ErrorClass;
use idem_runtime::fault::{AfterCommit, AfterHandler, FaultHooks};

use crate::faults::{Fault, Faults};
use crate::harness::PgProxy;

/// A message as the journal knows it: its handler and its message id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key {
    pub(crate) handler: String,
    pub(crate) id: String,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.id, self.handler)
    }
}

/// What happened to one message.
#[derive(Debug, Default, Clone)]
pub(crate) struct Journal {
    /// The per-message fault it was given, if any.
    pub(crate) fault: Option<Fault>,
    /// Whether that fault has acted.
    pub(crate) injected: bool,
    /// The delivery counts of its deliveries, in the order seen.
    pub(crate) deliveries: Vec<u64>,
    /// Where its first delivery is stored: (stream, sequence); `None` for a
    /// request.
    pub(crate) position: Option<(String, u64)>,
    /// Handler calls that returned (a batch that fell back calls again).
    pub(crate) calls: u32,
    /// Successful COMMITs that included it.
    pub(crate) commits: u32,
    /// The delivery held open (redelivery-during-attempt).
    pub(crate) held: Option<u64>,
    /// The delivery that arrived while it was held.
    pub(crate) redelivered_while_held: Option<u64>,
    /// Whether PostgreSQL showed a session waiting on a lock during the
    /// hold (the redelivery's claim, waiting on the held one's).
    pub(crate) lock_wait_seen: bool,
    /// Whether it was dropped after COMMIT without an ack.
    pub(crate) dropped: bool,
    /// Whether it is a request of a reply route.
    pub(crate) request: bool,
}

#[derive(Default)]
struct State {
    /// How many more messages each (handler, fault) wants.
    wanted: HashMap<(String, Fault), usize>,
    /// Where the round robin of each handler stands.
    turn: HashMap<String, usize>,
    messages: BTreeMap<Key, Journal>,
    /// Deliveries seen per (handler, stream, sequence): a redelivery of a
    /// message whose id changed (a key from the delivery count) is still a
    /// redelivery of the stored message.
    positions: HashMap<(String, String, u64), usize>,
    commits: u64,
}

/// The journal at the end of a run.
pub(crate) struct Snapshot {
    pub(crate) messages: BTreeMap<Key, Journal>,
    positions: HashMap<(String, String, u64), usize>,
    pub(crate) commits: u64,
    /// COMMITs the proxy cut.
    pub(crate) cuts: usize,
}

impl Snapshot {
    /// Whether the message `key` names was delivered again: under its id,
    /// or at its stream position under another id.
    pub(crate) fn delivered_again(&self, key: &Key) -> bool {
        let Some(journal) = self.messages.get(key) else {
            return false;
        };
        journal.deliveries.len() > 1
            || journal.position.as_ref().is_some_and(|(stream, sequence)| {
                self.positions
                    .get(&(key.handler.clone(), stream.clone(), *sequence))
                    .is_some_and(|n| *n > 1)
            })
    }
}

/// The per-message faults of one run.
pub(crate) struct Plan {
    faults: Faults,
    state: Mutex<State>,
    proxy: Arc<PgProxy>,
    /// A pool straight to the database (not through the proxy), to see
    /// lock waits during a hold.
    pool: sqlx::PgPool,
    /// How long a hold waits for the redelivery before giving up.
    hold_limit: Duration,
    /// Holds still running.
    holding: Mutex<usize>,
    /// The `Nats-Msg-Id`s of the messages that duplicate-after-window
    /// publishes again: none of them is given dead-letter-replay, whose
    /// message would otherwise be applied by its copy (or dead-lettered
    /// twice) when the copy arrives before the original is dead-lettered.
    copied_late: HashSet<String>,
}

impl Plan {
    pub(crate) fn new(
        faults: Faults,
        proxy: Arc<PgProxy>,
        pool: sqlx::PgPool,
        hold_limit: Duration,
        copied_late: HashSet<String>,
    ) -> Arc<Plan> {
        Arc::new(Plan {
            copied_late,
            faults,
            state: Mutex::new(State::default()),
            proxy,
            pool,
            hold_limit,
            holding: Mutex::new(0),
        })
    }

    /// The runtime hooks that carry out this plan.
    pub(crate) fn hooks(self: &Arc<Self>) -> FaultHooks {
        let (seen, handled, committed) = (self.clone(), self.clone(), self.clone());
        FaultHooks::default()
            .on_delivery(move |delivery| seen.on_delivery(delivery))
            .after_handler(move |delivery| handled.after_handler(delivery))
            .after_commit(move |delivery| committed.after_commit(delivery))
    }

    fn key(delivery: &Delivery) -> Key {
        Key {
            handler: delivery.handler().to_owned(),
            id: delivery.message_id().as_str().to_owned(),
        }
    }

    fn on_delivery(&self, delivery: &Delivery) {
        let key = Self::key(delivery);
        let request = delivery.stream().is_empty();
        let mut state = self.state.lock().unwrap();
        if !state.messages.contains_key(&key) {
            let copied_late = delivery
                .headers()
                .get("Nats-Msg-Id")
                .is_some_and(|id| self.copied_late.contains(id.as_str()));
            let fault = self.assign(&mut state, &key.handler, request, copied_late);
            state.messages.insert(
                key.clone(),
                Journal {
                    fault,
                    request,
                    position: (!request)
                        .then(|| (delivery.stream().to_owned(), delivery.stream_sequence())),
                    ..Journal::default()
                },
            );
        }
        if !request {
            *state
                .positions
                .entry((
                    key.handler.clone(),
                    delivery.stream().to_owned(),
                    delivery.stream_sequence(),
                ))
                .or_default() += 1;
        }
        let journal = state.messages.get_mut(&key).expect("inserted above");
        journal.deliveries.push(delivery.delivered());
        if let Some(held) = journal.held
            && journal.redelivered_while_held.is_none()
            && delivery.delivered() > held
        {
            journal.redelivered_while_held = Some(delivery.delivered());
        }
    }

    /// The next per-message fault that still wants a message of `handler`.
    fn assign(
        &self,
        state: &mut State,
        handler: &str,
        request: bool,
        copied_late: bool,
    ) -> Option<Fault> {
        let candidates: Vec<Fault> = self
            .faults
            .iter()
            .filter(|fault| fault.per_message() && (!request || fault.fits_requests()))
            .filter(|fault| !(copied_late && *fault == Fault::DeadLetterReplay))
            // Given at its COMMIT instead (see the module docs).
            .filter(|fault| *fault != Fault::CrashBeforeAck)
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let turn = state.turn.entry(handler.to_owned()).or_default();
        let start = *turn;
        *turn += 1;
        for step in 0..candidates.len() {
            let fault = candidates[(start + step) % candidates.len()];
            if self.take_one(&mut state.wanted, handler, fault) {
                return Some(fault);
            }
        }
        None
    }

    /// Whether `fault` still wants a message of `handler`; if so, counts
    /// one taken.
    fn take_one(
        &self,
        wanted: &mut HashMap<(String, Fault), usize>,
        handler: &str,
        fault: Fault,
    ) -> bool {
        let wanted = wanted
            .entry((handler.to_owned(), fault))
            .or_insert(self.faults.each());
        let wants = *wanted > 0;
        if wants {
            *wanted -= 1;
        }
        wants
    }

    fn after_handler(self: &Arc<Self>, delivery: &Delivery) -> AfterHandler {
        let key = Self::key(delivery);
        let mut state = self.state.lock().unwrap();
        let Some(journal) = state.messages.get_mut(&key) else {
            return AfterHandler::Return;
        };
        journal.calls += 1;
        // A dead-letter-replay message fails every call of its first copy
        // until it is dead-lettered, also the call a batch makes again
        // alone after the failure; its replay (which names its handler)
        // then succeeds, and so does a copy stored at another position
        // (a publisher's retry after the duplicate window, which another
        // fault may have made): failing it too would dead-letter the
        // message twice.
        let replay = delivery.headers().get("Idem-Replay-For").is_some();
        let first_copy = journal.position.as_ref().is_none_or(|(stream, sequence)| {
            stream == delivery.stream() && *sequence == delivery.stream_sequence()
        });
        let dead_lettering =
            journal.fault == Some(Fault::DeadLetterReplay) && !replay && first_copy;
        if journal.injected && !dead_lettering {
            return AfterHandler::Return;
        }
        let reason = |fault: Fault| {
            format!(
                "idem-test fault {fault} on message {}: {}",
                key.id,
                fault.what()
            )
        };
        match journal.fault {
            Some(fault @ Fault::HandlerFailure) => {
                journal.injected = true;
                AfterHandler::Fail {
                    class: ErrorClass::Transient,
                    reason: reason(fault),
                }
            }
            Some(fault @ Fault::DeadLetterReplay) => {
                journal.injected = true;
                AfterHandler::Fail {
                    class: ErrorClass::Permanent,
                    reason: reason(fault),
                }
            }
            Some(Fault::AmbiguousCommit) => {
                journal.injected = true;
                self.proxy.cut_next_commit();
                AfterHandler::Return
            }
            Some(Fault::RedeliveryDuringAttempt) if !journal.request => {
                journal.injected = true;
                journal.held = Some(delivery.delivered());
                *self.holding.lock().unwrap() += 1;
                AfterHandler::Wait(Box::pin(self.clone().hold(key)))
            }
            _ => AfterHandler::Return,
        }
    }

    /// Keeps an attempt open until its redelivery has arrived, and then
    /// until PostgreSQL shows a session waiting on a lock (the
    /// redelivery's claim waits on this attempt's), each within a bound.
    async fn hold(self: Arc<Self>, key: Key) {
        let deadline = Instant::now() + self.hold_limit;
        let arrived = loop {
            let arrived = self.state.lock().unwrap().messages[&key]
                .redelivered_while_held
                .is_some();
            if arrived || Instant::now() > deadline {
                break arrived;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if arrived {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                let waiting: Result<i64, _> = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&self.pool)
                .await;
                if waiting.is_ok_and(|n| n > 0) {
                    if let Some(journal) = self.state.lock().unwrap().messages.get_mut(&key) {
                        journal.lock_wait_seen = true;
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        *self.holding.lock().unwrap() -= 1;
    }

    fn after_commit(&self, delivery: &Delivery) -> AfterCommit {
        let key = Self::key(delivery);
        let mut guard = self.state.lock().unwrap();
        let state = &mut *guard;
        state.commits += 1;
        let Some(journal) = state.messages.get_mut(&key) else {
            return AfterCommit::Ack;
        };
        journal.commits += 1;
        // Crash-before-ack is given here (see the module docs).
        if journal.fault.is_none()
            && self.faults.contains(Fault::CrashBeforeAck)
            && self.take_one(&mut state.wanted, &key.handler, Fault::CrashBeforeAck)
        {
            journal.fault = Some(Fault::CrashBeforeAck);
        }
        if journal.fault == Some(Fault::CrashBeforeAck) && !journal.dropped {
            journal.dropped = true;
            journal.injected = true;
            return AfterCommit::DropWithoutAck;
        }
        AfterCommit::Ack
    }

    /// Successful COMMITs so far, over every route: the run's progress.
    pub(crate) fn commits(&self) -> u64 {
        self.state.lock().unwrap().commits
    }

    /// Whether an attempt is still held open.
    pub(crate) fn holding(&self) -> bool {
        *self.holding.lock().unwrap() > 0
    }

    /// The messages given `fault` whose fault has acted.
    pub(crate) fn injected(&self, fault: Fault) -> Vec<Key> {
        self.state
            .lock()
            .unwrap()
            .messages
            .iter()
            .filter(|(_, journal)| journal.fault == Some(fault) && journal.injected)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// A copy of the journal as it stands.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let state = self.state.lock().unwrap();
        Snapshot {
            messages: state.messages.clone(),
            positions: state.positions.clone(),
            commits: state.commits,
            cuts: self.proxy.cuts(),
        }
    }
}
