#!/usr/bin/env bash
# The project's test command, as documented in the README and run by CI:
#
#   scripts/test.sh [NEXTEST_ARGS...]   extra args go to `cargo nextest run`
#
# Formatting, lints, all tests (each integration test starts its own
# nats-server and PostgreSQL, so nothing needs to run beforehand), doctests.
# Set NATS_URL and/or DATABASE_URL to test against servers you run yourself;
# the harness reads them (tests that crash a server then refuse to run).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

# The harness starts one nats-server per test; give it the pinned binary
# itself, not Debian's older one or a pyenv shim that may come first on PATH.
NATS_SERVER_BIN=$(find_nats_server) || die "no nats-server v$NATS_SERVER_VERSION; see scripts/setup.sh"
export NATS_SERVER_BIN

# In CI: the committed Cargo.lock must be up to date, and every failure is
# reported instead of only the first (the nextest `ci` profile, and
# --no-fail-fast for the doctests).
locked=()
profile=default
doc_fail_fast=()
if [ -n "${CI:-}" ]; then
    locked=(--locked)
    profile=ci
    # A build from a clean clone gains nothing from incremental state, and
    # rustc 1.95 has hit an incremental-compilation ICE on the macro's
    # compile-test binary after the macro changed (evaluate_obligation).
    export CARGO_INCREMENTAL=0
    doc_fail_fast=(--no-fail-fast)
fi

step() { printf '\n==> %s\n' "$*" >&2; }
if [ -n "${NATS_URL:-}" ]; then log "using NATS_URL=$NATS_URL (not starting nats-server per test)"; fi
if [ -n "${DATABASE_URL:-}" ]; then log "using DATABASE_URL=$DATABASE_URL (a fresh database per test)"; fi

# Cheapest first: a formatting slip fails in seconds, not after a build.
step "cargo fmt --check"
cargo fmt --all -- --check

# The runtime's modules form layers, each importing only those below it: a
# new cycle or an import that reaches up fails here, in a fraction of a second.
step "module layers and cycles"
python3 scripts/check-module-cycles.py idem-runtime/src idem-macros/src

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets "${locked[@]}" -- -D warnings

# The rustdoc is the user's reference (docs.rs shows it): a broken intra-doc
# link or a bad HTML tag in it fails here. --no-deps: only the workspace's
# crates are documented; the dependencies' metadata is the one clippy built.
step "cargo doc (warnings are errors)"
# First the runtime's private items: their docs are the maintainers' map
# (consume/mod.rs walks a message through its steps by intra-doc links), so
# a link a move broke fails here too. Then the public docs, last so that
# they are what target/doc shows.
RUSTDOCFLAGS="-D warnings" cargo doc -p idem-runtime --no-deps --document-private-items "${locked[@]}"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps "${locked[@]}"

# The published crates must publish: every dependency has a version, the
# metadata and the files a crate needs are in it, and crates.io's index
# resolves them (they are packaged together, so idem-runtime finds the
# idem-macros it is packaged with, and idem-test its idem-test-macros). A dry run: nothing is uploaded. It reads
# crates.io's index over HTTP (about 8 s; the build above needed crates.io
# anyway). --no-verify: a verification build of the packages compiles every
# dependency again, under the packaged manifests' profile (minutes on 2
# cores), and the workspace build above already compiled these sources.
# Listed by name: `--workspace` would also take the members marked
# `publish = false`.
step "cargo publish --dry-run (the published crates)"
cargo publish --dry-run --no-verify -p idem-macros -p idem-runtime -p idem-cli \
    -p idem-test-macros -p idem-test --allow-dirty "${locked[@]}"

# nextest and the doctests build with the same (test) profile and features,
# so the second step reuses the first step's dependencies.
#
# The macro's compile tests (trybuild's tests/ui and macrotest's
# tests/expand) run cargo themselves, on target dirs of their own: on a clean
# clone they first compile every dependency again (over 5 minutes on 2
# cores). Run beside the integration tests, that build and those tests slow
# each other down until one of them times out; so they run first, alone, and
# the rest after them. With arguments, one run with exactly those arguments.
compile_tests='binary(handlers) & (test(/^ui::/) | test(/^expand::/))'
if [ $# -eq 0 ]; then
    step "cargo nextest run (profile $profile): the macro's compile tests, alone"
    # Quiet: trybuild's and macrotest's builds print a "Compiling" line per
    # dependency into the test's output (hundreds on a cold target dir),
    # ahead of the mismatch or build error that failed it. Errors still print.
    CARGO_TERM_QUIET=true \
        cargo nextest run --workspace "${locked[@]}" --profile "$profile" -E "$compile_tests"
    step "cargo nextest run (profile $profile): everything else"
    cargo nextest run --workspace "${locked[@]}" --profile "$profile" -E "not ($compile_tests)"
else
    step "cargo nextest run (profile $profile) $*"
    cargo nextest run --workspace "${locked[@]}" --profile "$profile" "$@"
fi

# The benchmark's smoke pass: every mode with a small N, a tenth of it
# published twice (stored twice by JetStream), checking effects = distinct
# messages in the dedup modes, so the bench keeps compiling and a broken
# dedup is noticed. Not timed, and in
# the test profile's build (debug), which reuses the dependencies built above.
step "idem-bench smoke"
cargo run -q -p idem-bench "${locked[@]}" -- smoke
# And on SQLite and MariaDB: each mode must end with one row per message.
step "idem-bench sqlite (small)"
cargo run -q -p idem-bench "${locked[@]}" -- sqlite --messages 500
step "idem-bench mariadb (small)"
cargo run -q -p idem-bench "${locked[@]}" -- mariadb --messages 500

# nextest does not run doctests.
step "cargo test --doc"
cargo test --workspace --doc "${locked[@]}" "${doc_fail_fast[@]}"

step "all checks passed"
