#!/usr/bin/env bash
# Runs the example service (examples/ledger) end to end against real servers.
#
#   scripts/demo.sh [ARGS...]     ARGS go to the ledger-example binary
#
# Uses NATS_URL and DATABASE_URL when they are set; otherwise starts a
# throwaway nats-server (JetStream) and PostgreSQL on 127.0.0.1 with random
# ports, and stops them and deletes their files on exit.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
# shellcheck source=lib/servers.sh
source scripts/lib/servers.sh

workdir=$(mktemp -d -t idem-demo.XXXXXX)
# mktemp makes the dir 0700; as root, PostgreSQL runs as the postgres user
# and must be able to reach its data dir inside.
chmod 755 "$workdir"
cleanup() {
    stop_servers
    rm -rf "$workdir"
}
trap cleanup EXIT
# bash skips the EXIT trap when a signal kills it; turn the signals into a
# normal exit so that the servers are stopped on Ctrl-C and kill too.
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -z "${NATS_URL:-}" ]; then
    start_nats "$workdir/nats"
else
    log "using NATS_URL=$NATS_URL"
fi
if [ -z "${DATABASE_URL:-}" ]; then
    start_postgres "$workdir/postgres"
else
    log "using DATABASE_URL=$DATABASE_URL"
fi
export NATS_URL DATABASE_URL

# Not `exec`: the trap must run after the example exits.
cargo run -q -p ledger-example -- "$@"
