#!/bin/sh
# One node of a Postgres primary + synchronous streaming standby pair, run as Patroni runs
# its nodes (without its consensus store: the peer's own answer stands in for the leader
# key). At every start:
#   - no data yet: PG_FIRST=primary initialises a primary; PG_FIRST=standby waits for the
#     peer to be a primary and copies it (pg_basebackup);
#   - data of a standby: starts as a standby;
#   - data of a primary while the peer is a primary: this node was demoted (fenced, its
#     standby promoted): pg_rewind to the peer's timeline (a fresh pg_basebackup if that
#     fails) and start as its standby;
#   - otherwise: starts as the primary.
# Works with the official postgres:18 image and the CI stand-in (same binaries path).
set -eu
BIN=/usr/lib/postgresql/18/bin
DATA=/var/lib/postgresql/topology
ME=$(hostname)
PEER=${PG_PEER:?}
CONNINFO="host=$PEER port=5432 user=postgres application_name=$ME"
log() { echo "pg-node $ME: $*" >&2; }

peer_is_primary() {
  [ "$("$BIN/psql" -h "$PEER" -U postgres -d postgres -XtAc 'SELECT NOT pg_is_in_recovery()' 2>/dev/null)" = t ]
}

copy_peer() {
  rm -rf "$DATA"
  until peer_is_primary; do log "waiting for $PEER to be a primary"; sleep 1; done
  log "copying $PEER (pg_basebackup)"
  "$BIN/pg_basebackup" -h "$PEER" -U postgres -D "$DATA" -X stream -R -c fast \
    -d "$CONNINFO"
}

if [ ! -s "$DATA/PG_VERSION" ]; then
  if [ "${PG_FIRST:-primary}" = primary ]; then
    log "initdb"
    rm -rf "$DATA"
    "$BIN/initdb" -D "$DATA" -U postgres --auth=trust >/dev/null
    cat >>"$DATA/postgresql.conf" <<CONF
listen_addresses = '*'
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
# WAL kept for pg_rewind of a demoted primary (and a standby that fell behind)
wal_keep_size = 512MB
hot_standby = on
# pg_rewind of a demoted primary
wal_log_hints = on
# Synchronous replication: a commit returns once the standby has it, so that what was
# committed survives promotion. pg-failover empties the list on the promoted node while
# it has no standby (as Patroni's non-strict synchronous mode does); pg-rejoin restores it.
synchronous_commit = on
synchronous_standby_names = '*'
CONF
    printf 'local all all trust\nhost all all all trust\nhost replication all all trust\n' \
      >"$DATA/pg_hba.conf"
  else
    copy_peer
  fi
else
  # Left by a killed postmaster whose PID was 1, as this script's is now: pg_rewind's
  # crash recovery would take it for a running server. Nothing else runs here.
  rm -f "$DATA/postmaster.pid"
fi
if [ ! -f "$DATA/standby.signal" ] && peer_is_primary; then
  log "$PEER is the primary now: rejoining as its standby (pg_rewind)"
  if "$BIN/pg_rewind" -D "$DATA" --source-server="$CONNINFO dbname=postgres" -R; then
    log "rewound"
  else
    log "pg_rewind failed: a fresh copy instead"
    copy_peer
  fi
fi
if [ -f "$DATA/standby.signal" ]; then
  # Whatever a copy or a rewind wrote: follow the peer, under this node's name.
  echo "primary_conninfo = '$CONNINFO'" >>"$DATA/postgresql.auto.conf"
  log "starting as a standby of $PEER"
else
  log "starting as the primary"
fi
exec "$BIN/postgres" -D "$DATA"
