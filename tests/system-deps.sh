#!/usr/bin/env bash
# What the tests need from the system, beyond Python (`make test` runs this first):
#   chromium          tests/test_page.py drives the page through Playwright (never `playwright install`)
#   docker.io, a running dockerd, mmdebstrap, iptables
#                     tests/test_container.py builds the image (on a local base made by
#                     mmdebstrap: Docker Hub may be out of reach) and runs it;
#                     tests/test_compose_up.py brings deploy/compose.yaml up. dockerd needs
#                     iptables, missing where docker.io was unpacked but an apt run failed
#                     before configuring it (installing the three configures what is pending)
#   docker-compose    tests/test_deploy.py: `docker-compose config`; test_compose_up.py: up, down
#   kubectl           tests/test_deploy.py: `kubectl kustomize deploy/k8s` (any kubectl: Debian's
#                     kubernetes-client only where none is installed, as another package's
#                     /usr/bin/kubectl would conflict with it)
#   redis-server      Redis tests start servers of their own (tests/redis_server.py)
#   promtool          tests/test_deploy.py checks the alert rules (Debian's prometheus, without
#                     its recommended node exporter)
#
# As root with apt-get it installs what is missing and starts dockerd when none runs;
# otherwise it names what to install and fails, before any test runs. When everything is
# there it only looks (well under a second, plus `docker info`). `make test SYSTEM_DEPS=skip`
# does not run it.
set -euo pipefail
# dockerd and iptables live in sbin, which is not on a Debian user's PATH
# (SYSTEM_SBIN: the directories looked in, for tests/test_system_deps.py).
PATH="$PATH:${SYSTEM_SBIN-/usr/local/sbin:/usr/sbin:/sbin}"

DOCKERD_LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
DOCKERD_START_S=60  # for a dockerd to answer `docker info` after it starts
APT_LOCK_WAIT_S=600 # for another apt/dpkg run (unattended upgrades...) to let go of the lock

have() { command -v "$1" >/dev/null 2>&1; }

missing=()
have chromium || [ -x /usr/bin/chromium ] || missing+=(chromium)
# docker.io only where no dockerd is (it conflicts with Docker's own docker-ce packages).
have dockerd || missing+=(docker.io)
have mmdebstrap || missing+=(mmdebstrap)
have iptables || missing+=(iptables)
have docker-compose || missing+=(docker-compose)
have kubectl || missing+=(kubernetes-client)
have redis-server || missing+=(redis-server)
need_promtool=0
have promtool || need_promtool=1

can_install=0
if [ "$(id -u)" -eq 0 ] && have apt-get; then
  can_install=1
fi

if [ ${#missing[@]} -gt 0 ] || [ "$need_promtool" -eq 1 ]; then
  if [ "$can_install" -eq 0 ]; then
    echo "The tests need system packages that are missing (Debian names):" >&2
    [ ${#missing[@]} -gt 0 ] && echo "  apt-get install -y ${missing[*]}" >&2
    [ "$need_promtool" -eq 1 ] && echo "  apt-get install -y --no-install-recommends prometheus" >&2
    echo "Install them as root (\`sudo make test\` installs them), or run" >&2
    echo "\`make test SYSTEM_DEPS=skip\` to test without them (see README, Tests)." >&2
    exit 1
  fi
  apt=(apt-get -o "DPkg::Lock::Timeout=$APT_LOCK_WAIT_S" -y -qq)
  echo "installing:${missing[*]:+ ${missing[*]}}$([ "$need_promtool" -eq 1 ] && echo ' prometheus')"
  # Installed services (prometheus on 0.0.0.0:9090, docker) are not started by the install:
  # the tests start what they need themselves. Only where no policy is in force already.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" update
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${missing[@]}"
  fi
  if [ "$need_promtool" -eq 1 ]; then
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install --no-install-recommends prometheus
  fi
fi

# A dockerd that answers; one that runs but does not answer yet is waited for, never doubled.
docker_answers() { timeout 10 docker info >/dev/null 2>&1; }
dockerd_runs() { grep -qsx dockerd /proc/[0-9]*/comm; } # no pgrep on a minimal Debian
if ! docker_answers; then
  if [ "$can_install" -eq 0 ]; then
    if dockerd_runs; then
      echo "dockerd runs but \`docker info\` fails for $(id -un): join the docker group," >&2
    else
      echo "dockerd is not running: start it as root (\`systemctl start docker\` or \`dockerd &\`)," >&2
    fi
    echo "or run \`make test SYSTEM_DEPS=skip\` (the docker tests then skip)." >&2
    exit 1
  fi
  if ! dockerd_runs; then
    echo "starting dockerd (log: $DOCKERD_LOG)"
    # Its own session: it outlives this script and make, for the tests and the next run.
    setsid nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq "$DOCKERD_START_S"); do
    docker_answers && break
    sleep 1
  done
  if ! docker_answers; then
    echo "dockerd does not answer after ${DOCKERD_START_S} s; its log ($DOCKERD_LOG):" >&2
    tail -20 "$DOCKERD_LOG" >&2 || true
    exit 1
  fi
fi
echo "system packages for the tests: present; dockerd answers"
