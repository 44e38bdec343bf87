//! Log lines a test can assert on: a warning the runtime must give (what is
//! down, what is at risk) is part of its behaviour, so tests check it.

use std::io::{self, Write};
use std::sync::{Arc, Mutex, OnceLock};

use tracing_subscriber::fmt::{MakeWriter, TestWriter};

/// Every line logged in this process since [`capture_logs`], without ANSI
/// colours. Lines also go to the test's output, as with
/// [`init_tracing`](crate::init_tracing).
#[derive(Clone)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// The lines logged so far.
    pub fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The lines logged so far that contain every one of `parts`.
    pub fn matching(&self, parts: &[&str]) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|line| parts.iter().all(|part| line.contains(part)))
            .collect()
    }
}

/// Installs the process's `tracing` subscriber, filtered by `RUST_LOG`
/// (default `warn`), so that the test can read back what was logged. Call it
/// first in the test, before [`TestEnv::start`](crate::TestEnv::start)
/// (which would install a subscriber of its own); calling it again returns
/// the same capture.
///
/// # Panics
///
/// If another subscriber was installed first.
pub fn capture_logs() -> Logs {
    static LOGS: OnceLock<Logs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Logs(Arc::default());
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(logs.clone())
            .try_init()
            .expect("capture_logs() is called before anything else installs a subscriber");
        logs
    })
    .clone()
}

/// Writes each line both to the capture and to the test's output.
pub struct Tee {
    logs: Arc<Mutex<Vec<u8>>>,
    test: TestWriter,
}

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.logs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        self.test.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.test.flush()
    }
}

impl<'a> MakeWriter<'a> for Logs {
    type Writer = Tee;

    fn make_writer(&'a self) -> Tee {
        Tee {
            logs: self.0.clone(),
            test: TestWriter::new(),
        }
    }
}
