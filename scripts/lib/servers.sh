# Starts and stops throwaway servers for scripts (demo.sh): a nats-server
# with JetStream and a PostgreSQL cluster, each on 127.0.0.1 with a random
# port and its files in a dir of the caller's choosing. The Rust test harness
# (tests/src) does the same for the tests, with the same configuration.
#
# Usage:
#   source scripts/lib/servers.sh
#   trap stop_servers EXIT
#   start_nats "$dir/nats"          # sets and exports NATS_URL
#   start_postgres "$dir/postgres"  # sets and exports DATABASE_URL
#
# stop_servers stops only what these functions started.

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

STARTED_NATS_PIDFILE=
STARTED_PG_DATA=
STARTED_MARIADB_PID=

# How long a server gets to start; generous for a busy CI machine.
SERVER_START_TIMEOUT=60

# start_nats DIR: runs nats-server with its config, store, log and pid file in DIR.
start_nats() {
    local dir=$1 bin port= i
    bin=$(find_nats_server) || die "no nats-server v$NATS_SERVER_VERSION; run scripts/setup.sh"
    mkdir -p "$dir"
    # port -1: the server picks a free port itself, so there is no race with
    # other processes; we read it back from the log. sync_interval: always
    # makes JetStream fsync before it acks, so a crash loses no acked write.
    cat >"$dir/nats-server.conf" <<EOF
host: 127.0.0.1
port: -1
pid_file: "$dir/nats-server.pid"
jetstream {
  store_dir: "$dir/js"
  sync_interval: always
}
EOF
    # setsid: a Ctrl-C at the terminal goes to our process group; the server
    # must not get it, so that the example can shut down cleanly before
    # stop_servers stops the server.
    : >"$dir/nats-server.log"
    setsid "$bin" -c "$dir/nats-server.conf" </dev/null >>"$dir/nats-server.log" 2>&1 &
    STARTED_NATS_PIDFILE=$dir/nats-server.pid
    for ((i = 0; i < SERVER_START_TIMEOUT * 10; i++)); do
        if grep -q "Server is ready" "$dir/nats-server.log"; then
            port=$(sed -n 's/.*Listening for client connections on .*:\([0-9]*\)$/\1/p' "$dir/nats-server.log" | head -n1)
            break
        fi
        sleep 0.1
    done
    if [ -z "$port" ]; then
        tail -n 30 "$dir/nats-server.log" >&2 || true
        die "nats-server did not start (log above: $dir/nats-server.log)"
    fi
    export NATS_URL="nats://127.0.0.1:$port"
    log "nats-server v$NATS_SERVER_VERSION on $NATS_URL (files in $dir)"
}

# Runs a PostgreSQL tool as the user the cluster belongs to: `postgres` when
# we are root (initdb and postgres refuse root), else ourselves. setpriv
# execs in place (unlike su or runuser), so no extra process stays around.
pg_tool() {
    local tool=$1
    shift
    if [ "$(id -u)" = 0 ]; then
        setpriv --reuid=postgres --regid=postgres --init-groups "$PG_BINDIR/$tool" "$@"
    else
        "$PG_BINDIR/$tool" "$@"
    fi
}

# start_postgres DIR: initdb's a cluster in DIR/data and starts it, with the
# unix socket and log in DIR.
start_postgres() {
    local dir=$1 port attempt
    [ -x "$PG_BINDIR/initdb" ] || die "no PostgreSQL in $PG_BINDIR; run scripts/setup.sh"
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; fi
    # Trust auth is fine: loopback only, throwaway data. Durability settings
    # keep their defaults (fsync on).
    pg_tool initdb -D "$dir/data" --username=postgres --auth=trust \
        --encoding=UTF8 --locale=C --no-instructions >"$dir/initdb.log" 2>&1 ||
        {
            cat "$dir/initdb.log" >&2
            die "initdb failed"
        }
    STARTED_PG_DATA=$dir/data
    # PostgreSQL cannot pick its own port, so we draw one below the
    # ephemeral range (32768+, where outgoing connections get theirs) and
    # retry if someone else binds it first.
    for attempt in 1 2 3 4 5 6 7 8 9 10; do
        port=$((15000 + RANDOM % 17000))
        # Something already listens there: draw again.
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then continue; fi
        # pg_ctl puts the server in its own session, so a Ctrl-C at the
        # terminal does not reach it; -w waits until it accepts connections.
        if pg_tool pg_ctl start -w -t "$SERVER_START_TIMEOUT" -D "$dir/data" -l "$dir/postgres.log" \
            -o "-p $port -h 127.0.0.1 -k $dir -c max_connections=200" >/dev/null; then
            export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
            log "PostgreSQL $PG_MAJOR on $DATABASE_URL (files in $dir)"
            return 0
        fi
        grep -q "Address already in use" "$dir/postgres.log" 2>/dev/null || break
        log "port $port was taken; trying another (attempt $attempt)"
    done
    tail -n 30 "$dir/postgres.log" >&2 || true
    die "PostgreSQL did not start (log above: $dir/postgres.log)"
}

# start_mariadb DIR: runs a MariaDB server with its data dir, socket and log
# in DIR, reached through the socket only (no TCP port), with an empty
# database `ledger`; sets and exports DATABASE_URL. Durability settings keep
# their defaults (innodb_flush_log_at_trx_commit = 1).
start_mariadb() {
    local dir=$1 i user=()
    [ -x /usr/sbin/mariadbd ] || die "no MariaDB server (/usr/sbin/mariadbd); run scripts/setup.sh"
    mkdir -p "$dir/tmp"
    if [ "$(id -u)" = 0 ]; then user=(--user=root); fi
    mariadb-install-db --no-defaults --datadir="$dir/data" --tmpdir="$dir/tmp" "${user[@]}" \
        --auth-root-authentication-method=normal --skip-test-db >"$dir/install.log" 2>&1 ||
        {
            cat "$dir/install.log" >&2
            die "mariadb-install-db failed"
        }
    setsid /usr/sbin/mariadbd --no-defaults --datadir="$dir/data" --tmpdir="$dir/tmp" "${user[@]}" \
        --socket="$dir/mariadbd.sock" --pid-file="$dir/mariadbd.pid" --skip-networking \
        </dev/null >>"$dir/mariadb.log" 2>&1 &
    # Its pid at once, so that stop_servers finds it even if start-up is
    # interrupted before the server writes its pid file.
    STARTED_MARIADB_PID=$!
    # Not this shell's job: stop_servers SIGKILLs it, which bash would report.
    disown
    for ((i = 0; i < SERVER_START_TIMEOUT * 10; i++)); do
        kill -0 "$STARTED_MARIADB_PID" 2>/dev/null || break
        if mariadb --no-defaults -S "$dir/mariadbd.sock" -uroot -e "CREATE DATABASE IF NOT EXISTS ledger" 2>/dev/null; then
            export DATABASE_URL="mysql://root@localhost/ledger?socket=$dir/mariadbd.sock"
            log "MariaDB on $DATABASE_URL (files in $dir)"
            return 0
        fi
        sleep 0.1
    done
    tail -n 30 "$dir/mariadb.log" >&2 || true
    die "MariaDB did not start (log above: $dir/mariadb.log)"
}

# Stops whatever start_nats, start_postgres and start_mariadb started. Safe to call more than
# once, and from an EXIT trap after a failure halfway through.
stop_servers() {
    local pid i
    if [ -n "$STARTED_NATS_PIDFILE" ] && [ -f "$STARTED_NATS_PIDFILE" ]; then
        pid=$(cat "$STARTED_NATS_PIDFILE")
        # SIGTERM: a clean shutdown that flushes JetStream state.
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    STARTED_NATS_PIDFILE=
    if [ -n "$STARTED_PG_DATA" ] && [ -f "$STARTED_PG_DATA/postmaster.pid" ]; then
        # fast: roll back open transactions and shut down cleanly.
        pg_tool pg_ctl stop -w -m fast -D "$STARTED_PG_DATA" >/dev/null 2>&1 ||
            pg_tool pg_ctl stop -w -m immediate -D "$STARTED_PG_DATA" >/dev/null 2>&1 || true
    fi
    STARTED_PG_DATA=
    if [ -n "$STARTED_MARIADB_PID" ]; then
        # The data is thrown away: no clean shutdown needed.
        kill -KILL "$STARTED_MARIADB_PID" 2>/dev/null || true
    fi
    STARTED_MARIADB_PID=
}
