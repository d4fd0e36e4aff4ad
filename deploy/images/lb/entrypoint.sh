#!/bin/sh
# nginx, reloaded whenever the upstream name's addresses change.
#
# Debian's nginx (1.22) resolves `server ecoscan:8000` in nginx.conf once, when it loads
# its configuration: every replica's address at that moment. (`server ... resolve`, which
# follows a name by itself, is in open-source nginx only from 1.27.3.) So this script asks
# Docker's DNS for the name every RESOLVE_EVERY_S seconds and, when the set of addresses
# has changed (a replica restarted with a new address, `--scale`), reloads nginx: new
# workers use the new set, old ones finish their open streams (bounded by
# worker_shutdown_timeout). SIGQUIT/SIGTERM are passed on to nginx as SIGQUIT (graceful).
set -eu
name="${UPSTREAM_NAME:-ecoscan}"
every="${RESOLVE_EVERY_S:-2}"

addresses() {
  getent ahostsv4 "$name" 2>/dev/null | awk '{ print $1 }' | sort -u | tr '\n' ' '
}

# nginx will not start while the name does not resolve: wait for a first replica.
trap 'exit 0' QUIT TERM INT
current="$(addresses)"
while [ -z "$current" ]; do
  echo "ecoscan-lb: waiting for $name to resolve" >&2
  sleep "$every"
  current="$(addresses)"
done

nginx -g 'daemon off;' "$@" &
nginx_pid=$!
stopping=0
trap 'stopping=1; kill -QUIT "$nginx_pid" 2>/dev/null || true' QUIT TERM INT
echo "ecoscan-lb: upstream $name: $current" >&2

while [ "$stopping" = 0 ] && kill -0 "$nginx_pid" 2>/dev/null; do
  sleep "$every" &
  wait $! || true
  [ "$stopping" = 0 ] || break
  new="$(addresses)"
  if [ -n "$new" ] && [ "$new" != "$current" ]; then
    if nginx -s reload; then
      echo "ecoscan-lb: upstream $name: $new (reloaded)" >&2
      current="$new"
    fi
  fi
done

status=0
wait "$nginx_pid" || status=$?
exit "$status"
