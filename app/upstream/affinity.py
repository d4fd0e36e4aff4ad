"""Prompt-cache affinity: OpenAI (and Azure) serve a prompt's prefix from a cache kept per
organisation (per resource), for prompts of 1,024 tokens or more, and only when the first
1,024 tokens match one processed lately. Calls whose first 1,024 tokens are equal (a photo
sent again with another note) hit that cache only where it was sent before; spread over
several organisations, each pays for it once more. `Router.pick` prefers the deployment a
prefix went to last when that deployment can take the call as soon as the one it would pick.

The key is a hash of the prompt's first `CACHED_PREFIX_TOKENS` tokens as we estimate them
(app/upstream/tokens.py), in the order the provider reads them: the schema, then the
messages; an image counts whole (it matches only whole). A prompt shorter than that has no
key: nothing of it can be cached. The key is Python's `hash` (per process, as the memory
is; a string's hash is kept on the string, so the photo's data URL is hashed once): two
prompts sharing a key by chance only share a preference.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.upstream.call import ChatRequest
from app.upstream.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    TILES_GPT_4O,
    estimate_image_tokens,
    estimate_text_tokens,
)

CACHED_PREFIX_TOKENS = 1024  # OpenAI's least cached prompt, and the prefix a hit needs
# A prefix unused this long is taken as gone from the provider's cache (OpenAI: "typically
# 5 to 10 minutes of inactivity"; Azure: "always removed within one hour").
PREFIX_MEMORY_S = 600.0
MAX_PREFIXES = 4096  # per stage: the distinct prefixes of ~10 minutes of photos sent again


def prefix_key(request: ChatRequest) -> int | None:
    """The hash of `request`'s first `CACHED_PREFIX_TOKENS` tokens; None when it is shorter."""
    parts: list[object] = []
    left = CACHED_PREFIX_TOKENS
    if request.response_format is not None:
        schema = json.dumps(request.response_format, ensure_ascii=False)  # as the stages price it
        parts.append(_text_prefix(schema, left))
        left -= estimate_text_tokens(schema)
    for message in request.messages:
        if left <= 0:
            break
        parts.append(message.get("role"))
        left -= MESSAGE_OVERHEAD_TOKENS
        for part in _content_parts(message.get("content")):
            if left <= 0:
                break
            if part.get("type") == "image_url":
                image = part.get("image_url") or {}
                url = str(image.get("url", ""))
                size = (request.image_sizes or {}).get(url, (None, None))
                parts.append(hash(url))
                left -= estimate_image_tokens(
                    size[0], size[1], str(image.get("detail", "auto")), TILES_GPT_4O
                )
            elif isinstance(text := part.get("text"), str):
                parts.append(_text_prefix(text, left))
                left -= estimate_text_tokens(text)
    return hash(tuple(parts)) if left <= 0 else None


def _content_parts(content: Any) -> Sequence[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [part for part in content if isinstance(part, Mapping)]
    return []


def _text_prefix(text: str, tokens: int) -> str:
    """`text`, or its shortest beginning of `tokens` estimated tokens when it is longer (the
    common case, a text wholly inside the prefix, keeps the string and its cached hash)."""
    if estimate_text_tokens(text) <= tokens:
        return text
    low, high = 0, len(text)  # the shortest cut whose estimate reaches `tokens`
    while low < high:
        middle = (low + high) // 2
        if estimate_text_tokens(text[:middle]) >= tokens:
            high = middle
        else:
            low = middle + 1
    return text[:low]


class PrefixAffinity:
    """Per stage, where each recent prefix was sent last: bounded (least recently used out
    first) and forgetting what the provider's cache will have forgotten."""

    def __init__(
        self,
        *,
        memory_s: float = PREFIX_MEMORY_S,
        max_prefixes: int = MAX_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._memory_s = memory_s
        self._max = max_prefixes
        self._clock = clock
        self._last: dict[str, OrderedDict[int, tuple[str, float]]] = {}

    def __len__(self) -> int:
        return sum(len(sent) for sent in self._last.values())

    def home(self, stage: str, key: int) -> str | None:
        """The deployment `key`'s prefix went to last for `stage`, while still remembered."""
        sent = self._last.get(stage)
        entry = None if sent is None else sent.get(key)
        if entry is None or self._clock() - entry[1] >= self._memory_s:
            return None
        return entry[0]

    def sent(self, stage: str, key: int, deployment: str) -> None:
        sent = self._last.setdefault(stage, OrderedDict())
        sent[key] = (deployment, self._clock())
        sent.move_to_end(key)
        while len(sent) > self._max:
            sent.popitem(last=False)
