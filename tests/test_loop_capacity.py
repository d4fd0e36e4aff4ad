"""Admission that knows the event loop's capacity: the utilisation signal, the rate it
spreads waves at and the ceiling on the scans in flight (as a unit, fed readings), the
pacer's bounded queue and its refusals at the ceiling, and over real HTTP a service whose
loop a test-only burner keeps busy: it sheds new scans with SERVER_BUSY before their body
is read while the scans it accepted complete."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.limits.loop_capacity import (
    CEILING_CUT_MIN,
    CEILING_GROWTH,
    MIN_CEILING,
    PRIOR_CPU_PER_SCAN_S,
    SAMPLE_INTERVAL_S,
    WAVE_FACTOR,
    LoopCapacity,
)
from app.limits.loop_pacer import BURST_S, QUEUE_S, SATURATED, WAVE, LoopBusy, LoopPacer
from app.sim.server import run_simulator

from .conftest import (
    BASE_SIM,
    SCAN_URL,
    Service,
    data_url,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
)

# How long the loop-capacity signal may take to follow the burner: it samples twice a second.
FOLLOW_WITHIN_S = 30.0
# A low target, so that the burner's load is a sustained saturation within seconds.
PACED = {"loop_utilisation_target": 0.3, "loop_pacing": True}
# The simulator's time scale for scans of a few seconds (BASE_SIM's take milliseconds).
SLOW_SIM = 0.3
# The admission's cap on the scans in flight, in the units.
MAX_IN_FLIGHT = 5000


class Loop:
    """Readings of a loop thread, fed to a `LoopCapacity` every `SAMPLE_INTERVAL_S`."""

    def __init__(
        self, target: float = 0.8, *, in_flight: int = 0, max_in_flight: int = MAX_IN_FLIGHT
    ) -> None:
        self.in_flight = in_flight
        self.capacity = LoopCapacity(
            target=target,
            admitted=lambda: 0,
            in_flight=lambda: self.in_flight,
            max_in_flight=lambda: max_in_flight,
        )
        self.now = self.cpu = self.wait = 0.0
        self.admitted = 0
        self.capacity.sample(0.0, 0.0, 0.0, 0)

    def run(
        self, seconds: float, *, busy: float, waiting: float = 0.0, scans_per_s: int = 0, refused: float = 0.0
    ) -> LoopCapacity:
        """`seconds` of a loop running `busy` and waiting for a core `waiting` of the time,
        admitting `scans_per_s`, spending `refused` of each second's CPU on refusals."""
        for _ in range(round(seconds / SAMPLE_INTERVAL_S)):
            self.now += SAMPLE_INTERVAL_S
            self.cpu += busy * SAMPLE_INTERVAL_S
            self.wait += waiting * SAMPLE_INTERVAL_S
            self.admitted += round(scans_per_s * SAMPLE_INTERVAL_S)
            self.capacity.refused(refused * SAMPLE_INTERVAL_S)
            self.capacity.sample(self.now, self.cpu, self.wait, self.admitted)
        return self.capacity


def test_utilisation_counts_the_wait_for_a_core_and_share_is_what_the_loop_got() -> None:
    cap = Loop().run(20, busy=0.3, waiting=0.6)  # 30 % CPU, yet busy 90 % of the time
    assert cap.utilisation == pytest.approx(0.9, rel=0.01)
    assert cap.share == pytest.approx(1 / 3)
    assert cap.saturated


def test_a_short_stall_is_not_a_saturation() -> None:
    loop = Loop()
    loop.run(10, busy=0.3)
    assert not loop.run(0.5, busy=1.0).saturated  # a GC pause, say


def test_saturation_has_hysteresis() -> None:
    loop = Loop(0.8)
    assert loop.run(20, busy=0.85).saturated
    assert loop.run(20, busy=0.75).saturated  # under the target, not 0.1 under it
    assert not loop.run(20, busy=0.65).saturated
    assert not loop.run(20, busy=0.75).saturated  # back up, not to the target


def test_waves_are_spread_at_twice_what_the_loop_sustains_at_its_target() -> None:
    loop = Loop(0.8)
    assert loop.capacity.rate == pytest.approx(WAVE_FACTOR * 0.8 / PRIOR_CPU_PER_SCAN_S)
    cap = loop.run(300, busy=0.4, scans_per_s=100)  # 4 ms a scan: the loop 40 % busy
    assert cap.cpu_per_scan_s == pytest.approx(0.004, rel=0.01)
    # At its target the loop sustains 0.8 / 4 ms = 200 scans a second.
    assert cap.rate == pytest.approx(WAVE_FACTOR * 200, rel=0.02)
    assert cap.reason == "cpu"
    cap = loop.run(60, busy=0.3, waiting=0.3, scans_per_s=100)  # half the time waiting for a core
    assert cap.rate == pytest.approx(WAVE_FACTOR * 0.8 * 0.5 / cap.cpu_per_scan_s, rel=0.02)


def test_what_refusals_cost_is_not_charged_to_the_scans() -> None:
    cap = Loop(0.8).run(300, busy=0.4, scans_per_s=100, refused=0.2)
    assert cap.cpu_per_scan_s == pytest.approx(0.002, rel=0.01)


def test_a_wave_of_completions_does_not_cut_the_ceiling() -> None:
    loop = Loop(0.8, in_flight=3000)
    loop.run(120, busy=0.5)
    cap = loop.run(10, busy=1.0)  # saturated for a while, not over the sustained window
    assert cap.saturated and cap.sustained_utilisation < 0.8
    assert cap.ceiling == MAX_IN_FLIGHT and not cap.binding


def test_a_sustained_saturation_cuts_the_ceiling_once_per_cut_shown() -> None:
    loop = Loop(0.8, in_flight=1000)
    cap = loop.run(60, busy=1.0)  # the sustained window crosses the target after ~48 s
    first = 1000 * max(CEILING_CUT_MIN, 0.7 / 1.0)
    assert cap.ceiling == pytest.approx(first) and cap.ceiling_reason == "saturated"
    assert loop.run(30, busy=1.0).ceiling == pytest.approx(first)  # 1,000 still in flight
    loop.in_flight = round(first)  # scans ended, none started
    assert loop.run(3, busy=1.0).ceiling == pytest.approx(first * CEILING_CUT_MIN)


def test_the_ceiling_grows_back_while_it_binds_and_is_lifted_once_the_loop_has_had_room() -> None:
    loop = Loop(0.8, in_flight=1000)
    cut = loop.run(60, busy=1.0).ceiling
    grown = loop.run(4, busy=0.3).ceiling  # room on the 2-s reading; 1,000 would be in flight
    assert cut * (1 + CEILING_GROWTH) ** 3 < grown < cut * (1 + CEILING_GROWTH) ** 8
    assert loop.capacity.binding and loop.capacity.sustained_utilisation >= 0.7
    loop.in_flight = round(grown / 2)  # far under it: no reason to grow
    assert loop.run(2, busy=0.3).ceiling == grown
    cap = loop.run(30, busy=0.3)  # room over 30 s too: back to the admission's cap
    assert cap.ceiling == MAX_IN_FLIGHT and not cap.binding


def test_an_uncut_ceiling_follows_the_admissions_cap_and_refuses_nothing() -> None:
    max_in_flight = 16
    loop = Loop(0.8, in_flight=16)
    loop.capacity._max_in_flight = lambda: max_in_flight
    assert loop.run(5, busy=0.3).ceiling == 16  # at the cap, with room: no growth of its own
    max_in_flight = 400  # the admission sized itself up
    assert loop.run(1, busy=0.3).ceiling == 400
    assert not loop.capacity.binding
    assert LoopPacer(loop.capacity).refusal() is None  # the admission refuses at its cap


def test_a_loop_busy_without_scans_keeps_a_floor_of_scans_in_flight() -> None:
    cap = Loop(0.8).run(120, busy=0.95)
    assert cap.saturated and cap.ceiling == MIN_CEILING


async def test_at_the_ceiling_arrivals_are_refused_and_told_to_come_back_as_scans_drain() -> None:
    loop = Loop(0.8, in_flight=10)
    cap = loop.capacity
    cap.ceiling, cap.ceiling_reason, cap.scans_per_s = 10.0, "saturated", 2.0  # two end a second
    pacer = LoopPacer(cap)
    refused = [pacer.refusal() for _ in range(4)]
    assert all(busy is not None and busy.reason == SATURATED for busy in refused)
    assert [busy.retry_after_s for busy in refused if busy] == [1, 1, 2, 2]
    loop.in_flight = 9
    assert pacer.refusal() is None
    await pacer.enter()


async def test_a_wave_starts_at_the_rate_and_what_the_queue_cannot_hold_is_refused_at_once() -> None:
    cap = Loop().capacity
    cap.rate = 10.0  # scans a second
    pacer = LoopPacer(cap)
    started: list[float] = []
    refused: list[LoopBusy] = []

    async def arrive() -> None:
        try:
            await pacer.enter()
        except LoopBusy as busy:
            refused.append(busy)
        else:
            started.append(time.monotonic())

    began = time.monotonic()
    await asyncio.gather(*(arrive() for _ in range(40)))
    # One burst's worth at once, then one every 0.1 s for at most QUEUE_S: about 12.
    assert 10 <= len(started) <= 13, len(started)
    assert len(refused) == 40 - len(started)
    assert all(busy.reason == WAVE for busy in refused)
    # Told to come back in turns at the rate, after the queue: a ramp again.
    assert sorted(busy.retry_after_s for busy in refused) == [
        math.ceil(QUEUE_S + BURST_S + (n + 1) / 10) for n in range(len(refused))
    ]
    assert max(started) - began >= 0.8 * QUEUE_S  # a ramp, not all at once
    assert pacer.waiting == 0


@contextlib.asynccontextmanager
async def burning_loop(busy_share: float = 0.9, period_s: float = 0.1) -> AsyncIterator[None]:
    """A test-only CPU burner on the running loop: it spins `busy_share` of every period, so
    the loop's utilisation is known whatever else the box runs (a wait for a core counts)."""
    stop = asyncio.Event()

    async def burn() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_share * period_s
            while time.perf_counter() < end:
                pass
            await asyncio.sleep((1 - busy_share) * period_s)

    task = asyncio.create_task(burn())
    try:
        yield
    finally:
        stop.set()
        await task


async def until(svc: Service, metric: str, value: float, labels: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + FOLLOW_WITHIN_S
    while svc.metric(metric, labels) != value:
        assert time.monotonic() < deadline, f"{metric} is {svc.metric(metric, labels)}, not {value}"
        await asyncio.sleep(0.1)


async def until_at_least(svc: Service, metric: str, value: float, labels: dict[str, str]) -> None:
    deadline = time.monotonic() + FOLLOW_WITHIN_S
    while svc.metric(metric, labels) < value:
        assert time.monotonic() < deadline, (
            f"{metric} is {svc.metric(metric, labels)}, under {value}",
            svc.metric("ecoscan_loop_shed_total", {"reason": WAVE}),
            svc.metric("ecoscan_limit", {"limit": "loop_inflight"}),
            svc.metric("ecoscan_limit", {"limit": "loop_rate"}),
            svc.metric("ecoscan_admission_slots_in_use"),
            svc.metric("ecoscan_scans_total", {"outcome": "completed", "code": ""}),
        )
        await asyncio.sleep(0.01)


async def early_refusals(svc: Service, photo: str) -> tuple[list[tuple[int, dict[str, str], Any]], bool]:
    """Sent at once, each in one write (the pacer's queue is ahead of the clock for less
    than a second): on one connection a scan with its body, a scan whose content type the
    app would refuse with 415 and a health check; on another a scan that asks to close the
    connection. Refused in the protocol, the scans never reach the app (503, not 415),
    their bodies are skipped and the first connection serves the health check behind
    them; the second closes. The four answers, and whether the second closed."""
    body = json.dumps({"image_url": photo}).encode()
    scan = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s"
    kept = scan % (SCAN_URL.encode(), b"application/json", len(body), b"", body)
    kept += scan % (SCAN_URL.encode(), b"text/plain", len(body), b"", body)
    kept += b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    closing = scan % (SCAN_URL.encode(), b"application/json", len(body), b"Connection: close\r\n", body)
    host, port = svc.url.removeprefix("http://").split(":")
    one, two = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
    try:
        one[1].write(kept)
        two[1].write(closing)
        async with asyncio.timeout(FOLLOW_WITHIN_S):
            answers = [await read_answer(one[0]) for _ in range(3)] + [await read_answer(two[0])]
            closed = await two[0].read() == b""
    finally:
        one[1].close()
        two[1].close()
    return answers, closed


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if ": " in line)}
    return (
        int(head[0].split()[1]),
        headers,
        json.loads(await reader.readexactly(int(headers["content-length"]))),
    )


async def test_a_busy_loop_sheds_new_scans_early_while_accepted_ones_complete(database_url: str) -> None:
    photos = [data_url(make_jpeg(seed, (320, 240))) for seed in range(MIN_CEILING + 4)]
    # Scans that last a few seconds, so that the ceiling's are still in flight when the
    # rest arrive; a low target, so that the burner's load is a sustained saturation soon.
    async with (
        run_simulator(dataclasses.replace(BASE_SIM, time_scale=SLOW_SIM)) as sim,
        running_service(
            settings_for(database_url, sim, loop_utilisation_target=0.3, loop_pacing=True)
        ) as svc,
    ):
        async with burning_loop():
            await until(svc, "ecoscan_limit", MIN_CEILING, {"limit": "loop_inflight"})
            assert svc.metric("ecoscan_loop_saturated") == 1.0
            wave = asyncio.gather(
                *(
                    run_scan(svc.client, json={"image_url": photo}, headers={"X-User-ID": f"u{n}"})
                    for n, photo in enumerate(photos)
                )
            )
            await until_at_least(svc, "ecoscan_loop_shed_total", 1, {"reason": SATURATED})
            # While the ceiling's scans are in flight: answered by the HTTP protocol.
            raw, closed = await early_refusals(svc, photos[0])
            outcomes = await wave
        assert [status for status, _, _ in raw] == [503, 503, 200, 503]
        for _, headers, body in raw[:2] + raw[3:]:
            assert body["code"] == "SERVER_BUSY" and int(headers["retry-after"]) >= 1, (headers, body)
            assert headers["content-type"] == "application/json"
        assert "connection" not in raw[0][1] and raw[3][1]["connection"] == "close" and closed
        accepted = [o for o in outcomes if o.status == 200]
        shed = [o for o in outcomes if o.status != 200]
        # The ceiling's floor still lets scans in, never more than it at once.
        assert 1 <= len(accepted) <= MIN_CEILING, len(accepted)
        assert all(o.terminal.event == "done" for o in accepted), [o.terminal for o in accepted]
        assert shed, "a saturated loop sheds new scans"
        for o in shed:
            assert o.status == 503 and o.body["code"] == "SERVER_BUSY", o.body
            assert int(o.headers["retry-after"]) >= 1
        refused = len(shed) + 3  # and the three on the raw connection
        # At the ceiling (the raw three at least); a box that gives the loop little of a core
        # may spread the wave slower than it comes, and refuse some of it as a wave.
        at_ceiling = svc.metric("ecoscan_loop_shed_total", {"reason": SATURATED})
        assert (
            at_ceiling >= 3
            and at_ceiling + svc.metric("ecoscan_loop_shed_total", {"reason": WAVE}) == refused
        )
        assert svc.metric("ecoscan_admission_rejected_total", {"reason": "SERVER_BUSY"}) == refused
        assert svc.metric("ecoscan_scans_total", {"outcome": "rejected", "code": "SERVER_BUSY"}) == refused
        assert svc.metric("ecoscan_loop_shed_cpu_seconds_total") > 0
        assert (
            svc.metric("ecoscan_limit_changes_total", {"limit": "loop_inflight", "reason": "saturated"}) >= 1
        )
        # Burner off: the loop comes back under its target, and new scans start again.
        await until(svc, "ecoscan_loop_saturated", 0.0)
        outcome = await run_scan(svc.client, json={"image_url": photos[0]}, headers={"X-User-ID": "after"})
        assert outcome.status == 200 and outcome.terminal.event == "done"
