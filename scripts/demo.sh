#!/usr/bin/env bash
# Runs the example services end to end against real servers, and fails if
# any of them applied a message more than once or not at all.
#
#   scripts/demo.sh                    the ledger, then the pipeline
#   scripts/demo.sh ledger [ARGS...]   the ledger (examples/ledger) only
#   scripts/demo.sh pipeline [ARGS...] the pipeline (examples/pipeline) only:
#                                      the orders and payments services, each
#                                      its own process, driven by pipeline-demo
#   scripts/demo.sh --credits N ...    the ledger only, with these ARGS
#   scripts/demo.sh --database sqlite  the ledger only, on a SQLite file
#   scripts/demo.sh --database mariadb the ledger only, on MariaDB
#
# --database sqlite|mariadb|postgres (default postgres), anywhere among the
# ARGS, chooses the database: sqlite runs the ledger on a file in the temp
# dir, mariadb on a MariaDB server of its own, and neither starts
# PostgreSQL. The pipeline needs PostgreSQL: its services use the
# transactional outbox, which idem does not have on SQLite or MariaDB yet.
#
# The other ARGS go to the ledger-example or pipeline-demo binary (--help
# lists them).
#
# Uses NATS_URL and DATABASE_URL when they are set (DATABASE_URL's scheme
# then names the database); otherwise starts a throwaway nats-server
# (JetStream), and PostgreSQL unless --database sqlite, on 127.0.0.1 with
# random ports, and stops them and deletes their files on exit.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=lib/servers.sh
source scripts/lib/servers.sh

demos=(ledger pipeline)
case "${1:-}" in
ledger | pipeline)
    demos=("$1")
    shift
    ;;
-*) demos=(ledger) ;;
esac

# --database is this script's; the binaries get the other ARGS.
database=
args=()
while [ "$#" -gt 0 ]; do
    case "$1" in
    --database)
        [ "$#" -ge 2 ] || die "--database needs a value: sqlite, mariadb or postgres"
        database=$2
        shift 2
        ;;
    --database=*)
        database=${1#--database=}
        shift
        ;;
    *)
        args+=("$1")
        shift
        ;;
    esac
done
case "$database" in
"" | sqlite | mariadb | postgres) ;;
*) die "--database $database: expected sqlite, mariadb or postgres" ;;
esac
if [ -n "${DATABASE_URL:-}" ]; then
    case "$DATABASE_URL" in
    sqlite:*) url_database=sqlite ;;
    mysql:* | mariadb:*) url_database=mariadb ;;
    *) url_database=postgres ;;
    esac
    if [ -n "$database" ] && [ "$database" != "$url_database" ]; then
        die "--database $database, but DATABASE_URL=$DATABASE_URL names a $url_database database; unset DATABASE_URL to run on a throwaway one"
    fi
    database=$url_database
fi
database=${database:-postgres}
if [ "$database" != postgres ] && [[ " ${demos[*]} " == *" pipeline "* ]]; then
    die "the pipeline demo runs on PostgreSQL only: its services use the transactional outbox, which idem does not have on $database yet; for the ledger on $database, run scripts/demo.sh ledger --database $database"
fi

scripts/setup.sh

workdir=$(mktemp -d -t idem-demo.XXXXXX)
# mktemp makes the dir 0700; as root, PostgreSQL runs as the postgres user
# and must be able to reach its data dir inside.
chmod 755 "$workdir"
service_pids=()
cleanup() {
    # The pipeline's services, if the script is stopped while they run.
    if [ "${#service_pids[@]}" -gt 0 ]; then kill -TERM "${service_pids[@]}" 2>/dev/null || true; fi
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
if [ -n "${DATABASE_URL:-}" ]; then
    log "using DATABASE_URL=$DATABASE_URL"
elif [ "$database" = sqlite ]; then
    # workdir is absolute, so the URL has three slashes: an absolute path.
    # The example creates the file.
    DATABASE_URL="sqlite://$workdir/ledger.db"
    log "SQLite on $DATABASE_URL"
elif [ "$database" = mariadb ]; then
    start_mariadb "$workdir/mariadb"
else
    start_postgres "$workdir/postgres"
fi
export NATS_URL DATABASE_URL

# Not `exec`: the trap must run after the examples exit.
run_ledger() {
    cargo run -q -p ledger-example -- "$@"
}

# Starts the two services in the background (logs in $workdir), runs the
# driver against them, then stops them with SIGTERM and checks that they
# exited cleanly.
run_pipeline() {
    cargo build -q -p pipeline-example --bins
    local bin=${CARGO_TARGET_DIR:-target}/debug service pid status=0
    local -A pids=()
    for service in orders payments; do
        "$bin/$service" >"$workdir/$service.log" 2>&1 &
        pids[$service]=$!
        service_pids+=("$!")
    done
    "$bin/pipeline-demo" "$@" | tee "$workdir/demo.out" || status=$?
    for service in orders payments; do
        pid=${pids[$service]}
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait "$pid"; then
            log "the $service service did not exit cleanly; its log:"
            cat "$workdir/$service.log" >&2
            status=1
        fi
    done
    service_pids=()
    # The services log each message's span; show those of the order the
    # driver followed, in the order they started.
    local trace
    trace=$(sed -n 's/.*followed in trace \([0-9a-f]\{32\}\).*/\1/p' "$workdir/demo.out")
    if [ -n "$trace" ]; then
        printf '  its spans, from the services'"'"' logs:\n'
        grep -h "^idem span .* trace=$trace " "$workdir/orders.log" "$workdir/payments.log" |
            sort -k3,3n | sed 's/^idem span [0-9.]* trace=[0-9a-f]* /    /' || true
    fi
    if [ "$status" != 0 ]; then
        for service in orders payments; do
            log "$service service log:"
            tail -n 20 "$workdir/$service.log" >&2
        done
    fi
    return "$status"
}

for demo in "${demos[@]}"; do
    [ "$demo" = "${demos[0]}" ] || printf '\n'
    "run_$demo" "${args[@]}"
done
