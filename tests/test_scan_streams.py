"""Following a running scan from another replica through Redis Streams (app/scans/mirror.py):
the mirror against a real Redis, then two real service instances sharing one database,
one simulator and one Redis."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio as redis
from httpx_sse import aconnect_sse

from app.db.pool import tagged_dsn
from app.errors import FollowerLimit, ScanRunningElsewhere, ServerBusy
from app.runtime.metrics import Metrics
from app.runtime.redis_link import RedisLink
from app.scans import mirror as scan_streams
from app.scans.events import AnswerDelta, EventLog, LogEntry, ScanDone, StageCompleted, StageStarted
from app.scans.followers import FollowerCaps
from app.scans.mirror import Following, ScanStreams
from app.sim.server import RunningSimulator
from app.streaming.responses import encode_event

from .conftest import (
    SCAN_URL,
    Service,
    data_url,
    eventually,
    make_jpeg,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
)
from .redis_server import RedisServer

# Slow enough (~2 s a scan) for a scan to still be running while another replica follows it.
SLOW = 0.2

# --- the mirror on its own ---------------------------------------------------------


@pytest.fixture
async def link(redis_server_url: str, redis_prefix: str) -> AsyncIterator[RedisLink]:
    link = RedisLink(redis_server_url, prefix=redis_prefix, timeout_s=0.5)
    try:
        yield link
    finally:
        await link.close()


@pytest.fixture
async def streams(link: RedisLink) -> AsyncIterator[ScanStreams]:
    mirror = ScanStreams(link, Metrics(process=False), scan_deadline_s=60.0, block_s=0.5)
    try:
        yield mirror
    finally:
        await mirror.close()


def a_scan(events: EventLog) -> None:
    events.append(StageStarted("vision"), 2)
    events.append(StageCompleted("vision", 12.5, {"classification": {"major": "종이류"}, "tags": []}), 30)
    for text in ("우유팩은 ", "헹궈서 ", "말려요."):
        events.append(AnswerDelta("answer", text), 40)


def finish(events: EventLog) -> None:
    events.append(ScanDone("done", {"answer": {"steps": ["헹구기"]}}, {"total_ms": 1234.5}), 100)


async def stream_length(link: RedisLink, key: str) -> int:
    return int(await link.client.xlen(key))


async def running(position: int, progress: int) -> list[LogEntry] | None:
    """What a follower hears from a row that still says `running`."""
    return None


async def collect(entries: AsyncIterator[LogEntry] | None) -> list[LogEntry]:
    assert entries is not None
    return [entry async for entry in entries]


def wire(job_id: str, entries: list[LogEntry]) -> list[bytes]:
    return [encode_event(job_id, e) for e in entries]


async def test_a_mirrored_log_is_followed_back_with_the_same_events(
    link: RedisLink, streams: ScanStreams
) -> None:
    scan_id, events = uuid.uuid4(), EventLog()
    streams.mirror(scan_id, events)
    a_scan(events)
    key = streams.events_key(scan_id)
    assert await eventually(lambda: _has(link, key, 5))
    ttl_running = await link.client.pttl(key)
    assert 300_000 < ttl_running <= 360_000  # SCAN_DEADLINE_S + STREAM_TTL_PAST_DEADLINE_S

    from_start = asyncio.create_task(collect(await streams.follow(scan_id, 0, ended_after=running)))
    from_three = asyncio.create_task(collect(await streams.follow(scan_id, 3, ended_after=running)))
    finish(events)
    job_id = str(scan_id)
    assert wire(job_id, await from_start) == wire(job_id, events.entries)
    assert wire(job_id, await from_three) == wire(job_id, events.entries[3:])
    # ...and the same as the stored log replayed (what the database path sends).
    assert wire(job_id, EventLog.from_json(events.to_json()).entries) == wire(job_id, events.entries)
    assert 0 < await link.client.pttl(key) <= 60_000  # STREAM_KEPT_AFTER_END_S once it ended
    assert await streams.follow(scan_id, 6, ended_after=running) is None  # past the end: 204


async def test_no_stream_or_a_trimmed_one_is_refused(link: RedisLink, streams: ScanStreams) -> None:
    with pytest.raises(ScanRunningElsewhere):
        await streams.follow(uuid.uuid4(), 0, ended_after=running)
    scan_id, events = uuid.uuid4(), EventLog()
    streams.mirror(scan_id, events)
    a_scan(events)
    key = streams.events_key(scan_id)
    assert await eventually(lambda: _has(link, key, 5))
    await link.client.xtrim(key, minid="3-0", approximate=False)  # as MAXLEN would: entries 1 and 2 are gone
    with pytest.raises(ScanRunningElsewhere):
        await streams.follow(scan_id, 1, ended_after=running)
    follow = await streams.follow(scan_id, 2, ended_after=running)
    finish(events)
    assert [e.seq for e in await collect(follow)] == [3, 4, 5, 6]


async def test_followers_are_capped_per_user_per_scan_and_in_all_and_give_their_slots_back(
    link: RedisLink,
) -> None:
    """`FollowerCaps`: a follow takes its slot before its response starts, and gives it back
    when closed (before its first entry too) or when it ends."""
    caps = FollowerCaps(per_user=2, per_scan=3, total=5)
    streams = ScanStreams(link, Metrics(process=False), scan_deadline_s=60.0, block_s=0.5, caps=caps)
    scans = {name: (uuid.uuid4(), EventLog()) for name in ("one", "two")}
    try:
        for scan_id, events in scans.values():
            streams.mirror(scan_id, events)
            a_scan(events)
            key = streams.events_key(scan_id)
            assert await eventually(lambda: _has(link, key, 5))  # noqa: B023 (awaited at once)
        one, two = scans["one"][0], scans["two"][0]

        async def follow(scan_id: uuid.UUID, who: str) -> Following:
            following = await streams.follow(scan_id, 0, ended_after=running, follower=who)
            assert following is not None
            return following

        held = [await follow(one, "u:a"), await follow(two, "u:a")]
        with pytest.raises(FollowerLimit) as per_user:
            await follow(one, "u:a")
        assert (per_user.value.status, per_user.value.code) == (429, "FOLLOWER_LIMIT")
        assert per_user.value.retry_after_s > 0 and "FOLLOWERS_MAX_PER_USER" in per_user.value.message
        held += [await follow(one, "u:b"), await follow(one, "u:c")]  # scan one has 3 now
        with pytest.raises(FollowerLimit) as per_scan:
            await follow(one, "u:d")
        assert "FOLLOWERS_MAX_PER_SCAN" in per_scan.value.message
        held.append(await follow(two, "u:d"))
        with pytest.raises(ServerBusy):  # all five slots taken
            await follow(two, "u:e")
        assert caps.in_use == 5

        await held.pop(0).aclose()  # gone before its first entry
        assert caps.in_use == 4 and caps.held_by("u:a") == 1
        held.append(await follow(one, "u:e"))
        for _, events in scans.values():
            finish(events)
        for following in held:  # each runs to its end: its slot comes back
            assert [e.seq for e in await collect(following)] == [1, 2, 3, 4, 5, 6]
        assert caps.in_use == 0
        assert await streams.follow(one, 6, ended_after=running, follower="u:a") is None  # 204
        assert caps.in_use == 0
    finally:
        await streams.close()


async def test_a_stream_expires_after_its_scan_ended(
    link: RedisLink, streams: ScanStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scan_streams, "STREAM_KEPT_AFTER_END_S", 0.2)
    scan_id, events = uuid.uuid4(), EventLog()
    streams.mirror(scan_id, events)
    a_scan(events)
    finish(events)
    key = streams.events_key(scan_id)
    assert await eventually(lambda: _has(link, key, 6))
    assert await eventually(lambda: _gone(link, key), attempts=100, interval=0.05)


async def test_the_mirror_catches_up_once_redis_is_back(own_redis: RedisServer) -> None:
    link = RedisLink(own_redis.url, prefix="ecoscan-test", timeout_s=0.5)
    metrics = Metrics(process=False)
    mirror = ScanStreams(link, metrics, scan_deadline_s=60.0, block_s=0.5)
    try:
        own_redis.stop()
        scan_id, events = uuid.uuid4(), EventLog()
        mirror.mirror(scan_id, events)
        a_scan(events)
        assert await eventually(lambda: _sample(metrics, "ecoscan_scan_stream_mirror_failures_total") >= 1)
        own_redis.start()
        finish(events)  # written with everything before it, at the next retry
        key = mirror.events_key(scan_id)
        assert await eventually(lambda: _has(link, key, 6), attempts=100, interval=0.05)
        entries = await collect(await mirror.follow(scan_id, 0, ended_after=running))
        assert wire(str(scan_id), entries) == wire(str(scan_id), events.entries)
        assert _sample(metrics, "ecoscan_scan_stream_events_mirrored_total") == 6
    finally:
        await mirror.close()
        await link.close()


async def _has(link: RedisLink, key: str, count: int) -> bool:
    return await stream_length(link, key) >= count


async def _gone(link: RedisLink, key: str) -> bool:
    return not await link.client.exists(key)


def _sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


# --- two replicas --------------------------------------------------------------------


def events_url(job_id: str) -> str:
    return f"/api/v1/scan/{job_id}/events"


def events_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:scan:{job_id}:events"


def without_pings(body: str) -> str:
    """The SSE body's events, keepalive comments left out (they come on a timer)."""
    blocks = body.split("\r\n\r\n")
    return "\r\n\r\n".join(b for b in blocks if b and not b.startswith(":")) + "\r\n\r\n"


def id_and_data(body: str) -> list[tuple[str, str]]:
    blocks = [dict(line.split(": ", 1) for line in b.split("\r\n")) for b in body.split("\r\n\r\n") if b]
    return [(block["id"], block["data"]) for block in blocks]


async def raw_body(svc: Service, job_id: str, headers: dict[str, str]) -> tuple[int, str]:
    async with (
        httpx.AsyncClient(base_url=svc.url, timeout=30) as client,
        client.stream("GET", events_url(job_id), headers=headers) as response,
    ):
        body = (await response.aread()).decode()
        return response.status_code, (without_pings(body) if response.status_code == 200 else body)


async def start_scan(
    client: httpx.AsyncClient, headers: dict[str, str], seed: int
) -> AsyncGenerator[tuple[str, str], None]:
    """POST a scan and yield its events as raw (id, data) pairs, as they arrive."""
    request = {"json": {"image_url": data_url(make_jpeg(seed))}, "headers": headers}
    async with aconnect_sse(client, "POST", SCAN_URL, **request) as source:
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():
            if sse.data:
                yield sse.id, sse.data


def replicas(database_url: str, sim: RunningSimulator, redis_url: str, prefix: str, **a: Any) -> Any:
    """Replica A (where scans start; `a` overrides its settings) and replica B."""
    shared = {"redis_url": redis_url, "redis_prefix": prefix}
    return (
        running_service(settings_for(database_url, sim, **shared, **a)),
        running_service(settings_for(database_url, sim, **shared)),
    )


async def test_a_scan_running_on_a_is_followed_on_b_with_the_bytes_of_its_stored_replay(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, time_scale=SLOW)
    user = {"X-User-ID": "follows-anywhere"}
    replica_a, replica_b = replicas(database_url, sim, redis_server_url, redis_prefix)
    probe = redis.Redis.from_url(redis_server_url)
    async with replica_a as a, replica_b as b, httpx.AsyncClient(base_url=a.url, timeout=30) as client:
        events = start_scan(client, user, seed=501)
        seen = [await anext(events)]
        job_id = json.loads(seen[0][1])["job_id"]
        key = events_key(redis_prefix, job_id)
        assert await eventually(lambda: _xlen_at_least(probe, key, 3), attempts=300, interval=0.01)
        assert 300_000 < await probe.pttl(key) <= 360_000
        from_start = asyncio.create_task(raw_body(b, job_id, user))
        from_two = asyncio.create_task(raw_body(b, job_id, {**user, "Last-Event-ID": "2"}))
        seen += [event async for event in events]
        assert json.loads(seen[-1][1])["step"] == "done"
        (status_start, followed), (status_two, followed_from_two) = await asyncio.gather(from_start, from_two)

        assert (await scan_row(db, job_id))["status"] == "completed"
        stored_status, stored = await raw_body(b, job_id, user)  # from the database now
        assert (status_start, status_two, stored_status) == (200, 200, 200)
        assert followed == stored  # byte for byte
        assert stored.startswith("id: 1\r\n")
        assert followed_from_two == stored[stored.index("id: 3\r\n") :]
        assert id_and_data(stored) == seen  # what A sent live
        assert b.metric("ecoscan_scan_stream_follows_total", {"outcome": "served"}) == 2
        assert a.metric("ecoscan_scan_stream_events_mirrored_total") == len(seen)
        assert 0 < await probe.pttl(key) <= 60_000  # the ended scan's stream goes soon
    await probe.aclose()


async def test_a_client_that_moved_to_b_keeps_its_scan_running_past_as_grace(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str, db: asyncpg.Connection
) -> None:
    """A's only client leaves; A's disconnect grace (1 s) ends before the scan (~2 s from
    its first event) does, but the client now follows it on B, so A lets it run to `done`.
    (The grace is the time the client has to reach B: 0.3 s was too short on a loaded
    machine, where the suite runs on several workers.)"""
    await sim_configure(sim, time_scale=SLOW)
    user = {"X-User-ID": "phone-changed-replica"}
    replica_a, replica_b = replicas(database_url, sim, redis_server_url, redis_prefix, disconnect_grace_s=1.0)
    probe = redis.Redis.from_url(redis_server_url)
    async with replica_a as a, replica_b as b:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as client:
            events = start_scan(client, user, seed=502)
            first_id, first_data = await anext(events)
            job_id = json.loads(first_data)["job_id"]
            assert await eventually(lambda: _xlen_at_least(probe, events_key(redis_prefix, job_id), 1))
            await events.aclose()  # the connection to A drops
        status, rest = await raw_body(b, job_id, {**user, "Last-Event-ID": first_id})
        assert status == 200 and '"step":"done"' in rest.split("\r\n\r\n")[-2]
        row = await scan_row(db, job_id)
        assert (row["status"], row["error_code"]) == ("completed", None)
        _, stored = await raw_body(b, job_id, user)
        assert stored.endswith(rest) and stored.startswith(f"id: {first_id}\r\n")
    await probe.aclose()


async def test_without_a_usable_stream_it_is_409_and_the_scan_never_fails_for_redis(
    database_url: str, sim: RunningSimulator, own_redis: RedisServer, db: asyncpg.Connection
) -> None:
    """Redis stops while B follows A's scan: B's stream ends (no terminal event; the
    client resumes), B answers 409 until the scan ends, and A's scan completes."""
    await sim_configure(sim, time_scale=SLOW)
    user = {"X-User-ID": "redis-went-away"}
    replica_a, replica_b = replicas(database_url, sim, own_redis.url, "ecoscan-test")
    async with replica_a as a, replica_b as b, httpx.AsyncClient(base_url=a.url, timeout=30) as client:
        events = start_scan(client, user, seed=503)
        seen = [await anext(events)]
        job_id = json.loads(seen[0][1])["job_id"]
        probe = redis.Redis.from_url(own_redis.url)
        assert await eventually(lambda: _xlen_at_least(probe, events_key("ecoscan-test", job_id), 1))
        await probe.aclose()
        following = asyncio.create_task(raw_body(b, job_id, user))
        assert await eventually(lambda: b.metric("ecoscan_scan_stream_follows_total", {"outcome": "served"}))
        own_redis.stop()
        status, cut_short = await following
        assert status == 200 and cut_short.startswith("id: 1\r\n")
        assert '"step":"done"' not in cut_short and '"code"' not in cut_short
        refused_status, refused = await raw_body(b, job_id, {**user, "Last-Event-ID": "1"})
        assert (refused_status, json.loads(refused)["code"]) == (409, "SCAN_RUNNING_ELSEWHERE")

        seen += [event async for event in events]
        assert json.loads(seen[-1][1])["step"] == "done"
        assert (await scan_row(db, job_id))["status"] == "completed"
        assert a.metric("ecoscan_scan_stream_mirror_failures_total") >= 1
        assert b.metric("ecoscan_scan_stream_follows_total", {"outcome": "cut"}) == 1
        assert b.metric("ecoscan_scan_stream_follows_total", {"outcome": "refused"}) == 1
        _, stored = await raw_body(b, job_id, user)  # ended: from the database, on any replica
        assert stored.startswith(cut_short)


async def test_a_running_scan_without_a_stream_is_409(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str, db: asyncpg.Connection
) -> None:
    """A `running` row of another instance with nothing in Redis (not mirrored yet, or
    mirrored while Redis was away): 409 as without Redis; the status reads `running`;
    cancelling it from here stays 409."""
    elsewhere, owner = uuid.uuid4(), uuid.uuid4()
    user, scan_url = {"X-User-ID": "stream-less"}, f"/api/v1/scan/{elsewhere}"
    settings = settings_for(database_url, sim, redis_url=redis_server_url, redis_prefix=redis_prefix)
    # The owner is alive (a connection with its tag), so no lost-scan sweep ends its row.
    owner_alive = await asyncpg.connect(tagged_dsn(database_url, owner))
    async with running_service(settings) as svc:
        await db.execute(
            "INSERT INTO scans (id, user_id, status, image_source, instance_id)"
            " VALUES ($1, 'stream-less', 'running', 'upload', $2)",
            elsewhere,
            owner,
        )
        try:
            assert (await svc.client.get(scan_url, headers=user)).json()["status"] == "running"
            for method, url in (("GET", events_url(str(elsewhere))), ("DELETE", scan_url)):
                response = await svc.client.request(method, url, headers=user)
                refused = (response.status_code, response.json()["code"])
                assert refused == (409, "SCAN_RUNNING_ELSEWHERE"), method
            assert svc.metric("ecoscan_scan_stream_follows_total", {"outcome": "refused"}) == 1
        finally:
            await db.execute("DELETE FROM scans WHERE id = $1", elsewhere)
            await owner_alive.close()


async def _xlen_at_least(client: redis.Redis, key: str, count: int) -> bool:
    return int(await client.xlen(key)) >= count


async def test_one_user_cannot_take_more_than_its_followers_and_others_still_resume(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str
) -> None:
    """Issue 34: each follow of a scan running elsewhere holds one of B's Redis follower
    connections. A user at `FOLLOWERS_MAX_PER_USER` gets 429 `FOLLOWER_LIMIT` for one more,
    while another user's resume on B goes through to `done`."""
    await sim_configure(sim, time_scale=1.0)  # ~9 s a scan: the follows stay open while we look
    greedy, patient = {"X-User-ID": "greedy-follower"}, {"X-User-ID": "patient-follower"}
    shared = {"redis_url": redis_server_url, "redis_prefix": redis_prefix}
    replica_a = running_service(settings_for(database_url, sim, **shared))
    replica_b = running_service(settings_for(database_url, sim, **shared, followers_max_per_user=2))
    probe = redis.Redis.from_url(redis_server_url)
    async with (
        replica_a as a,
        replica_b as b,
        httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
    ):
        greedy_scan, patient_scan = start_scan(on_a, greedy, seed=511), start_scan(on_a, patient, seed=512)
        greedy_id = json.loads((await anext(greedy_scan))[1])["job_id"]
        patient_first, patient_data = await anext(patient_scan)
        patient_id = json.loads(patient_data)["job_id"]
        for job_id in (greedy_id, patient_id):
            assert await eventually(lambda j=job_id: _xlen_at_least(probe, events_key(redis_prefix, j), 1))
        async with AsyncExitStack() as held:
            for _ in range(2):
                following = await held.enter_async_context(
                    on_b.stream("GET", events_url(greedy_id), headers=greedy)
                )
                assert following.status_code == 200
            refused = await on_b.get(events_url(greedy_id), headers=greedy)
            assert (refused.status_code, refused.json()["code"]) == (429, "FOLLOWER_LIMIT")
            assert int(refused.headers["Retry-After"]) >= 1
            status, rest = await raw_body(b, patient_id, {**patient, "Last-Event-ID": patient_first})
            assert status == 200 and '"step":"done"' in rest.split("\r\n\r\n")[-2]
        assert b.metric("ecoscan_scan_stream_follows_total", {"outcome": "limited"}) == 1
        assert b.metric("ecoscan_scan_stream_follows_total", {"outcome": "served"}) == 3
        # Its streams closed, the greedy user follows again.
        status, _ = await raw_body(b, greedy_id, greedy)
        assert status == 200
        await greedy_scan.aclose()
        await patient_scan.aclose()
    await probe.aclose()
