//! Network-fault mode: the worker reaches PostgreSQL and nats-server only
//! through a fault proxy each (`idem_tests::fault_proxy`), and the test
//! pauses, drops and resets its connections while messages flow.
//!
//! The schedule holds each of the six kinds (pause, drop, reset; on
//! PostgreSQL, on NATS) equally often, in an order and at moments drawn
//! from the seed, one fault at a time. For each fault the test checks that
//! it happened (the proxy cut at least one live connection, or the pause
//! held bytes in transit) and that the worker saw it before the next one:
//!
//! - PostgreSQL: the worker's `SELECT 1` probe, which goes through the same
//!   proxy, fails and then recovers. A pause lasts 1 to 2 s, twice the
//!   probe's 500 ms timeout or more. Across the run, the router's own counters
//!   (failed, retried in process, commit failed, held for the database) must move with the cuts,
//!   and the probe must have seen a reset as ECONNRESET.
//! - NATS: the worker's client reports a disconnect and a reconnect. A
//!   pause lasts 2 to 3.5 s; the worker PINGs every 300 ms, and three
//!   unanswered PINGs make the client drop the connection.
//!
//! A pause stops traffic in one direction or both (drawn from the seed); a
//! paused direction's bytes are held and delivered once it ends, so a late
//! COMMIT result, a late ack or a late delivery all happen.

use std::time::{Duration, Instant};

use idem_tests::TestEnv;
use idem_tests::fault_proxy::{Cut, Direction, FaultProxy, Paused};

use crate::{Expected, Fault, FaultDriver, Rng, Route, drive, env_or, place, publish_rate, seed};

/// The worker's way to each server.
pub struct Proxies {
    pub postgres: FaultProxy,
    pub nats: FaultProxy,
}

impl Proxies {
    pub fn start(env: &TestEnv) -> Proxies {
        Proxies {
            postgres: FaultProxy::start("postgres", env.database_url()),
            nats: FaultProxy::start("nats", env.nats_url()),
        }
    }

    fn to(&self, server: Server) -> &FaultProxy {
        match server {
            Server::Postgres => &self.postgres,
            Server::Nats => &self.nats,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Postgres,
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetFault {
    /// Stop forwarding (one way or both) for a while, then deliver what was
    /// held.
    Pause(Server),
    /// Close every live connection with FIN.
    Drop(Server),
    /// Close every live connection with RST.
    Reset(Server),
}

impl NetFault {
    fn server(self) -> Server {
        match self {
            NetFault::Pause(s) | NetFault::Drop(s) | NetFault::Reset(s) => s,
        }
    }
}

/// Every kind, each on each server.
const KINDS: [NetFault; 6] = [
    NetFault::Pause(Server::Postgres),
    NetFault::Drop(Server::Postgres),
    NetFault::Reset(Server::Postgres),
    NetFault::Pause(Server::Nats),
    NetFault::Drop(Server::Nats),
    NetFault::Reset(Server::Nats),
];

/// One fault, as done and as seen.
#[derive(Debug, Clone)]
pub struct Done {
    pub fault: NetFault,
    /// What a pause held.
    pub paused: Option<Paused>,
    /// How many live connections a drop or reset ended.
    pub cut: usize,
    /// From the end of the fault until the worker reported it.
    pub seen_after: Duration,
    /// The worker's router failures (failed + retried in process + commit
    /// failed) just before the fault.
    pub router_failures_before: u64,
    /// ECONNRESETs the PostgreSQL probe saw from the fault until it was seen.
    pub probe_resets: u64,
}

/// The network faults of a run.
#[derive(Debug, Default)]
pub struct Tally {
    pub faults: Vec<Done>,
}

impl Tally {
    fn of(&self, fault: NetFault) -> impl Iterator<Item = &Done> {
        self.faults.iter().filter(move |d| d.fault == fault)
    }

    /// How far the router's failures moved from each fault to the next (to
    /// `end` for the last one), summed over the faults `which` selects.
    fn router_failures_during(&self, end: u64, which: impl Fn(NetFault) -> bool) -> u64 {
        let mut sum = 0;
        for (k, done) in self.faults.iter().enumerate() {
            let next = self
                .faults
                .get(k + 1)
                .map_or(end, |d| d.router_failures_before);
            if which(done.fault) {
                sum += next.saturating_sub(done.router_failures_before);
            }
        }
        sum
    }
}

impl FaultDriver<'_> {
    /// Does `fault`, checks that it landed, and waits until the worker saw
    /// it.
    pub(crate) async fn network_fault(&mut self, fault: NetFault) {
        let before = self.worker().last();
        let server = fault.server();
        let proxies = self
            .setup
            .proxies
            .as_ref()
            .expect("network faults need the proxies");
        let proxy = proxies.to(server);
        let mut done = Done {
            fault,
            paused: None,
            cut: 0,
            seen_after: Duration::ZERO,
            router_failures_before: before.router_failures(),
            probe_resets: 0,
        };
        let landed = match fault {
            NetFault::Pause(_) => {
                let direction =
                    self.rng
                        .pick(&[Direction::ToServer, Direction::ToClient, Direction::Both]);
                let hold = match server {
                    Server::Postgres => self.rng.millis(1000, 2000),
                    Server::Nats => self.rng.millis(2000, 3500),
                };
                proxy.pause(direction);
                tokio::time::sleep(hold).await;
                let paused = proxy.resume();
                done.paused = Some(paused);
                (paused.held_bytes() > 0)
                    .then_some(())
                    .ok_or(format!("{fault:?} held no bytes: {paused:?}"))
            }
            NetFault::Drop(_) | NetFault::Reset(_) => {
                let cut = if matches!(fault, NetFault::Drop(_)) {
                    Cut::Drop
                } else {
                    Cut::Reset
                };
                done.cut = proxy.cut(cut).await;
                (done.cut > 0)
                    .then_some(())
                    .ok_or(format!("{fault:?} found no live connection to cut"))
            }
        };
        if let Err(e) = landed {
            self.fail(&e).await;
        }
        let ended = Instant::now();
        let seen = match server {
            Server::Postgres => {
                self.worker()
                    .wait_for(
                        "see PostgreSQL fail and recover through the proxy (probe)",
                        Duration::from_secs(30),
                        |r| {
                            r.pg_outages > before.pg_outages
                                && r.pg_recoveries > before.pg_recoveries
                        },
                    )
                    .await
            }
            Server::Nats => {
                self.worker()
                    .wait_for(
                        "see its NATS connection drop and come back",
                        Duration::from_secs(30),
                        |r| {
                            r.nats_disconnects > before.nats_disconnects
                                && r.nats_reconnects > before.nats_reconnects
                        },
                    )
                    .await
            }
        };
        match seen {
            Ok(after) => {
                done.seen_after = ended.elapsed();
                done.probe_resets = after.pg_probe_resets - before.pg_probe_resets;
                eprintln!(
                    "chaos: {fault:?}: {} ; worker saw it {:.0?} later",
                    match &done.paused {
                        Some(p) => format!(
                            "{:?} for {:.1?}, held {} bytes to the server, {} to the client",
                            p.direction, p.lasted, p.held_to_server, p.held_to_client
                        ),
                        None => format!("{} connections cut", done.cut),
                    },
                    done.seen_after
                );
                self.tally.network.faults.push(done);
            }
            Err(e) => self.fail(&e).await,
        }
    }
}

pub async fn run(test: &str, batch: usize) {
    let started = Instant::now();
    let messages: u64 = env_or("IDEM_CHAOS_MESSAGES", 2_000);
    let faults: usize = env_or("IDEM_CHAOS_NET_FAULTS", 12.max(messages as usize / 1_000));
    let per_kind = faults.div_ceil(KINDS.len()).max(1);
    let rate = publish_rate(messages);
    let seed = seed();
    eprintln!(
        "chaos: {messages} messages, {} network faults ({per_kind} of each kind), batch {batch}, \
         publish rate {rate:.0}/s, seed {seed} (replay with IDEM_CHAOS_SEED={seed})",
        per_kind * KINDS.len()
    );
    let batch_env = batch.to_string();
    let Some(mut setup) = crate::setup(
        test,
        &[
            // Transactions that stay open a while, so that PostgreSQL cuts meet
            // them, not only idle connections the pool replaces unseen.
            ("CHAOS_HANDLER_DELAY_MS", "20"),
            ("CHAOS_BATCH", batch_env.as_str()),
            ("CHAOS_NATS_PING_MS", "300"),
            ("CHAOS_PG_PROBE_TIMEOUT_MS", "500"),
        ],
        Route::Proxied,
    )
    .await
    else {
        return;
    };
    let expected = Expected::for_messages(messages);
    let mut rng = Rng(seed);
    let mut schedule: Vec<Fault> = KINDS
        .iter()
        .flat_map(|&kind| std::iter::repeat_n(Fault::Network(kind), per_kind))
        .collect();
    rng.shuffle(&mut schedule);
    let (schedule, spacing) = place(messages, schedule, &mut rng);
    let (finished, publish_report, faults_done) =
        drive(&mut setup, &expected, rate, rng, &schedule, spacing).await;
    let proxies = setup.proxies.as_ref().expect("the proxies ran");
    let (pg, nats) = (proxies.postgres.counts(), proxies.nats.counts());
    let tally = &finished.tally;
    let network = &tally.network;
    let totals = tally.totals();
    let pg_cut_failures = network.router_failures_during(totals.router_failures(), |f| {
        matches!(
            f,
            NetFault::Drop(Server::Postgres) | NetFault::Reset(Server::Postgres)
        )
    });
    let pg_reset_probe_resets: u64 = network
        .of(NetFault::Reset(Server::Postgres))
        .map(|d| d.probe_resets)
        .sum();
    eprintln!(
        "chaos: {messages} messages in {:.1?} (faults done at {faults_done:.1?}; published in {:.1?}; \
         last worker stopped {:.2?} after SIGTERM)\n\
         chaos: proxy to PostgreSQL {pg:?}\n\
         chaos: proxy to NATS {nats:?}\n\
         chaos: router failures across PostgreSQL cuts {pg_cut_failures}; probe ECONNRESETs \
         across PostgreSQL resets {pg_reset_probe_resets}\n\
         chaos: longest stall of the ledger while rows were due: {}\n\
         chaos: redeliveries of committed work absorbed by the claim (ack tap): {} messages\n\
         chaos: worker: processed {}, duplicates skipped {}, failed {}, commit failed {}, \
         retried in process {}, batches {} (largest {}, fallbacks {}), NATS disconnects {}, \
         PostgreSQL probe failures {} (timeouts {}, resets {}, other {})\n\
         chaos: consumer {:?}",
        started.elapsed(),
        publish_report.took,
        finished.shutdown_took,
        tally.longest_stall(),
        finished.absorbed.len(),
        totals.processed,
        totals.duplicates,
        totals.failed,
        totals.commit_failed,
        totals.retried_in_process,
        totals.batches,
        totals.largest_batch,
        totals.batch_fallbacks,
        totals.nats_disconnects,
        totals.pg_probe_failures,
        totals.pg_probe_timeouts,
        totals.pg_probe_resets,
        totals.pg_probe_other,
        finished.consumer,
    );

    finished.assert_exactly_once(messages, batch);
    assert_eq!(
        tally.workers_started, 1,
        "one worker lived through every network fault"
    );
    for kind in KINDS {
        assert_eq!(
            network.of(kind).count(),
            per_kind,
            "{kind:?} happened, and the worker saw it, {per_kind} times: {network:?}"
        );
    }
    // Each fault was checked as it happened; the proxies' own totals agree.
    let cut = |fault| network.of(fault).map(|d| d.cut as u64).sum::<u64>();
    assert_eq!(
        (pg.dropped, pg.reset, nats.dropped, nats.reset),
        (
            cut(NetFault::Drop(Server::Postgres)),
            cut(NetFault::Reset(Server::Postgres)),
            cut(NetFault::Drop(Server::Nats)),
            cut(NetFault::Reset(Server::Nats)),
        ),
        "the proxies cut what the faults report"
    );
    assert_eq!(
        (pg.pauses, nats.pauses),
        (per_kind as u64, per_kind as u64),
        "every pause ended"
    );
    assert!(
        pg_cut_failures > 0,
        "the router met the PostgreSQL cuts in its own transactions (failed, retried in process \
         or commit failed moved): {network:?}"
    );
    assert!(
        pg_reset_probe_resets > 0,
        "a PostgreSQL reset reached the worker as ECONNRESET: {network:?}"
    );
}
