//! Snapshots of what `#[idempotent]` expands to, as `cargo expand` prints
//! it. Regenerate them with
//! `MACROTEST=overwrite cargo test -p idem-tests --test handlers -- expand::`.
//!
//! Neither test passes without having checked something: a missing snapshot
//! fails (macrotest would write it and pass), and without cargo-expand the
//! comparison is built as ignored (`tests/build.rs` sets
//! `cfg(idem_no_cargo_expand)`), except under `CI`, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

const REGENERATE: &str = "MACROTEST=overwrite cargo test -p idem-tests --test handlers -- expand::";

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

/// The guide chapter that shows the handler and its expansion.
const CHAPTER: &str = "../idem-runtime/docs/guide/writing-handlers.md";

/// The code block in the guide chapter after `marker`, without the lines
/// rustdoc hides (`# ...`), which only set the doctest up.
fn readme_block(marker: &str) -> String {
    let chapter = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(CHAPTER))
        .unwrap_or_else(|e| panic!("{CHAPTER} is unreadable: {e}"));
    let after = chapter
        .split_once(marker)
        .unwrap_or_else(|| panic!("{CHAPTER} has no `{marker}`"))
        .1;
    let block = after
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .unwrap_or_else(|| panic!("no ```rust block follows `{marker}` in {CHAPTER}"))
        .0;
    let shown: Vec<&str> = block
        .lines()
        .filter(|line| *line != "#" && !line.starts_with("# "))
        .collect();
    shown.join("\n").trim().to_owned()
}

/// The part of an expansion case or snapshot from the handler's doc comment
/// to the end, without `fn main() {}`.
fn handler_part(path: &str) -> String {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let start = text
        .find("/// ")
        .unwrap_or_else(|| panic!("{path} has no doc comment"));
    text[start..]
        .trim_end()
        .trim_end_matches("fn main() {}")
        .trim()
        .to_owned()
}

/// The guide (`writing-handlers.md`) shows the handler of
/// `tests/expand/readme.rs` and what it really expands to, kept so by this
/// test: regenerate the snapshot, then paste it into the chapter when the
/// expansion changes.
#[test]
fn the_readme_shows_the_real_expansion() {
    assert_eq!(
        readme_block("<!-- handler: tests/expand/readme.rs -->"),
        handler_part("expand/readme.rs"),
        "the guide's handler differs from tests/expand/readme.rs"
    );
    assert_eq!(
        readme_block("<!-- expansion: tests/expand/readme.expanded.rs -->"),
        handler_part("expand/readme.expanded.rs"),
        "the guide's expansion differs from tests/expand/readme.expanded.rs; copy the snapshot's handler part into it"
    );
}
