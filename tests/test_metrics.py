"""The metrics as prometheus-client keeps them (app/runtime/metrics.py): one child per
label set, however it is asked for, and a labelled parent that takes no observation."""

from __future__ import annotations

import pytest

from app.runtime.metrics import Metrics


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


def test_a_labelled_parent_still_refuses_observations() -> None:
    m = Metrics(process=False)
    with pytest.raises(ValueError):
        m.scans.inc()
    with pytest.raises(ValueError):
        m.scan_duration.observe(1.0)
    with pytest.raises(ValueError):
        m.scans.labels("completed", "").inc(-1)
