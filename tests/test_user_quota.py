"""Per-user scan rate and quota (app/limits/user_quota.py): exact counts in a real Redis
shared by two reservers (as two replicas), this process's own count without Redis and
while Redis is away; then over HTTP against real uvicorn: two replicas sharing one Redis
see one rate and one quota, a single one without Redis, a refusal before the body is read,
refused and repeated scans that use nothing, and anonymous IPv6 callers counted per /64."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from app.errors import Overloaded, UserOverLimit, UserQuotaExhausted, UserRateLimited
from app.limits import user_quota as user_quota_module
from app.limits.user_quota import (
    QUOTA_WINDOW_S,
    RATE_WINDOW_S,
    SWEEP_EVERY,
    UserQuota,
    Window,
    windows,
)
from app.runtime.redis_link import RedisLink
from app.sim.server import RunningSimulator
from tests.conftest import (
    SCAN_URL,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
    sim_configure,
)
from tests.redis_server import RedisServer
from tests.test_lifecycle import stalled_scan

# A window short enough to see it free itself in a test, long enough that the reservations
# before the refusal are made well within it on a loaded machine.
SHORT_WINDOW_S = 5.0


@contextlib.asynccontextmanager
async def redis_link(url: str, prefix: str, timeout_s: float = 0.5) -> AsyncIterator[RedisLink]:
    link = RedisLink(url, prefix=prefix, timeout_s=timeout_s)
    try:
        yield link
    finally:
        await link.close()


@contextlib.asynccontextmanager
async def user_quota(limits: tuple[Window, ...], link: RedisLink | None = None) -> AsyncIterator[UserQuota]:
    quota = UserQuota(limits, link=link)
    try:
        yield quota
    finally:
        await quota.aclose()


async def refusal(quota: UserQuota, rate_key: str) -> Overloaded:
    with pytest.raises(Overloaded) as raised:
        await quota.reserve(rate_key)
    return raised.value


# --- the windows, with and without Redis ----------------------------------------------


def test_settings_turn_windows_on_and_off() -> None:
    assert windows(0, 0) == ()
    assert [(w.name, w.limit, w.seconds) for w in windows(5, 0)] == [("rate", 5, RATE_WINDOW_S)]
    both = windows(5, 100)
    assert [(w.name, w.refusal) for w in both] == [("quota", UserQuotaExhausted), ("rate", UserRateLimited)]
    assert both[0].seconds == QUOTA_WINDOW_S


async def test_two_reservers_on_one_redis_grant_exactly_the_limit(
    redis_server_url: str, redis_prefix: str
) -> None:
    limits = windows(7, 0)
    async with (
        redis_link(redis_server_url, redis_prefix) as link_a,
        redis_link(redis_server_url, redis_prefix) as link_b,
        user_quota(limits, link_a) as a,
        user_quota(limits, link_b) as b,
    ):
        outcomes = await asyncio.gather(*(q.reserve("u:burst") for q in [a, b] * 10), return_exceptions=True)
        granted = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(granted) == 7
        assert all(isinstance(e, UserRateLimited) for e in refused)
        assert all(1 <= e.retry_after_s <= RATE_WINDOW_S for e in refused)  # type: ignore[attr-defined]
        # Another caller has a window of its own; a place given back is free again, everywhere.
        await a.reserve("u:other")
        granted[0].give_back()
        granted[0].give_back()  # at most once
        assert await eventually(lambda: _reserves(b, "u:burst"), attempts=100, interval=0.02)
        assert isinstance(await refusal(a, "u:burst"), UserRateLimited)


async def _reserves(quota: UserQuota, rate_key: str) -> bool:
    try:
        await quota.reserve(rate_key)
    except UserRateLimited:
        return False
    return True


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_a_window_frees_itself_and_says_when(
    shared: bool, redis_server_url: str, redis_prefix: str
) -> None:
    limits = (Window("quota", 2, SHORT_WINDOW_S, UserQuotaExhausted),)
    async with contextlib.AsyncExitStack() as stack:
        link = await stack.enter_async_context(redis_link(redis_server_url, redis_prefix)) if shared else None
        quota = await stack.enter_async_context(user_quota(limits, link))
        await quota.reserve("a:198.51.100.1")
        await quota.reserve("a:198.51.100.1")
        refused = await refusal(quota, "a:198.51.100.1")
        assert isinstance(refused, UserQuotaExhausted) and refused.code == "USER_QUOTA_EXHAUSTED"
        assert 1 <= refused.retry_after_s <= SHORT_WINDOW_S
        # Both leave the window within Retry-After (give or take the poll); the limit holds on.
        assert await eventually(
            lambda: _reserves_any(quota, "a:198.51.100.1"),
            attempts=int(SHORT_WINDOW_S * 2 / 0.05) + 40,
            interval=0.05,
        )
        assert await eventually(lambda: _reserves_any(quota, "a:198.51.100.1"), attempts=200, interval=0.05)
        assert isinstance(await refusal(quota, "a:198.51.100.1"), UserQuotaExhausted)


async def _reserves_any(quota: UserQuota, rate_key: str) -> bool:
    try:
        await quota.reserve(rate_key)
    except Overloaded:
        return False
    return True


async def test_redis_away_falls_back_to_this_process_count(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[None] = []
    async with redis_link(own_redis.url, "quota-away", timeout_s=0.2) as link:
        quota = UserQuota(windows(2, 0), link=link, on_error=lambda: errors.append(None))
        try:
            held = await quota.reserve("u:steady")  # shared: Redis answers
            own_redis.stop()
            with caplog.at_level(logging.WARNING, logger="ecoscan.admission"):
                await quota.reserve("u:steady")  # Redis fails: never a refusal for that
                assert isinstance(await refusal(quota, "u:steady"), UserRateLimited)  # the local count
            assert errors
            warnings = [r for r in caplog.records if "Redis failed" in r.getMessage()]
            assert len(warnings) == 1  # once per outage
            held.give_back()  # its Redis member cannot be removed now: the local place is
            await quota.reserve("u:steady")
        finally:
            await quota.aclose()


async def test_a_give_back_redis_missed_is_taken_when_it_answers_again(own_redis: RedisServer) -> None:
    """Issue 34 review: a scan refused while Redis hangs gives its place back; Redis does not
    take it then, and the daily window would otherwise keep that place for 24 hours. It is
    sent again until Redis takes it, and the other replica sees the place free."""
    async with (
        redis_link(own_redis.url, "quota-return", timeout_s=0.2) as link_a,
        redis_link(own_redis.url, "quota-return", timeout_s=0.2) as link_b,
        user_quota(windows(0, 1), link_a) as a,
        user_quota(windows(0, 1), link_b) as b,
    ):
        held = await a.reserve("u:paused")
        assert isinstance(await refusal(b, "u:paused"), UserQuotaExhausted)
        own_redis.freeze()
        try:
            held.give_back()
            assert await eventually(lambda: a.unreturned == 1, attempts=100, interval=0.05)
        finally:
            own_redis.thaw()
        assert await eventually(lambda: a.unreturned == 0, attempts=200, interval=0.05)
        await b.reserve("u:paused")  # the place is free across replicas again


async def test_a_reservation_that_reaches_redis_after_its_give_back_adds_nothing(
    redis_server_url: str, redis_prefix: str
) -> None:
    """A reserve call that timed out may still be queued in Redis when its give-back goes
    out on another connection; the give-back's tombstone keeps the late reserve from
    taking a place nobody will give back."""
    async with redis_link(redis_server_url, redis_prefix) as link, user_quota(windows(0, 1), link) as quota:
        member = "late-reserve"
        keys = quota._keys("u:late", member)
        await quota._send_give_back("u:late", member)  # the give-back wins the race
        script = link.script(user_quota_module._RESERVE)
        assert await script(keys=keys, args=[member, 1, QUOTA_WINDOW_S]) == [0, 0]
        assert await link.client.zcard(keys[0]) == 0
        await quota.reserve("u:late")  # the one place is still there


async def test_this_process_forgets_callers_with_nothing_in_their_windows() -> None:
    async with user_quota(windows(3, 10)) as quota:
        held = [await quota.reserve(f"u:{n}") for n in range(5)]
        assert quota.callers == 5
        for reservation in held:
            reservation.give_back()
        assert quota.callers == 0
    # Callers whose scans have all left the window are swept out as others come.
    async with user_quota((Window("rate", 1, 1e-6, UserRateLimited),)) as quota:
        for n in range(SWEEP_EVERY):
            await quota.reserve(f"a:198.51.100.{n}")
        assert quota.callers < SWEEP_EVERY // 2


# --- over HTTP --------------------------------------------------------------------------


def body(seed: int) -> dict[str, str]:
    return {"image_url": data_url(make_jpeg(seed))}


def user(name: str) -> dict[str, str]:
    return {"X-User-ID": name}


async def test_two_replicas_sharing_redis_see_one_rate_and_one_quota(
    database_url: str, sim: RunningSimulator, redis_server_url: str, redis_prefix: str
) -> None:
    settings = settings_for(
        database_url,
        sim,
        redis_url=redis_server_url,
        redis_prefix=redis_prefix,
        user_scan_rate_per_min=3,
        user_daily_scan_quota=5,
    )
    async with running_service(settings) as a, running_service(settings) as b:
        for n, svc in enumerate([a, b, a]):
            assert (
                await run_scan(svc.client, json=body(500 + n), headers=user("rita"))
            ).terminal.event == "done"
        for svc in (b, a):
            refused = await run_scan(svc.client, json=body(510), headers=user("rita"))
            assert (refused.status, refused.body["code"]) == (429, "USER_RATE_LIMITED")
            assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert a.metric("ecoscan_admission_rejected_total", {"reason": "USER_RATE_LIMITED"}) == 1
        # Others are not counted with her.
        assert (await run_scan(b.client, json=body(511), headers=user("sam"))).terminal.event == "done"

    # The quota: five in 24 hours across both replicas (no rate this time).
    settings = settings.replace(user_scan_rate_per_min=0, user_daily_scan_quota=2)
    async with running_service(settings) as a, running_service(settings) as b:
        assert (await run_scan(a.client, json=body(520), headers=user("quinn"))).terminal.event == "done"
        assert (await run_scan(b.client, json=body(521), headers=user("quinn"))).terminal.event == "done"
        for svc in (a, b):
            refused = await run_scan(svc.client, json=body(522), headers=user("quinn"))
            assert (refused.status, refused.body["code"]) == (429, "USER_QUOTA_EXHAUSTED")
            assert int(refused.headers["retry-after"]) > RATE_WINDOW_S  # hours, not a minute


async def test_without_redis_each_process_counts_its_own(database_url: str, sim: RunningSimulator) -> None:
    settings = settings_for(database_url, sim, user_scan_rate_per_min=2)
    async with running_service(settings) as svc:
        for seed in (530, 531):
            assert (
                await run_scan(svc.client, json=body(seed), headers=user("lone"))
            ).terminal.event == "done"
        refused = await run_scan(svc.client, json=body(532), headers=user("lone"))
        assert (refused.status, refused.body["code"]) == (429, "USER_RATE_LIMITED")
        assert (await run_scan(svc.client, json=body(533))).terminal.event == "done"  # anonymous: its own


async def test_refused_and_repeated_scans_use_no_quota(database_url: str, sim: RunningSimulator) -> None:
    settings = settings_for(database_url, sim, user_daily_scan_quota=3, max_inflight_per_user=1)
    key = f"k-{uuid.uuid4()}"
    async with running_service(settings) as svc:
        bad_json = {**user("thrifty"), "Content-Type": "application/json"}
        assert (await svc.client.post(SCAN_URL, content=b"{not json", headers=bad_json)).status_code == 422
        plain = {"image_url": "http://plain.example/x.jpg"}
        assert (await svc.client.post(SCAN_URL, json=plain, headers=user("thrifty"))).status_code == 422
        keyed = {**user("thrifty"), "Idempotency-Key": key}
        first = await run_scan(svc.client, json=body(540), headers=keyed)  # 1
        assert first.terminal.event == "done"
        replayed = await run_scan(svc.client, json=body(540), headers=keyed)
        assert replayed.headers["idempotent-replayed"] == "true"
        await sim_configure(sim, stall_rate=1.0, stall_s=10.0)
        async with stalled_scan(svc, "thrifty", seed=541):  # 2
            # Refused by admission (her one slot is taken): its place is given back.
            busy = await run_scan(svc.client, json=body(542), headers=user("thrifty"))
            assert (busy.status, busy.body["code"]) == (429, UserOverLimit.code)
        await sim_configure(sim, stall_rate=0.0)
        assert await eventually(lambda: svc.metric("ecoscan_scans_in_flight") == 0, attempts=500)
        assert (
            await run_scan(svc.client, json=body(543), headers=user("thrifty"))
        ).terminal.event == "done"  # 3
        refused = await run_scan(svc.client, json=body(544), headers=user("thrifty"))
        assert (refused.status, refused.body["code"]) == (429, "USER_QUOTA_EXHAUSTED")
        # A retry of a scan she has is still answered at the quota.
        again = await run_scan(svc.client, json=body(540), headers=keyed)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["x-scan-id"] == first.headers["x-scan-id"]


async def test_an_exhausted_caller_is_refused_before_its_body_is_read(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, user_daily_scan_quota=1)
    async with running_service(settings) as svc:
        assert (await run_scan(svc.client, json=body(550), headers=user("eager"))).terminal.event == "done"
        head = await post_head_only(svc, user("eager"), content_length=5_000_000)
        assert head.startswith(b"HTTP/1.1 429 ") and b"USER_QUOTA_EXHAUSTED" in head
        assert b"retry-after:" in head.lower()


async def post_head_only(svc: Service, headers: dict[str, str], *, content_length: int) -> bytes:
    """Send a POST's head and none of its body; the response that comes back regardless."""
    url = urlsplit(svc.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        lines = [
            f"POST {SCAN_URL} HTTP/1.1",
            f"Host: {url.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {content_length}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            return head + await reader.readexactly(length)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_anonymous_ipv6_callers_share_a_rate_per_64(database_url: str, sim: RunningSimulator) -> None:
    settings = settings_for(database_url, sim, user_scan_rate_per_min=1)
    async with running_service(settings, proxy_headers=True, forwarded_allow_ips="127.0.0.1") as svc:

        def client(address: str) -> dict[str, str]:
            return {"X-Forwarded-For": address}

        assert (
            await run_scan(svc.client, json=body(560), headers=client("2001:db8:0:1::1"))
        ).terminal.event == "done"
        rotated = await run_scan(svc.client, json=body(561), headers=client("2001:db8:0:1:ffff::2"))
        assert (rotated.status, rotated.body["code"]) == (429, "USER_RATE_LIMITED")
        other_block = await run_scan(svc.client, json=body(562), headers=client("2001:db8:0:2::1"))
        assert other_block.terminal.event == "done"
        # IPv4 callers are counted by address.
        for address in ("198.51.100.1", "198.51.100.2"):
            assert (
                await run_scan(svc.client, json=body(563), headers=client(address))
            ).terminal.event == "done"
