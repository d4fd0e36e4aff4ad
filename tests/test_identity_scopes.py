"""Identity over HTTP (app/intake/identity.py): keys by kind, so that a user who calls
itself `anon:127.0.0.1` is not the anonymous caller at 127.0.0.1 (neither its idempotent
scans nor its per-user cap); the rows written before keep their retries (migration 008);
and a gateway that proves itself with AUTH_GATEWAY_SECRET."""

from __future__ import annotations

import uuid

import asyncpg

from app.db.migrations import bundled_migrations
from app.sim.server import RunningSimulator
from tests.conftest import (
    Service,
    data_url,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
)
from tests.test_lifecycle import stalled_scan

IMPOSTOR = "anon:127.0.0.1"  # the anonymous key of the test client, before keys had kinds
GATEWAY_SECRET = "gateway-secret-for-http-tests-42"


async def test_a_user_named_anon_cannot_replay_an_anonymous_callers_scan(
    service: Service, db: asyncpg.Connection
) -> None:
    key = f"k-{uuid.uuid4()}"
    body = {"image_url": data_url(make_jpeg(401))}
    anonymous = await run_scan(service.client, json=body, headers={"Idempotency-Key": key})
    assert anonymous.terminal.event == "done" and anonymous.headers["x-scan-token"]
    impostor = await run_scan(
        service.client, json=body, headers={"Idempotency-Key": key, "X-User-ID": IMPOSTOR}
    )
    assert impostor.terminal.event == "done"
    assert "idempotent-replayed" not in impostor.headers
    assert impostor.headers["x-scan-id"] != anonymous.headers["x-scan-id"]
    # Nor read or cancel it without its token (its owner is nobody's user id).
    scan_url = f"/api/v1/scan/{anonymous.headers['x-scan-id']}"
    for method in ("GET", "DELETE"):
        response = await service.client.request(method, scan_url, headers={"X-User-ID": IMPOSTOR})
        assert (response.status_code, response.json()["code"]) == (404, "SCAN_NOT_FOUND")
    # The anonymous caller's own retry is still its scan, replayed.
    again = await run_scan(service.client, json=body, headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-scan-id"] == anonymous.headers["x-scan-id"]
    scopes = await db.fetch(
        "SELECT user_id, idempotency_scope FROM scans WHERE idempotency_key = $1 ORDER BY created_at", key
    )
    assert [tuple(r) for r in scopes] == [(None, "a:127.0.0.1"), (IMPOSTOR, f"u:{IMPOSTOR}")]


async def test_a_user_named_anon_does_not_share_an_anonymous_callers_cap(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, max_inflight_per_user=1)
    await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
    async with (
        running_service(settings) as svc,
        stalled_scan(svc, None, seed=402),
        stalled_scan(svc, IMPOSTOR, seed=403),  # admitted: it is not the anonymous caller
    ):
        anonymous_again = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(404))})
        assert (anonymous_again.status, anonymous_again.body["code"]) == (429, "USER_CONCURRENCY_LIMIT")
        impostor_again = await run_scan(
            svc.client, json={"image_url": data_url(make_jpeg(405))}, headers={"X-User-ID": IMPOSTOR}
        )
        assert (impostor_again.status, impostor_again.body["code"]) == (429, "USER_CONCURRENCY_LIMIT")


async def test_rows_written_before_scopes_had_kinds_keep_their_retries(
    service: Service, db: asyncpg.Connection
) -> None:
    """Migration 008 rewrites the old scopes (a user's id, `anon:<address>`) to the new."""
    requests = {
        "legacy-user": {"X-User-ID": "legacy-user"},
        None: {},
        IMPOSTOR: {"X-User-ID": IMPOSTOR},
    }
    bodies = {who: {"image_url": data_url(make_jpeg(410 + n))} for n, who in enumerate(requests)}
    firsts = {}
    for who, headers in requests.items():
        key = f"k-{uuid.uuid4()}"
        headers["Idempotency-Key"] = key
        firsts[who] = await run_scan(service.client, json=bodies[who], headers=headers)
        old_scope = who if who is not None else "anon:127.0.0.1"
        await db.execute("UPDATE scans SET idempotency_scope = $1 WHERE idempotency_key = $2", old_scope, key)
    migration = next(m for m in bundled_migrations() if m.name == "008_identity_scopes.sql")
    for _ in range(2):  # re-applied, it changes nothing more
        await db.execute(migration.sql)
        for who, headers in requests.items():
            scope = await db.fetchval(
                "SELECT idempotency_scope FROM scans WHERE idempotency_key = $1", headers["Idempotency-Key"]
            )
            assert scope == (f"u:{who}" if who is not None else "a:127.0.0.1")
    for who, headers in requests.items():
        again = await run_scan(service.client, json=bodies[who], headers=headers)
        assert again.headers["idempotent-replayed"] == "true", who
        assert again.headers["x-scan-id"] == firsts[who].headers["x-scan-id"]


async def test_migration_008_moves_users_whose_new_scopes_collide_with_old_ones(
    service: Service, db: asyncpg.Connection
) -> None:
    """Users `bob` and `u:bob` used the same Idempotency-Key before scopes had kinds: `bob`
    becomes `u:bob` while the other row still holds that scope, which the unique index
    refuses row by row unless the move goes through a prefix no scope holds."""
    key = f"k-{uuid.uuid4()}"
    bob = f"bob-{uuid.uuid4().hex[:6]}"
    u_bob = f"u:{bob}"
    for n, user in enumerate((bob, u_bob)):
        headers = {"X-User-ID": user, "Idempotency-Key": key}
        await run_scan(service.client, json={"image_url": data_url(make_jpeg(430 + n))}, headers=headers)
        await db.execute(
            "UPDATE scans SET idempotency_scope = $1 WHERE idempotency_key = $2 AND user_id = $1", user, key
        )
    migration = next(m for m in bundled_migrations() if m.name == "008_identity_scopes.sql")
    await db.execute(migration.sql)
    rows = await db.fetch("SELECT user_id, idempotency_scope FROM scans WHERE idempotency_key = $1", key)
    assert {(r["user_id"], r["idempotency_scope"]) for r in rows} == {(bob, u_bob), (u_bob, f"u:{u_bob}")}


async def test_with_a_gateway_secret_only_the_gateway_names_users(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, auth_gateway_secret=GATEWAY_SECRET)
    body = {"image_url": data_url(make_jpeg(420))}
    async with running_service(settings) as svc:
        proven = {"X-User-ID": "gina", "X-Gateway-Secret": GATEWAY_SECRET}
        scan = await run_scan(svc.client, json=body, headers=proven)
        assert scan.terminal.event == "done"
        scan_url = f"/api/v1/scan/{scan.headers['x-scan-id']}"
        assert (await svc.client.get(scan_url, headers=proven)).status_code == 200
        for forged in ({"X-User-ID": "gina"}, {"X-User-ID": "gina", "X-Gateway-Secret": "guessed-guessed-1"}):
            refused = await run_scan(svc.client, json=body, headers=forged)
            assert (refused.status, refused.body["code"]) == (401, "GATEWAY_SECRET_INVALID")
            assert "www-authenticate" in refused.headers
            for method in ("GET", "DELETE"):
                response = await svc.client.request(method, scan_url, headers=forged)
                assert (response.status_code, response.json()["code"]) == (401, "GATEWAY_SECRET_INVALID")
            mine = await svc.client.get("/api/v1/users/me/characters", headers=forged)
            assert (mine.status_code, mine.json()["code"]) == (401, "GATEWAY_SECRET_INVALID")
        # Anonymous callers need no secret.
        anonymous = await run_scan(svc.client, json=body)
        assert anonymous.terminal.event == "done" and anonymous.headers["x-scan-token"]
