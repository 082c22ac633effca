#!/bin/bash
# The SQL API's write rate without a daemon: expect() and publish_at_commit() calls a
# second (pgbench, 2 clients, one call per transaction, RUNS runs of 10 s each) by a
# login role granted only <schema>_api, on a schema migrated from MIGRATIONS (default:
# this checkout's migrations/, applied by target/release/timeoutd migrate, or $TIMEOUTD).
# Compare two migration sets by running it for each.
#   timeoutd-bench/scripts/sql_api_rate.sh [MIGRATIONS] [LABEL]
set -euo pipefail
MIG=${1:-migrations}
L=${2:-rate}
S=sql_api_rate_$L
PG="psql -qX -v ON_ERROR_STOP=1 -U postgres -h ${PGHOST:-127.0.0.1}"
$PG -c "DROP SCHEMA IF EXISTS $S CASCADE" -c "DROP ROLE IF EXISTS sql_api_rate_pm" 2>/dev/null
$PG -c "CREATE SCHEMA $S"
if [ "$MIG" = migrations ]; then
  # This checkout's: migrated, and the SQL door's rules written, as a deployment does.
  TIMEOUTD__POSTGRES__SCHEMA=$S TIMEOUTD__POSTGRES__URL="postgres://postgres@${PGHOST:-127.0.0.1}:5432/postgres" \
    "${TIMEOUTD:-target/release/timeoutd}" migrate >/dev/null
else
  for f in "$MIG"/*.sql; do
    (echo "SET search_path = $S;"; cat "$f") | $PG >/dev/null 2>&1
  done
fi
$PG -c "CREATE ROLE sql_api_rate_pm LOGIN" -c "GRANT ${S}_api TO sql_api_rate_pm"
dir=$(mktemp -d)
echo "SELECT $S.expect('p' || random(), 'T', 'rk', now() + interval '1 day', 'orders');" > "$dir/expect.sql"
echo "SELECT $S.publish_at_commit('timeoutd.delayed', 'rk', '\x0102030405060708'::bytea, '{\"headers\":{\"a\":\"b\"}}');" > "$dir/outbox.sql"
for t in expect outbox; do
  for _ in $(seq 1 "${RUNS:-3}"); do
    pgbench -n -U sql_api_rate_pm -h "${PGHOST:-127.0.0.1}" -c 2 -j 2 -T 10 -f "$dir/$t.sql" postgres 2>/dev/null \
      | awk -v t="$t" -v l="$L" '/tps =/{printf "%s %s %.0f/s\n", l, t, $3}'
  done
done
$PG -c "DROP SCHEMA $S CASCADE" -c "DROP ROLE sql_api_rate_pm" 2>/dev/null
rm -r "$dir"
