"""Per-model RPM/TPM token buckets and the rate headers each flavour sends.

OpenAI sends six ``x-ratelimit-*`` headers (limit, remaining, reset for requests and
tokens); Azure OpenAI only ``x-ratelimit-remaining-requests`` and ``-tokens`` (its quota
guide); Gemini none. The buckets are keyed by model (OpenAI, Gemini) or deployment (Azure).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Header = tuple[bytes, bytes]
ORGANIZATION = "org-sim"
# Which rate headers each flavour sends (see TokenBucket.headers).
HEADER_STYLES = {"openai": "openai", "azure": "azure", "gemini": "none"}
_DOCS = "Visit https://platform.openai.com/account/rate-limits to learn more."


def format_duration(seconds: float) -> str:
    """Format like OpenAI's reset headers: ``0s``, ``120ms``, ``1s``, ``8.64s``, ``6m0s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        ms = math.ceil(seconds * 1000)
        return "1s" if ms >= 1000 else f"{ms}ms"
    total = round(seconds, 3)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if hours or minutes:
        out += f"{int(minutes)}m"
    return out + f"{round(secs, 3):g}s"


# A bucket that another consumer drains faster than it refills never recovers; the
# retry-after we then report is capped like OpenAI's reset horizon.
_MAX_WAIT_S = 60.0


class TokenBucket:
    """Capacity ``limit``, refilled continuously at ``limit / 60`` per second (OpenAI's model).

    ``shared`` (per minute) is drained steadily by another user of the same key."""

    __slots__ = ("level", "limit", "rate", "stamp")

    def __init__(self, limit: int, now: float, shared: int = 0) -> None:
        self.limit = limit
        self.rate = (limit - shared) / 60.0  # net refill left for us
        self.level = float(limit)
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            level = self.level + (now - self.stamp) * self.rate
            self.level = max(0.0, min(float(self.limit), level))
            self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (call ``refill`` first)."""
        missing = amount - self.level
        if missing <= 0:
            return 0.0
        return missing / self.rate if self.rate > 0 else _MAX_WAIT_S

    def time_to_full(self) -> float:
        return (self.limit - self.level) / self.rate if self.rate > 0 else _MAX_WAIT_S

    def headers(self, name: str, style: str = "openai") -> list[Header]:
        remaining = (b"x-ratelimit-remaining-" + name.encode(), str(max(0, int(self.level))).encode())
        if style == "azure":
            return [remaining]
        if style != "openai":
            return []
        return [
            (b"x-ratelimit-limit-" + name.encode(), str(self.limit).encode()),
            remaining,
            (b"x-ratelimit-reset-" + name.encode(), format_duration(self.time_to_full()).encode()),
        ]


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request could not be paid for; ``limit_type`` is ``requests`` or ``tokens``.

    ``message`` is OpenAI's wording; the numbers let other flavours word their own.
    """

    limit_type: str
    message: str
    retry_after_s: float
    limit: int = 0
    used: int = 0
    requested: int = 0
    too_large: bool = False  # more than the bucket ever holds


class _ModelBuckets:
    __slots__ = ("requests", "tokens")

    def __init__(self, rpm: int, tpm: int, now: float, shared_rpm: int, shared_tpm: int) -> None:
        self.requests = TokenBucket(rpm, now, shared_rpm) if rpm > 0 else None
        self.tokens = TokenBucket(tpm, now, shared_tpm) if tpm > 0 else None

    def headers(self, style: str) -> list[Header]:
        out: list[Header] = []
        if self.requests is not None:
            out += self.requests.headers("requests", style)
        if self.tokens is not None:
            out += self.tokens.headers("tokens", style)
        return out


class RateLimiter:
    """RPM/TPM limits per key (model or deployment). ``rpm``/``tpm`` of 0 mean unlimited.

    ``header_style`` is ``openai`` (six headers), ``azure`` (remaining only) or ``none``.
    """

    def __init__(
        self,
        rpm: int,
        tpm: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        shared_rpm: int = 0,
        shared_tpm: int = 0,
        header_style: str = "openai",
    ) -> None:
        self.header_style = header_style
        self.rpm = rpm
        self.tpm = tpm
        self.shared_rpm = shared_rpm
        self.shared_tpm = shared_tpm
        self._clock = clock
        self._models: dict[str, _ModelBuckets] = {}

    def _buckets(self, model: str) -> _ModelBuckets:
        buckets = self._models.get(model)
        now = self._clock()
        if buckets is None:
            buckets = self._models[model] = _ModelBuckets(
                self.rpm, self.tpm, now, self.shared_rpm, self.shared_tpm
            )
        else:
            for bucket in (buckets.requests, buckets.tokens):
                if bucket is not None:
                    bucket.refill(now)
        return buckets

    def acquire(self, model: str, tokens: int) -> tuple[Denial | None, list[Header]]:
        """Take one request and ``tokens`` tokens, or nothing if either bucket can't pay."""
        buckets = self._buckets(model)
        denial = self._check(model, buckets.requests, 1, "requests", "RPM")
        if denial is None:
            denial = self._check(model, buckets.tokens, tokens, "tokens", "TPM")
        if denial is None:
            if buckets.requests is not None:
                buckets.requests.level -= 1
            if buckets.tokens is not None:
                buckets.tokens.level -= tokens
        return denial, buckets.headers(self.header_style)

    def headers(self, model: str) -> list[Header]:
        """Current headers for ``model`` without spending anything."""
        return self._buckets(model).headers(self.header_style)

    @staticmethod
    def _check(
        model: str, bucket: TokenBucket | None, amount: int, limit_type: str, short: str
    ) -> Denial | None:
        if bucket is None or bucket.level >= amount:
            return None
        what = f"{limit_type} per min ({short})"
        if amount > bucket.limit:
            message = (
                f"Request too large for {model} in organization {ORGANIZATION} on {what}: "
                f"Limit {bucket.limit}, Requested {amount}. "
                "The input or output tokens must be reduced in order to run successfully. " + _DOCS
            )
            return Denial(limit_type, message, bucket.time_to_full(), bucket.limit, 0, amount, True)
        wait = bucket.wait_for(amount)
        used = bucket.limit - max(0, int(bucket.level))
        message = (
            f"Rate limit reached for {model} in organization {ORGANIZATION} on {what}: "
            f"Limit {bucket.limit}, Used {used}, Requested {amount}. "
            f"Please try again in {format_duration(wait)}. " + _DOCS
        )
        return Denial(limit_type, message, wait, bucket.limit, used, amount)


def retry_headers(seconds: float) -> list[Header]:
    """``retry-after`` in whole seconds (ceil, at least 1) and ``retry-after-ms`` (ceil)."""
    ms = max(1, math.ceil(seconds * 1000))
    return [
        (b"retry-after", str(max(1, math.ceil(seconds))).encode()),
        (b"retry-after-ms", str(ms).encode()),
    ]
