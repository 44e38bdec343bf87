//! Snapshots of what `#[idempotent]` expands to, as `cargo expand` prints
//! it. Regenerate them with `MACROTEST=overwrite cargo test -p idem-tests --test expand`.

use std::io::Write;
use std::process::Command;

#[test]
fn expand() {
    // `cargo expand` is a separate install (`cargo install cargo-expand --locked`).
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let installed = Command::new(cargo)
        .args(["expand", "--version"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !installed {
        // Straight to stderr: the test harness would swallow `println!`.
        let _ = writeln!(
            std::io::stderr(),
            "expand: skipped, cargo-expand is not installed (`cargo install cargo-expand --locked`)"
        );
        return;
    }
    macrotest::expand("expand/*.rs");
}
