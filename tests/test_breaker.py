"""A deployment's breaker, on a clock the test sets: when it opens, for how long, how it
comes back, and what takes a deployment out."""

from __future__ import annotations

import logging

import pytest

from app.upstream.breaker import CLOSED, HALF_OPEN, OPEN, OPEN_MAX_S, Breaker


def test_three_failures_in_a_row_open_it_for_the_base_cooldown_then_one_probe_goes() -> None:
    b = Breaker("a", open_base_s=2.0)
    for t in (0.0, 0.1):
        b.failed(t, "5xx")
        assert b.state == CLOSED and b.ready(t)
    b.failed(0.2, "5xx")
    assert b.state == OPEN and not b.ready(1.0) and b.open_until == pytest.approx(2.2)
    assert b.would_probe(2.2) and not b.ready(2.2)  # past the cooldown: a probe's, never a call's
    b.begin(2.2)
    assert b.state == HALF_OPEN and not b.would_probe(2.3)  # one probe at a time
    b.succeeded(2.4)
    assert b.state == CLOSED and b.ready(2.4) and b.opened == 0


def test_a_failed_probe_reopens_it_for_twice_as_long_up_to_the_cap() -> None:
    b = Breaker("a", open_base_s=10.0)
    now = 0.0
    for _ in range(3):
        b.failed(now, "timeout")
    cooldowns = []
    for _ in range(5):
        now = b.open_until
        b.begin(now)
        b.failed(now, "timeout")
        cooldowns.append(b.open_until - now)
    assert cooldowns == [20.0, 40.0, OPEN_MAX_S, OPEN_MAX_S, OPEN_MAX_S]


def test_the_upstreams_own_wait_wins_when_longer() -> None:
    b = Breaker("a", open_base_s=1.0)
    for t in (0.0, 0.0, 0.0):
        b.failed(t, "429", wait_s=17.0)
    assert b.open_until == pytest.approx(17.0)


def test_calls_sent_before_it_failed_do_not_vouch_for_it() -> None:
    """Streams in flight when the deployment went down finish fine after its first
    failures: they neither break the run of failures nor close it once open."""
    b = Breaker("a", open_base_s=5.0)
    b.failed(10.0, "5xx")
    b.succeeded(10.5, started=6.0)  # sent before the failure
    b.failed(11.0, "5xx")
    b.succeeded(11.5, started=7.0)
    b.failed(12.0, "5xx")
    assert b.state == OPEN
    b.succeeded(13.0, started=8.0)
    assert b.state == OPEN and not b.ready(13.0)
    b.succeeded(17.5, started=17.0)  # sent after: the deployment answers again
    assert b.state == CLOSED


def test_failures_of_calls_already_out_when_it_opened_neither_extend_nor_double_it() -> None:
    # Six calls sent at once to a deployment that went down: the first three failures open
    # it; the other three were on their way already and say nothing new. (They used to
    # count as a new run of three and reopen it for twice as long.)
    b = Breaker("a", open_base_s=2.0)
    for t in (0.0, 0.01, 0.02):
        b.failed(t, "5xx")
    assert b.state == OPEN and b.open_until == pytest.approx(2.02)
    for t in (0.03, 0.04, 0.05):
        b.failed(t, "5xx")
    assert b.open_until == pytest.approx(2.02) and b.would_probe(2.02)
    b.failed(0.06, "429", wait_s=5.0)  # a provider's own wait still holds
    assert b.open_until == pytest.approx(5.06)
    b.begin(5.06)
    b.failed(5.1, "5xx")  # the probe failed: now it doubles
    assert b.open_until == pytest.approx(5.1 + 4.0)


def test_a_late_failure_while_its_probe_is_out_neither_reopens_it_nor_voids_the_probe() -> None:
    b = Breaker("a", open_base_s=2.0)
    for t in (0.0, 0.01, 0.02):
        b.failed(t, "5xx", sent_at=t - 0.5)
    b.begin(2.1)  # the probe goes
    assert b.state == HALF_OPEN
    b.failed(2.2, "timeout", sent_at=0.01)  # a call sent before it opened ends only now
    assert b.state == HALF_OPEN
    b.succeeded(2.3, started=2.1)  # the probe's word stands
    assert b.state == CLOSED


def test_a_failing_window_opens_it_without_a_run() -> None:
    b = Breaker("a")
    t = 0.0
    for i in range(10):  # alternating: never 3 in a row, half failed
        t += 1.0
        if i % 2:
            b.failed(t, "5xx")
        else:
            b.succeeded(t)
    assert b.state == OPEN


def test_a_cancelled_probe_frees_the_slot() -> None:
    b = Breaker("a", open_base_s=1.0)
    for _ in range(3):
        b.failed(0.0, "5xx")
    probe = b.begin(1.0)
    assert probe and not b.would_probe(1.0)
    b.released(probe)
    assert b.would_probe(1.0)


def test_a_stale_probe_does_not_free_a_newer_ones_slot() -> None:
    b = Breaker("a", open_base_s=1.0)
    for _ in range(3):
        b.failed(0.0, "5xx")
    first = b.begin(1.0)
    b.failed(1.1, "5xx")  # its verdict: open again, for 2 s
    second = b.begin(3.1)
    assert second and second != first
    b.released(first)  # the first call's cleanup, late: not the probe in flight
    assert b.probing and not b.would_probe(3.2)
    b.released(second)
    assert b.would_probe(3.2)


def test_taking_out_is_loud_and_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    b = Breaker("azure-eu")
    b.take_out(0.0, "401: invalid key", 300.0)
    assert b.out and not b.would_probe(299.0) and b.would_probe(300.0) and not b.ready(300.0)
    assert any("azure-eu taken out" in r.getMessage() for r in caplog.records)
    b.begin(300.0)
    b.succeeded(300.5)
    assert not b.out and b.state == CLOSED


def test_the_cap_of_the_probes_backoff_is_a_setting_and_a_return_is_told_to_who_waits() -> None:
    b = Breaker("a", open_base_s=1.0, open_max_s=3.0)
    now = 0.0
    for _ in range(3):
        b.failed(now, "connection")
    cooldowns = []
    for _ in range(4):
        now = b.open_until
        b.begin(now)
        b.failed(now, "connection")
        cooldowns.append(b.open_until - now)
    assert cooldowns == [2.0, 3.0, 3.0, 3.0]  # however long the outage, probed every 3 s at most
    told: list[str] = []
    b.watch_closed(lambda: told.append("back"))
    b.begin(b.open_until)
    b.succeeded(b.open_until + 0.1, started=b.open_until)
    assert told == ["back"] and b.ready(now)
    b.succeeded(now + 20)  # already closed: nobody is told again
    assert told == ["back"]
