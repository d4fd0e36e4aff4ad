"""The service's /metrics, scraped before and after the k6 run and read as differences.

Counters and histograms only grow over a process's life (start-up, warm-up), so the
difference of two scrapes is what the measured run alone did.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any

from .processes import http_get

Samples = dict[str, list[tuple[dict[str, str], float]]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
LOOP_LAG = "ecoscan_event_loop_lag_seconds"


def parse_prometheus(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        with contextlib.suppress(ValueError):
            out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def scrape(base_url: str) -> Samples:
    """The service's /metrics, or nothing when it does not answer (never raises)."""
    try:
        status, body = http_get(base_url + "/metrics")
    except OSError:
        return {}
    return parse_prometheus(body.decode()) if status == 200 else {}


@dataclass(frozen=True)
class Window:
    """Two scrapes around the k6 run."""

    before: Samples
    after: Samples

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)

    def avg_ms(self, histogram: str, **labels: str) -> float | None:
        count = self.delta(histogram + "_count", **labels)
        return round(self.delta(histogram + "_sum", **labels) / count * 1000, 2) if count else None

    def quantile_bound_ms(self, histogram: str, q: float) -> float | None:
        """Upper bucket bound (ms) holding the q-quantile of the window's observations."""
        buckets = []
        for labels, value in self.after.get(histogram + "_bucket", []):
            le = labels.get("le", "+Inf")
            bound = math.inf if le == "+Inf" else float(le)
            buckets.append((bound, value - total(self.before, histogram + "_bucket", le=le)))
        buckets.sort()
        if not buckets or buckets[-1][1] <= 0:
            return None
        target = q * buckets[-1][1]
        for bound, cumulative in buckets:
            if cumulative >= target:
                return None if math.isinf(bound) else round(bound * 1000, 3)
        return None


def metrics_digest(before: Samples, after: Samples) -> dict[str, Any]:
    """Counter/histogram deltas over the k6 run (gauges as read at the end)."""
    window = Window(before, after)
    out: dict[str, Any] = {}
    for stage in ("vision", "answer"):
        # Per call, over all its waits: one call queues at the semaphore and at the budget.
        count = window.delta("ecoscan_stage_service_seconds_count", stage=stage)
        queued = window.delta("ecoscan_stage_queue_seconds_sum", stage=stage)
        out[f"{stage}_queue_avg_ms"] = round(queued / count * 1000, 2) if count else None
        out[f"{stage}_service_avg_ms"] = window.avg_ms("ecoscan_stage_service_seconds", stage=stage)
    for phase in ("queue", "run"):
        out[f"cpu_{phase}_avg_ms"] = window.avg_ms("ecoscan_cpu_job_seconds", phase=phase)
    out["first_event_avg_ms"] = window.avg_ms("ecoscan_scan_first_event_seconds")
    # The max gauge covers the process's whole life (start-up, warm-up, first scan); the
    # histogram's deltas cover the run only, to bucket resolution (an upper bound).
    out["loop_lag_max_ms"] = window.quantile_bound_ms(LOOP_LAG, 1.0)
    out["loop_lag_p99_ms"] = window.quantile_bound_ms(LOOP_LAG, 0.99)
    lag_max = total(after, "ecoscan_event_loop_lag_max_seconds")
    out["loop_lag_gauge_max_ms"] = round(lag_max * 1000, 1) if after else None
    out["upstream_429"] = window.delta("ecoscan_upstream_rate_limited_total")
    out["upstream_retries"] = window.delta("ecoscan_upstream_retries_total")
    out["scans_by_outcome"] = scans_by_outcome(window)
    return out


def scans_by_outcome(window: Window) -> dict[str, float]:
    """Scans the run ended, keyed `outcome:code` (`-` when there is no code)."""
    counts: dict[str, float] = {}
    for labels, _ in window.after.get("ecoscan_scans_total", []):
        key = f"{labels.get('outcome')}:{labels.get('code') or '-'}"
        outcome, code = labels["outcome"], labels.get("code", "")
        counts[key] = window.delta("ecoscan_scans_total", outcome=outcome, code=code)
    return {k: v for k, v in sorted(counts.items()) if v}
