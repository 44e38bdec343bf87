//! Running the built `idem` binary, for the tests of each command; and
//! [`outbox`], the outbox's checks written once for SQLite and MariaDB.

// Each test binary uses part of it.
#![allow(dead_code)]

pub mod outbox;

use std::path::Path;

use serde_json::Value;

/// One run of the `idem` binary.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Its stdout as JSON, after checking it exited `code`.
    pub fn json(&self, code: i32) -> Value {
        assert_eq!(self.code, code, "exit code of {self:#?}");
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|error| panic!("stdout is not JSON ({error}): {self:#?}"))
    }

    /// Its stdout as text, after checking it exited 0.
    pub fn text(&self) -> &str {
        assert_eq!(self.code, 0, "exit code of {self:#?}");
        &self.stdout
    }

    /// Its stderr, after checking it exited `code` and printed nothing on
    /// stdout.
    pub fn failure(&self, code: i32) -> &str {
        assert_eq!(self.code, code, "exit code of {self:#?}");
        assert!(self.stdout.is_empty(), "nothing on stdout: {self:#?}");
        &self.stderr
    }
}

/// Runs `idem args...` with these URLs (no NATS_URL at all for `None`), in
/// the directory `cwd` if given (where a relative SQLite path is found).
/// What it printed goes to the test's output: the text outputs are the
/// README's examples, and `--no-capture` shows them.
pub async fn idem_in(
    cwd: Option<&Path>,
    nats_url: Option<&str>,
    database_url: &str,
    args: &[&str],
) -> Run {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    command.args(args).env("DATABASE_URL", database_url);
    match nats_url {
        Some(url) => command.env("NATS_URL", url),
        None => command.env_remove("NATS_URL"),
    };
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    let output = command.output().await.expect("the idem binary runs");
    let run = Run {
        code: output.status.code().expect("idem exits, not killed"),
        stdout: String::from_utf8(output.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8(output.stderr).expect("stderr is UTF-8"),
    };
    println!("$ idem {}\n{}{}", args.join(" "), run.stdout, run.stderr);
    run
}
