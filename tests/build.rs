//! Decides, at build time, which tests cannot run here, so that they are
//! reported as ignored instead of passing without having run:
//!
//! - `idem_external_servers`: `NATS_URL` or `DATABASE_URL` is set, so the
//!   harness uses servers it does not own, and tests that crash or restart a
//!   server cannot run. Such tests carry
//!   `#[cfg_attr(idem_external_servers, ignore = "...")]` and call
//!   `idem_tests::require_own_servers()` first.
//! - `idem_no_cargo_expand`: `cargo expand` is not installed, so the
//!   expansion snapshots (`tests/tests/handlers/expand.rs`) cannot be
//!   checked.
//!
//! Neither is ever set under `CI`: there every test runs, and one that
//! cannot fails loudly, saying why.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(idem_external_servers)");
    println!("cargo::rustc-check-cfg=cfg(idem_no_cargo_expand)");
    for var in ["CI", "NATS_URL", "DATABASE_URL", "PATH", "CARGO_HOME"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    // Installing or removing cargo-expand changes its bin dir. (Cargo reruns
    // on every build when a watched path does not exist, so only an existing
    // dir is watched.)
    if let Some(bin) = cargo_bin_dir().filter(|dir| dir.is_dir()) {
        println!("cargo::rerun-if-changed={}", bin.display());
    }
    println!("cargo::rerun-if-changed=build.rs");

    // As scripts/test.sh reads it: an empty CI is no CI.
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
        return;
    }
    // As the harness reads them: set at all means "use that server".
    if std::env::var_os("NATS_URL").is_some() || std::env::var_os("DATABASE_URL").is_some() {
        println!("cargo::rustc-cfg=idem_external_servers");
    }
    if !cargo_expand_installed() {
        println!("cargo::rustc-cfg=idem_no_cargo_expand");
    }
}

/// Where `cargo install` puts binaries: `$CARGO_HOME/bin`, by default
/// `~/.cargo/bin`.
fn cargo_bin_dir() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    Some(home.join("bin"))
}

fn cargo_expand_installed() -> bool {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    Command::new(cargo)
        .args(["expand", "--version"])
        .output()
        .is_ok_and(|output| output.status.success())
}
