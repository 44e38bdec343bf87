//! A PostgreSQL server (or database) for one test.

use std::fs::File;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use tempfile::TempDir;

use super::process::{
    LOG_TAIL_LINES, POLL, STARTUP_TIMEOUT, ServerProcess, as_postgres_user, chown_to_postgres_user,
    free_port, postgres_os_user, random_u64, scratch_root, temp_dir,
};

/// Where Debian's postgresql-15 puts the server binaries. Override with
/// `IDEM_PG_BINDIR` (for example `$(pg_config --bindir)`).
const DEFAULT_BINDIR: &str = "/usr/lib/postgresql/15/bin";

/// Bump when the template's initdb arguments change, so that old templates
/// are not reused.
const TEMPLATE_LAYOUT: u32 = 1;

/// A PostgreSQL database for one test.
///
/// [`Postgres::start`] runs a cluster of its own: a copy of a template data
/// dir (initdb runs once per machine and PostgreSQL version), a `postgres`
/// process on 127.0.0.1 with a random port and its unix socket in the same
/// temp dir. Durability settings keep their defaults (`fsync` on), so
/// [`Postgres::restart_immediate`] behaves like a crash. Dropping it stops
/// the server (immediate shutdown) and removes the dir. When the harness runs
/// as root, the server runs as the `postgres` OS user.
///
/// If the `DATABASE_URL` environment variable is set, no server is started:
/// a database with a unique name is created on that server for this test,
/// and dropped (best effort) on drop. The restart methods then panic, and so
/// do [`Postgres::start_with`] and [`Postgres::start_standby`], which need a
/// server of their own.
///
/// ```no_run
/// # async fn demo() {
/// let mut pg = idem_test::harness::Postgres::start().await;
/// let pool = pg.pool().await;
/// sqlx::query("CREATE TABLE t (id int PRIMARY KEY)").execute(&pool).await.unwrap();
/// pg.restart_immediate().await; // crash and recover; committed rows stay
/// # }
/// ```
pub struct Postgres {
    url: String,
    kind: Kind,
}

enum Kind {
    /// A cluster we run. Fields drop in order: the server stops before its
    /// dir is removed.
    Owned {
        process: Option<ServerProcess>,
        port: u16,
        /// `-c` settings the server runs with, on every start.
        settings: Vec<String>,
        data_dir: PathBuf,
        log: PathBuf,
        dir: TempDir,
    },
    /// A database we created on the `DATABASE_URL` server.
    External { admin_url: String, database: String },
}

impl Postgres {
    /// Starts a cluster for this test (or creates a database on the
    /// `DATABASE_URL` server), and waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// If the server does not become ready within a minute; the message
    /// includes the tail of its log.
    pub async fn start() -> Postgres {
        if let Ok(admin_url) = std::env::var("DATABASE_URL") {
            return Self::create_database(admin_url).await;
        }
        Self::start_owned(Vec::new(), None).await
    }

    /// Starts a cluster of its own for this test, with server settings
    /// (`name=value`, as `postgres -c` takes them) that it keeps across
    /// restarts, for example `["synchronous_commit=off"]`.
    ///
    /// # Panics
    ///
    /// As [`Postgres::start`], and if `DATABASE_URL` is set (the settings
    /// need a server of the test's own).
    pub async fn start_with(settings: &[&str]) -> Postgres {
        if let Ok(admin_url) = std::env::var("DATABASE_URL") {
            panic!(
                "Postgres::start_with() needs a PostgreSQL server owned by the test harness, but \
                 DATABASE_URL is set ({admin_url}); run this test without DATABASE_URL"
            );
        }
        let settings = settings.iter().map(|s| (*s).to_owned()).collect();
        Self::start_owned(settings, None).await
    }

    /// Starts a streaming-replication standby of this server: a base backup
    /// (`pg_basebackup -R`) in a temp dir of its own, run on another port,
    /// connected with `application_name` set to `name` (the name
    /// `synchronous_standby_names` and `pg_stat_replication` know it by).
    /// Returns once the standby accepts connections (read-only). Stop and
    /// start it with [`Postgres::stop_immediate`] and
    /// [`Postgres::start_again`].
    ///
    /// # Panics
    ///
    /// If the backup or the start fails, or if `DATABASE_URL` is set.
    pub async fn start_standby(&self, name: &str) -> Postgres {
        let primary_port = match &self.kind {
            Kind::Owned { port, .. } => *port,
            Kind::External { admin_url, .. } => panic!(
                "Postgres::start_standby() needs a PostgreSQL server owned by the test harness, \
                 but DATABASE_URL is set ({admin_url}); run this test without DATABASE_URL"
            ),
        };
        assert!(
            name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "a standby name is letters, digits and `_`: {name:?}"
        );
        let name = name.to_owned();
        let dir = tokio::task::spawn_blocking(move || {
            let dir = temp_dir("pgstandby");
            chown_to_postgres_user(dir.path());
            base_backup(primary_port, &dir.path().join("data"), &name);
            dir
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        Self::start_owned(Vec::new(), Some(dir)).await
    }

    /// Starts a server on `dir`'s data dir (a copy of the template if no
    /// dir is given) on a free port.
    async fn start_owned(settings: Vec<String>, dir: Option<TempDir>) -> Postgres {
        let dir = match dir {
            Some(dir) => dir,
            // Copying the template is blocking file work (~40 MB); keep it
            // off the runtime so the NATS server can start meanwhile.
            None => tokio::task::spawn_blocking(|| {
                let dir = temp_dir("pg");
                chown_to_postgres_user(dir.path());
                copy_template(&dir.path().join("data"));
                dir
            })
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())),
        };
        let mut kind = Kind::Owned {
            process: None,
            port: 0,
            settings,
            data_dir: dir.path().join("data"),
            log: dir.path().join("postgres.log"),
            dir,
        };
        let Kind::Owned {
            process,
            port,
            settings,
            data_dir,
            log,
            dir,
        } = &mut kind
        else {
            unreachable!()
        };
        // We pick the port, so another test can take it first; then the
        // server exits with "Address already in use" and we try another.
        for attempt in 1.. {
            *port = free_port();
            let url = url_for(*port);
            let mut server = spawn(data_dir, dir.path(), *port, log, settings);
            match wait_until_ready(&url, &mut server).await {
                Ok(()) => {
                    *process = Some(server);
                    break;
                }
                Err(log) if log.contains("Address already in use") && attempt < 10 => continue,
                Err(_) => panic!(
                    "PostgreSQL did not start on port {port}\n{}",
                    server.log_tail()
                ),
            }
        }
        let url = url_for(*port);
        Postgres { url, kind }
    }

    async fn create_database(admin_url: String) -> Postgres {
        let database = format!("idem_test_{}_{:x}", std::process::id(), random_u64());
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to DATABASE_URL ({admin_url}): {e}"));
        // The name is ours (digits, hex, underscores), so it is safe in SQL.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{database}\""
        )))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("cannot create database {database} on DATABASE_URL: {e}"));
        let _ = admin.close().await;
        Postgres {
            url: with_database(&admin_url, &database),
            kind: Kind::External {
                admin_url,
                database,
            },
        }
    }

    /// The URL of this test's database, e.g.
    /// `postgres://postgres@127.0.0.1:23456/postgres`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A new connection pool on this test's database (up to 10 connections).
    ///
    /// # Panics
    ///
    /// If the database cannot be reached.
    pub async fn pool(&self) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL at {}: {e}", self.url))
    }

    /// The data dir, or `None` on a `DATABASE_URL` server.
    pub fn data_dir(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Owned { data_dir, .. } => Some(data_dir),
            Kind::External { .. } => None,
        }
    }

    /// The postmaster's pid while it runs, or `None` (stopped, or
    /// `DATABASE_URL`).
    pub fn pid(&self) -> Option<u32> {
        match &self.kind {
            Kind::Owned { process, .. } => process.as_ref().map(ServerProcess::pid),
            Kind::External { .. } => None,
        }
    }

    /// The last lines of the server log, for diagnostics.
    pub fn log_tail(&self) -> String {
        match &self.kind {
            Kind::Owned { log, .. } => super::process::log_tail(log, LOG_TAIL_LINES),
            Kind::External { .. } => "(PostgreSQL is not run by the harness: DATABASE_URL)".into(),
        }
    }

    /// Stops the server like `pg_ctl stop -m immediate` does: SIGQUIT to the
    /// postmaster, which kills its backends without a checkpoint, so the
    /// next start runs crash recovery. Open connections break.
    ///
    /// # Panics
    ///
    /// If `DATABASE_URL` is set (the test needs its own server).
    pub async fn stop_immediate(&mut self) {
        let (process, ..) = self.owned_mut("stop_immediate");
        if let Some(mut server) = process.take() {
            server.stop(Duration::from_secs(10)).await;
        }
    }

    /// Starts the server again after [`Postgres::stop_immediate`], on the
    /// same port and data dir, and waits until it accepts connections
    /// (crash recovery included).
    ///
    /// # Panics
    ///
    /// If it is already running or does not become ready, or if
    /// `DATABASE_URL` is set.
    pub async fn start_again(&mut self) {
        let url = self.url.clone();
        let (process, port, settings, data_dir, log, dir) = self.owned_mut("start_again");
        assert!(process.is_none(), "PostgreSQL is already running");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut server = spawn(data_dir, dir, port, log, settings);
            match wait_until_ready(&url, &mut server).await {
                Ok(()) => {
                    *process = Some(server);
                    return;
                }
                // Someone may have bound the port while it was free.
                Err(log) if log.contains("Address already in use") && attempt < 50 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => panic!(
                    "PostgreSQL did not restart on port {port}\n{}",
                    server.log_tail()
                ),
            }
        }
    }

    /// The equivalent of `pg_ctl restart -m immediate`: a crash (see
    /// [`Postgres::stop_immediate`]) and a restart on the same port, with
    /// crash recovery. Committed transactions survive; open ones are lost.
    ///
    /// We signal the postmaster ourselves instead of calling `pg_ctl`,
    /// because `pg_ctl restart` would start the new postmaster as a daemon
    /// that the harness no longer owns, and could not kill on drop.
    ///
    /// # Panics
    ///
    /// If the server does not come back, or if `DATABASE_URL` is set.
    pub async fn restart_immediate(&mut self) {
        self.stop_immediate().await;
        self.start_again().await;
    }

    #[allow(clippy::type_complexity)]
    fn owned_mut(
        &mut self,
        what: &str,
    ) -> (
        &mut Option<ServerProcess>,
        u16,
        &[String],
        &Path,
        &Path,
        &Path,
    ) {
        match &mut self.kind {
            Kind::Owned {
                process,
                port,
                settings,
                data_dir,
                log,
                dir,
            } => (process, *port, settings, data_dir, log, dir.path()),
            Kind::External { admin_url, .. } => panic!(
                "Postgres::{what}() needs a PostgreSQL server owned by the test harness, but \
                 DATABASE_URL is set ({admin_url}); run this test without DATABASE_URL"
            ),
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // An owned server stops when its ServerProcess drops.
        let Kind::External {
            admin_url,
            database,
        } = &self.kind
        else {
            return;
        };
        // Drop cannot await, and may run inside a runtime that is shutting
        // down, so use a private runtime on a private thread. Best effort: a
        // leftover database is harmless.
        let admin_url = admin_url.clone();
        let sql = format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)");
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&admin_url).await.ok()?;
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&mut admin)
                    .await
                    .ok()?;
                admin.close().await.ok()
            })
        })
        .join();
    }
}

fn url_for(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

/// `url` with its database (the path) replaced by `database`; the query
/// string (`?sslmode=...`) is kept.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let path = base[authority..]
        .find('/')
        .map_or(base.len(), |i| authority + i);
    match query {
        Some(query) => format!("{}/{database}?{query}", &base[..path]),
        None => format!("{}/{database}", &base[..path]),
    }
}

fn bin(tool: &str) -> PathBuf {
    let dir = std::env::var_os("IDEM_PG_BINDIR").unwrap_or_else(|| DEFAULT_BINDIR.into());
    let path = Path::new(&dir).join(tool);
    assert!(
        path.exists(),
        "{} not found. idem-test runs a PostgreSQL server of its own for each test: install \
         PostgreSQL (on Debian `apt-get install postgresql-15`; this project's scripts/setup.sh \
         does), and set IDEM_PG_BINDIR to the dir with `initdb` and `postgres` (for example \
         `$(pg_config --bindir)`) if they are not in {DEFAULT_BINDIR}; or set DATABASE_URL to use \
         a server you run (each test then gets a database of its own on it)",
        path.display()
    );
    path
}

fn spawn(
    data_dir: &Path,
    socket_dir: &Path,
    port: u16,
    log: &Path,
    settings: &[String],
) -> ServerProcess {
    let mut cmd = Command::new(bin("postgres"));
    cmd.arg("-D")
        .arg(data_dir)
        .args(["-p", &port.to_string()])
        .args(["-h", "127.0.0.1"])
        // The socket goes in our own dir: no clash with other clusters or a
        // system server in /var/run/postgresql, and no root-owned dir needed.
        .arg("-k")
        .arg(socket_dir)
        // Pools of several tests' components add up; the default 100 is
        // tight for concurrency tests.
        .args(["-c", "max_connections=200"])
        .current_dir(socket_dir);
    // After the harness's own, so that a test's setting wins.
    for setting in settings {
        cmd.args(["-c", setting]);
    }
    as_postgres_user(&mut cmd);
    // SIGQUIT is an immediate shutdown: no checkpoint, quick.
    ServerProcess::spawn("postgres", cmd, log, libc::SIGQUIT)
}

/// Polls until a connection succeeds. On exit or timeout, returns the log
/// of this run as the error.
async fn wait_until_ready(url: &str, server: &mut ServerProcess) -> Result<(), String> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        // Connection attempts fail fast while the server is down or still
        // recovering ("the database system is starting up").
        let attempt = tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url));
        if let Ok(Ok(conn)) = attempt.await {
            let _ = conn.close().await;
            return Ok(());
        }
        if server.exited().is_some() || Instant::now() > deadline {
            return Err(server.log_since_spawn());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A base backup of the server on `primary_port` into `target`, set up to
/// stream from it as a standby called `name`.
fn base_backup(primary_port: u16, target: &Path, name: &str) {
    let mut cmd = Command::new(bin("pg_basebackup"));
    cmd.args(["-h", "127.0.0.1", "-p", &primary_port.to_string()])
        .args(["-U", "postgres", "-D"])
        .arg(target)
        // -R: standby.signal and primary_conninfo; fast checkpoint, WAL
        // streamed alongside.
        .args(["-R", "-X", "stream", "-c", "fast"]);
    as_postgres_user(&mut cmd);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run pg_basebackup: {e}"));
    assert!(
        out.status.success(),
        "pg_basebackup failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The later line wins: the same connection, under the standby's name.
    let auto_conf = target.join("postgresql.auto.conf");
    let mut conf = std::fs::read_to_string(&auto_conf)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", auto_conf.display()));
    conf.push_str(&format!(
        "primary_conninfo = 'host=127.0.0.1 port={primary_port} user=postgres application_name={name}'\n"
    ));
    std::fs::write(&auto_conf, conf)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", auto_conf.display()));
}

/// Copies the template cluster to `target` (`cp -a` keeps the postgres
/// user's ownership and the 0700 mode that postgres insists on).
fn copy_template(target: &Path) {
    let template = template_data_dir();
    let out = Command::new("cp")
        .arg("-a")
        .arg(template)
        .arg(target)
        .output()
        .unwrap_or_else(|e| panic!("cannot run cp: {e}"));
    assert!(
        out.status.success(),
        "cp -a {} {} failed: {}",
        template.display(),
        target.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The template data dir, made by initdb once per boot (it lives in
/// [`scratch_root`]), PostgreSQL version and user. initdb takes 1.8 to
/// 2.8 s on ext4; a copy takes 0.05 s on tmpfs. Parallel test processes serialise on a file lock; the template is
/// built under a temporary name and renamed into place, so a crash halfway
/// never leaves a broken template behind.
fn template_data_dir() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let version = Command::new(bin("postgres"))
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut hasher = DefaultHasher::new();
        (TEMPLATE_LAYOUT, version.trim(), unsafe { libc::geteuid() }).hash(&mut hasher);
        let name = format!("idem-pg-template-{:016x}", hasher.finish());
        let tmp = scratch_root();
        let root = tmp.join(&name);
        let data = root.join("data");
        if data.join("PG_VERSION").exists() {
            return data;
        }
        let lock_path = tmp.join(format!("{name}.lock"));
        let lock = File::create(&lock_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", lock_path.display()));
        lock.lock()
            .unwrap_or_else(|e| panic!("cannot lock {}: {e}", lock_path.display()));
        if !data.join("PG_VERSION").exists() {
            build_template(&root, &tmp.join(format!("{name}.building")));
        }
        // The lock is released when `lock` drops.
        data
    })
}

fn build_template(root: &Path, building: &Path) {
    // Left over from a process that died while building: we hold the lock.
    let _ = std::fs::remove_dir_all(building);
    std::fs::create_dir(building)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", building.display()));
    chown_to_postgres_user(building);
    let started = Instant::now();
    let mut cmd = Command::new(bin("initdb"));
    cmd.arg("-D")
        .arg(building.join("data"))
        .args(["--username=postgres", "--auth=trust"])
        .args(["--encoding=UTF8", "--locale=C", "--no-instructions"])
        .current_dir(building);
    as_postgres_user(&mut cmd);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run initdb: {e}"));
    assert!(
        out.status.success(),
        "initdb failed (as {}):\n{}{}",
        if postgres_os_user().is_some() {
            "the postgres OS user"
        } else {
            "the current user"
        },
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(building, root).unwrap_or_else(|e| {
        panic!(
            "cannot rename {} to {}: {e}",
            building.display(),
            root.display()
        )
    });
    eprintln!(
        "idem-test: made the PostgreSQL template {} in {:.2?}",
        root.display(),
        started.elapsed()
    );
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn with_database_replaces_the_path_and_keeps_the_query() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/app?sslmode=disable", "t1"),
            "postgres://u:p@h:5432/t1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "t1"), "postgres://h/t1");
        assert_eq!(with_database("postgres://h/", "t1"), "postgres://h/t1");
    }
}
