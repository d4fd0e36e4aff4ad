#!/bin/sh
# Starts PostgreSQL on $PGDATA, initialising it first when the volume is empty:
# superuser $POSTGRES_USER (ecoscan) with the password in $POSTGRES_PASSWORD_FILE,
# database $POSTGRES_DB (the user's name), password authentication over TCP and trust
# on the container's own socket (pg_isready, `docker exec ... psql`). Arguments are
# passed to postgres (`-c name=value`).
set -eu
user="${POSTGRES_USER:-ecoscan}"
db="${POSTGRES_DB:-$user}"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile="${POSTGRES_PASSWORD_FILE:-}"
  if [ -z "$pwfile" ] || [ ! -s "$pwfile" ]; then
    echo "ecoscan-postgres: POSTGRES_PASSWORD_FILE must name a non-empty file (a compose secret)" >&2
    exit 1
  fi
  initdb --pgdata="$PGDATA" --username="$user" --pwfile="$pwfile" --encoding=UTF8 \
    --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\";" | postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "ecoscan-postgres: initialised $PGDATA (user $user, database $db)" >&2
fi

exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
