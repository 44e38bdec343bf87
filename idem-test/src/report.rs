//! What a run did: each fault with its evidence and the messages it
//! touched, the routes' counters, and the text every failed assertion
//! prints.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::faults::{Fault, Faults};
use crate::plan::{Journal, Key, Plan, Snapshot};
use crate::run::Connections;

/// A copy of a message published again (a duplicate publish).
#[derive(Debug, Clone)]
pub(crate) struct Copy {
    pub(crate) id: String,
    /// Whether JetStream stored it (rather than dropping it as a
    /// duplicate).
    pub(crate) stored: bool,
    pub(crate) sequence: u64,
}

/// A server restart.
#[derive(Debug, Clone)]
pub(crate) struct Restart {
    pub(crate) old_pid: Option<u32>,
    pub(crate) new_pid: Option<u32>,
    /// Commits the routers had made before it.
    pub(crate) commits_before: u64,
    /// NATS disconnects the routers' clients had seen before it.
    pub(crate) disconnects_before: usize,
}

/// One request, as the client saw it.
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestLog {
    pub(crate) subject: String,
    /// Times it was sent.
    pub(crate) sent: u32,
    /// The payloads of the answers (no `Idem-Error`), in order.
    pub(crate) answers: Vec<bytes::Bytes>,
    /// Error replies and timeouts.
    pub(crate) errors: Vec<String>,
    /// Whether a reply said the request will never succeed.
    pub(crate) refused: bool,
}

/// The dead letter of a dead-letter-replay message and its replays.
#[derive(Debug, Clone, Default)]
pub(crate) struct Replays {
    pub(crate) letter: Option<u64>,
    pub(crate) first: Option<(u64, std::time::Instant)>,
    pub(crate) second: Option<u64>,
    pub(crate) discarded: bool,
}

/// What the publishing, the servers and the replays went through.
#[derive(Debug, Default)]
pub(crate) struct Happened {
    pub(crate) in_window: Vec<Copy>,
    pub(crate) after_window: Vec<Copy>,
    pub(crate) postgres: Option<Restart>,
    pub(crate) nats: Option<Restart>,
    pub(crate) replays: BTreeMap<Key, Replays>,
    pub(crate) requests: BTreeMap<String, RequestLog>,
    pub(crate) notes: Vec<String>,
}

/// One route's counters at the end of the run.
#[derive(Debug, Clone)]
pub(crate) struct RouteStats {
    pub(crate) route: String,
    pub(crate) processed: u64,
    pub(crate) duplicates: u64,
    pub(crate) failed: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) commit_failed: u64,
    pub(crate) infrastructure_errors: u64,
    pub(crate) dropped_by_fault: u64,
}

/// How one fault went.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) fault: Fault,
    /// Whether it is shown to have happened.
    pub(crate) shown: bool,
    /// What shows it, or why it is not shown.
    pub(crate) evidence: String,
    /// The message ids it touched (the ids the claims use, or for a
    /// publish, the `Nats-Msg-Id`).
    pub(crate) messages: Vec<String>,
}

/// What a run did, for assertions and their messages.
#[derive(Debug, Clone)]
pub(crate) struct RunReport {
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) notes: Vec<String>,
    pub(crate) routes: Vec<RouteStats>,
    pub(crate) requests: BTreeMap<String, RequestLog>,
    /// How many times each message's handler ran, by message id, where
    /// more than once.
    pub(crate) reruns: BTreeMap<String, u32>,
    pub(crate) elapsed: Duration,
}

impl RunReport {
    pub(crate) fn new(
        faults: &Faults,
        plan: &Plan,
        happened: &Happened,
        connections: &Connections,
        routes: Vec<RouteStats>,
        elapsed: Duration,
    ) -> RunReport {
        let plan = plan.snapshot();
        let outcomes = faults
            .iter()
            .map(|fault| outcome(fault, &plan, happened, connections))
            .collect();
        let reruns = plan
            .messages
            .iter()
            .filter(|(_, j)| j.calls > 1)
            .map(|(key, j)| (key.id.clone(), j.calls))
            .collect();
        RunReport {
            outcomes,
            reruns,
            notes: happened.notes.clone(),
            routes,
            requests: happened.requests.clone(),
            elapsed,
        }
    }

    /// Panics, naming each fault that did not happen and why.
    pub(crate) fn check_every_fault_happened(&self) {
        let missing: Vec<&Outcome> = self.outcomes.iter().filter(|o| !o.shown).collect();
        if missing.is_empty() {
            return;
        }
        let mut text = String::from(
            "idem-test: the run settled, but not every fault it was given is shown to have \
             happened, so it proves nothing about them:\n",
        );
        for outcome in missing {
            let _ = writeln!(text, "  {}: {}", outcome.fault, outcome.evidence);
        }
        let _ = write!(text, "\n{self}");
        panic!("{text}");
    }

    /// What the run did to message `id`: the faults that touched it, and
    /// how many times its handler ran if more than once (a batch that a
    /// fault rolled back runs its other messages again).
    pub(crate) fn story_of(&self, id: &str) -> Option<String> {
        let faults: Vec<&str> = self
            .outcomes
            .iter()
            .filter(|o| o.messages.iter().any(|m| m == id))
            .map(|o| o.fault.name())
            .collect();
        let runs = self.reruns.get(id);
        match (faults.is_empty(), runs) {
            (true, None) => None,
            (true, Some(runs)) => Some(format!(
                "its handler ran {runs} times: in a transaction a fault rolled back"
            )),
            (false, None) => Some(format!("hit by {}", faults.join(", "))),
            (false, Some(runs)) => Some(format!(
                "hit by {}; its handler ran {runs} times",
                faults.join(", ")
            )),
        }
    }

    /// A failed assertion's message: what failed, then the report.
    pub(crate) fn failure(&self, what: &str) -> String {
        let ran: Vec<&str> = self.outcomes.iter().map(|o| o.fault.name()).collect();
        let ran = if ran.is_empty() {
            "no fault".to_owned()
        } else {
            ran.join(", ")
        };
        format!("idem-test: {what}\n  under: {ran}\n\n{self}")
    }
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.outcomes.is_empty() {
            writeln!(f, "faults injected: none")?;
        } else {
            writeln!(f, "faults injected, each shown to have happened:")?;
        }
        for outcome in &self.outcomes {
            writeln!(f, "  {:<26} {}", outcome.fault.name(), outcome.fault.what())?;
            writeln!(f, "  {:<26} {}", "", outcome.evidence)?;
            if !outcome.messages.is_empty() {
                writeln!(f, "  {:<26} messages: {}", "", list(&outcome.messages, 8))?;
            }
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        for route in &self.routes {
            writeln!(
                f,
                "route {}: {} processed, {} duplicates skipped, {} failed, {} dead-lettered, \
                 {} COMMITs of unknown outcome, {} database errors, {} dropped after COMMIT",
                route.route,
                route.processed,
                route.duplicates,
                route.failed,
                route.dead_lettered,
                route.commit_failed,
                route.infrastructure_errors,
                route.dropped_by_fault
            )?;
        }
        write!(f, "run took {:.1?}", self.elapsed)
    }
}

/// At most `max` items, then how many more.
pub(crate) fn list(items: &[String], max: usize) -> String {
    let mut text = items
        .iter()
        .take(max)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > max {
        let _ = write!(text, " and {} more", items.len() - max);
    }
    text
}

/// `n word`, with an `s` unless `n` is 1.
fn count(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

fn ids(keys: &[&Key]) -> Vec<String> {
    keys.iter().map(|key| key.id.clone()).collect()
}

/// The messages given `fault` whose fault acted.
fn touched(journal: &BTreeMap<Key, Journal>, fault: Fault) -> Vec<(&Key, &Journal)> {
    journal
        .iter()
        .filter(|(_, j)| j.fault == Some(fault) && j.injected)
        .collect()
}

fn not_given(fault: Fault) -> Outcome {
    Outcome {
        fault,
        shown: false,
        evidence: "no message was given it: a per-message fault takes the first messages each \
                   handler sees (crash-before-ack: the first that commit without another fault), \
                   a few per fault (Faults::messages_each); publish more messages"
            .to_owned(),
        messages: Vec::new(),
    }
}

fn outcome(
    fault: Fault,
    plan: &Snapshot,
    happened: &Happened,
    connections: &Connections,
) -> Outcome {
    let done = |shown: bool, evidence: String, messages: Vec<String>| Outcome {
        fault,
        shown,
        evidence,
        messages,
    };
    match fault {
        Fault::DuplicateInWindow | Fault::DuplicateAfterWindow => {
            let (copies, want_stored) = if fault == Fault::DuplicateInWindow {
                (&happened.in_window, false)
            } else {
                (&happened.after_window, true)
            };
            let landed: Vec<&Copy> = copies.iter().filter(|c| c.stored == want_stored).collect();
            let messages = landed.iter().map(|c| c.id.clone()).collect();
            if copies.is_empty() {
                return done(
                    false,
                    "no message was published, so none was copied".into(),
                    messages,
                );
            }
            let evidence = if want_stored {
                format!(
                    "{} of {} copies stored again by JetStream (at sequences {})",
                    landed.len(),
                    copies.len(),
                    landed
                        .iter()
                        .map(|c| c.sequence.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                format!(
                    "{} of {} copies dropped by JetStream as duplicates (PubAck duplicate: true)",
                    landed.len(),
                    copies.len()
                )
            };
            done(!landed.is_empty(), evidence, messages)
        }
        Fault::CrashBeforeAck => {
            let hit = touched(&plan.messages, fault);
            if hit.is_empty() {
                return not_given(fault);
            }
            let again: Vec<&Key> = hit
                .iter()
                .filter(|(k, j)| j.dropped && plan.delivered_again(k))
                .map(|(k, _)| *k)
                .collect();
            done(
                again.len() == hit.len(),
                format!(
                    "{} committed and dropped unacked; {} of them delivered again",
                    count(hit.len(), "message"),
                    again.len()
                ),
                ids(&hit.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            )
        }
        Fault::RedeliveryDuringAttempt => {
            let hit = touched(&plan.messages, fault);
            if hit.is_empty() {
                return not_given(fault);
            }
            let raced: Vec<(&Key, &Journal)> = hit
                .iter()
                .filter(|(_, j)| j.redelivered_while_held.is_some())
                .copied()
                .collect();
            let waited = raced.iter().filter(|(_, j)| j.lock_wait_seen).count();
            done(
                !raced.is_empty(),
                format!(
                    "{} held open after the handler returned; {} redelivered meanwhile \
                     ({} with a session seen waiting on a lock)",
                    count(hit.len(), "first attempt"),
                    raced.len(),
                    waited
                ),
                ids(&hit.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            )
        }
        Fault::AmbiguousCommit => {
            let hit = touched(&plan.messages, fault);
            if hit.is_empty() {
                return not_given(fault);
            }
            let cuts = plan.cuts;
            done(
                cuts > 0,
                format!(
                    "the proxy was armed after {} and cut {} right after PostgreSQL ran \
                     their COMMIT",
                    count(hit.len(), "handler call"),
                    count(cuts, "connection")
                ),
                ids(&hit.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            )
        }
        Fault::HandlerFailure => {
            let hit = touched(&plan.messages, fault);
            if hit.is_empty() {
                return not_given(fault);
            }
            let again = hit
                .iter()
                .filter(|(k, j)| j.calls > 1 || plan.delivered_again(k))
                .count();
            done(
                again == hit.len(),
                format!(
                    "{} failed after the body ran; {again} of them ran again",
                    count(hit.len(), "handler call")
                ),
                ids(&hit.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            )
        }
        Fault::DeadLetterReplay => {
            let hit = touched(&plan.messages, fault);
            if hit.is_empty() {
                return not_given(fault);
            }
            let replayed: Vec<&Key> = hit
                .iter()
                .filter(|(k, _)| {
                    happened
                        .replays
                        .get(*k)
                        .is_some_and(|r| r.second.is_some() && r.discarded)
                })
                .map(|(k, _)| *k)
                .collect();
            done(
                replayed.len() == hit.len(),
                format!(
                    "{} dead-lettered; {} replayed, replayed again after the window, and \
                     discarded",
                    count(hit.len(), "message"),
                    replayed.len()
                ),
                ids(&hit.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            )
        }
        Fault::PostgresRestart => match &happened.postgres {
            None => done(false, "the restart never ran".into(), Vec::new()),
            Some(restart) => {
                let after = plan.commits.saturating_sub(restart.commits_before);
                done(
                    restart.old_pid != restart.new_pid && restart.commits_before > 0 && after > 0,
                    format!(
                        "postmaster pid {:?} -> {:?}, after {} commits; {after} commits after it",
                        restart.old_pid, restart.new_pid, restart.commits_before
                    ),
                    Vec::new(),
                )
            }
        },
        Fault::NatsRestart => match &happened.nats {
            None => done(false, "the restart never ran".into(), Vec::new()),
            Some(restart) => {
                let after = plan.commits.saturating_sub(restart.commits_before);
                let seen =
                    connections.disconnects.load(Ordering::SeqCst) > restart.disconnects_before;
                done(
                    restart.old_pid != restart.new_pid && seen && after > 0,
                    format!(
                        "nats-server pid {:?} -> {:?}, after {} commits; the routers' clients {} \
                         the connection drop; {after} commits after it",
                        restart.old_pid,
                        restart.new_pid,
                        restart.commits_before,
                        if seen { "saw" } else { "did not see" }
                    ),
                    Vec::new(),
                )
            }
        },
    }
}
