"""A replica dies with a scan in it: two `uvicorn app.main:app` processes on one
PostgreSQL and Redis, the owner SIGKILLed mid-answer or mid-vision while a follower reads
the scan from the other one. With takeover the other replica finishes the scan (one
`done`; a completed vision call not paid twice, one in flight paid once more); without,
or with no time left before the scan's deadline, the follower gets `PROCESS_LOST` within
moments of the owner's lease lapsing, and the same Idempotency-Key then starts a new
attempt."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from app.scans.handover import Handover
from app.sim.server import RunningSimulator

from .conftest import SCAN_URL, Event, data_url, make_jpeg, run_scan, scan_row, sim_configure, sim_stats
from .service_process import ServiceProcess, service_env, service_process

# A fast vision call and an answer that streams for ~8 s (no spread): the first delta
# comes ~1.2 s into the answer, leaving ~7 s in which the owner dies mid-answer.
SLOW_ANSWER = {"vision_median_s": 0.3, "text_median_s": 8.0, "latency_sigma": 0.0, "time_scale": 1.0}
# A vision call of ~6 s and a short answer: the owner dies ~1 s into the vision call.
SLOW_VISION = {"vision_median_s": 6.0, "text_median_s": 0.5, "latency_sigma": 0.0, "time_scale": 1.0}
# From the vision stage's `started` event to the kill: its entry is mirrored (a follower
# on the other replica is served from it) and the vision call is in flight.
INTO_VISION_S = 0.7
# A deadline the scan of SLOW_ANSWER cannot meet once its owner is dead: killed at its first
# delta (~1.5 s in), its lease lapses up to LEASE_TTL_S later, past this.
SHORT_DEADLINE_S = 4.0
LEASE_TTL_S = 3.0
# From the owner's last renewal to the follower's terminal event: the lease runs out, the
# survivor's next renewal judges it (one renew interval), the end reaches the stream.
TERMINAL_AFTER_LAPSE_S = 2.0
READ_TIMEOUT_S = 60.0


class Follower:
    """The scan's events, read from `url` after `after`; every event in `events`."""

    def __init__(self, url: str, scan_id: str, after: int, user: str) -> None:
        self.events: list[Event] = []
        self.ended_at: float | None = None
        headers = {"X-User-ID": user, "Last-Event-ID": str(after)}
        self.task = asyncio.create_task(self._read(url, f"/api/v1/scan/{scan_id}/events", headers))

    async def _read(self, url: str, path: str, headers: dict[str, str]) -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=READ_TIMEOUT_S) as client,
            aconnect_sse(client, "GET", path, headers=headers) as source,
        ):
            assert source.response.status_code == 200, await source.response.aread()
            async for sse in source.aiter_sse():
                if sse.data:
                    self.events.append(Event(sse.event, sse.id, json.loads(sse.data)))
                    if sse.event in ("done", "error"):
                        self.ended_at = time.monotonic()
        if self.ended_at is None:
            self.ended_at = time.monotonic()

    def terminals(self) -> list[Event]:
        return [e for e in self.events if e.event in ("done", "error")]


def first_delta(sse: ServerSentEvent) -> bool:
    return sse.event == "delta"


def vision_started(sse: ServerSentEvent) -> bool:
    data = json.loads(sse.data) if sse.data else {}
    return sse.event == "stage" and (data.get("step"), data.get("status")) == ("vision", "started")


async def post_until(
    svc: ServiceProcess, user: str, key: str, until: Callable[[ServerSentEvent], bool] = first_delta
) -> tuple[str, int]:
    """POST a scan on `svc` and read it until the first event `until` accepts; the scan id
    and that event's id. The connection stays open (the owner is about to die under it)."""
    found: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()

    async def read() -> None:
        headers = {"X-User-ID": user, "Idempotency-Key": key}
        body = {"image_url": data_url(make_jpeg(901))}
        async with (
            httpx.AsyncClient(base_url=svc.url, timeout=READ_TIMEOUT_S) as client,
            aconnect_sse(client, "POST", SCAN_URL, json=body, headers=headers) as source,
        ):
            async for sse in source.aiter_sse():
                if until(sse) and not found.done():
                    found.set_result((json.loads(sse.data)["job_id"], int(sse.id)))

    reader = asyncio.create_task(read())
    try:
        async with asyncio.timeout(30):
            return await found
    finally:
        reader.add_done_callback(lambda t: t.cancelled() or t.exception())


def two_replicas_env(
    database_url: str, sim: RunningSimulator, redis_url: str, prefix: str, **more: str
) -> Any:
    return service_env(
        database_url,
        sim,
        REDIS_URL=redis_url,
        REDIS_PREFIX=prefix,
        LIVENESS_TTL_S=str(LEASE_TTL_S),
        LIVENESS_RENEW_S="1",
        **more,
    )


async def kill_owner_mid_answer(
    owner: ServiceProcess, other: ServiceProcess, user: str, key: str
) -> tuple[str, Follower, float]:
    """The scan started on `owner`, followed from `other`, then `owner` SIGKILLed; the
    scan id, the follower and when the kill happened."""
    scan_id, seen = await post_until(owner, user, key)
    assert seen > 3  # vision completed: its stage events came before the answer's delta
    follower = Follower(other.url, scan_id, seen, user)
    await asyncio.sleep(0.3)  # the follower is reading the stream
    owner.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    await owner.exited()
    return scan_id, follower, killed_at


async def test_a_scan_whose_owner_died_mid_answer_is_finished_by_the_other_replica(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    redis_server_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    await sim_configure(sim, **SLOW_ANSWER)
    env = two_replicas_env(database_url, sim, redis_server_url, redis_prefix)
    async with (
        service_process(env, tmp_path / "a.log") as a,
        service_process(env, tmp_path / "b.log") as b,
    ):
        scan_id, follower, _ = await kill_owner_mid_answer(a, b, "survivor", "k-901")
        instance_a = (await scan_row(db, scan_id))["instance_id"]
        async with asyncio.timeout(READ_TIMEOUT_S):
            await follower.task
        row = await scan_row(db, scan_id)
        assert f"scan {scan_id} of dead instance {instance_a} claimed: resumed" in b.log, b.log

    assert [e.event for e in follower.terminals()] == ["done"], follower.events
    # One seamless stream: seq goes on from the follower's position, the dead owner's
    # partial text is void (`discard`) before the new one.
    seqs = [int(e.id) for e in follower.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    kinds = [e.event for e in follower.events]
    assert "discard" in kinds and kinds.index("discard") < len(kinds) - 1
    assert row["status"] == "completed"
    assert row["instance_id"] not in (None, instance_a)  # the other replica's now
    stats = await sim_stats(sim)
    assert stats["by_kind"]["vision"] == 1, stats  # the completed vision call is not repeated
    assert stats["by_kind"]["text"] == 2, stats  # the answer the owner died in, then the new one
    stored = json.loads(row["event_log"]) if isinstance(row["event_log"], str) else row["event_log"]
    assert stored[-1][2] == "done" and [e[0] for e in stored] == list(range(1, len(stored) + 1))


async def test_without_takeover_the_follower_gets_process_lost_and_the_key_retries(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    redis_server_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    await sim_configure(sim, **SLOW_ANSWER)
    env = two_replicas_env(database_url, sim, redis_server_url, redis_prefix, TAKEOVER="false")
    async with (
        service_process(env, tmp_path / "a.log") as a,
        service_process(env, tmp_path / "b.log") as b,
    ):
        scan_id, follower, killed_at = await kill_owner_mid_answer(a, b, "unlucky", "k-902")
        async with asyncio.timeout(READ_TIMEOUT_S):
            await follower.task
        assert follower.ended_at is not None
        # The lease lapses at most LEASE_TTL_S after the kill (renewed up to then).
        assert follower.ended_at - killed_at <= LEASE_TTL_S + TERMINAL_AFTER_LAPSE_S, (
            follower.ended_at - killed_at
        )
        (terminal,) = follower.terminals()
        assert (terminal.event, terminal.data["code"], terminal.data["retryable"]) == (
            "error",
            "PROCESS_LOST",
            True,
        )
        row = await scan_row(db, scan_id)
        assert (row["status"], row["error_code"]) == ("failed", "PROCESS_LOST")

        await sim_configure(sim, text_median_s=0.5)
        async with httpx.AsyncClient(base_url=b.url, timeout=READ_TIMEOUT_S) as client:
            retried = await run_scan(
                client,
                json={"image_url": data_url(make_jpeg(901))},
                headers={"X-User-ID": "unlucky", "Idempotency-Key": "k-902"},
            )
    assert retried.headers["x-retry-of"] == scan_id
    assert retried.terminal.event == "done"


async def test_a_scan_whose_owner_died_mid_vision_pays_the_vision_call_once_more(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    redis_server_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    await sim_configure(sim, **SLOW_VISION)
    env = two_replicas_env(database_url, sim, redis_server_url, redis_prefix)
    async with (
        service_process(env, tmp_path / "a.log") as a,
        service_process(env, tmp_path / "b.log") as b,
    ):
        scan_id, seen = await post_until(a, "midvision", "k-903", vision_started)
        await asyncio.sleep(INTO_VISION_S)
        follower = Follower(b.url, scan_id, seen, "midvision")
        await asyncio.sleep(0.3)  # the follower is reading the stream
        assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 0}  # in flight
        instance_a = (await scan_row(db, scan_id))["instance_id"]
        a.signal(signal.SIGKILL)
        await a.exited()
        async with asyncio.timeout(READ_TIMEOUT_S):
            await follower.task
        row = await scan_row(db, scan_id)
        assert f"scan {scan_id} of dead instance {instance_a} claimed: resumed" in b.log, b.log

    assert [e.event for e in follower.terminals()] == ["done"], follower.events
    seqs = [int(e.id) for e in follower.events]
    assert seqs == list(range(seen + 1, seen + 1 + len(seqs))), seqs
    assert row["status"] == "completed"
    assert row["instance_id"] not in (None, instance_a)
    # The vision call in flight died with its owner: its result was never mirrored, so the
    # taker makes it again, once (2 in all: the simulator counts a call when it arrives).
    # The answer had not started: one text call.
    stats = await sim_stats(sim)
    assert stats["by_kind"] == {"vision": 2, "text": 1}, stats
    stored = json.loads(row["event_log"]) if isinstance(row["event_log"], str) else row["event_log"]
    assert stored[-1][2] == "done" and [e[0] for e in stored] == list(range(1, len(stored) + 1))
    vision_completed = [
        e for e in stored if e[2] == "stage" and e[3] == "vision" and e[4]["status"] == "completed"
    ]
    assert len(vision_completed) == 1, stored


async def test_a_scan_with_no_time_left_ends_process_lost_for_its_follower(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    redis_server_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    """Takeover on, but the scan's deadline passes while its owner is dead: the replica that
    claims it ends it at once with `PROCESS_LOST` (retryable, what the client can act on:
    the same key starts a new attempt), not a run it cannot finish in time."""
    await sim_configure(sim, **SLOW_ANSWER)
    env = two_replicas_env(
        database_url, sim, redis_server_url, redis_prefix, SCAN_DEADLINE_S=str(SHORT_DEADLINE_S)
    )
    async with (
        service_process(env, tmp_path / "a.log") as a,
        service_process(env, tmp_path / "b.log") as b,
    ):
        scan_id, follower, killed_at = await kill_owner_mid_answer(a, b, "late", "k-904")
        async with asyncio.timeout(READ_TIMEOUT_S):
            await follower.task
        assert follower.ended_at is not None
        assert follower.ended_at - killed_at <= LEASE_TTL_S + TERMINAL_AFTER_LAPSE_S, (
            follower.ended_at - killed_at
        )
        row = await scan_row(db, scan_id)
        assert f"scan {scan_id} of dead instance" in b.log and "claimed: lost" in b.log, b.log

    (terminal,) = follower.terminals()
    assert (terminal.event, terminal.data["code"], terminal.data["retryable"]) == (
        "error",
        "PROCESS_LOST",
        True,
    )
    assert "too little of its deadline was left" in terminal.data["message"], terminal.data
    assert follower.events[-1] is terminal
    assert (row["status"], row["error_code"]) == ("failed", "PROCESS_LOST")
    stored = json.loads(row["event_log"]) if isinstance(row["event_log"], str) else row["event_log"]
    assert [e for e in stored if e[2] in ("done", "error")] == [stored[-1]]
    assert stored[-1][0] == int(terminal.id) and stored[-1][4]["code"] == "PROCESS_LOST"
    # No run was started for it: the answer the owner died in is the only text call.
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}


def test_an_untraced_handover_record_is_one_the_version_before_traces_can_read() -> None:
    """Mid-rollout, a replica of the version before traces takes over scans of the new one:
    its `Handover` has no `traceparent` field and refuses a record with unknown keys."""
    untraced = Handover(
        source="url",
        image_url="https://example.com/a.jpg",
        image=None,
        user_input=None,
        user_id="u",
        rate_key="u:u",
        token_sha256=None,
        retry_of=None,
        timings={},
        received_at=1.0,
        deadline_at=2.0,
    )
    assert "traceparent" not in json.loads(untraced.encode())
    assert Handover.decode(untraced.encode()) == untraced
    traced = dataclasses.replace(untraced, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert Handover.decode(traced.encode()) == traced
