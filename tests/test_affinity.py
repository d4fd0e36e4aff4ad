"""Prompt-cache affinity (app/upstream/affinity.py): which prompts share a cacheable prefix,
how `Router.pick` prefers where one went last without overriding limits, budgets or
breakers, and, over real HTTP with two simulated organisations, that it raises the share
of prompt tokens their caches serve."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest

from app.limits.clock import FakeClock
from app.sim.config import SimConfig
from app.sim.server import RunningSimulator
from app.upstream.affinity import CACHED_PREFIX_TOKENS, PREFIX_MEMORY_S, PrefixAffinity, prefix_key
from app.upstream.call import ChatRequest
from app.upstream.routes import Router

from .conftest import data_url, make_jpeg, run_scan, sim_stats
from .test_router import hold, route, tokens
from .test_routing import deployment, routed_service, simulators

SYSTEM = "You sort waste. " * 200  # ~800 tokens, shared by every call
PHOTO_SIZE = (640, 480)  # 765 tokens at `high` detail: with the system prompt, past 1,024


def vision(photo: str, note: str = "", *, detail: str = "high", system: str = SYSTEM) -> ChatRequest:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": photo, "detail": detail}}]
    if note:
        content.append({"type": "text", "text": note})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": content},
    ]
    return ChatRequest("vision", messages, image_sizes={photo: PHOTO_SIZE})


def test_a_photo_sent_again_with_another_note_keeps_its_key() -> None:
    first = prefix_key(vision("data:image/jpeg;base64,AAAA", "is this glass?"))
    assert first is not None
    assert prefix_key(vision("data:image/jpeg;base64,AAAA", "or plastic?")) == first
    assert prefix_key(vision("data:image/jpeg;base64,BBBB", "is this glass?")) != first


def test_a_prompt_under_the_cacheable_length_has_no_key() -> None:
    # `low` detail: 85 tokens, so the prompt ends short of 1,024 tokens
    assert prefix_key(vision("data:image/jpeg;base64,AAAA", "note", detail="low")) is None
    assert prefix_key(vision("data:image/jpeg;base64,AAAA", "note", system="short")) is None


def test_only_the_first_1024_tokens_of_a_long_text_make_the_key() -> None:
    shared = "x" * (4 * CACHED_PREFIX_TOKENS)  # 1,024 tokens at ~4 ASCII characters each
    one = ChatRequest("answer", [{"role": "system", "content": shared + "tail one"}])
    other = ChatRequest("answer", [{"role": "system", "content": shared + "tail two"}])
    early = ChatRequest("answer", [{"role": "system", "content": "y" + shared}])
    assert prefix_key(one) is not None
    assert prefix_key(one) == prefix_key(other)
    assert prefix_key(early) != prefix_key(one)


async def test_the_memory_is_bounded_and_forgets_what_the_provider_cache_has() -> None:
    clock = FakeClock()
    affinity = PrefixAffinity(max_prefixes=3, clock=clock.now)
    for key in range(5):
        affinity.sent("vision", key, "org-b")
    assert len(affinity) == 3
    assert affinity.home("vision", 0) is None  # the least recently sent went first
    assert affinity.home("vision", 4) == "org-b"
    assert affinity.home("answer", 4) is None  # per stage
    await clock.advance(PREFIX_MEMORY_S)
    assert affinity.home("vision", 4) is None


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack


async def test_pick_prefers_where_the_prefix_went_only_when_it_takes_the_call_as_soon(
    stack: AsyncExitStack,
) -> None:
    clock = FakeClock()
    a = route(stack, clock, "org-a", rpm=600, priority=0, limit=4)
    b = route(stack, clock, "org-b", rpm=600, priority=0, limit=4)
    router = Router([a, b], clock, spill_after_s=10.0, affinity=PrefixAffinity(clock=clock.now))
    key = router.prefix_of(vision("data:image/jpeg;base64,AAAA"))
    assert key is not None
    hold(a, 1)
    assert router.pick("vision", tokens, prefix=key) is b  # the least loaded; remembered
    hold(b, 1)  # as loaded as a: the balance has no preference, the cache decides
    assert router.pick("vision", tokens, prefix=key) is b
    hold(b, 2)  # b now holds two calls more than a (4/4 against 2/4): the balance wins
    assert router.pick("vision", tokens, prefix=key) is a
    assert router.pick("vision", tokens, prefix=key) is a  # and a is now its home


async def test_affinity_never_overrides_a_budget_or_a_breaker(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    a = route(stack, clock, "org-a", rpm=600, priority=0)
    b = route(stack, clock, "org-b", rpm=600, priority=0)
    affinity = PrefixAffinity(clock=clock.now)
    router = Router([a, b], clock, spill_after_s=10.0, affinity=affinity)
    affinity.sent("vision", 7, "org-b")
    b.budget.pause(1.0)  # b admits the call later than a
    assert router.pick("vision", tokens, prefix=7) is a
    affinity.sent("vision", 7, "org-b")
    await clock.advance(1.0)
    assert router.pick("vision", tokens, prefix=7) is b
    b.breaker.take_out(clock.now(), "401: invalid key", 300.0)
    assert router.pick("vision", tokens, prefix=7) is a


async def test_without_affinity_the_prefix_is_not_looked_at(stack: AsyncExitStack) -> None:
    clock = FakeClock()
    a = route(stack, clock, "org-a", rpm=600, priority=0)
    b = route(stack, clock, "org-b", rpm=600, priority=0)
    router = Router([a, b], clock, spill_after_s=10.0)
    assert router.prefix_of(vision("data:image/jpeg;base64,AAAA")) is None
    hold(a, 1)
    assert router.pick("vision", tokens, prefix=None) is b
    hold(b, 2)
    assert router.pick("vision", tokens, prefix=None) is a


DEPLOYMENTS = ("org-a", "org-b")
PHOTOS = 6
ROUNDS = 4  # each photo scanned this many times, with a new note each time


async def cached_share(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch, *, affinity: bool
) -> float:
    """The share of the vision prompts' tokens the two organisations' caches served, as the
    service counts them per deployment, when each photo comes back `ROUNDS` times: all of
    a round at once, in a new order each round."""
    fast = SimConfig(time_scale=0.002, latency_sigma=0.0, text_tokens=20)
    order = random.Random(35)
    async with simulators(2, fast) as (a, b):
        # gpt-4o: a photo at `high` detail is 765 tokens (gpt-4o-mini bills it ~33 times that).
        listed = [deployment(name, s, vision_model="gpt-4o") for name, s in (("org-a", a), ("org-b", b))]
        async with routed_service(
            database_url, sim, monkeypatch, listed, vision_detail="high", upstream_cache_affinity=affinity
        ) as svc:
            for round_ in range(ROUNDS):
                photos = list(range(PHOTOS))
                order.shuffle(photos)
                for outcome in await _round(svc, photos, round_):
                    assert outcome.terminal.event == "done", outcome.terminal.data
            counted = {
                (u, stage, kind): svc.metric(
                    "ecoscan_upstream_prompt_tokens_total", {"upstream": u, "stage": stage, "kind": kind}
                )
                for u in DEPLOYMENTS
                for stage in ("vision", "answer")
                for kind in ("prompt", "cached")
            }
            stats = [await sim_stats(a), await sim_stats(b)]
    # Each organisation's cache, as the service counts it, is what that organisation served.
    served = [counted[(u, "vision", "cached")] + counted[(u, "answer", "cached")] for u in DEPLOYMENTS]
    assert served == [s["tokens"]["cached"] for s in stats]
    assert min(s["requests_total"] for s in stats) > 0, stats  # both organisations carried calls
    cached = sum(counted[(u, "vision", "cached")] for u in DEPLOYMENTS)
    return cached / sum(counted[(u, "vision", "prompt")] for u in DEPLOYMENTS)


async def _round(svc: Any, photos: list[int], round_: int) -> list[Any]:
    return await asyncio.gather(
        *(
            run_scan(
                svc.client,
                json={"image_url": data_url(make_jpeg(500 + p)), "user_input": f"round {round_}: which bin?"},
            )
            for p in photos
        )
    )


async def test_affinity_raises_the_share_of_prompt_tokens_the_caches_serve(
    database_url: str, sim: RunningSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_share = await cached_share(database_url, sim, monkeypatch, affinity=True)
    without_share = await cached_share(database_url, sim, monkeypatch, affinity=False)
    assert with_share > without_share, (with_share, without_share)
