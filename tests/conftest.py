"""Shared test fixtures: a real PostgreSQL, the simulator over real HTTP, and the
service served by a real uvicorn on a loopback port, read by a real SSE client.

Database: `TEST_DATABASE_URL` when set (CI points it at the machine's server),
else an embedded PostgreSQL from pgserver. Either way each test session gets a
fresh database of its own, dropped at the end.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import os
import secrets
import tempfile
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
import openai
import pytest
from httpx_sse import aconnect_sse
from PIL import Image, ImageDraw

from app.db.embedded import EmbeddedPostgres
from app.http.protocol import HttpToolsProtocol
from app.main import create_app
from app.runtime.metrics import Metrics
from app.runtime.serving import serve_in_loop
from app.settings import Settings
from app.sim.config import SimConfig
from app.sim.server import RunningSimulator, run_simulator
from app.stages.base import StageClass
from app.stages.order import STAGES
from tests.redis_server import RedisServer, delete_prefix, fresh_prefix, shared_redis_url

SCAN_URL = "/api/v1/scan/classify/completion"

# Fast, unlimited, fault-free: tests turn knobs on per test through PATCH /sim/config.
BASE_SIM = SimConfig(time_scale=0.002, rpm=0, tpm=0, latency_sigma=0.0, text_tokens=40)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a pytest-xdist worker under `--dist=loadgroup`, xdist suffixes the node id of each
    test marked `xdist_group` with its group, which is how the tests of a group reach one
    worker. Without the suffix they are spread over workers (the compose stack brought up by
    several at once): fail before any fixture starts."""
    if (
        getattr(item.config.option, "loadgroup", False)
        and item.get_closest_marker("xdist_group") is not None
        and "@" not in item.nodeid
    ):
        pytest.fail(
            "its xdist_group is ignored by this pytest-xdist and pytest"
            " (pytest-dev/pytest-xdist#1386): see the pin in pyproject.toml",
            pytrace=False,
        )


def with_database(url: str, name: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


@pytest.fixture(scope="session")
async def database_url() -> AsyncIterator[str]:
    base = os.environ.get("TEST_DATABASE_URL")
    embedded: EmbeddedPostgres | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if not base:
        tmp = tempfile.TemporaryDirectory(prefix="ecoscan-test-pg-")
        embedded = EmbeddedPostgres(os.path.join(tmp.name, "pgdata"))
        base = await embedded.start()
    name = f"ecoscan_test_{os.getpid()}_{secrets.token_hex(3)}"
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield with_database(base, name)
    finally:
        admin = await asyncpg.connect(base)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        if embedded is not None:
            await embedded.stop()
        if tmp is not None:
            tmp.cleanup()


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """A real Redis: the machine's, or one this session starts (see tests/redis_server.py)."""
    url, own = shared_redis_url()
    try:
        yield url
    finally:
        if own is not None:
            own.close()


@pytest.fixture
def redis_prefix(redis_server_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards (never a flush)."""
    prefix = fresh_prefix()
    try:
        yield prefix
    finally:
        delete_prefix(redis_server_url, prefix)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server the test may stop, freeze and restart."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@asynccontextmanager
async def loop_errors_fail(what: str) -> AsyncIterator[None]:
    """Fail if the event loop's exception handler fires within ("Task exception was never
    retrieved", errors in callbacks...), as asyncpg's suite does. Unretrieved task
    exceptions are reported when the task is freed: the collection at the end frees
    those in reference cycles."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not errors, f"the event loop reported errors {what}: {[e.get('message') for e in errors]}"


@pytest.fixture(scope="session", autouse=True)
async def no_stray_loop_errors_in_session() -> AsyncIterator[None]:
    """What `no_stray_loop_errors` froze is collected at the end of the session, session
    fixtures' teardowns included, under the same check."""
    yield
    gc.unfreeze()
    async with loop_errors_fail("at the end of the session"):
        pass


@pytest.fixture(autouse=True)
async def no_stray_loop_errors() -> AsyncIterator[None]:
    """Fail any test during which the event loop reported an error. What survives the
    test's collection is then frozen (`gc.freeze`), so that the next test's collection
    walks only what that test allocated, not every object of the imports again (walks
    that cost more CPU than the tests themselves: docs/benchmarks.md). A survivor that a
    later test turns into cyclic garbage is collected, and checked, at the end of the
    session instead. (An app's `tuned_heap` unfreezes everything on exit: the test's
    collection then walks it all.)"""
    async with loop_errors_fail("during the test"):
        yield
    gc.freeze()


@pytest.fixture(scope="session")
async def sim() -> AsyncIterator[RunningSimulator]:
    async with run_simulator(BASE_SIM) as running:
        yield running


# The simulator tests' clients, of the `sim_server` their module starts with its own config.
@pytest.fixture
async def sdk(sim_server: RunningSimulator) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=sim_server.base_url, api_key="sim", max_retries=0) as c:
        yield c


@pytest.fixture
async def sim_http(sim_server: RunningSimulator) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim_server.url, headers={"Authorization": "Bearer sim"}) as c:
        yield c


@pytest.fixture(autouse=True)
async def reset_sim(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Every test starts with the base simulator config and zeroed stats."""
    if "sim" not in request.fixturenames:
        yield
        return
    running: RunningSimulator = request.getfixturevalue("sim")
    async with httpx.AsyncClient(base_url=running.url) as client:
        await client.patch("/sim/config", json=_config_json(BASE_SIM))
        await client.post("/sim/stats/reset")
    yield


def _config_json(config: SimConfig) -> dict[str, Any]:
    as_json: dict[str, Any] = json.loads(json.dumps(config.to_dict()))
    return as_json


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
    try:
        yield conn
    finally:
        await conn.close()


def settings_for(database_url: str, sim: RunningSimulator, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "openai_api_key": "test-key",
        "openai_base_url": sim.base_url,
        "cpu_max_workers": 2,
        "retry_base_delay_s": 0.005,
        "retry_max_delay_s": 0.05,
        "db_pool_min": 1,
        "db_pool_max": 10,
        "delta_flush_ms": 0.0,
        "sse_ping_s": 5.0,
        "log_level": "WARNING",
        # A disconnect cancels at once (the grace has tests of its own, in test_resources.py).
        "disconnect_grace_s": 0.0,
        # No pacing by the loop's utilisation (tests of its own in test_loop_capacity.py): the
        # test's one loop runs the service, its replicas, the simulator and the client at once
        # on a shared box, and would be "saturated" for reasons no deployment has.
        "loop_utilisation_target": 0.0,
    }
    values.update(overrides)
    return Settings(**values)


@dataclass
class Service:
    url: str
    metrics: Metrics
    client: httpx.AsyncClient
    settings: Settings

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


@asynccontextmanager
async def running_service(
    settings: Settings, *, stages: Sequence[StageClass] = STAGES, **server: Any
) -> AsyncIterator[Service]:
    """The app under a real uvicorn; `server` overrides uvicorn's config (proxy headers...)."""
    metrics = Metrics(process=False)
    app = create_app(settings, metrics=metrics, stages=stages)
    async with (
        serve_in_loop(app, lifespan="on", http=HttpToolsProtocol, **server) as url,
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0)) as client,
    ):
        yield Service(url, metrics, client, settings)


@pytest.fixture
async def service(database_url: str, sim: RunningSimulator) -> AsyncIterator[Service]:
    async with running_service(settings_for(database_url, sim)) as svc:
        yield svc


@dataclass
class Event:
    event: str
    id: str
    data: dict[str, Any]


@dataclass
class ScanOutcome:
    status: int
    headers: httpx.Headers
    events: list[Event] = field(default_factory=list)
    body: Any = None

    @property
    def terminal(self) -> Event:
        return self.events[-1]

    def of(self, name: str) -> list[Event]:
        return [e for e in self.events if e.event == name]

    def stage(self, step: str, status: str) -> Event:
        return next(
            e
            for e in self.events
            if e.event == "stage" and e.data["step"] == step and e.data["status"] == status
        )


async def run_scan(client: httpx.AsyncClient, **request: Any) -> ScanOutcome:
    """POST a scan and read the whole SSE stream (or the JSON error)."""
    async with aconnect_sse(client, "POST", SCAN_URL, **request) as source:
        response = source.response
        if response.status_code != 200:
            await response.aread()
            return ScanOutcome(response.status_code, response.headers, body=response.json())
        outcome = ScanOutcome(200, response.headers)
        async for sse in source.aiter_sse():
            # Every event the service sends has data; httpx-sse can report a spurious empty
            # one when a frame's CRLF is split across two reads (the raw bytes are whole).
            if sse.data:
                outcome.events.append(Event(sse.event, sse.id, json.loads(sse.data)))
        return outcome


def make_jpeg(
    seed: int, size: tuple[int, int] = (640, 480), *, quality: int = 85, exif_orientation: int | None = None
) -> bytes:
    """A deterministic photo-like JPEG: different seeds give different bytes."""
    img = Image.new("RGB", size, ((seed * 37) % 256, (seed * 91) % 256, (seed * 53) % 256))
    draw = ImageDraw.Draw(img)
    for i in range(6):
        x = (seed * 13 + i * 97) % size[0]
        y = (seed * 29 + i * 61) % size[1]
        draw.ellipse(
            (x, y, x + size[0] // 5, y + size[1] // 5),
            fill=((i * 40) % 256, 255 - i * 30, (seed + i * 70) % 256),
        )
    out = io.BytesIO()
    kwargs: dict[str, Any] = {"quality": quality}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    img.save(out, "JPEG", **kwargs)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def sim_stats(sim: RunningSimulator) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        stats: dict[str, Any] = (await client.get("/sim/stats")).json()
        return stats


async def sim_configure(sim: RunningSimulator, **changes: Any) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        response = await client.patch("/sim/config", json=changes)
        response.raise_for_status()


async def eventually(predicate: Any, *, attempts: int = 200, interval: float = 0.01) -> bool:
    """Poll a (possibly async) predicate a bounded number of times."""
    for _ in range(attempts):
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return True
        await asyncio.sleep(interval)
    return False


@pytest.fixture
def jpeg() -> Iterator[bytes]:
    yield make_jpeg(1)


async def scan_row(db: asyncpg.Connection, job_id: str) -> dict[str, Any]:
    row = await db.fetchrow("SELECT * FROM scans WHERE id = $1", uuid.UUID(job_id))
    assert row is not None, f"no scans row for {job_id}"
    return dict(row)
