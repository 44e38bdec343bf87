//! Snapshots of what `#[idempotent]` expands to, as `cargo expand` prints
//! it. Regenerate them with
//! `MACROTEST=overwrite cargo test -p idem-tests --test expand`.
//!
//! Neither test passes without having checked something: a missing snapshot
//! fails (macrotest would write it and pass), and without cargo-expand the
//! comparison is built as ignored (`tests/build.rs` sets
//! `cfg(idem_no_cargo_expand)`), except under `CI`, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

const REGENERATE: &str = "MACROTEST=overwrite cargo test -p idem-tests --test expand";

/// Whether `MACROTEST=overwrite` asks for the snapshots to be (re)written.
fn overwriting() -> bool {
    std::env::var_os("MACROTEST").is_some_and(|v| v == "overwrite")
}

/// The expansion cases (`tests/expand/*.rs`) whose `.expanded.rs` snapshot
/// is missing.
fn cases_without_snapshot() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("expand");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a dir entry").path())
        .filter(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            name.ends_with(".rs") && !name.ends_with(".expanded.rs")
        })
        .collect();
    assert!(!cases.is_empty(), "no expansion cases in {}", dir.display());
    cases.sort();
    cases.retain(|case| !case.with_extension("expanded.rs").is_file());
    cases
}

/// Every expansion case has its snapshot checked in. Needs no cargo-expand,
/// so it runs everywhere.
#[test]
fn every_expansion_case_has_a_snapshot() {
    if overwriting() {
        return;
    }
    let missing = cases_without_snapshot();
    assert!(
        missing.is_empty(),
        "expansion cases without a checked-in .expanded.rs snapshot: {missing:?}. \
         Generate them with `{REGENERATE}`, review them, and commit them."
    );
}

/// The expansion of every case equals its snapshot.
#[test]
#[cfg_attr(
    idem_no_cargo_expand,
    ignore = "cargo-expand is not installed (`cargo install cargo-expand --locked`)"
)]
fn expansions_match_their_snapshots() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let installed = Command::new(cargo)
        .args(["expand", "--version"])
        .output()
        .is_ok_and(|output| output.status.success());
    assert!(
        installed,
        "cargo-expand is not installed, so the expansion snapshots cannot be checked. \
         Install it with `cargo install cargo-expand --locked` (scripts/setup.sh does). \
         Outside CI this test is then built as ignored."
    );
    if overwriting() {
        macrotest::expand("expand/*.rs");
    } else {
        // Unlike `expand`, this fails on a missing snapshot instead of
        // writing it and passing.
        let missing = cases_without_snapshot();
        assert!(
            missing.is_empty(),
            "no snapshot for {missing:?}: generate it with `{REGENERATE}`, review it, and commit it"
        );
        macrotest::expand_without_refresh("expand/*.rs");
    }
}
