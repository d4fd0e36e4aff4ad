"""The metrics' label children, looked up from a dict after the first call
(app/runtime/metrics.py, `_KnownChildren`): the same child, the same exposition."""

from __future__ import annotations

import math

import prometheus_client
import pytest

from app.runtime.metrics import FAST_BUCKETS, LATENCY_BUCKETS, Counter, Gauge, Histogram, Metrics


def test_a_label_set_is_one_child_however_it_is_asked_for() -> None:
    m = Metrics(process=False)
    first = m.scans.labels("completed", "")
    assert m.scans.labels("completed", "") is first
    assert m.scans.labels(outcome="completed", code="") is first
    first.inc()
    m.scans.labels("completed", "").inc(2)
    m.upstream_tokens.labels("gpt-4o-mini", "prompt").inc(5)
    assert m.registry.get_sample_value("ecoscan_scans_total", {"outcome": "completed", "code": ""}) == 3
    tokens = {"model": "gpt-4o-mini", "kind": "prompt"}
    assert m.registry.get_sample_value("ecoscan_upstream_tokens_total", tokens) == 5
    assert b'ecoscan_scans_total{code="",outcome="completed"} 3.0' in m.render()
    with pytest.raises(ValueError):
        m.scans.labels("completed")  # a missing label is still an error, every time
    with pytest.raises(ValueError):
        m.scans.labels("completed")


Sample = tuple[str, dict[str, str], float]


def _samples(registry: prometheus_client.CollectorRegistry) -> list[Sample]:
    return [
        (s.name, s.labels, s.value)
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    ]


def test_the_direct_observations_expose_what_the_library_would() -> None:
    """Counter, Gauge and Histogram skip the library's per-call checks and find the
    bucket by bisection: the same samples as prometheus-client's own classes, for
    values on, between and beyond the bounds, NaN included."""
    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    values = [0.0, 0.0005, 0.0004, 0.001, 0.7, 1.0, 2.5, 29.9, 30.0, 31.0, math.inf, -1.0, math.nan]
    for registry, (counter, gauge, histogram) in (
        (ours, (Counter, Gauge, Histogram)),
        (theirs, (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)),
    ):
        c = counter("c_total", "c", ["k"], registry=registry)
        g = gauge("g", "g", ["k"], registry=registry)
        h = histogram("h_seconds", "h", ["k"], buckets=FAST_BUCKETS, registry=registry)
        plain = histogram("p_seconds", "p", buckets=LATENCY_BUCKETS, registry=registry)
        for v in values:
            h.labels("a").observe(v)
            plain.observe(v)
            if v == v and v >= 0:
                c.labels("a").inc(v)
            g.labels("a").inc(2)
            g.labels("a").dec(0.5)
    assert _same(_samples(ours), _samples(theirs))


def _same(a: list[Sample], b: list[Sample]) -> bool:
    def equal(x: float, y: float) -> bool:
        return x == y or (math.isnan(x) and math.isnan(y))

    return len(a) == len(b) and all(x[:2] == y[:2] and equal(x[2], y[2]) for x, y in zip(a, b, strict=True))


def test_a_labelled_parent_still_refuses_observations() -> None:
    m = Metrics(process=False)
    with pytest.raises(ValueError):
        m.scans.inc()
    with pytest.raises(ValueError):
        m.scan_duration.observe(1.0)
    with pytest.raises(ValueError):
        m.scans.labels("completed", "").inc(-1)
