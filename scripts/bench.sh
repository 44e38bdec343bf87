#!/usr/bin/env bash
# Runs the benchmark (bench/, the idem-bench package) in release mode.
#
#   scripts/bench.sh [MODE] [OPTIONS...]    default: compare
#   scripts/bench.sh smoke                  every mode, small N, checks only
#                                           correctness (for CI)
#   scripts/bench.sh --help                 modes and scenarios
#   scripts/bench.sh MODE --help            the options of one of them
#
# The bench itself starts a throwaway nats-server and PostgreSQL on 127.0.0.1
# (random ports, files under TMPDIR on disk, durability settings on) unless
# NATS_URL / DATABASE_URL are set, and stops and removes them on exit. This
# script only installs what is missing and picks the pinned nats-server.
# JSON results go to stdout, one object per run; everything else to stderr.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

# The pinned binary itself, not Debian's older one or a pyenv shim.
NATS_SERVER_BIN=$(find_nats_server) || die "no nats-server v$NATS_SERVER_VERSION; see scripts/setup.sh"
export NATS_SERVER_BIN

if [ "$#" -eq 0 ]; then set -- compare; fi
# cargo run execs the bench, which handles Ctrl-C and SIGTERM itself and
# stops its servers.
exec cargo run --release -q -p idem-bench -- "$@"
