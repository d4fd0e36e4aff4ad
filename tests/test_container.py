"""The container image as it ships: built from the Dockerfile by `make image`, started
with its embedded defaults (PostgreSQL and the OpenAI simulator inside), one scan
completed through it, then `docker stop` with a scan in flight: the drain ends that
scan's stream with exactly one terminal event, never a cut stream.

Docker Hub may be out of reach, so the base image is built locally from Debian packages
by deploy/base-image/build.sh (cached by tag: the second run reuses it and docker's
layer cache). CONTAINER_TEST_BASE_IMAGE names another base instead (python:3.11-slim,
the Dockerfile's default). Without a usable docker the test skips, except under CI,
where .ci/run installs docker.io and starts dockerd, so it fails instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import Event, data_url, make_jpeg, run_scan
from .streamed_scan import StreamedScan

REPO = Path(__file__).resolve().parent.parent
IMAGE = "ecoscan:container-test"
BUILD_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 90.0
# `docker stop`'s own 10 s would SIGKILL a drain of up to SHUTDOWN_DRAIN_S (25 s).
STOP_GRACE_S = 40
# The built-in simulator at 0.6 x its real latency: a scan takes ~6 s, long enough to
# still be running when the container is told to stop.
SIM_TIME_SCALE = "0.6"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: .ci/run installs docker.io and mmdebstrap and starts dockerd)")
    pytest.skip(reason)


def _run(args: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def _checked(args: list[str], *, timeout: float = 120.0) -> str:
    result = _run(args, timeout=timeout)
    command = " ".join(args)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _base_image() -> str:
    base = os.environ.get("CONTAINER_TEST_BASE_IMAGE")
    if base:
        return base
    if shutil.which("mmdebstrap") is None:
        _unavailable("no mmdebstrap to build the local base image (or set CONTAINER_TEST_BASE_IMAGE)")
    out = _checked([str(REPO / "deploy" / "base-image" / "build.sh")], timeout=BUILD_TIMEOUT_S)
    return out.strip().splitlines()[-1]


@dataclass
class Built:
    image: str
    base: str
    build_s: float
    size_bytes: int


@pytest.fixture(scope="module")
def built_image() -> Built:
    if shutil.which("docker") is None:
        _unavailable("no docker CLI")
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if info.returncode != 0:
        _unavailable(f"docker daemon not reachable: {info.stderr.strip()}")
    base = _base_image()
    started = time.monotonic()
    _checked(["make", "image", f"IMAGE={IMAGE}", f"BASE_IMAGE={base}"], timeout=BUILD_TIMEOUT_S)
    build_s = time.monotonic() - started
    size = int(_checked(["docker", "image", "inspect", "--format", "{{.Size}}", IMAGE]).strip())
    return Built(IMAGE, base, build_s, size)


@dataclass
class Container:
    name: str
    url: str
    startup_s: float

    def logs(self) -> str:
        result = _run(["docker", "logs", self.name], timeout=30)
        return result.stdout + result.stderr

    def state(self) -> dict[str, object]:
        state: dict[str, object] = json.loads(
            _checked(["docker", "inspect", "--format", "{{json .State}}", self.name])
        )
        return state


def _wait_ready(container: Container) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(base_url=container.url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if container.state().get("Running") is not True:
                raise AssertionError(f"the container exited during start-up:\n{container.logs()}")
            time.sleep(0.1)
    raise AssertionError(f"/readyz not 200 within {READY_TIMEOUT_S} s:\n{container.logs()}")


@pytest.fixture
def container(built_image: Built) -> Iterator[Container]:
    name = f"ecoscan-test-{secrets.token_hex(4)}"
    started = time.monotonic()
    _checked(
        [
            "docker",
            "run",
            "--detach",
            "--name",
            name,
            "--publish",
            "127.0.0.1::8000",  # a free port, chosen by docker
            "--env",
            f"SIM_TIME_SCALE={SIM_TIME_SCALE}",
            built_image.image,
        ]
    )
    try:
        address = _checked(["docker", "port", name, "8000/tcp"]).splitlines()[0].strip()
        running = Container(name, f"http://{address}", 0.0)
        _wait_ready(running)
        running.startup_s = time.monotonic() - started
        yield running
    finally:
        _run(["docker", "rm", "--force", "--volumes", name], timeout=60)


def _assert_one_terminal_last(events: list[Event]) -> Event:
    terminals = [e for e in events if e.event in ("done", "error")]
    assert len(terminals) == 1, [e.event for e in events]
    assert events[-1] is terminals[0], [e.event for e in events]
    seqs = [int(e.id) for e in events]
    assert seqs == list(range(1, len(events) + 1)), seqs
    return terminals[0]


@pytest.mark.timeout(900)
async def test_image_serves_a_scan_and_drains_on_docker_stop(
    built_image: Built, container: Container, capsys: pytest.CaptureFixture[str]
) -> None:
    with capsys.disabled():
        print(
            f"\n[container] base {built_image.base}; `make image` took {built_image.build_s:.1f} s; "
            f"image {built_image.image} is {built_image.size_bytes / 1e6:.0f} MB; "
            f"docker run -> /readyz 200 in {container.startup_s:.1f} s"
        )

    # A whole scan through the published port: the terminal `done`, then the stream ends.
    async with httpx.AsyncClient(base_url=container.url, timeout=60) as client:
        outcome = await run_scan(
            client,
            json={"image_url": data_url(make_jpeg(7)), "user_input": "라벨은 떼야 하나요?"},
            headers={"X-User-ID": "container-test"},
        )
    assert outcome.status == 200, outcome.body
    done = _assert_one_terminal_last(outcome.events)
    assert done.event == "done", done.data
    assert done.data["classification"]["major"], done.data
    assert done.data["answer"], done.data
    assert outcome.of("delta"), "the answer was not streamed"

    # `docker stop` with a scan in flight: SIGTERM drains it.
    scan = StreamedScan(container.url, 11, user="container-11", user_input="뚜껑은 어떻게 버리나요?")
    async with asyncio.timeout(30):
        await scan.started.wait()
    assert not scan.terminals(), "the scan ended before the stop: nothing was in flight"
    stopping_at = time.monotonic()
    stop = await asyncio.create_subprocess_exec(
        "docker",
        "stop",
        "--time",
        str(STOP_GRACE_S),
        container.name,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    # While it drains, the sockets stay open and readiness says no.
    readiness: list[int] = []
    async with httpx.AsyncClient(base_url=container.url, timeout=5) as client, asyncio.timeout(10):
        while not scan.task.done():
            status = (await client.get("/readyz")).status_code
            readiness.append(status)
            if status == 503:
                break
            await asyncio.sleep(0.05)

    async with asyncio.timeout(STOP_GRACE_S + 20):
        stop_out, stop_err = await stop.communicate()
        await scan.task  # raises if the stream was cut
    stop_s = time.monotonic() - stopping_at
    logs = container.logs()
    assert stop.returncode == 0, (stop_out, stop_err)

    terminal = _assert_one_terminal_last(scan.events)
    assert terminal.event == "done" or terminal.data.get("code") == "SERVER_SHUTDOWN", terminal.data
    assert 503 in readiness, f"/readyz during the drain: {readiness}"

    state = container.state()
    assert state["ExitCode"] == 0 and state["OOMKilled"] is False, (state, logs)
    assert stop_s < STOP_GRACE_S, f"docker stop took {stop_s:.1f} s: SIGKILLed?\n{logs}"
    assert "shutdown: draining 1 scans in flight" in logs, logs
    assert "embedded PostgreSQL stopped" in logs, logs
    with capsys.disabled():
        print(f"[container] docker stop with a scan in flight: `{terminal.event}` after {stop_s:.1f} s")
