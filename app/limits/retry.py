"""The one retry layer. The openai SDK runs with `max_retries=0` (its hidden retries
bypass our budget); this policy decides whether and when a failed call is tried again.

Backoff is "full jitter" (a random delay up to base * 2**attempt, capped), so that
callers failing together do not come back together. When the upstream says how long
to wait (`retry-after-ms`, then `retry-after`), that wins, with a little jitter on top.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")

    def delay(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        if retry_after_s is not None:
            return retry_after_s * (1 + 0.1 * self.rng.random())
        cap = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return self.rng.uniform(0, cap)


def retry_after_from_headers(headers: Mapping[str, str] | None) -> float | None:
    """`retry-after-ms` (OpenAI) or `retry-after` (seconds), whichever is present."""
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue  # an HTTP date; OpenAI never sends one, so fall back to backoff
        if value >= 0:
            return value
    return None
