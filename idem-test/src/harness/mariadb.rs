//! A MariaDB server for one test (feature `mariadb`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, MySqlPool};
use tempfile::TempDir;

use super::process::{POLL, STARTUP_TIMEOUT, ServerProcess, free_port, temp_dir};

/// The database every test's server holds, empty.
const DATABASE: &str = "idem";

/// A MariaDB server of the test's own.
///
/// [`Mariadb::start`] makes a data dir in a temp dir (`mariadb-install-db`,
/// about a second) and runs `mariadbd` on it, reached through a unix socket
/// in the same dir only (no TCP port, so none to race for;
/// [`Mariadb::start_on_tcp`] adds one), with an empty database `idem`. Durability settings keep their defaults
/// (`innodb_flush_log_at_trx_commit = 1`). Dropping it kills the server and
/// removes the dir.
///
/// ```no_run
/// # async fn demo() {
/// let mariadb = idem_test::harness::Mariadb::start().await;
/// let pool = mariadb.pool().await;
/// sqlx::query("CREATE TABLE t (id INT PRIMARY KEY)").execute(&pool).await.unwrap();
/// # }
/// ```
pub struct Mariadb {
    options: MySqlConnectOptions,
    /// The loopback port, when the server listens on one too.
    port: Option<u16>,
    /// Fields drop in order: the server stops before its dir is removed.
    _process: ServerProcess,
    _dir: TempDir,
}

impl Mariadb {
    /// Starts a server for this test and waits until it accepts
    /// connections.
    ///
    /// # Panics
    ///
    /// If MariaDB is not installed, or does not become ready within a
    /// minute; the message includes the tail of its log.
    pub async fn start() -> Mariadb {
        Self::start_listening(false).await
    }

    /// Starts a server that also listens on a loopback TCP port (random),
    /// for a test that puts a proxy between it and its clients
    /// ([`Mariadb::tcp_url`]).
    ///
    /// # Panics
    ///
    /// As [`Mariadb::start`].
    pub async fn start_on_tcp() -> Mariadb {
        Self::start_listening(true).await
    }

    async fn start_listening(tcp: bool) -> Mariadb {
        let dir = temp_dir("mariadb");
        let data = dir.path().join("data");
        let log = dir.path().join("mariadb.log");
        let socket = dir.path().join("mariadbd.sock");
        // Its own temp dir: the bootstrap's temporary tables are named by
        // pid, and installs in parallel tests collided in /tmp.
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).expect("a temp dir for MariaDB");
        {
            // Blocking work (about a second): off the runtime's threads.
            let (data, tmp, log) = (data.clone(), tmp.clone(), log.clone());
            tokio::task::spawn_blocking(move || install(&data, &tmp, &log))
                .await
                .expect("mariadb-install-db ran");
        }
        let root = MySqlConnectOptions::new()
            .socket(&socket)
            .username("root")
            .disable_statement_logging();
        // We pick the port, so another process can take it first: then
        // another is drawn.
        let mut tries = 0;
        let (process, port) = loop {
            tries += 1;
            let port = tcp.then(free_port);
            let mut process = spawn(&data, &tmp, &socket, &log, port);
            match wait_until_ready(&root, &mut process).await {
                Ok(()) => break (process, port),
                Err(text)
                    if port.is_some() && tries < 5 && text.contains("Address already in use") =>
                {
                    continue;
                }
                Err(text) => panic!("MariaDB did not start\n{text}"),
            }
        };
        let mut admin = root.connect().await.expect("MariaDB accepts root");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
            .execute(&mut admin)
            .await
            .expect("the test database is created");
        let _ = admin.close().await;
        Mariadb {
            options: root.database(DATABASE),
            port,
            _process: process,
            _dir: dir,
        }
    }

    /// The options that reach the test database (as root, through the
    /// socket).
    pub fn options(&self) -> MySqlConnectOptions {
        self.options.clone()
    }

    /// A URL for the test database, as `DATABASE_URL` takes it.
    pub fn url(&self) -> String {
        let socket = self.options.get_socket().expect("a socket");
        format!(
            "mysql://root@localhost/{DATABASE}?socket={}",
            socket.display()
        )
    }

    /// A URL for the test database over TCP on loopback
    /// (`mysql://root@127.0.0.1:PORT/idem`).
    ///
    /// # Panics
    ///
    /// If the server was not started with [`Mariadb::start_on_tcp`].
    pub fn tcp_url(&self) -> String {
        let port = self
            .port
            .expect("a server started with Mariadb::start_on_tcp listens on TCP");
        format!("mysql://root@127.0.0.1:{port}/{DATABASE}")
    }

    /// A new pool on the test database (10 connections).
    pub async fn pool(&self) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(10)
            .connect_with(self.options())
            .await
            .expect("connect to the test's MariaDB")
    }
}

/// The server binary: `mariadbd`, or `mysqld` where only that name exists.
fn server_binary() -> PathBuf {
    for candidate in ["/usr/sbin/mariadbd", "/usr/sbin/mysqld"] {
        if Path::new(candidate).exists() {
            return candidate.into();
        }
    }
    panic!(
        "MariaDB's server is not installed (no /usr/sbin/mariadbd). idem-test runs a MariaDB \
         server of its own for each MariaDB test: install it (on Debian `apt-get install \
         mariadb-server`; this project's scripts/setup.sh does)"
    )
}

/// Whether we run as root, which `mariadbd` must then be told.
fn as_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// Small logs and buffers: a test's server holds little.
const SMALL: [&str; 2] = ["--innodb-log-file-size=8M", "--innodb-buffer-pool-size=64M"];

fn install(data: &Path, tmp: &Path, log: &Path) {
    let started = Instant::now();
    let mut cmd = Command::new("mariadb-install-db");
    cmd.arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--tmpdir={}", tmp.display()))
        .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
        .args(SMALL);
    if as_root() {
        cmd.arg("--user=root");
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run mariadb-install-db ({e}); install mariadb-server (scripts/setup.sh)")
    });
    let _ = std::fs::write(log, &out.stdout);
    assert!(
        out.status.success(),
        "mariadb-install-db failed after {:?}: {}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn spawn(data: &Path, tmp: &Path, socket: &Path, log: &Path, port: Option<u16>) -> ServerProcess {
    let mut cmd = Command::new(server_binary());
    cmd.arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--tmpdir={}", tmp.display()))
        .arg(format!("--socket={}", socket.display()))
        .arg(format!(
            "--pid-file={}",
            data.join("mariadbd.pid").display()
        ))
        .args(SMALL)
        .arg("--max-connections=200");
    match port {
        Some(port) => cmd.args([
            format!("--port={port}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--skip-name-resolve".to_owned(),
        ]),
        None => cmd.arg("--skip-networking"),
    };
    if as_root() {
        cmd.arg("--user=root");
    }
    // SIGKILL: the test is over, nothing need be flushed.
    ServerProcess::spawn("mariadbd", cmd, log, libc::SIGKILL)
}

/// Polls until a connection succeeds. On exit or timeout, returns the log
/// of this run as the error.
async fn wait_until_ready(
    options: &MySqlConnectOptions,
    server: &mut ServerProcess,
) -> Result<(), String> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(5), options.connect());
        if let Ok(Ok(connection)) = attempt.await {
            let _ = connection.close().await;
            return Ok(());
        }
        if server.exited().is_some() || Instant::now() > deadline {
            return Err(server.log_since_spawn());
        }
        tokio::time::sleep(POLL).await;
    }
}
