//! A worker binary as a child process of the test (`chaos_worker` for the
//! chaos suite, `sqlite_worker` for the SQLite kill run): start it, read
//! the JSON lines it prints (stats, and the journal of its messages), hold a
//! commit before its ack, SIGKILL or SIGTERM it.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Deserialize;

/// One line the worker printed (see `src/bin/chaos_worker.rs`; fields a
/// worker does not print stay zero): a stats
/// report, or a journal line (`begin`, `committed`, `held`) with `id`,
/// `delivered` and `seq` set.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Report {
    pub event: String,
    pub pid: u32,
    pub received: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub failed: u64,
    pub commit_failed: u64,
    pub rejected: u64,
    pub retried_in_process: u64,
    pub infrastructure_errors: u64,
    pub abandoned_transactions: u64,
    pub dead_lettered: u64,
    pub dead_letter_failed: u64,
    pub batches: u64,
    pub largest_batch: u64,
    pub batch_fallbacks: u64,
    pub in_flight: u64,
    pub nats_connects: u64,
    pub nats_disconnects: u64,
    pub nats_reconnects: u64,
    pub pg_probe_ok: u64,
    pub pg_probe_failures: u64,
    pub pg_outages: u64,
    pub pg_recoveries: u64,
    pub pg_probe_timeouts: u64,
    pub pg_probe_resets: u64,
    pub pg_probe_other: u64,
    pub startup_failures: u64,
    /// The day-two profile's other routes and its relay
    /// (`src/bin/chaos_worker/day_two.rs`); zero in the other modes.
    pub mirror_processed: u64,
    pub mirror_duplicates: u64,
    pub mirror_rejected: u64,
    pub mirror_dead_lettered: u64,
    pub mirror_dead_letter_failed: u64,
    pub place_processed: u64,
    pub place_duplicates: u64,
    pub place_failed: u64,
    pub place_rejected: u64,
    pub relay_published: u64,
    pub relay_failed: u64,
    pub relay_cycles: u64,
    /// Journal lines: the message.
    pub id: String,
    pub delivered: u64,
    pub seq: u64,
}

impl Report {
    /// Transactions the router saw fail, retried, held for the database, or
    /// stopped waiting for: what a server outage leaves in its own counters.
    pub fn router_failures(&self) -> u64 {
        self.failed
            + self.retried_in_process
            + self.commit_failed
            + self.infrastructure_errors
            + self.abandoned_transactions
    }
}

/// What one worker process journaled of its messages, line by line as it
/// happened, so that a SIGKILL loses none of it.
#[derive(Clone, Default)]
pub struct Journal {
    /// Messages whose handler body started: the claim was fresh and the
    /// transaction open.
    pub begun: HashSet<String>,
    /// Messages whose COMMIT succeeded (the runtime's after-commit hook ran,
    /// before the ack).
    pub committed: HashSet<String>,
    /// Messages held between COMMIT and ack after SIGUSR1: id and stream
    /// sequence.
    pub held: Vec<(String, u64)>,
    /// Messages whose handler paused inside its transaction after SIGUSR2
    /// (`sqlite_worker`).
    pub paused: Vec<String>,
    /// How many `begin` lines, and the latest one's message.
    begins: u64,
    last_begun: Option<String>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("begun", &self.begun.len())
            .field("committed", &self.committed.len())
            .field("open", &self.open().count())
            .field("held", &self.held)
            .finish()
    }
}

impl Journal {
    /// Messages begun and never committed: their transactions were open
    /// when the journal ended (or failed; see the caller).
    pub fn open(&self) -> impl Iterator<Item = &String> {
        self.begun.difference(&self.committed)
    }
}

/// What the reader thread has seen on the worker's stdout.
#[derive(Debug, Default)]
struct Seen {
    started: bool,
    last: Report,
    stopped: Option<Report>,
    journal: Journal,
    /// Lines that were not reports (a panic message would go to stderr, so
    /// these should not exist).
    garbage: Vec<String>,
}

/// A running worker process. Dropping it SIGKILLs it, so no worker outlives
/// its test; if the test process dies first, the kernel kills the worker
/// (`PR_SET_PDEATHSIG`).
pub struct Worker {
    /// 1 for the first worker of a test, 2 for the next, ...
    pub ordinal: usize,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    reader: Option<JoinHandle<()>>,
    log: PathBuf,
}

/// How a worker ended.
#[derive(Debug)]
pub struct Ended {
    pub ordinal: usize,
    pub pid: u32,
    pub status: ExitStatus,
    /// The last report it printed before it ended.
    pub last: Report,
    /// Its `stopped` report, if it shut down gracefully.
    pub stopped: Option<Report>,
    /// Its whole journal.
    pub journal: Journal,
}

impl Worker {
    /// Starts the worker `binary` (a test's `env!("CARGO_BIN_EXE_<name>")`)
    /// with `env`, its stderr (the logs) going to
    /// `<log_dir>/worker-<ordinal>.log`.
    pub fn spawn(
        binary: &Path,
        ordinal: usize,
        env: &[(String, String)],
        log_dir: &Path,
    ) -> Worker {
        let log = log_dir.join(format!("worker-{ordinal:03}.log"));
        let stderr = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let mut cmd = Command::new(binary);
        cmd.envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        crate::die_with_test(&mut cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let stdout = child.stdout.take().expect("stdout is piped");
        // Every report is also kept, next to the log, for a post-mortem.
        let reports_path = log.with_extension("jsonl");
        let mut reports = std::fs::File::create(&reports_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", reports_path.display()));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let reader = {
            let seen = seen.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let _ = writeln!(reports, "{line}");
                    let mut seen = seen.lock().expect("reader lock");
                    match serde_json::from_str::<Report>(&line) {
                        Ok(report) => match report.event.as_str() {
                            "begin" => {
                                seen.journal.begins += 1;
                                seen.journal.last_begun = Some(report.id.clone());
                                seen.journal.begun.insert(report.id);
                            }
                            "committed" => {
                                seen.journal.committed.insert(report.id);
                            }
                            "held" => seen.journal.held.push((report.id, report.seq)),
                            "paused" => seen.journal.paused.push(report.id),
                            event => {
                                match event {
                                    "started" => seen.started = true,
                                    "stopped" => seen.stopped = Some(report.clone()),
                                    _ => {}
                                }
                                seen.last = report;
                            }
                        },
                        Err(_) => seen.garbage.push(line),
                    }
                }
            })
        };
        Worker {
            ordinal,
            child,
            seen,
            reader: Some(reader),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The latest report (all zeros before the first one).
    pub fn last(&self) -> Report {
        self.seen.lock().expect("reader lock").last.clone()
    }

    /// The exit status, if the process has ended (and reaps it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("waitpid on the worker")
    }

    /// Polls the reports every 20 ms until `done` holds for the latest one.
    /// Errs with a description if the worker ends first or `timeout` passes.
    pub async fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Report) -> bool,
    ) -> Result<Report, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let (started, last) = {
                let seen = self.seen.lock().expect("reader lock");
                (seen.started, seen.last.clone())
            };
            if started && done(&last) {
                return Ok(last);
            }
            if let Some(status) = self.exited() {
                return Err(format!(
                    "worker #{} (pid {}) ended ({status}) while waiting for: {what}; last report {last:?}",
                    self.ordinal,
                    self.pid()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "worker #{} (pid {}) did not {what} within {timeout:?}; last report {last:?}",
                    self.ordinal,
                    self.pid()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Arms the worker's hold (SIGUSR1): its next commit waits before the
    /// ack, and journals `held`.
    pub fn hold_next_commit(&self) {
        // SAFETY: plain kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGUSR1) };
    }

    /// Waits until the worker journals a held commit; returns its message
    /// id and stream sequence.
    pub async fn wait_for_held(&mut self, timeout: Duration) -> Result<(String, u64), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(id) = self.seen.lock().expect("reader lock").journal.held.last() {
                return Ok(id.clone());
            }
            if let Some(status) = self.exited() {
                return Err(format!(
                    "worker #{} ended ({status}) before it held a commit",
                    self.ordinal
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "worker #{} held no commit within {timeout:?} of SIGUSR1; last report {:?}",
                    self.ordinal,
                    self.last()
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Makes the worker's next handler call pause inside its transaction
    /// (SIGUSR2, `sqlite_worker`), and waits until it journals `paused`;
    /// returns its message id. A SIGKILL then lands mid-transaction for
    /// certain.
    pub async fn pause_next_transaction(&mut self, timeout: Duration) -> Result<String, String> {
        // SAFETY: plain kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGUSR2) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(id) = self.seen.lock().expect("reader lock").journal.paused.last() {
                return Ok(id.clone());
            }
            if let Some(status) = self.exited() {
                return Err(format!(
                    "worker #{} ended ({status}) before it paused a transaction",
                    self.ordinal
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "worker #{} paused no transaction within {timeout:?} of SIGUSR2; last report {:?}",
                    self.ordinal,
                    self.last()
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until the worker journals the start of a new transaction that
    /// it has not committed yet; returns its message id. The caller kills
    /// at once to land mid-transaction (the journal shows later whether it
    /// did).
    pub async fn wait_for_open_transaction(&mut self, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        let begins_before = self.seen.lock().expect("reader lock").journal.begins;
        loop {
            {
                let seen = self.seen.lock().expect("reader lock");
                let journal = &seen.journal;
                if journal.begins > begins_before
                    && let Some(id) = &journal.last_begun
                    && !journal.committed.contains(id)
                {
                    return Ok(id.clone());
                }
            }
            if let Some(status) = self.exited() {
                return Err(format!(
                    "worker #{} ended ({status}) while we waited for a transaction",
                    self.ordinal
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "worker #{} began no transaction within {timeout:?}; last report {:?}",
                    self.ordinal,
                    self.last()
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// SIGKILLs the worker and reaps it.
    pub fn sigkill(mut self) -> Ended {
        // Child::kill sends SIGKILL. It has not been reaped, so the pid is
        // still ours.
        let _ = self.child.kill();
        let status = self.child.wait().expect("wait for the killed worker");
        self.finish(status)
    }

    /// Sends SIGTERM and waits up to `grace` for the worker to exit. Errs
    /// (after a SIGKILL) if it does not.
    pub async fn sigterm(mut self, grace: Duration) -> Result<(Ended, Duration), String> {
        let sent = Instant::now();
        // SAFETY: plain kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
        while sent.elapsed() < grace {
            if let Some(status) = self.exited() {
                let took = sent.elapsed();
                return Ok((self.finish(status), took));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (ordinal, pid, last) = (self.ordinal, self.pid(), self.last());
        let log = self.log_tail(30);
        drop(self.sigkill());
        Err(format!(
            "worker #{ordinal} (pid {pid}) did not exit within {grace:?} of SIGTERM; \
             last report {last:?}\n{log}"
        ))
    }

    fn finish(&mut self, status: ExitStatus) -> Ended {
        // The pipe is closed now: the reader sees EOF after the last line.
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let mut seen = self.seen.lock().expect("reader lock");
        assert!(
            seen.garbage.is_empty(),
            "worker #{} printed lines that are not reports: {:?}",
            self.ordinal,
            seen.garbage
        );
        Ended {
            ordinal: self.ordinal,
            pid: self.child.id(),
            status,
            last: seen.last.clone(),
            stopped: seen.stopped.clone(),
            journal: std::mem::take(&mut seen.journal),
        }
    }

    /// The last `lines` lines of the worker's log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.reader.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Ended {
    /// Whether SIGKILL ended it.
    pub fn was_sigkilled(&self) -> bool {
        self.status.signal() == Some(libc::SIGKILL)
    }
}

/// The last `lines` lines of the file at `path`.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    format!(
        "--- last lines of {} ---\n{}\n---",
        path.display(),
        all[all.len().saturating_sub(lines)..].join("\n")
    )
}
