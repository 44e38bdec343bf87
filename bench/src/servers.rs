//! The servers the bench runs on: `NATS_URL` and `DATABASE_URL` when set,
//! otherwise a nats-server and a PostgreSQL cluster of its own, on 127.0.0.1
//! with random ports and files in one temp dir, stopped and removed on exit.
//!
//! The temp dir is under `--data-dir` if given, else `TMPDIR` (default
//! /tmp), on purpose not /dev/shm: the numbers are only honest when every
//! COMMIT and every JetStream write waits for a real fsync, and a dedup
//! table of 100 million claims (about 10 GB) does not belong in RAM. The
//! bench warns when the dir is on a RAM file system. Both servers keep their durability settings
//! (`fsync` and `synchronous_commit` on; JetStream `sync_interval: always`,
//! as the project's tests and demo run it).

use std::fs::{self, File};
use std::hash::{BuildHasher, RandomState};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tempfile::TempDir;

use crate::BenchError;

/// Where Debian's postgresql-15 puts initdb and postgres.
const DEFAULT_PG_BINDIR: &str = "/usr/lib/postgresql/15/bin";

/// How long a server gets to start.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Server settings that only change sizes, never durability: a bigger buffer
/// cache so that a 5M-row dedup table fits, and room for the WAL of its
/// bulk fill without back-to-back checkpoints.
const PG_SETTINGS: &[&str] = &[
    "shared_buffers=1GB",
    "max_wal_size=4GB",
    "max_connections=200",
];

/// The URLs the bench connects to, and the servers it started for them.
pub struct Servers {
    pub nats_url: String,
    /// The URL of a database the bench may connect to and run
    /// `CREATE DATABASE` from; `None` when no mode needs PostgreSQL.
    pub database_url: Option<String>,
    /// What the servers are, for the report.
    pub description: Vec<String>,
    /// The bench's own MariaDB server, as root through its socket (see
    /// [`Servers::start_mariadb`]).
    pub mariadb: Option<sqlx::mysql::MySqlConnectOptions>,
    nats: Option<OwnedProcess>,
    postgres: Option<OwnedProcess>,
    mariadb_process: Option<OwnedProcess>,
    // Dropped last: the processes stop before their files are removed.
    _dir: Option<TempDir>,
}

pub(crate) struct OwnedProcess {
    name: &'static str,
    child: Child,
    /// Signal name for `kill -s`: the server's quickest clean stop.
    stop_signal: &'static str,
}

impl Servers {
    /// The dir the bench's own servers keep their files in, if it started
    /// any.
    pub fn dir(&self) -> Option<std::path::PathBuf> {
        self._dir.as_ref().map(|dir| dir.path().to_owned())
    }

    /// Uses `NATS_URL` / `DATABASE_URL`, or starts what is missing.
    /// `data_dir`: where the servers' temp dir goes (default: `TMPDIR`);
    /// `pg_settings`: `name=value`s for our PostgreSQL, after (and so
    /// overriding) [`PG_SETTINGS`].
    pub async fn start(
        need_postgres: bool,
        data_dir: Option<&Path>,
        pg_settings: &[String],
        nats_sync: NatsSync,
    ) -> Result<Servers, BenchError> {
        let mut servers = Servers {
            nats_url: String::new(),
            database_url: None,
            description: Vec::new(),
            mariadb: None,
            nats: None,
            postgres: None,
            mariadb_process: None,
            _dir: None,
        };
        let external_nats = std::env::var("NATS_URL").ok();
        let external_pg = std::env::var("DATABASE_URL").ok().filter(|_| need_postgres);
        if external_nats.is_none() || (need_postgres && external_pg.is_none()) {
            let parent = data_dir.map_or_else(std::env::temp_dir, Path::to_owned);
            fs::create_dir_all(&parent).map_err(|e| {
                BenchError::setup(format!("cannot create {}: {e}", parent.display()))
            })?;
            let dir = tempfile::Builder::new()
                .prefix("idem-bench-")
                .tempdir_in(&parent)
                .map_err(|e| {
                    BenchError::setup(format!(
                        "cannot create a temp dir in {}: {e}",
                        parent.display()
                    ))
                })?;
            let file_system = file_system_of(dir.path());
            if file_system.starts_with("tmpfs") || file_system.starts_with("ramfs") {
                eprintln!(
                    "idem-bench: warning: the servers' files go to {} on {file_system}, in RAM: \
                     fsync costs nothing there, and a large dedup table takes memory; \
                     --data-dir puts them on disk",
                    dir.path().display()
                );
            }
            // As root, PostgreSQL runs as `postgres` and must reach its dir.
            fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))
                .map_err(|e| BenchError::setup(format!("cannot chmod the temp dir: {e}")))?;
            servers._dir = Some(dir);
        }
        let dir = servers._dir.as_ref().map(|d| d.path().to_owned());

        match external_nats {
            Some(url) => {
                servers.description.push(format!(
                    "NATS: {url} (from NATS_URL; its sync_interval is unknown)"
                ));
                servers.nats_url = url;
            }
            None => {
                let dir = dir.as_ref().expect("made above").join("nats");
                let (process, port) = start_nats_with(&dir, "", nats_sync).await?;
                servers.nats = Some(process);
                servers.nats_url = format!("nats://127.0.0.1:{port}");
                servers.description.push(format!(
                    "NATS: nats-server on {} (JetStream file store, {}, in {} on {})",
                    servers.nats_url,
                    nats_sync.describe(),
                    dir.display(),
                    file_system_of(&dir)
                ));
            }
        }
        if need_postgres {
            match external_pg {
                Some(url) => {
                    servers
                        .description
                        .push(format!("PostgreSQL: {url} (from DATABASE_URL)"));
                    servers.database_url = Some(url);
                }
                None => {
                    let dir = dir.as_ref().expect("made above").join("pg");
                    let settings: Vec<&str> = PG_SETTINGS
                        .iter()
                        .copied()
                        .chain(pg_settings.iter().map(String::as_str))
                        .collect();
                    let (process, url) = start_postgres(&dir, &settings).await?;
                    servers.postgres = Some(process);
                    servers.description.push(format!(
                        "PostgreSQL: {url} (data dir {} on {}; {})",
                        dir.join("data").display(),
                        file_system_of(&dir),
                        settings.join(", ")
                    ));
                    servers.database_url = Some(url);
                }
            }
        }
        Ok(servers)
    }
}

impl Servers {
    /// Starts a MariaDB server of the bench's own in its temp dir (on disk
    /// unless `--data-dir` says otherwise), reached through a unix socket
    /// only, its durability settings at their defaults
    /// (`innodb_flush_log_at_trx_commit = 1`).
    pub async fn start_mariadb(&mut self) -> Result<(), BenchError> {
        use sqlx::ConnectOptions;
        let dir = self
            ._dir
            .as_ref()
            .ok_or_else(|| {
                BenchError::setup("the MariaDB bench needs a server of its own: unset NATS_URL")
            })?
            .path()
            .join("mariadb");
        let tmp = dir.join("tmp");
        fs::create_dir_all(&tmp)
            .map_err(|e| BenchError::setup(format!("cannot create {}: {e}", tmp.display())))?;
        let tmpdir = format!("--tmpdir={}", tmp.display());
        let root = unsafe { libc::geteuid() } == 0;
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(&tmpdir)
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        if root {
            install.arg("--user=root");
        }
        let out = tokio::task::spawn_blocking(move || install.output())
            .await
            .map_err(|e| BenchError::setup(format!("mariadb-install-db task: {e}")))?
            .map_err(|e| {
                BenchError::setup(format!(
                    "cannot run mariadb-install-db ({e}): install mariadb-server (scripts/setup.sh does)"
                ))
            })?;
        if !out.status.success() {
            return Err(BenchError::setup(format!(
                "mariadb-install-db failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let socket = dir.join("mariadbd.sock");
        let mut cmd = Command::new("/usr/sbin/mariadbd");
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(&tmpdir)
            .arg(format!("--pid-file={}", dir.join("mariadbd.pid").display()))
            .args([
                "--skip-networking",
                "--innodb-buffer-pool-size=1G",
                "--max-connections=200",
            ]);
        if root {
            cmd.arg("--user=root");
        }
        let log = dir.join("mariadb.log");
        let mut process = OwnedProcess::spawn("mariadbd", cmd, &log, "KILL")?;
        let options = sqlx::mysql::MySqlConnectOptions::new()
            .socket(&socket)
            .username("root")
            .disable_statement_logging();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(Ok(connection)) =
                tokio::time::timeout(Duration::from_secs(5), options.connect()).await
            {
                let _ = connection.close().await;
                break;
            }
            if process.exited() || Instant::now() > deadline {
                process.stop();
                return Err(BenchError::setup(format!(
                    "MariaDB did not start:\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.description.push(format!(
            "MariaDB: mariadbd on {} (data dir {} on {}; innodb_flush_log_at_trx_commit = 1)",
            socket.display(),
            dir.join("data").display(),
            file_system_of(&dir)
        ));
        self.mariadb_process = Some(process);
        self.mariadb = Some(options);
        Ok(())
    }

    /// The pids of the servers when the bench runs all it uses itself (for
    /// their CPU time); `None` when one came from `NATS_URL`/`DATABASE_URL`.
    pub fn owned_pids(&self) -> Option<Vec<u32>> {
        let mut pids = vec![self.nats.as_ref()?.child.id()];
        if self.database_url.is_some() {
            pids.push(self.postgres.as_ref()?.child.id());
        }
        Some(pids)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for process in [
            self.nats.take(),
            self.postgres.take(),
            self.mariadb_process.take(),
        ]
        .into_iter()
        .flatten()
        {
            process.stop();
        }
    }
}

impl OwnedProcess {
    /// Spawns `cmd` with its output appended to `log`, in a process group of
    /// its own so that a Ctrl-C at the terminal reaches only the bench,
    /// which then stops the server itself.
    fn spawn(
        name: &'static str,
        mut cmd: Command,
        log: &Path,
        stop_signal: &'static str,
    ) -> Result<Self, BenchError> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| BenchError::setup(format!("cannot open {}: {e}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(|e| BenchError::setup(format!("cannot dup a file descriptor: {e}")))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| BenchError::setup(format!("cannot start {name} ({cmd:?}): {e}")))?;
        Ok(Self {
            name,
            child,
            stop_signal,
        })
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the stop signal, waits up to 10 s, then SIGKILLs.
    pub(crate) fn stop(mut self) {
        if self.exited() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-s", self.stop_signal, &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("idem-bench: {} did not stop in 10 s; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// JetStream's `sync_interval` for the bench's own nats-server
/// (`--nats-sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NatsSync {
    /// `sync_interval: always`: every write fsynced before its PubAck.
    Always,
    /// The server's default: fsync every 2 minutes, PubAcks at once.
    Default,
}

impl NatsSync {
    fn config(self) -> &'static str {
        match self {
            NatsSync::Always => "  sync_interval: always\n",
            NatsSync::Default => "",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            NatsSync::Always => "sync_interval: always",
            NatsSync::Default => "default sync_interval (2 min)",
        }
    }
}

/// Runs nats-server with JetStream in `dir`, `extra` appended to its
/// config (a cluster's settings); returns it and its port.
pub(crate) async fn start_nats(dir: &Path, extra: &str) -> Result<(OwnedProcess, u16), BenchError> {
    start_nats_with(dir, extra, NatsSync::Always).await
}

/// [`start_nats`] with the given `sync_interval`.
async fn start_nats_with(
    dir: &Path,
    extra: &str,
    sync: NatsSync,
) -> Result<(OwnedProcess, u16), BenchError> {
    fs::create_dir_all(dir)
        .map_err(|e| BenchError::setup(format!("cannot create {}: {e}", dir.display())))?;
    let config = dir.join("nats-server.conf");
    let log = dir.join("nats-server.log");
    // port -1: the server picks a free port, read back from its log.
    let text = format!(
        "host: 127.0.0.1\nport: -1\njetstream {{\n  store_dir: {:?}\n{}}}\n{extra}",
        dir.join("js").display().to_string(),
        sync.config()
    );
    fs::write(&config, text)
        .map_err(|e| BenchError::setup(format!("cannot write {}: {e}", config.display())))?;
    let bin = std::env::var_os("NATS_SERVER_BIN").unwrap_or_else(|| "nats-server".into());
    let mut cmd = Command::new(bin);
    cmd.arg("-c").arg(&config).current_dir(dir);
    let mut process = OwnedProcess::spawn("nats-server", cmd, &log, "TERM")?;
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        if text.contains("Server is ready") {
            let port = text
                .lines()
                .find_map(|line| line.split("Listening for client connections on ").nth(1))
                .and_then(|addr| addr.trim().rsplit(':').next()?.parse().ok());
            return match port {
                Some(port) => Ok((process, port)),
                None => Err(BenchError::setup(format!(
                    "nats-server is ready but its log names no port:\n{}",
                    tail(&text)
                ))),
            };
        }
        if process.exited() || Instant::now() > deadline {
            return Err(BenchError::setup(format!(
                "nats-server did not start (is v2.15.1 on PATH? scripts/setup.sh installs it):\n{}",
                tail(&text)
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// initdb's a cluster in `dir/data` and runs it; returns it and its URL.
async fn start_postgres(
    dir: &Path,
    settings: &[&str],
) -> Result<(OwnedProcess, String), BenchError> {
    let bindir = PathBuf::from(
        std::env::var_os("IDEM_PG_BINDIR").unwrap_or_else(|| DEFAULT_PG_BINDIR.into()),
    );
    if !bindir.join("initdb").exists() {
        return Err(BenchError::setup(format!(
            "no initdb in {}: install PostgreSQL 15 (scripts/setup.sh does) or set IDEM_PG_BINDIR",
            bindir.display()
        )));
    }
    let user = postgres_os_user()?;
    fs::create_dir_all(dir)
        .map_err(|e| BenchError::setup(format!("cannot create {}: {e}", dir.display())))?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .map_err(|e| BenchError::setup(format!("cannot chown {}: {e}", dir.display())))?;
    }
    let as_user = |cmd: &mut Command| {
        if let Some((uid, gid)) = user {
            cmd.uid(uid).gid(gid);
        }
    };

    let mut initdb = Command::new(bindir.join("initdb"));
    initdb
        .arg("-D")
        .arg(dir.join("data"))
        .args(["--username=postgres", "--auth=trust"])
        .args(["--encoding=UTF8", "--locale=C", "--no-instructions"])
        .current_dir(dir);
    as_user(&mut initdb);
    let out = tokio::task::spawn_blocking(move || initdb.output())
        .await
        .map_err(|e| BenchError::setup(format!("initdb task: {e}")))?
        .map_err(|e| BenchError::setup(format!("cannot run initdb: {e}")))?;
    if !out.status.success() {
        return Err(BenchError::setup(format!(
            "initdb failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }

    let log = dir.join("postgres.log");
    // PostgreSQL cannot pick its own port: draw one below the ephemeral
    // range, and draw again if someone takes it first.
    for _ in 0..10 {
        let port = free_port()?;
        let mut cmd = Command::new(bindir.join("postgres"));
        cmd.arg("-D")
            .arg(dir.join("data"))
            .args(["-p", &port.to_string(), "-h", "127.0.0.1"])
            .arg("-k")
            .arg(dir)
            .current_dir(dir);
        for setting in settings {
            cmd.args(["-c", setting]);
        }
        as_user(&mut cmd);
        let log_start = fs::metadata(&log).map(|m| m.len()).unwrap_or(0) as usize;
        // SIGQUIT: immediate shutdown; the data is thrown away anyway.
        let mut process = OwnedProcess::spawn("postgres", cmd, &log, "QUIT")?;
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let attempt =
                tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(&url)).await;
            if let Ok(Ok(conn)) = attempt {
                let _ = conn.close().await;
                return Ok((process, url));
            }
            if process.exited() || Instant::now() > deadline {
                let text = fs::read_to_string(&log).unwrap_or_default();
                let text = text.get(log_start..).unwrap_or(&text).to_owned();
                if text.contains("Address already in use") {
                    break;
                }
                process.stop();
                return Err(BenchError::setup(format!(
                    "PostgreSQL did not start:\n{}",
                    tail(&text)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Err(BenchError::setup(
        "PostgreSQL found no free port in 10 tries",
    ))
}

/// The uid and gid of the `postgres` OS user when we are root (initdb and
/// postgres refuse to run as root); `None` otherwise.
fn postgres_os_user() -> Result<Option<(u32, u32)>, BenchError> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|id| id.parse::<u32>().ok());
    if euid != Some(0) {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .map(Some)
        .ok_or_else(|| {
            BenchError::setup(
                "running as root, but there is no `postgres` OS user to run PostgreSQL as; \
                 scripts/setup.sh installs postgresql-15, which creates it",
            )
        })
}

/// A loopback port that is free right now, drawn from 15000..32000.
pub(crate) fn free_port() -> Result<u16, BenchError> {
    for _ in 0..1000 {
        let port = 15_000 + (RandomState::new().hash_one(Instant::now()) % 17_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(BenchError::setup("no free loopback port in 15000..32000"))
}

/// The file system `path` lives on, e.g. `ext4 (/dev/vda)`, from
/// /proc/mounts: the report says whether fsync was real.
pub fn file_system_of(path: &Path) -> String {
    let path = fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let device = fields.next()?;
            let mount_point = fields.next()?;
            let fs_type = fields.next()?;
            path.starts_with(mount_point)
                .then(|| (mount_point.len(), format!("{fs_type} ({device})")))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "an unknown file system".into(), |(_, fs)| fs)
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
