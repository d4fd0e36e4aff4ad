"""The service's /metrics, scraped before and after the k6 run and read as differences,
and its limit gauges, sampled during the run.

Counters and histograms only grow over a process's life (start-up, warm-up), so the
difference of two scrapes is what the measured run alone did. Gauges (slots in use,
queued) are worth nothing after the run, when everything is idle: `GaugeSampler` scrapes
them every `SLOT_SAMPLE_S` while k6 loads.

The queue split: every place a scan can wait, in the order it meets them (`WAITS`), read
from the service's queue-time histograms, and which of them held scans the longest.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from .processes import http_get

Samples = dict[str, list[tuple[dict[str, str], float]]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
LOOP_LAG = "ecoscan_event_loop_lag_seconds"
STAGE_QUEUE = "ecoscan_stage_queue_seconds"
# Where a scan waits, in the order it meets the limits: column name, histogram, labels.
WAITS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("cpu", STAGE_QUEUE, {"stage": "prepare", "limit": "cpu"}),  # the CPU lane (CPU_MAX_WORKERS)
    ("admission", "ecoscan_admission_wait_seconds", {}),  # MAX_INFLIGHT_SCANS
    ("vision_gate", STAGE_QUEUE, {"stage": "vision", "limit": "semaphore"}),  # VISION_CONCURRENCY
    ("vision_budget", STAGE_QUEUE, {"stage": "vision", "limit": "budget"}),  # OPENAI_RPM / _TPM
    ("answer_gate", STAGE_QUEUE, {"stage": "answer", "limit": "semaphore"}),  # ANSWER_CONCURRENCY
    ("answer_budget", STAGE_QUEUE, {"stage": "answer", "limit": "budget"}),
)
# A limit "binds" when scans waited there longest, and at least this long per pass on
# average: below it the wait is scheduling noise, and no limit held the scans.
BINDING_MIN_MS = 1.0
# The limit gauges sampled during the run: column name, gauge, labels (summed over the
# rest: the budget's waiters over models). `*_limit` ones are sizes (which an automatic
# limit moves during the run), the rest use.
LIMIT = "ecoscan_limit"
SLOTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("inflight", "ecoscan_admission_slots_in_use", {}),
    ("inflight_limit", LIMIT, {"limit": "admission"}),
    ("admission_waiting", "ecoscan_admission_waiting", {}),
    ("cpu_busy", "ecoscan_cpu_busy_workers", {}),
    ("cpu_limit", "ecoscan_cpu_workers", {}),
    ("cpu_queued", "ecoscan_cpu_queue_depth", {}),
    ("cpu_queue_limit", LIMIT, {"limit": "cpu_queue"}),
    ("vision_gate", "ecoscan_stage_semaphore_in_use", {"stage": "vision"}),
    ("vision_gate_limit", LIMIT, {"limit": "vision_gate"}),
    ("vision_gate_waiting", "ecoscan_stage_semaphore_waiting", {"stage": "vision"}),
    ("answer_gate", "ecoscan_stage_semaphore_in_use", {"stage": "answer"}),
    ("answer_gate_limit", LIMIT, {"limit": "answer_gate"}),
    ("answer_gate_waiting", "ecoscan_stage_semaphore_waiting", {"stage": "answer"}),
    ("budget_waiting", "ecoscan_budget_waiters", {}),
)
SLOT_SAMPLE_S = 1.0  # one /metrics render a second: well under 1 % of the service's loop


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


def present(samples: Samples, name: str, **labels: str) -> bool:
    """Whether any series of `name` has `labels` (a service without the metric has none)."""
    return any(all(lab.get(k) == x for k, x in labels.items()) for lab, _ in samples.get(name, []))


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

    def quantile_bound_ms(self, histogram: str, q: float, **labels: str) -> float | None:
        """Upper bucket bound (ms) holding the q-quantile of the window's observations
        (of the series with `labels`, their buckets summed)."""
        by_le: dict[str, float] = {}
        for series, _ in self.after.get(histogram + "_bucket", []):
            le = series.get("le", "+Inf")
            if all(series.get(k) == x for k, x in labels.items()):
                by_le[le] = self.delta(histogram + "_bucket", **labels, le=le)
        buckets = sorted((math.inf if le == "+Inf" else float(le), n) for le, n in by_le.items())
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
    out.update(queue_split(window))
    return out


def queue_split(window: Window) -> dict[str, Any]:
    """Per limit of `WAITS`: `wait_<limit>_ms`, the average wait per pass (a scan through
    the lane or admission, a call through a gate or the budget), `wait_<limit>_p95_ms`
    (bucket bound) and `wait_<limit>_s`, the seconds all passes waited there together;
    `binding`, the limit with the most of those seconds (`-`: none held scans)."""
    out: dict[str, Any] = {}
    waited: dict[str, float] = {}
    for name, histogram, labels in WAITS:
        if not present(window.after, histogram + "_count", **labels):
            out[f"wait_{name}_ms"] = out[f"wait_{name}_p95_ms"] = out[f"wait_{name}_s"] = None
            continue
        waited[name] = window.delta(histogram + "_sum", **labels)
        out[f"wait_{name}_ms"] = window.avg_ms(histogram, **labels)
        out[f"wait_{name}_p95_ms"] = window.quantile_bound_ms(histogram, 0.95, **labels)
        out[f"wait_{name}_s"] = round(waited[name], 3)
    binding = max(waited, key=lambda n: waited[n], default=None)
    holds = binding is not None and (out[f"wait_{binding}_ms"] or 0) >= BINDING_MIN_MS
    out["binding"] = binding if holds else "-"
    return out


def slots_digest(scrapes: list[Samples]) -> dict[str, float | None]:
    """Per gauge of `SLOTS` over scrapes taken during the run: `slots_<name>_avg` and
    `_max`; None where the service has no such gauge."""
    out: dict[str, float | None] = {}
    for name, gauge, labels in SLOTS:
        values = [total(s, gauge, **labels) for s in scrapes if present(s, gauge, **labels)]
        out[f"slots_{name}_avg"] = round(sum(values) / len(values), 2) if values else None
        out[f"slots_{name}_max"] = max(values) if values else None
    return out


class GaugeSampler(threading.Thread):
    """Scrapes the service's /metrics every `interval` seconds until stopped."""

    def __init__(self, base_url: str, interval: float = SLOT_SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.interval = interval
        self.scrapes: list[Samples] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            scraped = scrape(self.base_url)
            if scraped:
                self.scrapes.append(scraped)

    def stop(self) -> dict[str, float | None]:
        self._stop_event.set()
        self.join(timeout=self.interval + 10)  # a scrape in flight ends within http_get's timeout
        return slots_digest(self.scrapes)


def scans_by_outcome(window: Window) -> dict[str, float]:
    """Scans the run ended, keyed `outcome:code` (`-` when there is no code)."""
    counts: dict[str, float] = {}
    for labels, _ in window.after.get("ecoscan_scans_total", []):
        key = f"{labels.get('outcome')}:{labels.get('code') or '-'}"
        outcome, code = labels["outcome"], labels.get("code", "")
        counts[key] = window.delta("ecoscan_scans_total", outcome=outcome, code=code)
    return {k: v for k, v in sorted(counts.items()) if v}
