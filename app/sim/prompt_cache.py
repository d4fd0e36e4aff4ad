"""OpenAI's automatic prompt caching, as its prompt-caching guide describes it:

- only prompts of 1,024 tokens or more are cached; a hit covers the longest prefix the
  prompt shares with one processed recently, in 128-token steps from 1,024 (1,024,
  1,152, …), never more than the prompt;
- the prefix is the request as the model reads it: the structured-output schema (a
  prefix to the system message), then the messages in order, images included (the same
  image, at the same detail);
- per model, and per `prompt_cache_key` when one is sent (it steers the routing);
- in memory for minutes: a prefix unused for `IDLE_S` is gone (OpenAI: "typically 5 to
  10 minutes of inactivity").

The hit is reported in `usage.prompt_tokens_details.cached_tokens`; cached tokens are
billed at a discount but count against TPM like any other. Not simulated: the routing
overflow past ~15 requests a minute for one prefix, and extended (24 h) retention.

Tokens here are the simulator's own (app/sim/tokens.py): a text's prefix of n tokens
ends where `prompt_text_tokens` of the text reaches n, walking it character by
character; a role's framing or an image matches only as a whole run of its tokens.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from app.sim.tokens import prompt_text_tokens

MIN_TOKENS = 1024
STEP = 128
IDLE_S = 300.0
MAX_PREFIXES = 65_536  # (model, key, prefix) entries; ~20 per long prompt

ASCII_PER_TOKEN = 4  # prompt_text_tokens: ~4 ASCII characters per token, one per other


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a prompt in reading order: text (matched by its characters) or an
    opaque run of `tokens` matched only whole (`label` names it: a role, an image)."""

    tokens: int
    text: str | None = None
    label: str = ""


def text_part(text: str) -> Part:
    return Part(prompt_text_tokens(text), text=text)


def prefix_digests(parts: Iterable[Part]) -> tuple[bytes, ...]:
    """Digests of the prompt's prefixes at every cacheable length: the i-th covers its
    first MIN_TOKENS + i * STEP tokens. Equal prompts up to a length, equal digests."""
    hasher = hashlib.sha256()
    digests: list[bytes] = []
    done = 0
    for part in parts:
        frame = b"\x00text\x00" if part.text is not None else b"\x00run\x00" + _label(part)
        first = MIN_TOKENS + len(digests) * STEP
        inside = tuple(range(first - done, part.tokens + 1, STEP))  # boundaries, as tokens into the part
        for piece in _pieces(part, inside):
            prefix = hasher.copy()
            prefix.update(frame + piece)
            digests.append(prefix.digest())
        hasher.update(frame + (b"#%d" % part.tokens if part.text is None else _utf8(part.text)))
        done += part.tokens
    return tuple(digests)


def _label(part: Part) -> bytes:
    return hashlib.sha256(_utf8(part.label)).digest()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _pieces(part: Part, tokens: tuple[int, ...]) -> list[bytes]:
    """What the part's first n tokens are, for each n in `tokens`: its text up to there
    (so two prompts whose texts share a beginning share those prefixes), or a count."""
    if part.text is None:
        return [b"#%d" % n for n in tokens]
    return [_utf8(part.text[:cut]) for cut in _cuts(part.text, tokens)]


@lru_cache(maxsize=256)  # the schema and system prompt come back on every request
def _cuts(text: str, tokens: tuple[int, ...]) -> tuple[int, ...]:
    """For each n in `tokens` (ascending), the character index where the text's n-th
    token ends, counting as `prompt_text_tokens` does."""
    cuts: list[int] = []
    wanted = iter(tokens)
    target = next(wanted, None)
    count = pending = 0
    for i, char in enumerate(text):
        if target is None:
            break
        if char.isascii():
            pending += 1
            if pending < ASCII_PER_TOKEN:
                continue
            pending = 0
        count += 1
        if count == target:
            cuts.append(i + 1)
            target = next(wanted, None)
    if target is not None:  # the last token: the ASCII characters left over
        cuts.append(len(text))
    return tuple(cuts)


class PromptCache:
    """Recently processed prefixes, least recently used first."""

    def __init__(
        self,
        *,
        idle_s: float = IDLE_S,
        max_prefixes: int = MAX_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._idle_s = idle_s
        self._max = max_prefixes
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str, bytes], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def cached_tokens(self, model: str, cache_key: str, digests: Sequence[bytes]) -> int:
        """How many of the prompt's tokens were cached; then its prefixes are (again)."""
        now = self._clock()
        cached = 0
        for i in range(len(digests) - 1, -1, -1):
            seen = self._seen.get((model, cache_key, digests[i]))
            if seen is not None and now - seen < self._idle_s:
                cached = MIN_TOKENS + i * STEP
                break
        for digest in digests:
            key = (model, cache_key, digest)
            self._seen[key] = now
            self._seen.move_to_end(key)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return cached
