"""Scans as resources, over real HTTP against the real PostgreSQL and the simulator:
status, resumable events (identical bytes), the disconnect grace, idempotency keys,
cancelling, ownership, the caller's collection, and the purge."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

import asyncpg
import httpx
import jwt
from httpx_sse import aconnect_sse

from app.sim.server import RunningSimulator

from .conftest import (
    SCAN_URL,
    Event,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
    sim_stats,
)


def scan_url(job_id: str, suffix: str = "") -> str:
    return f"/api/v1/scan/{job_id}{suffix}"


async def read_events(
    client: httpx.AsyncClient, method: str, url: str, **request: Any
) -> tuple[httpx.Response, list[Event]]:
    async with aconnect_sse(client, method, url, **request) as source:
        if source.response.status_code != 200:
            await source.response.aread()
            return source.response, []
        events = [
            Event(sse.event, sse.id, json.loads(sse.data)) async for sse in source.aiter_sse() if sse.data
        ]
        return source.response, events


async def stream_until(
    svc: Service, *, until: str, headers: dict[str, str], seed: int
) -> tuple[str, list[tuple[str, str, str]]]:
    """POST a scan, read raw events until one whose event/step matches `until`
    ("stage:rule", "delta", ...), then drop the connection; the job id and the raw
    (id, event, data) triples seen."""
    seen: list[tuple[str, str, str]] = []
    async with (
        httpx.AsyncClient(base_url=svc.url, timeout=30) as client,
        aconnect_sse(
            client, "POST", SCAN_URL, json={"image_url": data_url(make_jpeg(seed))}, headers=headers
        ) as source,
    ):
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():
            if not sse.data:
                continue
            seen.append((sse.id, sse.event, sse.data))
            step = json.loads(sse.data)["step"]
            if until in (sse.event, f"{sse.event}:{step}"):
                break
    return json.loads(seen[0][2])["job_id"], seen


async def raw_events(client: httpx.AsyncClient, url: str, **request: Any) -> list[tuple[str, str, str]]:
    async with aconnect_sse(client, "GET", url, **request) as source:
        assert source.response.status_code == 200, await source.response.aread()
        return [(sse.id, sse.event, sse.data) async for sse in source.aiter_sse() if sse.data]


async def test_a_finished_scan_has_a_status_and_replays_its_events_identically(service: Service) -> None:
    user = {"X-User-ID": "resource-owner"}
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
        async with aconnect_sse(
            client, "POST", SCAN_URL, json={"image_url": data_url(make_jpeg(301))}, headers=user
        ) as source:
            original = [(sse.id, sse.event, sse.data) async for sse in source.aiter_sse() if sse.data]
        job_id = json.loads(original[0][2])["job_id"]

        status = (await client.get(scan_url(job_id), headers=user)).json()
        assert status["status"] == "completed" and status["finished_at"] is not None
        assert status["result"] == json.loads(original[-1][2])

        assert await raw_events(client, scan_url(job_id, "/events"), headers=user) == original
        resumed = await raw_events(
            client, scan_url(job_id, "/events"), headers={**user, "Last-Event-ID": "3"}
        )
        assert resumed == original[3:]
        assert await raw_events(client, scan_url(job_id, "/events?after=5"), headers=user) == original[5:]


async def test_a_dropped_stream_resumes_at_every_stage_with_identical_events(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, time_scale=0.05)
    settings = settings_for(database_url, sim, disconnect_grace_s=10.0)
    user = {"X-User-ID": "phone-on-a-train"}
    async with running_service(settings) as svc:
        for seed, until in enumerate(["stage:vision", "stage:rule", "delta", "stage:reward"], start=310):
            job_id, seen = await stream_until(svc, until=until, headers=user, seed=seed)
            async with httpx.AsyncClient(base_url=svc.url, timeout=30) as client:
                rest = await raw_events(
                    client, scan_url(job_id, "/events"), headers={**user, "Last-Event-ID": seen[-1][0]}
                )
                assert rest[-1][1] == "done", (until, rest[-1])
                # What the two connections saw is exactly what is stored.
                stored = await raw_events(client, scan_url(job_id, "/events"), headers=user)
            assert seen + rest == stored, until
            assert (await scan_row(db, job_id))["status"] == "completed"
        assert (await sim_stats(sim))["by_kind"] == {"vision": 4, "text": 4}  # no scan paid twice


async def test_an_abandoned_scan_is_cancelled_after_the_grace(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
    settings = settings_for(database_url, sim, disconnect_grace_s=0.3)
    async with running_service(settings) as svc:
        job_id, _ = await stream_until(svc, until="stage:vision", headers={"X-User-ID": "gone"}, seed=320)

        async def cancelled() -> bool:
            row = await scan_row(db, job_id)
            return (row["status"], row["error_code"]) == ("cancelled", "CLIENT_DISCONNECTED")

        assert await eventually(cancelled, attempts=300, interval=0.02)


async def test_an_idempotent_post_twice_is_one_scan_replayed(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    request = {
        "json": {"image_url": data_url(make_jpeg(330))},
        "headers": {"X-User-ID": "retrier", "Idempotency-Key": "k-330"},
    }
    first = await run_scan(service.client, **request)
    second = await run_scan(service.client, **request)
    assert first.headers["x-scan-id"] == second.headers["x-scan-id"]
    assert second.headers["idempotent-replayed"] == "true"
    assert [(e.id, e.event, e.data) for e in second.events] == [(e.id, e.event, e.data) for e in first.events]
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}
    other_body = {**request, "json": {"image_url": data_url(make_jpeg(331))}}
    reused = await run_scan(service.client, **other_body)
    assert (reused.status, reused.body["code"]) == (422, "IDEMPOTENCY_KEY_REUSED")
    count = await db.fetchval("SELECT count(*) FROM scans WHERE idempotency_key = 'k-330'")
    assert count == 1


async def test_a_key_whose_scan_ended_retryably_starts_a_linked_new_attempt(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    request = {
        "json": {"image_url": data_url(make_jpeg(335))},
        "headers": {"X-User-ID": "unlucky", "Idempotency-Key": "k-335"},
    }
    await sim_configure(sim, outage="503")
    failed = await run_scan(service.client, **request)
    assert failed.terminal.event == "error" and failed.terminal.data["retryable"] is True
    await sim_configure(sim, outage="none")
    retried = await run_scan(service.client, **request)
    old_id, new_id = failed.headers["x-scan-id"], retried.headers["x-scan-id"]
    assert new_id != old_id and retried.headers["x-retry-of"] == old_id
    assert "idempotent-replayed" not in retried.headers
    assert retried.terminal.event == "done"
    status = await service.client.get(f"/api/v1/scan/{new_id}", headers={"X-User-ID": "unlucky"})
    assert status.json()["retry_of"] == old_id
    # The completed attempt pins the key now: the same POST replays it.
    again = await run_scan(service.client, **request)
    assert again.headers["x-scan-id"] == new_id and again.headers["idempotent-replayed"] == "true"
    rows = await db.fetch(
        "SELECT id::text, status, retry_of::text, idempotency_key FROM scans WHERE id = ANY($1::uuid[])",
        [old_id, new_id],
    )
    by_id = {r["id"]: r for r in rows}
    assert (by_id[old_id]["status"], by_id[old_id]["idempotency_key"]) == ("failed", None)
    assert (by_id[new_id]["retry_of"], by_id[new_id]["idempotency_key"]) == (old_id, "k-335")


async def test_five_concurrent_duplicates_make_one_scan(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, time_scale=0.02)
    request = {
        "json": {"image_url": data_url(make_jpeg(340))},
        "headers": {"X-User-ID": "hammer", "Idempotency-Key": "k-340"},
    }
    outcomes = await asyncio.gather(*(run_scan(service.client, **request) for _ in range(5)))
    assert {o.status for o in outcomes} == {200}
    assert len({o.headers["x-scan-id"] for o in outcomes}) == 1
    assert all(o.terminal.event == "done" for o in outcomes)
    assert await db.fetchval("SELECT count(*) FROM scans WHERE idempotency_key = 'k-340'") == 1
    assert (await sim_stats(sim))["by_kind"] == {"vision": 1, "text": 1}


async def test_only_the_owner_reads_or_cancels_a_scan(service: Service) -> None:
    owner, other = {"X-User-ID": "owner-1"}, {"X-User-ID": "someone-else"}
    done = await run_scan(service.client, json={"image_url": data_url(make_jpeg(350))}, headers=owner)
    job_id = done.headers["x-scan-id"]
    for headers in (other, {}):
        for method, url in (
            ("GET", scan_url(job_id)),
            ("GET", scan_url(job_id, "/events")),
            ("DELETE", scan_url(job_id)),
        ):
            response = await service.client.request(method, url, headers=headers)
            assert (response.status_code, response.json()["code"]) == (404, "SCAN_NOT_FOUND"), (method, url)
    missing = await service.client.get(scan_url(str(uuid.uuid4())), headers=owner)
    assert missing.status_code == 404 and missing.json()["code"] == "SCAN_NOT_FOUND"
    assert (await service.client.get(scan_url("not-a-uuid"), headers=owner)).status_code == 404
    finished = await service.client.delete(scan_url(job_id), headers=owner)
    assert (finished.status_code, finished.json()["code"]) == (409, "SCAN_FINISHED")


async def test_an_anonymous_scan_is_read_with_its_token(service: Service) -> None:
    done = await run_scan(service.client, json={"image_url": data_url(make_jpeg(360))})
    job_id, token = done.headers["x-scan-id"], done.headers["x-scan-token"]
    assert (await service.client.get(scan_url(job_id))).status_code == 404
    assert (await service.client.get(scan_url(job_id), params={"token": "wrong"})).status_code == 404
    assert (await service.client.get(scan_url(job_id), params={"token": token})).json()[
        "status"
    ] == "completed"
    by_header = await service.client.get(scan_url(job_id), headers={"X-Scan-Token": token})
    assert by_header.status_code == 200


async def test_the_owner_cancels_a_running_scan(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
    settings = settings_for(database_url, sim, disconnect_grace_s=10.0)
    owner = {"X-User-ID": "changed-my-mind"}
    async with running_service(settings) as svc:
        job_id, _ = await stream_until(svc, until="stage:vision", headers=owner, seed=370)
        response = await svc.client.delete(scan_url(job_id), headers=owner)
        assert response.status_code == 202
        events = await raw_events(svc.client, scan_url(job_id, "/events"), headers=owner)
        assert events[-1][1] == "error" and json.loads(events[-1][2])["code"] == "CANCELLED"
        row = await scan_row(db, job_id)
        assert (row["status"], row["error_code"]) == ("cancelled", "CANCELLED")


async def test_my_characters_lists_what_my_scans_earned(service: Service) -> None:
    user = {"X-User-ID": f"collector-{uuid.uuid4().hex[:8]}"}
    rewarded = None
    for seed in range(100, 160):  # scan until one earns a character (the simulator decides)
        outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(seed))}, headers=user)
        reward = outcome.terminal.data.get("reward")
        if reward and reward["received"]:
            rewarded = (outcome.headers["x-scan-id"], reward["character"]["code"])
            break
    assert rewarded is not None, "no scan earned a character"
    mine = (await service.client.get("/api/v1/users/me/characters", headers=user)).json()["characters"]
    assert [(c["scan_id"], c["code"]) for c in mine] == [rewarded]
    anonymous = await service.client.get("/api/v1/users/me/characters")
    assert anonymous.status_code == 401


async def test_the_purge_deletes_finished_scans_past_the_retention(
    service: Service, db: asyncpg.Connection
) -> None:
    done = await run_scan(
        service.client, json={"image_url": data_url(make_jpeg(410))}, headers={"X-User-ID": "old"}
    )
    job_id = uuid.UUID(done.headers["x-scan-id"])
    await db.execute("UPDATE scans SET created_at = now() - interval '40 days' WHERE id = $1", job_id)
    from app.scans.store import ScanStore

    pool = await asyncpg.create_pool(str(service.settings.database_url), min_size=1, max_size=1)
    try:
        store = ScanStore(pool, instance_id=uuid.uuid4(), timeout_s=5)
        assert await store.purge(older_than_days=30, batch=1000) >= 1
    finally:
        await pool.close()
    assert await db.fetchval("SELECT count(*) FROM scans WHERE id = $1", job_id) == 0


async def test_with_jwt_identity_only_the_tokens_subject_owns_its_scans(
    database_url: str, sim: RunningSimulator
) -> None:
    secret = "s" * 40
    settings = settings_for(
        database_url, sim, auth_mode="jwt", auth_jwt_secret=secret, auth_jwt_audience="ecoscan"
    )

    def bearer(sub: str, *, expires_in: int = 300, audience: str = "ecoscan") -> dict[str, str]:
        now = int(time.time())
        claims = {"sub": sub, "aud": audience, "iat": now, "exp": now + expires_in}
        return {"Authorization": f"Bearer {jwt.encode(claims, secret, algorithm='HS256')}"}

    async with running_service(settings) as svc:
        done = await run_scan(
            svc.client, json={"image_url": data_url(make_jpeg(420))}, headers=bearer("alice")
        )
        assert done.terminal.event == "done" and "x-scan-token" not in done.headers
        job_id = done.headers["x-scan-id"]
        assert (await svc.client.get(scan_url(job_id), headers=bearer("alice"))).status_code == 200
        cases = {
            "another user": (bearer("mallory"), 404, "SCAN_NOT_FOUND"),
            "no token": ({}, 401, "UNAUTHENTICATED"),
            "X-User-ID is not identity here": ({"X-User-ID": "alice"}, 401, "UNAUTHENTICATED"),
            "expired": (bearer("alice", expires_in=-120), 401, "TOKEN_EXPIRED"),
            "wrong audience": (bearer("alice", audience="other"), 401, "TOKEN_INVALID"),
            "garbage": ({"Authorization": "Bearer not.a.jwt"}, 401, "TOKEN_INVALID"),
        }
        for name, (headers, status, code) in cases.items():
            response = await svc.client.get(scan_url(job_id), headers=headers)
            assert (response.status_code, response.json()["code"]) == (status, code), name
            if status == 401:
                assert response.headers["www-authenticate"].startswith("Bearer"), name
        refused = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(421))})
        assert (refused.status, refused.body["code"]) == (401, "UNAUTHENTICATED")


async def raw_get(service: Service, path: str, headers: dict[str, str | bytes]) -> bytes:
    """A GET sent byte for byte, with `Connection: close`; the whole answer as received."""
    host, port = service.url.removeprefix("http://").split(":")
    fields = b"".join(
        name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()) + b"\r\n"
        for name, value in headers.items()
    )
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + fields + b"\r\n"
        )
        async with asyncio.timeout(30):
            return await reader.read(-1)
    finally:
        writer.close()


async def test_positions_at_or_past_the_end_and_odd_positions(
    service: Service, db: asyncpg.Connection
) -> None:
    user = {"X-User-ID": "edge-reader"}
    done = await run_scan(service.client, json={"image_url": data_url(make_jpeg(430))}, headers=user)
    job_id, last = done.headers["x-scan-id"], done.terminal.id
    # An EventSource reconnecting after `done` with its id: 204, which stops it (no endless stream).
    for position in (last, str(int(last) + 5)):
        response = await service.client.get(
            scan_url(job_id, "/events"), headers={**user, "Last-Event-ID": position}
        )
        assert response.status_code == 204, position
    # Whitespace around the header's value is not part of it: "3\t" is position 3 (sent
    # over a raw socket: httpx refuses to send such a header).
    event_ids = [int(n) for n in range(4, int(last) + 1)]
    for padded in (b"3\t", b"3 \t"):
        answer = await raw_get(service, scan_url(job_id, "/events"), {**user, "Last-Event-ID": padded})
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert [int(n) for n in re.findall(rb"(?m)^id: (\d+)\r?$", answer)] == event_ids, padded
    for odd in ("²", "-1", "1.5", "9" * 12, "3 4"):
        response = await service.client.get(scan_url(job_id, "/events"), params={"after": odd}, headers=user)
        assert (response.status_code, response.json()["code"]) == (422, "INVALID_REQUEST"), odd
    # A scan whose process was lost has a row but no stored log: 410, its status still readable.
    lost = uuid.uuid4()
    await db.execute(
        "INSERT INTO scans (id, user_id, status, image_source, error_code)"
        " VALUES ($1, $2, 'failed', 'upload', 'PROCESS_LOST')",
        lost,
        "edge-reader",
    )
    gone = await service.client.get(scan_url(str(lost), "/events"), headers=user)
    assert (gone.status_code, gone.json()["code"]) == (410, "SCAN_EVENTS_UNAVAILABLE")
    assert (await service.client.get(scan_url(str(lost)), headers=user)).json()["status"] == "failed"


async def test_a_scan_running_on_another_replica_is_409_until_it_ends(
    service: Service, db: asyncpg.Connection
) -> None:
    """A `running` row this process has no run for (another replica's scan)."""
    elsewhere = uuid.uuid4()
    await db.execute(
        "INSERT INTO scans (id, user_id, status, image_source, instance_id)"
        " VALUES ($1, 'replica-user', 'running', 'upload', $2)",
        elsewhere,
        uuid.uuid4(),
    )
    user = {"X-User-ID": "replica-user"}
    assert (await service.client.get(scan_url(str(elsewhere)), headers=user)).json()["status"] == "running"
    for method, url in (("GET", scan_url(str(elsewhere), "/events")), ("DELETE", scan_url(str(elsewhere)))):
        response = await service.client.request(method, url, headers=user)
        assert (response.status_code, response.json()["code"]) == (409, "SCAN_RUNNING_ELSEWHERE"), method
    await db.execute("DELETE FROM scans WHERE id = $1", elsewhere)  # not left for the lost-scan sweep
