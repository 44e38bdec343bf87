//! Steps 1, 4 and 5 of a run: waiting for the routers to start, waiting
//! for everything to settle (replaying dead letters meanwhile), and
//! stopping the routers.
//!
//! A run has settled when, in three looks in a row at least 100 ms apart,
//! every route's consumer has nothing pending, nothing awaiting ack and
//! nothing redelivered, the outbox holds no row, no attempt is held open,
//! every dead letter the run caused is replayed and discarded, and none of
//! the numbers moved: not the consumers' delivered and acked sequences,
//! not the routers' commits.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_runtime::dead_letter::{self, Filter, ReplayError};

use crate::bed::Bed;
use crate::faults::Fault;
use crate::plan::Plan;
use crate::report::{Happened, RouteStats};
use crate::run::{Launched, SHORT_WINDOW};

/// How often the run looks.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How many looks in a row must agree.
const STILL_LOOKS: usize = 3;

/// Waits until every route's consumer exists: the routers are past
/// start-up.
pub(crate) async fn wait_for_start_up(
    js: &jetstream::Context,
    routes: &[(String, String)],
    launched: &[Launched],
    timeout: Duration,
) {
    let deadline = Instant::now() + timeout;
    for (stream, durable) in routes {
        loop {
            check_running(launched);
            let ready = match js.get_stream_no_info(stream).await {
                Ok(handle) => handle.consumer_info(durable).await.is_ok(),
                Err(_) => false,
            };
            if ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "idem-test: route {durable} did not start within {timeout:?}: its consumer on \
                 stream {stream} does not exist (see the log above for the router's warnings)"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Panics if a router stopped by itself.
fn check_running(launched: &[Launched]) {
    for (n, router) in launched.iter().enumerate() {
        if router.task.is_finished() {
            let routes: Vec<&str> = router.routes.iter().map(|(_, d)| d.as_str()).collect();
            panic!(
                "idem-test: router {n} (routes {routes:?}) stopped by itself; its messages are \
                 no longer processed. Its error, if any, is in the log above (RUST_LOG=warn)"
            );
        }
    }
}

/// One look at everything that must be still.
#[derive(Debug, PartialEq, Eq)]
struct Look {
    /// Per route: delivered and ack floor, by stream and consumer sequence.
    consumers: Vec<(u64, u64, u64, u64)>,
    commits: u64,
}

pub(crate) struct Settler<'b, 'l> {
    pub(crate) bed: &'b Bed,
    pub(crate) js: jetstream::Context,
    pub(crate) plan: Arc<Plan>,
    pub(crate) routes: Vec<(String, String)>,
    pub(crate) launched: &'l [Launched],
    pub(crate) happened: Arc<Mutex<Happened>>,
    pub(crate) deadline: Instant,
}

impl Settler<'_, '_> {
    /// Runs `driving` to its end, then waits until the run has settled,
    /// replaying dead letters all along.
    pub(crate) async fn until_settled(&self, driving: impl Future<Output = ()>) {
        let mut driving = std::pin::pin!(driving);
        let mut driven = false;
        let mut still: Vec<Look> = Vec::new();
        loop {
            if driven {
                tokio::time::sleep(LOOK_EVERY).await;
            } else {
                tokio::select! {
                    () = &mut driving => driven = true,
                    () = tokio::time::sleep(LOOK_EVERY) => {}
                }
            }
            check_running(self.launched);
            self.replay_dead_letters().await;
            if Instant::now() > self.deadline {
                self.time_out(driven).await;
            }
            if !driven || self.plan.holding() || !self.replays_done() {
                still.clear();
                continue;
            }
            match self.look().await {
                Some(look) if still.last().is_none_or(|last| *last == look) => {
                    still.push(look);
                    if still.len() >= STILL_LOOKS {
                        return;
                    }
                }
                Some(look) => still = vec![look],
                None => still.clear(),
            }
        }
    }

    /// `None` while anything is pending.
    async fn look(&self) -> Option<Look> {
        let mut consumers = Vec::new();
        for (stream, durable) in &self.routes {
            let info = self
                .js
                .get_stream_no_info(stream)
                .await
                .ok()?
                .consumer_info(durable)
                .await
                .ok()?;
            if info.num_pending > 0 || info.num_ack_pending > 0 || info.num_redelivered > 0 {
                return None;
            }
            consumers.push((
                info.delivered.stream_sequence,
                info.delivered.consumer_sequence,
                info.ack_floor.stream_sequence,
                info.ack_floor.consumer_sequence,
            ));
        }
        let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
            .fetch_one(&self.bed.pool())
            .await
            .ok()?;
        (outbox == 0).then(|| Look {
            consumers,
            commits: self.plan.commits(),
        })
    }

    fn replays_done(&self) -> bool {
        let happened = self.happened.lock().unwrap();
        self.plan
            .injected(Fault::DeadLetterReplay)
            .iter()
            .all(|key| happened.replays.get(key).is_some_and(|r| r.discarded))
    }

    /// Moves each dead-letter-replay message one step on: find its dead
    /// letter, replay it, replay it again after the stream's duplicate
    /// window, discard it.
    async fn replay_dead_letters(&self) {
        for key in self.plan.injected(Fault::DeadLetterReplay) {
            let state = self
                .happened
                .lock()
                .unwrap()
                .replays
                .get(&key)
                .cloned()
                .unwrap_or_default();
            if state.discarded {
                continue;
            }
            let letter = match state.letter {
                Some(letter) => letter,
                None => match self.find_letter(&key.handler, &key.id).await {
                    Some(letter) => letter,
                    None => continue,
                },
            };
            let mut state = state;
            state.letter = Some(letter);
            if let Some((_, at)) = state.first {
                if state.second.is_none() {
                    if at.elapsed() > SHORT_WINDOW {
                        state.second = self.replay(letter, &key.id).await;
                    }
                } else if !state.discarded {
                    dead_letter::discard(&self.js, dead_letter::DEFAULT_STREAM, letter)
                        .await
                        .unwrap_or_else(|e| {
                            panic!("idem-test: cannot discard the dead letter of {key}: {e}")
                        });
                    state.discarded = true;
                }
            } else {
                let ack = self.replay(letter, &key.id).await;
                state.first = ack.map(|seq| (seq, Instant::now()));
            }
            self.happened.lock().unwrap().replays.insert(key, state);
        }
    }

    async fn find_letter(&self, handler: &str, id: &str) -> Option<u64> {
        let letters = dead_letter::list(
            &self.js,
            dead_letter::DEFAULT_STREAM,
            &Filter::new().handler(handler),
        )
        .await
        .ok()?;
        letters
            .iter()
            .find(|letter| letter.message_id() == Some(id))
            .map(|letter| letter.sequence)
    }

    /// Replays dead letter `letter`; `None` while JetStream drops it as a
    /// duplicate of the last replay.
    async fn replay(&self, letter: u64, id: &str) -> Option<u64> {
        match dead_letter::replay(&self.js, dead_letter::DEFAULT_STREAM, letter).await {
            Ok(ack) => Some(ack.sequence),
            Err(ReplayError::InsideDuplicateWindow) => None,
            Err(error) => panic!(
                "idem-test: cannot replay dead letter {letter} (message {id}) for fault \
                 dead-letter-replay: {error}"
            ),
        }
    }

    /// Fails the run, saying what is still pending.
    async fn time_out(&self, driven: bool) -> ! {
        let mut pending = Vec::new();
        if !driven {
            pending.push("publishing, requests or a server restart had not finished".to_owned());
        }
        if self.plan.holding() {
            pending.push("an attempt was still held open for its redelivery".to_owned());
        }
        for (stream, durable) in &self.routes {
            let info = match self.js.get_stream_no_info(stream).await {
                Ok(handle) => handle.consumer_info(durable).await.ok(),
                Err(_) => None,
            };
            match info {
                Some(info) => pending.push(format!(
                    "route {durable}: {} not yet delivered, {} awaiting ack, {} redelivered",
                    info.num_pending, info.num_ack_pending, info.num_redelivered
                )),
                None => pending.push(format!("route {durable}: its consumer cannot be read")),
            }
        }
        if let Ok(rows) = sqlx::query_as::<_, (i64, i64)>(
            "SELECT count(*), count(*) FILTER (WHERE failed_at IS NOT NULL) FROM idem_outbox",
        )
        .fetch_one(&self.bed.pool())
        .await
        {
            pending.push(format!(
                "outbox: {} rows not yet published ({} failing)",
                rows.0, rows.1
            ));
        }
        if !self.replays_done() {
            pending.push("dead letters of dead-letter-replay not yet replayed".to_owned());
        }
        panic!(
            "idem-test: the run did not settle in time; still pending:\n  {}\n\
             Messages that fail again and again are in the log above (RUST_LOG=warn); \
             Run::timeout gives a slow run longer.",
            pending.join("\n  ")
        );
    }
}

/// Stops every router and returns its routes' counters.
pub(crate) async fn stop(launched: Vec<Launched>, extra: &[String]) -> Vec<RouteStats> {
    let mut stats = Vec::new();
    for router in launched {
        router.handle.shutdown();
        match tokio::time::timeout(Duration::from_secs(30), router.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => panic!("idem-test: a router stopped with an error: {error}"),
            Ok(Err(join)) => panic!("idem-test: a router's task failed: {join}"),
            Err(_) => panic!("idem-test: a router did not shut down within 30 s"),
        }
        let names = router
            .routes
            .iter()
            .map(|(_, durable)| durable.clone())
            .chain(extra.iter().cloned());
        for name in names {
            if let Some(s) = router.handle.stats(&name) {
                stats.push(RouteStats {
                    route: name,
                    processed: s.processed(),
                    duplicates: s.duplicates(),
                    failed: s.failed(),
                    dead_lettered: s.dead_lettered(),
                    commit_failed: s.commit_failed(),
                    infrastructure_errors: s.infrastructure_errors(),
                    dropped_by_fault: s.dropped_by_fault(),
                });
            }
        }
    }
    stats
}
