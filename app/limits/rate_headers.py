"""Reading OpenAI's `x-ratelimit-*` response headers into an `UpstreamSnapshot`.

Every response, 2xx or not, reports the key's limits, what is left of them and when the
upstream bucket will be full again. The values come from a server we do not control and
pass through an SDK that hands over whatever it received, so parsing never raises: a
missing or unparseable value is None, and `lowercase_headers` gives up (None) on a
mapping it cannot even iterate. What the rate budget does with a snapshot is its own
business (`app/limits/rate_budget.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["UpstreamSnapshot", "lowercase_headers", "parse_reset_duration"]

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)")


@dataclass(frozen=True, slots=True)
class UpstreamSnapshot:
    """The last rate-limit headers seen (None where missing or garbage)."""

    observed_at: float
    limit_requests: int | None
    limit_tokens: int | None
    remaining_requests: int | None
    remaining_tokens: int | None
    reset_requests: float | None
    reset_tokens: float | None

    @classmethod
    def from_headers(cls, headers: Mapping[str, object], *, observed_at: float) -> UpstreamSnapshot:
        """Read the six `x-ratelimit-*` values from lower-cased `headers`."""
        get = headers.get
        return cls(
            observed_at=observed_at,
            limit_requests=_parse_count(get("x-ratelimit-limit-requests")),
            limit_tokens=_parse_count(get("x-ratelimit-limit-tokens")),
            remaining_requests=_parse_count(get("x-ratelimit-remaining-requests")),
            remaining_tokens=_parse_count(get("x-ratelimit-remaining-tokens")),
            reset_requests=_parse_duration_header(get("x-ratelimit-reset-requests")),
            reset_tokens=_parse_duration_header(get("x-ratelimit-reset-tokens")),
        )


def lowercase_headers(headers: Mapping[str, str]) -> dict[str, object] | None:
    """The headers keyed by lower-case name (HTTP names are case-insensitive); None when
    the mapping cannot be read at all, so a broken response never breaks the caller."""
    try:
        return {str(k).lower(): v for k, v in headers.items()}
    except Exception:
        return None


def parse_reset_duration(value: str) -> float | None:
    """Parse OpenAI reset durations (`120ms`, `1s`, `6m0s`, `1m30.5s`, `0s`, or bare seconds).

    Returns seconds, or None for anything unparseable.
    """
    text = value.strip().lower()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                return None
            seconds += float(match.group(1)) * _UNITS[match.group(2)]
            pos = match.end()
        if pos != len(text):
            return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _parse_count(value: object) -> int | None:
    """A non-negative count; OpenAI sends integers, but a float or junk must not raise."""
    if not isinstance(value, str):
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def _parse_duration_header(value: object) -> float | None:
    """A reset duration, or None when the header is absent or not text."""
    return parse_reset_duration(value) if isinstance(value, str) else None
