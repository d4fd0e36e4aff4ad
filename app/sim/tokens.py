"""Rough OpenAI-like text token accounting: prompt text and the streamed token unit.

Image tokens depend on the model and live in ``app.sim.images``.
"""

from __future__ import annotations

import math
import re

MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3

# One streamed token: an optional leading space plus up to 4 Latin letters, 3 digits,
# 2 Hangul syllables or 1 other symbol; whitespace runs stand alone. Every character
# matches some branch, so the pieces always re-join to the original text.
_TOKEN_RE = re.compile(
    r" ?[A-Za-z]{1,4}| ?[0-9]{1,3}| ?[\uac00-\ud7a3]{1,2}| ?[^\sA-Za-z0-9\uac00-\ud7a3]|\s+"
)


def split_tokens(text: str) -> list[str]:
    """Split generated text into the unit the simulator streams and bills as one token."""
    return _TOKEN_RE.findall(text)


def count_tokens(text: str) -> int:
    """Number of streamed tokens in ``text`` (see ``split_tokens``)."""
    return len(_TOKEN_RE.findall(text))


_HANGUL_RE = re.compile(r"[\uac00-\ud7a3]")


def count_hangul(text: str) -> int:
    """Hangul syllables in ``text``: what a limiter may count apart from other characters."""
    return len(_HANGUL_RE.findall(text))


def prompt_text_tokens(text: str) -> int:
    """Approximate prompt tokens: ~4 ASCII chars per token, one per non-ASCII char."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_chars / 4) + (len(text) - ascii_chars)
