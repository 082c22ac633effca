#!/usr/bin/env bash
# The crowd phase of the benchmark (`timeoutd-bench --only-crowd`: 100 daemons in one
# group, then 20 groups of 3) against the machine's RabbitMQ and a throwaway PostgreSQL
# cluster: Postgres's default max_connections (100) cannot hold 100 daemons, and the
# machine's main cluster is not ours to reconfigure or restart.
#
# Usage (from the repository root, as root on a Debian/Ubuntu machine with
# postgresql-common, PostgreSQL and RabbitMQ on 5672):
#   cargo build --release --bins
#   timeoutd-bench/crowd.sh [timeoutd-bench flags, e.g. --runs 3 --out bench-results/crowd]
#
# It makes a cluster "$PG_VERSION/$CLUSTER" on port $PG_PORT (max_connections
# $MAX_CONNECTIONS, listening on localhost only, trust auth) and a RabbitMQ vhost $VHOST (guest may use
# it), and removes both when it ends, whatever happened; the bench removes its own
# processes, schemas, queues and exchanges. It refuses to start if either exists already
# (never removing what it did not make).
set -euo pipefail

PG_VERSION=${PG_VERSION:-15}
CLUSTER=${CLUSTER:-timeoutd_crowd}
PG_PORT=${PG_PORT:-5446}
MAX_CONNECTIONS=${MAX_CONNECTIONS:-600}
VHOST=${VHOST:-timeoutd-crowd}
BENCH=${BENCH:-${CARGO_TARGET_DIR:-target}/release/timeoutd-bench}

[ -x "$BENCH" ] || { echo "crowd.sh: $BENCH not found: cargo build --release --bins" >&2; exit 2; }
if pg_lsclusters -h | awk '{print $1"/"$2}' | grep -qx "$PG_VERSION/$CLUSTER"; then
  echo "crowd.sh: cluster $PG_VERSION/$CLUSTER exists already; remove it first:" \
    "pg_dropcluster --stop $PG_VERSION $CLUSTER" >&2
  exit 2
fi
if rabbitmqctl -q list_vhosts | grep -qx "$VHOST"; then
  echo "crowd.sh: vhost $VHOST exists already; remove it first:" \
    "rabbitmqctl delete_vhost $VHOST" >&2
  exit 2
fi

made_cluster=
made_vhost=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$made_vhost" ]; then
    rabbitmqctl -q delete_vhost "$VHOST" || echo "crowd.sh: could not delete vhost $VHOST" >&2
  fi
  if [ -n "$made_cluster" ]; then
    pg_dropcluster --stop "$PG_VERSION" "$CLUSTER" ||
      echo "crowd.sh: could not drop cluster $PG_VERSION/$CLUSTER" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

made_cluster=1
pg_createcluster -q -p "$PG_PORT" -o "max_connections=$MAX_CONNECTIONS" "$PG_VERSION" "$CLUSTER" -- --auth-local=trust --auth-host=trust >/dev/null
pg_ctlcluster --skip-systemctl-redirect "$PG_VERSION" "$CLUSTER" start

made_vhost=1
rabbitmqctl -q add_vhost "$VHOST"
rabbitmqctl -q set_permissions -p "$VHOST" guest '.*' '.*' '.*'

# 100 daemons: a pipe each to this bench, sockets for their probes.
ulimit -n 65536 2>/dev/null || true
echo "crowd.sh: PostgreSQL $PG_VERSION/$CLUSTER on $PG_PORT (max_connections $MAX_CONNECTIONS), vhost $VHOST; $(uptime)"
"$BENCH" --only-crowd \
  --pg-url "postgres://postgres@127.0.0.1:$PG_PORT/postgres" \
  --amqp-url "amqp://guest:guest@127.0.0.1:5672/$VHOST" \
  "$@"
