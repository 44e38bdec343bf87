//! One service of the example pipeline (`orders` or `payments`, built from
//! examples/pipeline/src/bin) as a child process of the test: start it with
//! `PIPELINE_REPORT_MS` set, read the counters it prints (see
//! `pipeline_example::report`), freeze it (SIGSTOP), SIGKILL or SIGTERM it.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Deserialize;

/// Which service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Orders,
    Payments,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Orders => "orders",
            Kind::Payments => "payments",
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Kind::Orders => env!("CARGO_BIN_EXE_pipeline-orders"),
            Kind::Payments => env!("CARGO_BIN_EXE_pipeline-payments"),
        }
    }
}

/// One route's counters in a report.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RouteReport {
    pub durable: String,
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
}

/// One line a service printed.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Report {
    pub pid: u32,
    pub routes: Vec<RouteReport>,
    pub relay_published: u64,
    pub relay_duplicates: u64,
    pub relay_failed: u64,
    pub relay_cycles: u64,
    pub nats_connects: u64,
    pub nats_disconnects: u64,
    pub nats_reconnects: u64,
}

impl Report {
    fn sum(&self, field: impl Fn(&RouteReport) -> u64) -> u64 {
        self.routes.iter().map(field).sum()
    }

    /// Messages committed by the handlers.
    pub fn processed(&self) -> u64 {
        self.sum(|r| r.processed)
    }

    /// Redeliveries and replays the claims skipped.
    pub fn duplicates(&self) -> u64 {
        self.sum(|r| r.duplicates)
    }

    /// Transactions the routers saw fail, retried, or stopped waiting for:
    /// what a database outage leaves in their counters.
    pub fn failures(&self) -> u64 {
        self.sum(|r| {
            r.failed
                + r.commit_failed
                + r.retried_in_process
                + r.infrastructure_errors
                + r.abandoned_transactions
        })
    }

    /// Messages rejected or dead-lettered (the test expects none).
    pub fn rejected(&self) -> u64 {
        self.sum(|r| r.rejected + r.dead_lettered)
    }

    /// Messages received and not yet settled.
    pub fn in_flight(&self) -> u64 {
        self.sum(|r| {
            r.received.saturating_sub(
                r.processed + r.duplicates + r.failed + r.commit_failed + r.rejected,
            )
        })
    }
}

#[derive(Default)]
struct Seen {
    last: Option<Report>,
    garbage: Vec<String>,
}

/// A running service process. Dropping it SIGKILLs it; if the test process
/// dies first, the kernel does (`PR_SET_PDEATHSIG`).
pub struct Service {
    /// Its `application_name` on PostgreSQL, e.g. `payments-3`: how the
    /// test finds its sessions in `pg_stat_activity`.
    pub app: String,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    reader: Option<JoinHandle<()>>,
    log: PathBuf,
}

/// How a service ended.
#[derive(Debug)]
pub struct Ended {
    pub app: String,
    pub status: ExitStatus,
    pub last: Option<Report>,
    pub log_tail: String,
}

impl Ended {
    pub fn was_sigkilled(&self) -> bool {
        self.status.signal() == Some(libc::SIGKILL)
    }
}

impl Service {
    /// Starts service `kind` as `<kind>-<ordinal>`, its logs (stderr) in
    /// `<log_dir>/<app>.log`.
    pub fn spawn(
        kind: Kind,
        ordinal: usize,
        nats_url: &str,
        database_url: &str,
        extra_env: &[(&str, String)],
        log_dir: &Path,
    ) -> Service {
        let app = format!("{}-{ordinal}", kind.name());
        let log = log_dir.join(format!("{app}.log"));
        let stderr = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let separator = if database_url.contains('?') { '&' } else { '?' };
        let mut cmd = Command::new(kind.binary());
        cmd.env("NATS_URL", nats_url)
            .env(
                "DATABASE_URL",
                format!("{database_url}{separator}application_name={app}"),
            )
            .env("PIPELINE_REPORT_MS", "200")
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        idem_tests::die_with_test(&mut cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {app}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let seen = Arc::new(Mutex::new(Seen::default()));
        let reader = {
            let seen = seen.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let mut seen = seen.lock().expect("reader lock");
                    match serde_json::from_str::<Report>(&line) {
                        Ok(report) => seen.last = Some(report),
                        Err(_) => seen.garbage.push(line),
                    }
                }
            })
        };
        Service {
            app,
            child,
            seen,
            reader: Some(reader),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The latest report; `None` until the service has started serving.
    pub fn last(&self) -> Option<Report> {
        self.seen.lock().expect("reader lock").last.clone()
    }

    /// The exit status if the process has ended (and reaps it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("waitpid on a service")
    }

    /// Stops the process where it is (SIGSTOP): its transactions stay open
    /// and its row locks held until it is killed.
    pub fn freeze(&self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGSTOP) };
    }

    /// Lets a frozen process go on (SIGCONT).
    pub fn thaw(&self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGCONT) };
    }

    /// SIGKILLs the service (frozen or not) and reaps it.
    pub fn sigkill(mut self) -> Ended {
        let _ = self.child.kill();
        let status = self.child.wait().expect("wait for a killed service");
        self.finish(status)
    }

    /// Reaps a service that exited by itself.
    pub fn reap(mut self, status: ExitStatus) -> Ended {
        self.finish(status)
    }

    /// Sends SIGTERM and waits up to `grace` for the service to exit; errs
    /// (after a SIGKILL) if it does not.
    pub async fn sigterm(mut self, grace: Duration) -> Result<Ended, String> {
        let sent = Instant::now();
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
        while sent.elapsed() < grace {
            if let Some(status) = self.exited() {
                return Ok(self.finish(status));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let app = self.app.clone();
        let ended = self.sigkill();
        Err(format!(
            "{app} did not exit within {grace:?} of SIGTERM\n{}",
            ended.log_tail
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
            "{} printed lines that are not reports: {:?}",
            self.app,
            seen.garbage
        );
        Ended {
            app: self.app.clone(),
            status,
            last: seen.last.clone(),
            log_tail: log_tail(&self.log, 30),
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if self.reader.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    format!(
        "--- last lines of {} ---\n{}",
        path.display(),
        all[all.len().saturating_sub(lines)..].join("\n")
    )
}
