#!/usr/bin/env bash
# Makes the secret files deploy/compose.yaml mounts, in DIR (default: ECOSCAN_SECRETS_DIR,
# else deploy/secrets, which git ignores). An existing file is never overwritten: run it
# again after adding a secret to compose.yaml, or delete a file to make it anew.
#
#   postgres_password       random; set in PostgreSQL when its volume is first initialised
#   database_url            postgresql://ecoscan:<that password>@postgres:5432/ecoscan
#   redis_password          random; Redis's requirepass
#   redis_url               redis://:<that password>@redis:6379/0
#   openai_api_key          $OPENAI_API_KEY if set, else empty: the built-in simulator
#   auth_jwt_secret         random, 64 hex digits: the HS256 key of the bearer tokens
#   grafana_admin_password  random (the grafana profile)
#
# To use a real key later: printf '%s' sk-... > deploy/secrets/openai_api_key, then
# `up -d --force-recreate ecoscan`. The directory is 0700, the files 0644: compose (v1 and
# v2 without swarm) bind-mounts them as they are, and the services read them as non-root
# users of their own.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-${ECOSCAN_SECRETS_DIR:-$here/secrets}}"
install -d -m 0700 "$dir"

random_hex() {
  od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'
}

write() { # name value: only if the file does not exist yet
  local file="$dir/$1"
  if [ -e "$file" ]; then
    echo "make-secrets.sh: $file exists; kept" >&2
    return
  fi
  (umask 022 && printf '%s\n' "$2" >"$file")
  echo "make-secrets.sh: wrote $file" >&2
}

if [ -e "$dir/database_url" ] && [ ! -e "$dir/postgres_password" ]; then
  echo "make-secrets.sh: $dir/database_url exists without postgres_password; remove it or write both" >&2
  exit 1
fi
if [ -e "$dir/redis_url" ] && [ ! -e "$dir/redis_password" ]; then
  echo "make-secrets.sh: $dir/redis_url exists without redis_password; remove it or write both" >&2
  exit 1
fi
write postgres_password "$(random_hex 24)"
write database_url "postgresql://ecoscan:$(head -n1 "$dir/postgres_password")@postgres:5432/ecoscan"
write redis_password "$(random_hex 24)"
write redis_url "redis://:$(head -n1 "$dir/redis_password")@redis:6379/0"
write openai_api_key "${OPENAI_API_KEY:-}"
write auth_jwt_secret "$(random_hex 32)"
write grafana_admin_password "$(random_hex 12)"
