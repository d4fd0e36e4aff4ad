"""Counters the simulator exposes at ``GET /sim/stats``."""

from __future__ import annotations

from typing import Any


class SimStats:
    """Chat-completion counters; ``inflight`` survives ``reset`` (those requests are real)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.held = 0  # requests the hang outage is holding right now
        self.reset()

    def reset(self) -> None:
        self.requests_total = 0
        self.by_status: dict[str, int] = {}
        self.by_kind: dict[str, int] = {"vision": 0, "text": 0}
        # By the structured output's name: which of a client's calls each was, whatever its
        # stages ("" for a call without a schema).
        self.by_schema: dict[str, int] = {}
        self.rate_limited_total = 0
        self.tokens_charged_total = 0  # against TPM: prompt + cap per admitted request
        self.quota_rejected_total = 0
        self.errors_injected_total = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0  # reasoning + visible, as OpenAI bills them
        self.reasoning_tokens = 0
        self.cached_tokens = 0  # of the prompt tokens, those the prompt cache served
        self.streams_started = 0
        self.streams_completed = 0
        self.streams_cancelled = 0
        self.stalls_injected = 0
        self.holds_injected = 0  # replies held before their first byte (hold_rate)
        self.refusals_injected = 0
        self.content_filters_injected = 0
        self.truncations_injected = 0
        self.malformed_injected = 0
        # The outage switch: API requests that arrived while it was on, by mode ("503",
        # "hang"), and connections a "refuse" reset (new ones are refused by the kernel).
        self.outage_requests: dict[str, int] = {}
        self.connections_reset = 0

    def count_outage(self, mode: str) -> None:
        self.outage_requests[mode] = self.outage_requests.get(mode, 0) + 1

    def count_status(self, status: int) -> None:
        key = str(status)
        self.by_status[key] = self.by_status.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "by_status": dict(self.by_status),
            "by_kind": dict(self.by_kind),
            "by_schema": dict(self.by_schema),
            "rate_limited_total": self.rate_limited_total,
            "tokens_charged_total": self.tokens_charged_total,
            "quota_rejected_total": self.quota_rejected_total,
            "errors_injected_total": self.errors_injected_total,
            "tokens": {
                "prompt": self.prompt_tokens,
                "completion": self.completion_tokens,
                "reasoning": self.reasoning_tokens,
                "cached": self.cached_tokens,
            },
            "streams_started": self.streams_started,
            "streams_completed": self.streams_completed,
            "streams_cancelled": self.streams_cancelled,
            "inflight": self.inflight,
            "stalls_injected": self.stalls_injected,
            "holds_injected": self.holds_injected,
            "refusals_injected": self.refusals_injected,
            "content_filters_injected": self.content_filters_injected,
            "truncations_injected": self.truncations_injected,
            "malformed_injected": self.malformed_injected,
            "outage_requests_total": sum(self.outage_requests.values()),
            "outage_requests": dict(self.outage_requests),
            "held": self.held,
            "connections_reset": self.connections_reset,
        }
