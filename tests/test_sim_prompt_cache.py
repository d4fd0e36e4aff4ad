"""The simulator's prompt caching, as OpenAI documents it: prompts of 1,024 tokens or more,
the longest prefix seen recently for the model, in 128-token steps from 1,024, reported in
`usage.prompt_tokens_details.cached_tokens` (streamed or not) and in `/sim/stats`."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from PIL import Image

from app.sim.config import SimConfig
from app.sim.prompt_cache import MIN_TOKENS, STEP, Part, PromptCache, prefix_digests, text_part
from app.sim.server import RunningSimulator, run_simulator
from app.sim.tokens import prompt_text_tokens

MODEL = "gpt-4o-mini"
# ~2,000 tokens of static instructions: one simulator token per Hangul syllable.
STATIC = "분리배출 안내 규칙입니다. " * 150


@pytest.fixture
async def sim_server() -> AsyncIterator[RunningSimulator]:
    async with run_simulator(SimConfig(time_scale=0.001)) as running:
        yield running


def messages(question: str, system: str = STATIC) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def cached_tokens(sdk: openai.AsyncOpenAI, msgs: list[ChatCompletionMessageParam], **kw: Any) -> int:
    reply = await sdk.chat.completions.create(model=kw.pop("model", MODEL), messages=msgs, **kw)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    assert cached <= reply.usage.prompt_tokens
    return cached


async def test_a_repeated_long_prompt_is_served_from_the_cache_in_128_token_steps(
    sdk: openai.AsyncOpenAI, sim_server: RunningSimulator
) -> None:
    msgs = messages("페트병은 어떻게 버리나요?")
    assert await cached_tokens(sdk, msgs) == 0  # first sight: nothing cached yet
    reply = await sdk.chat.completions.create(model=MODEL, messages=msgs)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    prompt = reply.usage.prompt_tokens
    assert cached >= MIN_TOKENS and (cached - MIN_TOKENS) % STEP == 0
    assert prompt - STEP < cached <= prompt  # the whole prompt, down to the last full step
    async with httpx.AsyncClient(base_url=sim_server.url) as client:
        assert (await client.get("/sim/stats")).json()["tokens"]["cached"] == cached


async def test_a_shared_prefix_is_cached_up_to_where_the_prompts_differ(sdk: openai.AsyncOpenAI) -> None:
    await cached_tokens(sdk, messages("종이팩은요?"))
    other = await cached_tokens(sdk, messages("유리병은 어떻게 버리나요? " + "자세히 " * 300))
    static_tokens = prompt_text_tokens(STATIC)  # system text, after a few tokens of framing
    assert static_tokens - STEP < other <= static_tokens + 8


async def test_short_prompts_other_models_and_other_keys_are_not_served(sdk: openai.AsyncOpenAI) -> None:
    short = messages("짧은 질문", system="짧은 시스템 프롬프트")
    await cached_tokens(sdk, short)
    assert await cached_tokens(sdk, short) == 0  # under 1,024 tokens: never cached
    long = messages("캔은요?")
    await cached_tokens(sdk, long)
    assert await cached_tokens(sdk, long, model="gpt-4o") == 0  # per model
    assert await cached_tokens(sdk, long, prompt_cache_key="tenant-b") == 0  # per routing key
    assert await cached_tokens(sdk, long) > 0


async def test_the_schema_leads_the_prefix_and_a_changed_schema_misses(sdk: openai.AsyncOpenAI) -> None:
    def schema(name: str) -> Any:
        properties = {name: {"type": "string"}}
        body = {"type": "object", "properties": properties, "required": [name], "additionalProperties": False}
        return {"type": "json_schema", "json_schema": {"name": "reply", "strict": True, "schema": body}}

    msgs = messages("플라스틱은요?")
    await cached_tokens(sdk, msgs, response_format=schema("answer"))
    assert await cached_tokens(sdk, msgs, response_format=schema("answer")) > 0
    # The schema comes before the system message: change it and nothing after it matches.
    assert await cached_tokens(sdk, msgs, response_format=schema("reply")) == 0


async def test_the_same_image_is_part_of_the_cached_prefix(sdk: openai.AsyncOpenAI) -> None:
    def vision(color: tuple[int, int, int], note: str) -> list[ChatCompletionMessageParam]:
        buffer = io.BytesIO()
        Image.new("RGB", (64, 48), color).save(buffer, "JPEG")
        url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
        image: Any = {"type": "image_url", "image_url": {"url": url, "detail": "low"}}
        return [
            {"role": "system", "content": "분류하세요."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "분류"}, image, {"type": "text", "text": note}],
            },
        ]

    # gpt-4o-mini bills a low-detail image at 2,833 tokens: the photo alone is a long prefix.
    await cached_tokens(sdk, vision((1, 2, 3), "메모 하나"))
    assert await cached_tokens(sdk, vision((1, 2, 3), "다른 메모")) >= 2048
    assert await cached_tokens(sdk, vision((3, 2, 1), "메모 하나")) == 0


async def test_a_streamed_reply_reports_cached_tokens_in_its_usage_chunk(sdk: openai.AsyncOpenAI) -> None:
    msgs = messages("건전지는요?")
    await cached_tokens(sdk, msgs)
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    assert (usage[0].prompt_tokens_details.cached_tokens or 0) >= MIN_TOKENS


def test_prefixes_are_forgotten_after_minutes_idle_and_past_the_bound() -> None:
    now = [0.0]
    cache = PromptCache(idle_s=300.0, max_prefixes=64, clock=lambda: now[0])
    digests = prefix_digests([text_part(STATIC)])
    assert len(digests) == (prompt_text_tokens(STATIC) - MIN_TOKENS) // STEP + 1
    assert cache.cached_tokens(MODEL, "", digests) == 0
    now[0] = 299.0
    assert cache.cached_tokens(MODEL, "", digests) == MIN_TOKENS + (len(digests) - 1) * STEP
    now[0] = 299.0 + 300.0  # idle for 5 minutes: gone
    assert cache.cached_tokens(MODEL, "", digests) == 0
    for i in range(20):  # other prompts push it out of the bounded memory
        cache.cached_tokens(MODEL, "", prefix_digests([text_part(f"{i} " + STATIC)]))
    assert len(cache) == 64
    assert cache.cached_tokens(MODEL, "", digests) == 0


def test_prefix_digests_agree_exactly_as_far_as_the_prompts_do() -> None:
    role = Part(4, label="system")
    a = prefix_digests([role, text_part(STATIC + "가" * 400)])
    b = prefix_digests([role, text_part(STATIC + "나" * 400)])
    shared = sum(1 for x, y in zip(a, b, strict=True) if x == y)
    # Equal digests exactly up to the last step inside the shared text.
    assert shared == (4 + prompt_text_tokens(STATIC) - MIN_TOKENS) // STEP + 1
    assert a[:shared] == b[:shared] and a[shared] != b[shared]
    image = prefix_digests([role, Part(2833, label="low data:a"), text_part("메모")])
    other = prefix_digests([role, Part(2833, label="low data:b"), text_part("메모")])
    assert len(image) == len(other) and not set(image) & set(other)
