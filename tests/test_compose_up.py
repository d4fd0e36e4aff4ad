"""deploy/compose.yaml brought up for real, on images built here from Debian packages
(Phoenix's from PyPI; no image registry), under a project name of its own, and taken
down with its volumes after.

1. The stack comes up: three replicas behind the balancer, PostgreSQL, Redis, Prometheus
   and Phoenix (the trace backend), every one healthy; no secret is in any container's
   environment.
   Every line of the replicas' env file is in each replica's environment.
2. Scans through the balancer complete and are spread over the replicas; Prometheus
   scrapes all three (its targets, and `up`) and has loaded the alerting rules.
   Phoenix takes an OTLP/HTTP export from this process (on its published port) and from
   a replica (to the replica's own OTEL_EXPORTER_OTLP_ENDPOINT), and lists both spans
   through its API; Prometheus runs with exemplar storage, and keeps the exemplars of
   ecoscan_scan_duration_seconds whose trace Phoenix has, when the replicas attach any.
3. A replica is SIGKILLed while it streams a scan's answer, and the client reads on
   through the balancer from another replica with `Last-Event-ID`: the other replica
   follows the scan's Redis Stream, so the client gets every event the owner had mirrored
   before it died, identical to what the owner sent; once the owner's lease has lapsed and
   it holds no database connection, a live replica takes the scan over
   (app/scans/liveness.py) and the client's stream goes on to one `done`, its seq
   unbroken, the row `completed` under the new owner's instance. The killed replica is
   restarted by its restart policy; the balancer and Prometheus follow it to its new
   address.
4. The kit's edge: the replicas believe bearer tokens (AUTH_MODE=jwt), so a client's
   X-User-ID claims nobody; /readyz and /metrics are not routed; an anonymous scan's
   `?token=` is read through the balancer and never written to its access log.
5. A POST reaches a second replica only when it never reached the first (a connection
   refused), never after it was sent (a connection cut before the answer): two decoys
   under the service's DNS name stand in for the broken replicas.
6. A replica stopped for good (`docker kill`: Docker treats it as a manual stop and does
   not restart it) leaves DNS, and Prometheus' EcoscanReplicasMissing turns pending.
7. With no replica left, the balancer answers a scan with the API's JSON error and a
   Retry-After, not nginx's HTML.

Takeover (like the sweep) waits for the dead instance to hold no PostgreSQL session, so
it could come between the kill and the resume: the test holds it off by keeping one
session under the dead instance's name until it has read what was mirrored, then lets
it go.

The base image comes from deploy/base-image/build.sh (cached by tag), the others from
`docker-compose build` on it (docker's layer cache: unchanged, a rebuild takes seconds).
COMPOSE_TEST_BASE_IMAGE names another base. Without docker, docker-compose or mmdebstrap
the tests skip, except under CI, where .ci/run installs them, so they fail instead.
Deselect them with `-m "not compose"`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest

from . import trace_backend
from .conftest import SCAN_URL, Event, data_url, make_jpeg
from .service_process import free_port

# One worker runs the module (under `pytest -n`): the stack is the module's, one project.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(1200), pytest.mark.xdist_group("compose")]

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
PROJECT = "ecoscan-compose-test"
REPLICAS = 3
IMAGE_TAG = "compose-test"
SERVICES = ("ecoscan", "lb", "postgres", "redis", "prometheus", "phoenix")
BUILD_TIMEOUT_S = 900.0
UP_TIMEOUT_S = 300.0
HEALTHY_TIMEOUT_S = 180.0
DOWN_TIMEOUT_S = 180.0
# Candidates for the test network's /24, next to compose.yaml's default (10.73.250.0/24),
# so that a stack of yours on the default does not collide with the test's.
SUBNETS = [ipaddress.IPv4Network(f"10.73.{n}.0/24") for n in range(240, 250)]
# The test's settings, on top of a copy of deploy/ecoscan.env. The simulator's answer
# streams for ~13 s (a scan takes ~16 s): the replica is killed a few seconds into it, with
# room to spare on a loaded machine. Pings every 2 s: a follower whose scan was swept
# notices it within one.
TEST_SETTINGS = {
    "SIM_LATENCY_SIGMA": "0",
    "SIM_VISION_MEDIAN_S": "1",
    "SIM_TEXT_MEDIAN_S": "15",
    "SSE_PING_S": "2",
}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: .ci/run installs docker.io, docker-compose and mmdebstrap)")
    pytest.skip(reason)


def _run(
    args: list[str], *, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _checked(args: list[str], *, timeout: float = 120.0, env: dict[str, str] | None = None) -> str:
    result = _run(args, timeout=timeout, env=env)
    command = " ".join(args)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _compose_command() -> list[str]:
    """The docker compose v2 plugin if present, else Debian's docker-compose (v1)."""
    if _run(["docker", "compose", "version"], timeout=30).returncode == 0:
        return ["docker", "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is None:
        _unavailable("neither `docker compose` nor docker-compose")
    assert legacy is not None
    return [legacy]


def _base_image() -> str:
    base = os.environ.get("COMPOSE_TEST_BASE_IMAGE")
    if base:
        return base
    if shutil.which("mmdebstrap") is None:
        _unavailable("no mmdebstrap to build the local base image (or set COMPOSE_TEST_BASE_IMAGE)")
    out = _checked([str(DEPLOY / "base-image" / "build.sh")], timeout=BUILD_TIMEOUT_S)
    return out.strip().splitlines()[-1]


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Docker's networks and this machine's routes: what the test's subnet must avoid."""
    taken = []
    ids = _checked(["docker", "network", "ls", "-q"]).split()
    if ids:
        out = _checked(
            ["docker", "network", "inspect", "-f", "{{range .IPAM.Config}}{{.Subnet}} {{end}}", *ids]
        )
        taken += out.split()
    if shutil.which("ip"):
        taken += [line.split()[0] for line in _run(["ip", "-4", "route"]).stdout.splitlines() if "/" in line]
    networks = []
    for text in taken:
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        if isinstance(network, ipaddress.IPv4Network):
            networks.append(network)
    return networks


def _free_subnet() -> ipaddress.IPv4Network:
    taken = _networks_in_use()
    for subnet in SUBNETS:
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    pytest.fail(f"no free /24 among {SUBNETS[0]}..{SUBNETS[-1]} for the test network")


@dataclass
class Stack:
    compose: list[str]
    env: dict[str, str]
    url: str
    prometheus_url: str
    phoenix_url: str
    secrets: Path
    base_image: str
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 120.0) -> str:
        return _checked([*self.compose, *args], timeout=timeout, env=self.env)

    def containers(self, service: str) -> list[str]:
        """The service's containers, by compose's labels (docker's CLI starts faster than
        docker-compose v1's), in the order of their number."""
        labels = [
            f"label=com.docker.compose.project={PROJECT}",
            f"label=com.docker.compose.service={service}",
        ]
        out = _checked(
            ["docker", "ps", "-a", "--format", '{{.ID}} {{.Label "com.docker.compose.container-number"}}']
            + [arg for label in labels for arg in ("--filter", label)]
        )
        rows = [line.split() for line in out.splitlines()]
        return [row[0] for row in sorted(rows, key=lambda row: int(row[1]))]

    def container(self, service: str) -> str:
        (only,) = self.containers(service)
        return only

    def inspect(self, container: str, template: str) -> str:
        return _checked(["docker", "inspect", "-f", template, container]).strip()

    def address(self, container: str) -> str:
        return self.inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")

    def psql(self, sql: str) -> str:
        """One statement through the database container's own socket (trusted there)."""
        return _checked(
            [
                "docker",
                "exec",
                self.container("postgres"),
                "psql",
                "-U",
                "ecoscan",
                "-d",
                "ecoscan",
                "-tAc",
                sql,
            ]
        ).strip()

    def redis(self, *command: str) -> str:
        """redis-cli in the Redis container, with the password it reads from its secret."""
        script = 'REDISCLI_AUTH="$(cat /run/secrets/redis_password)" exec redis-cli "$@"'
        return _checked(["docker", "exec", self.container("redis"), "sh", "-c", script, "sh", *command])

    def auth(self, user: str) -> dict[str, str]:
        """A bearer token for `user`, signed with the stack's HS256 secret: the only way
        a client names itself to the replicas (AUTH_MODE=jwt)."""
        secret = (self.secrets / "auth_jwt_secret").read_text().strip()
        token = jwt.encode({"sub": user, "exp": int(time.time()) + 3600}, secret, algorithm="HS256")
        return {"Authorization": f"Bearer {token}"}

    def logs(self, tail: int = 60) -> str:
        result = _run([*self.compose, "logs", "--no-color", f"--tail={tail}"], timeout=60, env=self.env)
        return result.stdout + result.stderr

    def healths(self) -> dict[str, str]:
        """`service[i]` -> each container's health, in one `docker inspect`."""
        ids = {service: self.containers(service) for service in SERVICES}
        template = "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}"
        every = [c for service in SERVICES for c in ids[service]]
        states = _checked(["docker", "inspect", "-f", template, *every]).split() if every else []
        names = [f"{service}[{i}]" for service in SERVICES for i in range(len(ids[service]))]
        return dict(zip(names, states, strict=True))

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> dict[str, str]:
        """Every container of every service healthy (replicas: all REPLICAS of them)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.healths()
            replicas = sum(1 for name in states if name.startswith("ecoscan["))
            if replicas == REPLICAS and all(state == "healthy" for state in states.values()):
                return states
            time.sleep(2)
        raise AssertionError(f"not all healthy within {timeout:.0f} s: {states}\n{self.logs()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    if shutil.which("docker") is None:
        _unavailable("no docker CLI")
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if info.returncode != 0:
        _unavailable(f"docker daemon not reachable: {info.stderr.strip()}")
    compose = _compose_command()
    started = time.monotonic()
    base = _base_image()
    base_s = time.monotonic() - started

    work = tmp_path_factory.mktemp("compose")
    secrets = work / "secrets"
    _checked([str(DEPLOY / "make-secrets.sh"), str(secrets)], env={"PATH": os.environ["PATH"]})
    settings = work / "ecoscan.env"
    settings.write_text(
        (DEPLOY / "ecoscan.env").read_text()
        + "\n# tests/test_compose_up.py\n"
        + "".join(f"{name}={value}\n" for name, value in TEST_SETTINGS.items())
    )
    no_dotenv = work / "compose.env"  # instead of deploy/.env, which may be yours
    no_dotenv.write_text("")
    subnet = _free_subnet()
    hosts = list(subnet.hosts())
    port, prometheus_port, phoenix_port = free_port(), free_port(), free_port()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(work)),
        **{k: v for k, v in os.environ.items() if k.startswith("DOCKER_")},
        "BASE_IMAGE": base,
        "ECOSCAN_IMAGE": f"ecoscan:{IMAGE_TAG}",
        "ECOSCAN_IMAGE_TAG": IMAGE_TAG,
        "ECOSCAN_SECRETS_DIR": str(secrets),
        "ECOSCAN_ENV_FILE": str(settings),
        "ECOSCAN_PORT": f"127.0.0.1:{port}",
        "PROMETHEUS_PORT": str(prometheus_port),
        "PHOENIX_PORT": str(phoenix_port),
        "ECOSCAN_SUBNET": str(subnet),
        "ECOSCAN_DYNAMIC_RANGE": str(ipaddress.ip_network(f"{hosts[127]}/25", strict=False)),
        "ECOSCAN_LB_IP": str(hosts[9]),
    }
    command = [*compose, "--env-file", str(no_dotenv), "-p", PROJECT, "-f", str(DEPLOY / "compose.yaml")]
    running = Stack(
        command,
        env,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{prometheus_port}",
        f"http://127.0.0.1:{phoenix_port}",
        secrets,
        base,
    )
    running.timings["base image"] = base_s
    failed_before = request.session.testsfailed
    # Whatever a run that was itself killed left behind.
    _run([*command, "down", "--volumes", "--remove-orphans"], timeout=DOWN_TIMEOUT_S, env=env)
    try:
        started = time.monotonic()
        running.run("build", timeout=BUILD_TIMEOUT_S)
        running.timings["compose build"] = time.monotonic() - started
        started = time.monotonic()
        running.run("up", "--detach", "--no-build", timeout=UP_TIMEOUT_S)
        running.wait_healthy()
        running.timings["up -> all healthy"] = time.monotonic() - started
        yield running
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n[compose] logs (tail):\n{running.logs()}")
        started = time.monotonic()
        _run([*command, "down", "--volumes", "--remove-orphans"], timeout=DOWN_TIMEOUT_S, env=env)
        print(f"\n[compose] down -v took {time.monotonic() - started:.1f} s")


def test_the_stack_comes_up_from_images_built_here(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    states = stack.wait_healthy()
    assert sorted(states) == sorted(
        [f"ecoscan[{i}]" for i in range(REPLICAS)] + [f"{s}[0]" for s in SERVICES if s != "ecoscan"]
    )
    images = {
        service: stack.inspect(stack.containers(service)[0], "{{.Config.Image}}") for service in SERVICES
    }
    assert images["ecoscan"] == f"ecoscan:{IMAGE_TAG}"
    for service in SERVICES[1:]:
        assert images[service] == f"ecoscan-{service}:{IMAGE_TAG}", images
    sizes = {
        image: int(_checked(["docker", "image", "inspect", "-f", "{{.Size}}", image]).strip())
        for image in [stack.base_image, *images.values()]
    }

    # Secrets are files under /run/secrets, never values in a container's environment.
    secret_values = {p.read_text().strip() for p in stack.secrets.iterdir()} - {""}
    for service in SERVICES:
        for container in stack.containers(service):
            env = json.loads(stack.inspect(container, "{{json .Config.Env}}"))
            leaked = [v for v in env if v.split("=", 1)[1] in secret_values]
            assert not leaked, f"{service}: a secret in its environment"
            command = stack.inspect(container, "{{json .Config.Cmd}} {{json .Args}}")
            assert not [v for v in secret_values if v in command], f"{service}: a secret in its command"
    # Redis wants the password (the replicas' redis_url has it) and keeps protected mode.
    anonymous = _run(["docker", "exec", stack.container("redis"), "redis-cli", "ping"])
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr, anonymous
    assert stack.redis("CONFIG", "GET", "protected-mode").split() == ["protected-mode", "yes"]
    # Every setting of the env file reaches every replica (the test's file: a copy of
    # deploy/ecoscan.env plus TEST_SETTINGS), and the stack's wiring on top.
    lines = Path(stack.env["ECOSCAN_ENV_FILE"]).read_text().splitlines()
    settings = {line for line in lines if line and not line.startswith("#")}
    assert len(settings) > len(TEST_SETTINGS) + 5, settings
    for container in stack.containers("ecoscan"):
        env = set(json.loads(stack.inspect(container, "{{json .Config.Env}}")))
        assert settings <= env, sorted(settings - env)
        assert f"FORWARDED_ALLOW_IPS={stack.env['ECOSCAN_LB_IP']}" in env
    replica = stack.containers("ecoscan")[0]
    mounted = _checked(["docker", "exec", replica, "ls", "/run/secrets"]).split()
    assert {"database_url", "redis_url", "openai_api_key", "auth_jwt_secret"} <= set(mounted)
    # Every replica has its memory limit (deploy.resources), and the balancer its address.
    for container in stack.containers("ecoscan"):
        assert stack.inspect(container, "{{.HostConfig.Memory}}") == str(1024**3)
    assert stack.address(stack.container("lb")) == stack.env["ECOSCAN_LB_IP"]

    with capsys.disabled():
        timings = ", ".join(f"{name} {s:.1f} s" for name, s in stack.timings.items())
        print(f"\n[compose] {timings}")
        print(
            "[compose] images: " + ", ".join(f"{image} {size / 1e6:.0f} MB" for image, size in sizes.items())
        )


async def test_scans_through_the_balancer_spread_and_prometheus_scrapes_every_replica(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(90, connect=10)) as client:
        outcomes = await asyncio.gather(
            *(_scan(client, 100 + i, stack.auth(f"compose-user-{i}")) for i in range(2 * REPLICAS))
        )
    for outcome in outcomes:
        _assert_done(outcome)
    ids = ", ".join(f"'{o.scan_id}'" for o in outcomes)
    served = stack.psql(
        f"SELECT instance_id, count(*) FROM scans WHERE id IN ({ids}) GROUP BY 1"
    ).splitlines()
    assert len(served) >= 2, f"least_conn sent {len(outcomes)} concurrent scans to one replica: {served}"

    # Prometheus: every replica a target (found by DNS), every one up.
    replicas = {f"{stack.address(c)}:8000" for c in stack.containers("ecoscan")}
    targets = await _eventually_targets(stack, replicas)
    up = await _prometheus_query(stack, 'up{job="ecoscan"}')
    assert sorted(series["value"][1] for series in up) == ["1"] * REPLICAS, up
    # ...and has loaded the alerting rules compose mounts beside its configuration.
    async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as prometheus:
        rules = (await prometheus.get("/api/v1/rules", params={"type": "alert"})).json()["data"]["groups"]
    assert sum(len(group["rules"]) for group in rules) > 0, rules
    with capsys.disabled():
        print(f"\n[compose] {len(outcomes)} scans over {len(served)} replicas; Prometheus targets: {targets}")


async def _prometheus_query(stack: Stack, query: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as client:
        response = await client.get("/api/v1/query", params={"query": query})
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


async def _eventually(
    fetch: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], what: str, within_s: float = 60.0
) -> Any:
    deadline = time.monotonic() + within_s
    value: Any = None
    while time.monotonic() < deadline:
        value = await fetch()
        if done(value):
            return value
        await asyncio.sleep(1)
    raise AssertionError(f"{what}: not within {within_s:.0f} s; last: {value}")


async def _eventually_targets(stack: Stack, replicas: set[str]) -> dict[str, str]:
    """Prometheus's ecoscan targets, once they are exactly `replicas`, all scraped up."""

    async def fetch() -> dict[str, str]:
        async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as client:
            response = await client.get("/api/v1/targets", params={"state": "active"})
        response.raise_for_status()
        return {
            t["labels"]["instance"]: t["health"]
            for t in response.json()["data"]["activeTargets"]
            if t["labels"]["job"] == "ecoscan"
        }

    targets: dict[str, str] = await _eventually(
        fetch,
        lambda found: found == dict.fromkeys(replicas, "up"),
        f"Prometheus scraping {sorted(replicas)}",
        within_s=90,
    )
    return targets


# Run by a replica's own Python: an OTLP/HTTP export (the body on standard input) to the
# endpoint its environment names, as its exporter sends.
POST_FROM_REPLICA = (
    "import os, sys, urllib.request\n"
    "url = os.environ['OTEL_EXPORTER_OTLP_ENDPOINT'].rstrip('/') + '/v1/traces'\n"
    "body = sys.stdin.buffer.read()\n"
    "request = urllib.request.Request(url, body, {'Content-Type': 'application/x-protobuf'})\n"
    "print(urllib.request.urlopen(request, timeout=10).status)\n"
)
# A replica's /metrics as Prometheus asks for it: OpenMetrics, the format with exemplars.
OPENMETRICS_FROM_REPLICA = (
    "import urllib.request\n"
    "accept = {'Accept': 'application/openmetrics-text; version=1.0.0'}\n"
    "request = urllib.request.Request('http://127.0.0.1:8000/metrics', headers=accept)\n"
    "print(urllib.request.urlopen(request, timeout=10).read().decode())\n"
)
EXEMPLAR = re.compile(r'^ecoscan_scan_duration_seconds_bucket\{.*\} \S+ # \{trace_id="([0-9a-f]{32})"', re.M)


async def _exemplar_trace_ids(stack: Stack) -> set[str]:
    """The trace_ids of the exemplars Prometheus keeps for the scan-duration histogram."""
    now = time.time()
    params: dict[str, str | float] = {
        "query": "ecoscan_scan_duration_seconds_bucket",
        "start": now - 3600,
        "end": now,
    }
    async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as client:
        response = await client.get("/api/v1/query_exemplars", params=params)
    response.raise_for_status()
    return {e["labels"]["trace_id"] for series in response.json()["data"] for e in series["exemplars"]}


async def test_phoenix_takes_the_replicas_traces_and_prometheus_keeps_exemplars(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the scans above. The trace backend's image takes OTLP/HTTP protobuf, from this
    process on its published port and from a replica at the endpoint the replica's
    settings name, and its API lists both spans. Prometheus runs with exemplar storage;
    the replicas attach exemplars to the scan-duration histogram, Prometheus has them
    and Phoenix has their traces: Grafana's link."""
    span, trace_id = trace_backend.make_span("compose-test.export")
    await asyncio.to_thread(trace_backend.export, stack.phoenix_url, span)
    (found,) = await asyncio.to_thread(trace_backend.find_spans, stack.phoenix_url, trace_id)
    assert found["name"] == "compose-test.export" and found["trace_id"] == trace_id

    replica = stack.containers("ecoscan")[0]
    sent, sent_trace = trace_backend.make_span("compose-test.from-replica")
    posted = await asyncio.to_thread(
        subprocess.run,
        ["docker", "exec", "-i", replica, "python", "-c", POST_FROM_REPLICA],
        input=trace_backend.encoded(sent),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert posted.returncode == 0 and posted.stdout.strip() == b"200", posted
    await asyncio.to_thread(trace_backend.find_spans, stack.phoenix_url, sent_trace)

    async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as prometheus:
        flags = (await prometheus.get("/api/v1/status/flags")).json()["data"]
    assert "exemplar-storage" in flags["enable-feature"].split(","), flags

    # The replicas trace every scan (deploy/ecoscan.env), so the scans above left exemplars.
    attached: set[str] = set()
    for container in stack.containers("ecoscan"):
        exposition = _checked(["docker", "exec", container, "python", "-c", OPENMETRICS_FROM_REPLICA])
        attached |= set(EXEMPLAR.findall(exposition))
    assert attached, "no replica attached an exemplar to the scan-duration histogram"
    kept = await _eventually(
        lambda: _exemplar_trace_ids(stack), lambda ids: attached & ids, "exemplars in Prometheus", 60
    )
    linked_trace = sorted(attached & kept)[0]
    spans = await asyncio.to_thread(trace_backend.find_spans, stack.phoenix_url, linked_trace)
    linked = f"exemplar trace {linked_trace}: {len(spans)} spans in Phoenix"
    with capsys.disabled():
        print(f"\n[compose] Phoenix: spans {trace_id} (this process), {sent_trace} (a replica); {linked}")


@dataclass
class Reading:
    """An SSE response as read: its events, its pings (comment lines), how it ended."""

    events: list[Event] = field(default_factory=list)
    pings: int = 0
    scan_id: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def seqs(self) -> list[int]:
        return [int(e.id) for e in self.events]

    def terminals(self) -> list[Event]:
        return [e for e in self.events if e.event in ("done", "error")]


async def _scan(client: httpx.AsyncClient, seed: int, headers: dict[str, str]) -> Reading:
    """A whole scan through the balancer (its SSE pings are comment lines, read as such)."""
    body = {"image_url": data_url(make_jpeg(seed)), "user_input": "어떻게 버리나요?"}
    reading = Reading()
    async with client.stream("POST", SCAN_URL, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        reading.scan_id = response.headers["x-scan-id"]
        await _read(response, reading)
    return reading


def _assert_done(reading: Reading) -> None:
    assert reading.terminals() == reading.events[-1:], [e.event for e in reading.events]
    done = reading.events[-1]
    assert done.event == "done", done.data
    assert done.data["classification"]["major"] and done.data["answer"], done.data
    assert reading.seqs() == list(range(1, len(reading.events) + 1))


async def _read(response: httpx.Response, reading: Reading) -> None:
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            reading.pings += 1
        elif line:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        elif "data" in fields:
            reading.events.append(
                Event(fields.get("event", "message"), fields["id"], json.loads(fields["data"]))
            )
            fields = {}
        reading.changed.set()


async def _until(reading: Reading, condition: Callable[[], bool], what: str, within_s: float) -> None:
    try:
        async with asyncio.timeout(within_s):
            while not condition():
                reading.changed.clear()
                await reading.changed.wait()
    except TimeoutError:
        raise AssertionError(f"{what}: not within {within_s:.0f} s; events {reading.seqs()}") from None


async def test_a_scan_whose_replica_is_sigkilled_is_read_on_through_another(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    headers = stack.auth("compose-kill")
    body = {"image_url": data_url(make_jpeg(4242)), "user_input": "뚜껑은 어떻게 버리나요?"}
    replicas_before = stack.containers("ecoscan")
    timeline: list[str] = []
    t0 = time.monotonic()

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:5.1f} s {what}")

    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(60, connect=10)) as client:
        # The scan, read through the balancer until its answer is streaming.
        first = Reading()

        async def read_first() -> None:
            async with client.stream("POST", SCAN_URL, json=body, headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                first.scan_id = response.headers["x-scan-id"]
                await _read(response, first)

        first_task = asyncio.create_task(read_first())
        await _until(first, lambda: any(e.event == "delta" for e in first.events), "the answer", 60)
        assert first.scan_id is not None
        scan_id = first.scan_id
        note(f"answer streaming (events 1..{first.seqs()[-1]})")

        # Which replica runs it: its row's instance, that instance's connections' address.
        instance = await asyncio.to_thread(
            stack.psql, f"SELECT instance_id FROM scans WHERE id = '{scan_id}'"
        )
        tag = f"ecoscan {uuid.UUID(instance)}"
        owner_address = await asyncio.to_thread(
            stack.psql,
            f"SELECT host(client_addr) FROM pg_stat_activity WHERE application_name = '{tag}' LIMIT 1",
        )
        addresses = {c: await asyncio.to_thread(stack.address, c) for c in replicas_before}
        (owner,) = [c for c, address in addresses.items() if address == owner_address]
        await asyncio.to_thread(_hold_the_sweep_off, stack, tag)

        # SIGKILL its process, as the OOM killer would: the restart policy brings it back.
        pid = int(await asyncio.to_thread(stack.inspect, owner, "{{.State.Pid}}"))
        os.kill(pid, signal.SIGKILL)
        note(f"SIGKILL to the replica at {owner_address} (after event {first.seqs()[-1]})")
        with pytest.raises(httpx.TransportError):
            await asyncio.wait_for(first_task, 30)
        received = first.events
        assert not first.terminals(), f"the scan ended before its replica was killed: {received[-1]}"
        assert first.seqs() == list(range(1, len(received) + 1))
        note(f"the client's stream was cut after event {len(received)}")

        # What the owner had mirrored to the scan's Redis Stream before it died.
        stream = await asyncio.to_thread(stack.redis, "XRANGE", f"ecoscan:scan:{scan_id}:events", "-", "+")
        mirrored = [int(line[:-2]) for line in stream.splitlines() if re.fullmatch(r"\d+-0", line)]
        assert mirrored and mirrored == list(range(1, len(mirrored) + 1)), mirrored

        # The replica is restarted by its restart policy (a new process, so a new instance),
        # and the balancer reloads with the replicas' addresses as they are now. A client
        # resumes a moment later too (an EventSource waits ~3 s before it reconnects).
        upstream = await asyncio.to_thread(_balancer_follows_the_replicas, stack, owner)
        note(f"the replica was restarted; the balancer's upstream: {upstream}")

        # Resume through the balancer from just before the answer's text (as if what came
        # after had been lost in flight), so another replica sends again what the owner
        # sent, and the rest.
        after = next(int(e.id) for e in received if e.event == "delta") - 1
        assert after < len(received)
        resumed = Reading()

        async def read_resumed() -> None:
            resume = {**headers, "Last-Event-ID": str(after)}
            async with client.stream("GET", f"/api/v1/scan/{scan_id}/events", headers=resume) as response:
                assert response.status_code == 200, await response.aread()
                await _read(response, resumed)

        resumed_task = asyncio.create_task(read_resumed())
        # Every mirrored event after `after`, then only pings: the scan is not over, as far
        # as anyone can tell yet.
        expected = list(range(after + 1, mirrored[-1] + 1))
        await _until(resumed, lambda: len(resumed.events) >= len(expected), "the mirrored events", 30)
        pings = resumed.pings
        await _until(resumed, lambda: resumed.pings >= pings + 2, "pings", 30)
        got = f"events {expected[0]}..{expected[-1]}" if expected else "no events"
        note(f"resumed after {after} on another replica: {got} (all mirrored), then pings")
        assert resumed.seqs() == expected
        for event in resumed.events:
            seq = int(event.id)
            if seq <= len(received):  # sent twice, by two replicas: the same event
                assert event == received[seq - 1]
        assert not resumed.terminals() and not resumed_task.done()

        # Once the owner holds no connection either, a live replica takes the scan over
        # (its lease lapsed long ago): it runs on from the mirrored log, and the follower's
        # stream ends with the one terminal event, `done`, its seq going on unbroken.
        await asyncio.to_thread(_let_the_sweep_run, stack, tag)
        await asyncio.wait_for(resumed_task, 90)
        terminals = resumed.terminals()
        assert [e.event for e in terminals] == ["done"] and resumed.events[-1] is terminals[0], terminals
        assert resumed.seqs() == list(range(after + 1, after + 1 + len(resumed.events)))
        note(
            f"taken over by another replica: the resumed stream ended with done (event {resumed.seqs()[-1]})"
        )
        status = await client.get(f"/api/v1/scan/{scan_id}", headers=headers)
        assert status.status_code == 200, status.text
        assert status.json()["status"] == "completed" and status.json()["finished_at"], status.text
        row_instance = await asyncio.to_thread(
            stack.psql, f"SELECT instance_id FROM scans WHERE id = '{scan_id}'"
        )
        assert uuid.UUID(row_instance) != uuid.UUID(instance), "the row is the dead owner's still"

    # The killed replica is back (restart policy), at an address the balancer and
    # Prometheus found by DNS.
    await asyncio.to_thread(stack.wait_healthy)
    assert int(stack.inspect(owner, "{{.RestartCount}}")) >= 1
    replicas = {f"{stack.address(c)}:8000" for c in stack.containers("ecoscan")}
    await _eventually_targets(stack, replicas)
    note(f"replica back at {stack.address(owner)}; Prometheus scrapes all {REPLICAS}")
    async with httpx.AsyncClient(base_url=stack.url, timeout=90) as client:
        _assert_done(await _scan(client, 4243, headers))
    served = [line for line in _balancer_log(stack) if f"/api/v1/scan/{scan_id}" in line]
    with capsys.disabled():
        print("\n[compose] " + "\n[compose] ".join(timeline))
        print("[compose] balancer: " + "\n[compose] balancer: ".join(served))


def _balancer_log(stack: Stack) -> list[str]:
    logs = _run(["docker", "logs", stack.container("lb")], timeout=30)
    return (logs.stdout + logs.stderr).splitlines()


def _balancer_follows_the_replicas(stack: Stack, restarted: str, timeout: float = 90.0) -> str:
    """Once `restarted` runs again and the balancer's last upstream list (its
    entrypoint's log) is every replica's current address: that list."""
    deadline = time.monotonic() + timeout
    listed: set[str] = set()
    current: set[str] = set()
    while time.monotonic() < deadline:
        running = stack.inspect(restarted, "{{.State.Running}} {{.RestartCount}}").split()
        current = {stack.address(c) for c in stack.containers("ecoscan")} - {""}
        upstreams = [line for line in _balancer_log(stack) if line.startswith("ecoscan-lb: upstream ")]
        if upstreams:
            listed = set(upstreams[-1].split(":", 2)[2].replace("(reloaded)", "").split())
        if running[0] == "true" and int(running[1]) >= 1 and len(current) == REPLICAS and listed == current:
            return " ".join(sorted(listed))
        time.sleep(0.5)
    raise AssertionError(f"the balancer lists {sorted(listed)}, the replicas are at {sorted(current)}")


def _hold_the_sweep_off(stack: Stack, tag: str) -> None:
    """A session under the owner's name: a sweep sees that instance as alive."""
    _checked(
        [
            "docker",
            "exec",
            "--detach",
            "--env",
            f"PGAPPNAME={tag}",
            stack.container("postgres"),
            "psql",
            "-U",
            "ecoscan",
            "-d",
            "ecoscan",
            "-c",
            "SELECT pg_sleep(600)",
        ]
    )
    query = f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{tag}' AND client_addr IS NULL"
    deadline = time.monotonic() + 30
    while stack.psql(query) != "1":
        assert time.monotonic() < deadline, "the session holding the sweep off did not start"
        time.sleep(0.2)


def _let_the_sweep_run(stack: Stack, tag: str) -> None:
    """Ends the session that held the sweep and the takeover off."""
    stack.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{tag}'")


async def test_the_edge_lets_no_client_claim_an_identity_or_read_private_routes(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    owner = stack.auth("compose-owner")
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(90, connect=10)) as client:
        reading = await _scan(client, 777, owner)
        _assert_done(reading)
        scan = f"/api/v1/scan/{reading.scan_id}"
        # The owner, by token, reads its scan and its list...
        assert (await client.get(scan, headers=owner)).status_code == 200
        mine = await client.get("/api/v1/users/me/characters", headers=owner)
        assert mine.status_code == 200, mine.text
        # ...a client naming the owner (or anyone) in X-User-ID, with or without a gateway
        # secret, is an anonymous caller like any other: the same answers whatever it names.
        claims = [
            {"X-User-ID": "compose-owner"},
            {"X-User-ID": "compose-owner", "X-Gateway-Secret": "guess"},
            {"X-User-ID": "someone-else"},
            {},
        ]
        lists = [await client.get("/api/v1/users/me/characters", headers=claim) for claim in claims]
        assert {(r.status_code, r.json()["code"]) for r in lists} == {(401, "UNAUTHENTICATED")}, [
            r.text for r in lists
        ]
        reads = [await client.get(scan, headers=claim) for claim in claims]
        assert {(r.status_code, r.json()["code"]) for r in reads} == {(404, "SCAN_NOT_FOUND")}, [
            r.text for r in reads
        ]
        cancel = await client.delete(scan, headers=claims[0])
        assert cancel.status_code == 404, cancel.text

        # Probes and metrics are for each replica directly, not for the public port.
        for private in ("/readyz", "/metrics"):
            answer = await client.get(private)
            assert answer.status_code == 404 and answer.json()["code"] == "NOT_FOUND", (private, answer.text)
        # What nginx refuses itself, it refuses in the API's words.
        long_line = await client.get("/api/v1/scan/categories", headers={"X-Long": "a" * 17 * 1024})
        assert long_line.status_code == 431, long_line.text
        assert long_line.json()["code"] == "REQUEST_HEADERS_TOO_LARGE"
        malformed = await _raw_request(stack, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
        assert malformed.startswith(b"HTTP/1.1 400 "), malformed
        assert json.loads(malformed.split(b"\r\n\r\n", 1)[1])["code"] == "BAD_HTTP_REQUEST", malformed

        # An anonymous scan (allowed: the page works without signing in), read back with
        # its capability token in the query: the balancer serves it and logs no token.
        anonymous = await _scan_anonymously(client, 778)
        assert anonymous.token
        status = await client.get(scan_of(anonymous), params={"token": anonymous.token})
        assert status.status_code == 200, status.text
        escaped = await client.get(f"{scan_of(anonymous)}?%74oken={anonymous.token}")
        assert escaped.status_code == 200, escaped.text
        assert (await client.get(scan_of(anonymous))).status_code == 404

    log = "\n".join(_balancer_log(stack))
    assert anonymous.token not in log
    logged = [line for line in log.splitlines() if f"GET {scan_of(anonymous)}" in line]
    assert len(logged) >= 3 and sum("?[redacted]" in line for line in logged) == 2, logged
    with capsys.disabled():
        print("\n[compose] balancer: " + "\n[compose] balancer: ".join(logged))


# Two stand-ins for a replica, joined to the stack's network under the service's name, so
# Docker's DNS lists them beside the replicas and the balancer sends them requests: one
# with nothing listening (a connection refused: the request never reached a replica), one
# that reads the request and closes without answering (it did).
DECOYS = {
    "refuses": "import time; time.sleep(600)",
    "drops": (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('', 8000)); s.listen(64)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.recv(65536); c.close()\n"
    ),
}
RETRY_PROBES = 12


@dataclass
class Probe:
    post: httpx.Response
    get: httpx.Response
    post_tried: list[str]  # the upstream addresses nginx tried, in order (its log)
    get_tried: list[str]
    post_line: str


async def _probe_beside(stack: Stack, kind: str) -> tuple[str, list[Probe]]:
    """With the decoy `kind` among the replicas: RETRY_PROBES POSTs and GETs in a row (nginx
    goes round its upstreams when none is busy), each as the client got it and as nginx
    logged it. The decoy's address, and the probes."""
    network = f"{PROJECT}_default"
    command = ["docker", "run", "--detach", "--rm", "--network", network, "--network-alias", "ecoscan"]
    label = ["--label", f"ecoscan-compose-test-decoy={kind}"]
    decoy = _checked([*command, *label, stack.base_image, "python3", "-c", DECOYS[kind]]).strip()
    try:
        address = await asyncio.to_thread(stack.address, decoy)
        await asyncio.to_thread(_balancer_lists, stack, {address})
        async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(30, connect=10)) as client:
            # POSTs, then GETs, each in a row: with none open, nginx takes its upstreams
            # in turn, so each kind meets the decoy (alternating them could keep the
            # decoy's turn for one kind). A POST refused at once by a replica (422, a
            # number for a text): the retry rules are the same for any POST, and no scan
            # is started.
            posts = [
                await client.post(f"{SCAN_URL}?probe={kind}{n}", json={"user_input": 1})
                for n in range(RETRY_PROBES)
            ]
            gets = [await client.get(f"/api/v1/scan/categories?probe={kind}{n}") for n in range(RETRY_PROBES)]
        answers = list(zip(posts, gets, strict=True))
        logged = {
            (m[1], m[2]): (line, [a.strip().rsplit(":", 1)[0] for a in m[3].split(",")])
            for line in _balancer_log(stack)
            if (m := re.search(rf'"(POST|GET) \S+\?probe={kind}(\d+) .*upstream=(.*) upstream_status=', line))
        }
    finally:
        _run(["docker", "rm", "--force", decoy], timeout=60)
    await asyncio.to_thread(_balancer_lists, stack, set())
    probes = [
        Probe(post, get, logged["POST", str(n)][1], logged["GET", str(n)][1], logged["POST", str(n)][0])
        for n, (post, get) in enumerate(answers)
    ]
    return address, probes


async def test_a_post_goes_to_a_second_replica_only_if_it_never_reached_the_first(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """nginx passes a POST on after a refused connection, never after its bytes went to an
    upstream (that one may have started the scan): the client gets the balancer's JSON 502
    instead. A GET is passed on in both cases."""
    examples = []
    for kind in DECOYS:
        decoy, probes = await _probe_beside(stack, kind)
        replicas_answer = {
            (p.post.status_code, p.post.json()["code"]) for p in probes if p.post_tried[0] != decoy
        }
        assert replicas_answer == {(422, "INVALID_REQUEST")}, replicas_answer
        hit = [p for p in probes if p.post_tried[0] == decoy]
        assert hit, f"no POST went to the decoy that {kind}: {[p.post_line for p in probes]}"
        for probe in hit:
            if kind == "refuses":  # never reached it: passed on, and a replica answered
                assert len(probe.post_tried) == 2 and probe.post_tried[1] != decoy, probe.post_line
                assert (probe.post.status_code, probe.post.json()["code"]) == (422, "INVALID_REQUEST")
            else:  # sent, then cut: not sent again; the balancer's JSON 502
                assert probe.post_tried == [decoy], probe.post_line
                assert probe.post.status_code == 502, probe.post.text
                assert probe.post.json()["code"] == "SERVICE_UNAVAILABLE"
                assert int(probe.post.headers["retry-after"]) >= 1
        for probe in probes:  # a GET is passed on either way
            assert probe.get.status_code == 200 and probe.get_tried[-1] != decoy, probe.get_tried
        assert any(p.get_tried[0] == decoy for p in probes), [p.get_tried for p in probes]
        examples.append(f"decoy that {kind}: {hit[0].post_line}")
    with capsys.disabled():
        print("\n[compose] " + "\n[compose] ".join(examples))


def _balancer_lists(stack: Stack, decoys: set[str], timeout: float = 60.0) -> None:
    """Until the balancer's last upstream list holds exactly these decoys' addresses."""
    deadline = time.monotonic() + timeout
    listed: set[str] = set()
    while time.monotonic() < deadline:
        upstreams = [line for line in _balancer_log(stack) if line.startswith("ecoscan-lb: upstream ")]
        listed = set(upstreams[-1].split(":", 2)[2].replace("(reloaded)", "").split())
        replicas = {stack.address(c) for c in stack.containers("ecoscan")} - {""}
        if listed == replicas | decoys:
            return
        time.sleep(0.5)
    raise AssertionError(f"the balancer lists {sorted(listed)}, not the replicas and {sorted(decoys)}")


async def _raw_request(stack: Stack, request: bytes) -> bytes:
    """Bytes as sent (no client library would send them), the answer until nginx closes."""
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


@dataclass
class AnonymousScan:
    scan_id: str
    token: str


def scan_of(anonymous: AnonymousScan) -> str:
    return f"/api/v1/scan/{anonymous.scan_id}"


async def _scan_anonymously(client: httpx.AsyncClient, seed: int) -> AnonymousScan:
    body = {"image_url": data_url(make_jpeg(seed)), "user_input": "어떻게 버리나요?"}
    reading = Reading()
    async with client.stream("POST", SCAN_URL, json=body) as response:
        assert response.status_code == 200, await response.aread()
        token = response.headers["x-scan-token"]
        await _read(response, reading)
    _assert_done(reading)
    return AnonymousScan(response.headers["x-scan-id"], token)


async def _alerts(stack: Stack, name: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=stack.prometheus_url, timeout=10) as client:
        response = await client.get("/api/v1/alerts")
    response.raise_for_status()
    return [a for a in response.json()["data"]["alerts"] if a["labels"]["alertname"] == name]


async def test_a_replica_stopped_for_good_raises_the_replicas_missing_alert(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """`docker kill` is a stop by hand to Docker: the container stays Exited (137), its
    address leaves DNS, its `up` series ends (it never reports 0). The count against the
    replicas expected sees it; the alert is pending at the next evaluation (15 s)."""
    await _eventually_targets(stack, {f"{stack.address(c)}:8000" for c in stack.containers("ecoscan")})
    await _eventually(
        lambda: _alerts(stack, "EcoscanReplicasMissing"), lambda a: a == [], "no replica missing", 120
    )
    victim = stack.containers("ecoscan")[-1]
    restarts = int(stack.inspect(victim, "{{.RestartCount}}"))
    started = time.monotonic()
    _checked(["docker", "kill", victim])
    alerts = await _eventually(
        lambda: _alerts(stack, "EcoscanReplicasMissing"), lambda a: len(a) == 1, "EcoscanReplicasMissing", 120
    )
    took = time.monotonic() - started
    (alert,) = alerts
    assert alert["state"] in ("pending", "firing"), alert
    assert alert["annotations"]["runbook_url"] == "docs/runbooks.md#ecoscanreplicasmissing"
    assert float(alert["value"]) == REPLICAS - 1, alert
    # ...and nothing restarted it: what docs/deploy.md says of `docker kill`.
    state = stack.inspect(victim, "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}").split()
    assert state == ["exited", "137", str(restarts)], state
    with capsys.disabled():
        print(
            f"\n[compose] replica killed for good: EcoscanReplicasMissing {alert['state']} after {took:.1f} s"
        )


async def test_with_no_replica_left_the_balancer_answers_in_the_apis_json(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last test: it stops every replica. nginx still holds their addresses (its
    entrypoint keeps the last set it resolved), so it tries them and fails: its own 502 or
    504, which must be the API's JSON with Retry-After."""
    replicas = stack.containers("ecoscan")
    _checked(["docker", "kill", *[c for c in replicas if stack.inspect(c, "{{.State.Running}}") == "true"]])
    body = {"image_url": data_url(make_jpeg(9)), "user_input": "?"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(60, connect=10)) as client:
        answers = [
            await client.post(SCAN_URL, json=body, headers=stack.auth("compose-late")),
            await client.get("/api/v1/scan/categories"),
        ]
    for answer in answers:
        assert answer.status_code in (502, 504), answer.text
        assert answer.headers["content-type"].startswith("application/json"), answer.headers
        code = {502: "SERVICE_UNAVAILABLE", 504: "GATEWAY_TIMEOUT"}[answer.status_code]
        assert answer.json() == {"detail": answer.json()["detail"], "code": code}, answer.text
        assert int(answer.headers["retry-after"]) >= 1
    with capsys.disabled():
        print(f"\n[compose] no replica: {[(a.status_code, a.json()['code']) for a in answers]}")
