"""Reasoning tokens a reasoning model spends before its visible output.

OpenAI does not publish how many reasoning tokens an effort level costs; the ranges
below are the simulator's assumption, chosen to be the right order of magnitude for a
short classification prompt and to grow ~4x per level. Within a range the count is
drawn from the request digest, so the same request always reasons the same amount.
"""

from __future__ import annotations

import hashlib
import random

# effort -> (fewest, most) reasoning tokens before ``reasoning_scale``.
REASONING_RANGES: dict[str, tuple[int, int]] = {
    "none": (0, 0),
    "minimal": (8, 64),
    "low": (128, 512),
    "medium": (512, 2048),
    "high": (2048, 8192),
    "xhigh": (4096, 16384),
}


def reasoning_tokens(digest: bytes, effort: str | None, seed: int, scale: float) -> int:
    """Reasoning tokens for a request with ``digest`` at ``effort`` (0 when not reasoning)."""
    if effort is None or scale <= 0:
        return 0
    low, high = REASONING_RANGES.get(effort, (0, 0))
    if high <= 0:
        return 0
    salt = seed.to_bytes(16, "big", signed=True)
    mixed = hashlib.sha256(b"reasoning\x00" + effort.encode() + b"\x00" + digest + salt).digest()
    drawn = random.Random(int.from_bytes(mixed[:8], "big")).randint(low, high)
    return max(0, round(drawn * scale))


def split_cap(cap: int | None, drawn: int) -> tuple[int, int | None]:
    """``(reasoning, room for visible tokens)``: the cap covers reasoning first."""
    if cap is None:
        return drawn, None
    reasoning = min(drawn, cap)
    return reasoning, cap - reasoning
