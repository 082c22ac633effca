#!/bin/sh
# PgBouncer in front of whichever of PG_HOSTS is the primary (as a failover hook or a
# virtual IP would point it): the configuration is written for the primary found at
# start, and rewritten and reloaded when another host becomes the primary.
#
# Transaction mode (docs/operating/pgbouncer.md): the daemons' pool comes through here,
# their sessions (LISTEN, migrations) go to the primary itself (postgres.session_url).
# Prepared statements are tracked (max_prepared_statements); the daemons send no session
# settings through a pooler, and the server must bound the sessions: the database entry
# sets the bounds on every server connection (connect_query).
set -eu
HOSTS=${PG_HOSTS:?}
DIR=/tmp/pgbouncer
mkdir -p "$DIR"

primary() {
  for h in $HOSTS; do
    if [ "$(psql -h "$h" -U postgres -d postgres -XtAc 'SELECT NOT pg_is_in_recovery()' 2>/dev/null)" = t ]; then
      echo "$h"
      return
    fi
  done
}

write_ini() {
  cat >"$DIR/pgbouncer.ini" <<INI
[databases]
postgres = host=$1 port=5432 dbname=postgres connect_query='SET statement_timeout = 10000; SET lock_timeout = 1000; SET idle_in_transaction_session_timeout = 10000'

[pgbouncer]
listen_addr = 0.0.0.0
listen_port = 6432
unix_socket_dir = $DIR
auth_type = trust
auth_file = $DIR/users.txt
pool_mode = transaction
max_prepared_statements = 200
ignore_startup_parameters = extra_float_digits
max_client_conn = 200
default_pool_size = 40
server_login_retry = 1
server_connect_timeout = 5
# Logs go to stderr; not every connection (the healthcheck connects every 2 s).
log_connections = 0
log_disconnections = 0
pidfile = $DIR/pgbouncer.pid
INI
}

echo '"postgres" ""' >"$DIR/users.txt"
current=""
until [ -n "$current" ]; do current=$(primary); sleep 1; done
write_ini "$current"
echo "pgbouncer.sh: $(pgbouncer --version | head -1), in front of $current" >&2
pgbouncer "$DIR/pgbouncer.ini" &
pid=$!
trap 'kill -TERM $pid; wait $pid; exit 0' TERM INT
while kill -0 "$pid" 2>/dev/null; do
  sleep 1 &
  wait $! || true
  now=$(primary)
  if [ -n "$now" ] && [ "$now" != "$current" ]; then
    echo "pgbouncer.sh: the primary is $now now (was $current): reloading" >&2
    current=$now
    write_ini "$current"
    kill -HUP "$pid"
  fi
done
wait "$pid"
