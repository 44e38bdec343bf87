//! Process plumbing shared by the NATS and PostgreSQL servers the harness owns:
//! spawning with a kill switch, stopping, logs, temp dirs, ports, the OS user.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, RandomState};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How long a server gets to become ready. Generous on purpose: CI has two
/// cores shared by parallel tests, and a slow start is not a test failure.
pub(crate) const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// How often readiness and exit are polled.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// How many log lines a startup panic shows.
pub(crate) const LOG_TAIL_LINES: usize = 40;

/// Every per-test temp dir starts with this, so that [`sweep_stale_dirs`] can
/// recognise dirs left behind by test processes that were killed outright.
const TEMP_PREFIX: &str = "idem-test-";

/// A server process owned by the harness. Dropping it stops the process.
pub(crate) struct ServerProcess {
    child: Child,
    name: &'static str,
    /// Signal for a normal stop; SIGKILL follows if it does not exit in time.
    stop_signal: libc::c_int,
    log: PathBuf,
    /// Length of the log when this process was spawned, so that startup checks
    /// only read what this run wrote (restarts append to the same file).
    log_start: u64,
}

impl ServerProcess {
    /// Spawns `cmd` with stdin closed and stdout and stderr appended to `log`.
    ///
    /// The output goes to a file rather than a pipe so that a chatty server can
    /// never block on a full pipe, and so that the test runner does not see
    /// our children holding its stdout open (nextest reports that as a leak).
    pub(crate) fn spawn(
        name: &'static str,
        mut cmd: Command,
        log: &Path,
        stop_signal: libc::c_int,
    ) -> Self {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("cannot open the {name} log {}: {e}", log.display()));
        let log_start = out.metadata().map(|m| m.len()).unwrap_or(0);
        let err = out.try_clone().expect("dup log file descriptor");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        die_with_test(&mut cmd);
        let child = cmd.spawn().unwrap_or_else(|e| {
            let hint = match (e.kind(), name) {
                (io::ErrorKind::NotFound, "nats-server") => super::nats::INSTALL_NATS,
                _ => "",
            };
            panic!("cannot start {name} ({cmd:?}): {e}. {hint}")
        });
        ServerProcess {
            child,
            name,
            stop_signal,
            log: log.to_owned(),
            log_start,
        }
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited (and reaps it).
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Everything this run has written to the log so far.
    pub(crate) fn log_since_spawn(&self) -> String {
        read_from(&self.log, self.log_start)
    }

    /// The last lines of the whole log, for panic messages.
    pub(crate) fn log_tail(&self) -> String {
        log_tail(&self.log, LOG_TAIL_LINES)
    }

    fn signal(&self, signal: libc::c_int) {
        // The pid cannot have been reused: we have not reaped the child yet.
        unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
    }

    /// Sends the stop signal and waits (polling, without blocking the async
    /// runtime) until the process exits; SIGKILL after `grace`.
    pub(crate) async fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        self.signal(self.stop_signal);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.kill_and_reap();
    }

    /// Blocking version of [`ServerProcess::stop`], for `Drop`.
    fn stop_blocking(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        self.signal(self.stop_signal);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill_and_reap();
    }

    fn kill_and_reap(&mut self) {
        eprintln!(
            "idem-test: {} (pid {}) did not stop in time; sending SIGKILL",
            self.name,
            self.pid()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop_blocking(Duration::from_secs(10));
    }
}

/// Reads `path` from byte `offset` to the end, lossily (logs may be cut
/// mid-character while the server writes).
pub(crate) fn read_from(path: &Path, offset: u64) -> String {
    let mut bytes = Vec::new();
    if let Ok(mut file) = File::open(path) {
        let _ = file.seek(SeekFrom::Start(offset));
        let _ = file.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The last `lines` lines of the file at `path`, or a note that it is missing.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = fs::read(path) else {
        return format!("(no log at {})", path.display());
    };
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    format!(
        "--- last {} lines of {} ---\n{}\n---",
        tail.len(),
        path.display(),
        tail.join("\n")
    )
}

/// Where servers keep their files: `$IDEM_TEST_TMPDIR`, else /dev/shm when
/// it is usable, else the system temp dir.
///
/// tmpfs because creating files on the CI disk costs ~0.4 ms each: copying
/// the 966-file template cluster takes 0.8 s on ext4 and 0.05 s on tmpfs,
/// and fsyncs stop competing with the build for the disk. The servers keep
/// fsync on; on tmpfs it is simply free. Nothing is lost for the tests: a
/// crash they simulate is a process crash, which the page cache survives on
/// any file system.
pub(crate) fn scratch_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        if let Some(dir) = std::env::var_os("IDEM_TEST_TMPDIR") {
            return dir.into();
        }
        let shm = Path::new("/dev/shm");
        // Probe: the dir may exist but be read-only or full.
        if tempfile::Builder::new()
            .prefix("idem-probe-")
            .tempdir_in(shm)
            .is_ok()
        {
            shm.to_owned()
        } else {
            std::env::temp_dir()
        }
    })
}

/// A fresh temp dir for one server, named `idem-test-<kind>-<pid>-<random>`.
///
/// Removed when the returned value is dropped. `kind` must not contain `-`.
pub(crate) fn temp_dir(kind: &str) -> TempDir {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(sweep_stale_dirs);
    tempfile::Builder::new()
        .prefix(&format!("{TEMP_PREFIX}{kind}-{}-", std::process::id()))
        .tempdir_in(scratch_root())
        .unwrap_or_else(|e| panic!("cannot create a temp dir for {kind}: {e}"))
}

/// Removes temp dirs of test processes that no longer exist. A test process
/// killed by a timeout never runs `Drop`; without this, every such kill would
/// leave a 40 MB PostgreSQL cluster behind (in RAM, on tmpfs).
fn sweep_stale_dirs() {
    let Ok(entries) = fs::read_dir(scratch_root()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TEMP_PREFIX)) else {
            continue;
        };
        // rest = "<kind>-<pid>-<random>"
        let Some(pid) = rest.split('-').nth(1).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// A random number, good enough for names and ports (not for secrets).
/// `RandomState` is seeded from the OS, so it differs across processes.
pub(crate) fn random_u64() -> u64 {
    RandomState::new().hash_one(Instant::now())
}

/// A loopback port that is free right now.
///
/// Drawn at random below the kernel's ephemeral range (32768+), so that the
/// outgoing connections of other tests cannot take it between this check
/// and the server's bind. Another process can still race us for it; callers
/// retry with a new port when the server reports the address in use.
pub(crate) fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = 15_000 + (random_u64() % 17_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port found in 15000..32000 after 1000 tries");
}

/// The uid and gid to run PostgreSQL as: the `postgres` OS user when we are
/// root (initdb and postgres refuse to run as root), `None` otherwise (run
/// as the current user).
pub(crate) fn postgres_os_user() -> Option<(u32, u32)> {
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    static USER: OnceLock<(u32, u32)> = OnceLock::new();
    Some(*USER.get_or_init(|| {
        lookup_user("postgres").unwrap_or_else(|| {
            panic!(
                "running as root, but there is no `postgres` OS user to run PostgreSQL as \
                 (initdb refuses to run as root); install PostgreSQL (Debian's postgresql-15 \
                 creates that user), or run the tests as another user"
            )
        })
    }))
}

/// Runs `cmd` as the PostgreSQL OS user (see [`postgres_os_user`]).
pub(crate) fn as_postgres_user(cmd: &mut Command) -> &mut Command {
    if let Some((uid, gid)) = postgres_os_user() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// Gives `path` to the PostgreSQL OS user, if we run it as another user.
pub(crate) fn chown_to_postgres_user(path: &Path) {
    if let Some((uid, gid)) = postgres_os_user() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("cannot chown {} to postgres: {e}", path.display()));
    }
}

fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let name = CString::new(name).ok()?;
    // SAFETY: getpwnam_r writes only into `pwd` and `buf`, both live and
    // sized as declared; `result` tells whether `pwd` was filled in.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 16 * 1024];
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(
            name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        );
        (rc == 0 && !result.is_null()).then_some((pwd.pw_uid, pwd.pw_gid))
    }
}

/// Makes the process `cmd` starts die with the test that starts it.
///
/// Drop does not run when the test process is killed (a nextest timeout,
/// Ctrl-C, SIGKILL), so the kernel kills the child then (`PR_SET_PDEATHSIG`),
/// and no server or worker outlives its test. The signal fires when the
/// spawning *thread* exits: spawn from the test's own thread or runtime
/// threads (never `spawn_blocking`), which outlive the child.
pub fn die_with_test(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only calls the
    // async-signal-safe functions prctl, getppid and _exit.
    unsafe {
        cmd.pre_exec(move || {
            // After std's setuid, which would otherwise clear it.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}
