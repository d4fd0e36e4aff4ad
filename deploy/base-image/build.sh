#!/usr/bin/env bash
# Builds a local stand-in for python:3.11-slim from Debian bookworm packages, for
# machines that cannot reach Docker Hub, and prints its tag (the last line of stdout):
#
#   make image BASE_IMAGE="$(deploy/base-image/build.sh)"
#
# mmdebstrap (root, or unprivileged user namespaces) -> `docker import` -> the small
# Dockerfile beside this script, which puts a venv's python/pip first on PATH and
# copies in this machine's CA bundle with PIP_CERT pointing at it (so pip works behind
# a TLS-intercepting proxy). The tag carries a hash of these inputs: an existing image
# is reused (nothing is rebuilt), a change to them builds a new one. FORCE=1 rebuilds.
#
# Environment: CA_BUNDLE (default: PIP_CERT, SSL_CERT_FILE or Debian's bundle),
# SUITE (bookworm), MIRROR (mmdebstrap's default), BASE_REPO (ecoscan-base).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
suite="${SUITE:-bookworm}"
repo="${BASE_REPO:-ecoscan-base}"
packages="python3,python3-venv,ca-certificates,passwd"

ca_bundle="${CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
if [ ! -f "$ca_bundle" ]; then
  echo "build.sh: no CA bundle at $ca_bundle (set CA_BUNDLE)" >&2
  exit 1
fi

inputs_hash="$(
  {
    printf '%s\n' "$suite" "$packages" "${MIRROR:-}"
    cat "$here/build.sh" "$here/Dockerfile" "$ca_bundle"
  } | sha256sum | cut -c1-12
)"
tag="$repo:$suite-$inputs_hash"

# One build of a tag at a time: a second caller (tests/test_container.py and
# tests/test_compose_up.py run in parallel) waits, then reuses what the first built.
exec 9>"${TMPDIR:-/tmp}/ecoscan-base-$inputs_hash.lock"
flock 9

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "build.sh: $tag exists; reusing it" >&2
  echo "$tag"
  exit 0
fi

command -v mmdebstrap >/dev/null 2>&1 || {
  echo "build.sh: needs mmdebstrap (apt-get install -y mmdebstrap)" >&2
  exit 1
}

work="$(mktemp -d "${TMPDIR:-/tmp}/ecoscan-base.XXXXXX")"
trap 'rm -rf "$work"' EXIT

start=$SECONDS
# No documentation, man pages or translations: nothing in the image reads them.
# shellcheck disable=SC2086
mmdebstrap --quiet --variant=apt --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  "$suite" "$work/rootfs.tar" ${MIRROR:-} >&2
echo "build.sh: mmdebstrap took $((SECONDS - start)) s" >&2

rootfs="$repo-rootfs:$suite-$inputs_hash"
docker import "$work/rootfs.tar" "$rootfs" >&2
cp "$ca_bundle" "$work/ca-certificates.crt"
cp "$here/Dockerfile" "$work/Dockerfile"
docker build --quiet --build-arg ROOTFS="$rootfs" -t "$tag" "$work" >&2
# The import is only a stage of the base: keep just the result.
docker image rm "$rootfs" >/dev/null 2>&1 || true
echo "build.sh: built $tag in $((SECONDS - start)) s" >&2
echo "$tag"
