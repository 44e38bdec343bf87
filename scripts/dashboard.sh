#!/usr/bin/env bash
# Draws examples/grafana/idem.svg: the dashboard's panels (examples/grafana/idem.json)
# evaluated over real scrapes of the example pipeline's /metrics while it
# runs a load that rises and falls.
#
#   scripts/dashboard.sh [--rate N] [--out FILE.svg]
#
# Starts a throwaway nats-server and PostgreSQL (or uses NATS_URL and
# DATABASE_URL), the orders and payments services with IDEM_METRICS_ADDR on
# free loopback ports, and pipeline-dashboard record against them.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
# shellcheck source=lib/servers.sh
source scripts/lib/servers.sh

workdir=$(mktemp -d -t idem-dashboard.XXXXXX)
chmod 755 "$workdir"
service_pids=()
cleanup() {
    if [ "${#service_pids[@]}" -gt 0 ]; then kill -TERM "${service_pids[@]}" 2>/dev/null || true; fi
    stop_servers
    rm -rf "$workdir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[ -n "${NATS_URL:-}" ] || start_nats "$workdir/nats"
[ -n "${DATABASE_URL:-}" ] || start_postgres "$workdir/postgres"
export NATS_URL DATABASE_URL

cargo build -q --release -p pipeline-example --bins
bin=${CARGO_TARGET_DIR:-target}/release
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
metrics=()
for service in orders payments; do
    addr=127.0.0.1:$(free_port)
    IDEM_METRICS_ADDR=$addr "$bin/$service" >"$workdir/$service.log" 2>&1 &
    service_pids+=("$!")
    metrics+=(--metrics "$addr")
done
status=0
"$bin/pipeline-dashboard" record "${metrics[@]}" "$@" || status=$?
if [ "$status" != 0 ]; then
    for service in orders payments; do
        log "$service service log:"
        tail -n 20 "$workdir/$service.log" >&2
    done
fi
exit "$status"
