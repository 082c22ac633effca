#!/bin/sh
# As the official image's entrypoint does for what the compose files use: a command
# starting with `postgres` runs the server (its data and configuration in Debian's
# places), with the rest of the arguments (e.g. `-c ssl=on`); anything else runs as is.
set -e
if [ "${1:-}" = postgres ]; then
  shift
  exec /usr/lib/postgresql/18/bin/postgres -D /var/lib/postgresql/18/main \
    -c config_file=/etc/postgresql/18/main/postgresql.conf "$@"
fi
exec "$@"
