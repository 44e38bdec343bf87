//! The `chaos_worker` binary as a child process of the test: start it, read
//! the JSON lines it prints, SIGKILL or SIGTERM it.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Deserialize;

/// One line the worker printed (see `src/bin/chaos_worker.rs`).
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
    pub dead_lettered: u64,
    pub dead_letter_failed: u64,
    pub in_flight: u64,
    pub nats_connects: u64,
    pub nats_disconnects: u64,
    pub nats_reconnects: u64,
    pub pg_probe_ok: u64,
    pub pg_probe_failures: u64,
    pub pg_outages: u64,
    pub pg_recoveries: u64,
    pub startup_failures: u64,
}

/// What the reader thread has seen on the worker's stdout.
#[derive(Debug, Default)]
struct Seen {
    started: bool,
    last: Report,
    stopped: Option<Report>,
    /// Lines that were not reports (a panic message would go to stderr, so
    /// these should not exist).
    garbage: Vec<String>,
}

/// A running `chaos_worker`. Dropping it SIGKILLs it, so no worker outlives
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
}

impl Worker {
    /// Starts the worker binary with `env`, its stderr (the logs) going to
    /// `<log_dir>/worker-<ordinal>.log`.
    pub fn spawn(ordinal: usize, env: &[(String, String)], log_dir: &Path) -> Worker {
        let log = log_dir.join(format!("worker-{ordinal:03}.log"));
        let stderr = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_chaos_worker"));
        cmd.envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec we only call prctl, getppid and
        // _exit, which are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // Drop does not run if the test process is killed (a nextest
                // timeout); let the kernel kill the worker then. It fires when
                // the spawning thread exits: the test's own thread.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the chaos worker: {e}"));
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
                        Ok(report) => {
                            match report.event.as_str() {
                                "started" => seen.started = true,
                                "stopped" => seen.stopped = Some(report.clone()),
                                _ => {}
                            }
                            seen.last = report;
                        }
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
        let seen = self.seen.lock().expect("reader lock");
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
