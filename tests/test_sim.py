"""The OpenAI simulator, exercised through the official openai SDK over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionUserMessageParam
from openai.types.chat.completion_create_params import ResponseFormat
from PIL import Image

from app.sim.__main__ import build_parser, config_from_args
from app.sim.config import SimConfig
from app.sim.images import image_tokens, tile_count
from app.sim.latency import plan_stream
from app.sim.models import Tiles
from app.sim.ratelimit import RateLimiter, format_duration
from app.sim.server import RunningSimulator, run_simulator
from app.sim.tokens import split_tokens

MODEL = "gpt-4o-mini"
CATEGORIES = ["plastic", "paper", "glass", "can", "vinyl", "styrofoam", "food", "general"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["category", "items", "confidence", "recyclable", "note", "extra", "tags"],
    "properties": {
        "category": {"type": "string", "enum": CATEGORIES},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "recyclable": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
        "extra": {"anyOf": [{"$ref": "#/$defs/hint"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
    },
    "$defs": {
        "item": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "count", "nothing"],
            "properties": {
                "name": {"type": "string"},
                "count": {"type": "integer", "minimum": 1, "maximum": 9},
                "nothing": {"type": "null"},
            },
        },
        "hint": {
            "type": "object",
            "additionalProperties": False,
            "required": ["text"],
            "properties": {"text": {"type": "string"}},
        },
    },
}


def schema_format(schema: dict[str, Any] = SCHEMA) -> ResponseFormat:
    return {
        "type": "json_schema",
        "json_schema": {"name": "classification", "strict": True, "schema": schema},
    }


def image_url(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def vision_messages(
    url: str, detail: Literal["low", "high", "auto"] = "low"
) -> list[ChatCompletionMessageParam]:
    user: ChatCompletionUserMessageParam = {
        "role": "user",
        "content": [
            {"type": "text", "text": "이 물건은 어떻게 버리나요?"},
            {"type": "image_url", "image_url": {"url": url, "detail": detail}},
        ],
    }
    return [{"role": "system", "content": "Classify the waste in the photo."}, user]


TEXT_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "페트병은 어떻게 버리나요?"}]


def validate(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "$") -> None:
    """A tiny JSON Schema validator for the subset the simulator supports."""
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        validate(value, target, root, path)
        return
    if "anyOf" in schema:
        errors = []
        for branch in schema["anyOf"]:
            try:
                validate(value, branch, root, path)
                return
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{path}: no anyOf branch matched: {errors}")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    assert any(checks[k](value) for k in kinds), f"{path}: {value!r} is not {kinds}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            assert name in value, f"{path}: missing {name}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for name, sub in value.items():
            if name in props:
                validate(sub, props[name], root, f"{path}.{name}")
    elif isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{path}: too few items"
        assert len(value) <= schema.get("maxItems", 10**9), f"{path}: too many items"
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), root, f"{path}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        assert value >= schema.get("minimum", -(10**18)), f"{path}: below minimum"
        assert value <= schema.get("maximum", 10**18), f"{path}: above maximum"


@pytest.fixture
async def sim_server() -> AsyncIterator[RunningSimulator]:
    async with run_simulator(SimConfig(time_scale=0.001)) as running:
        yield running


async def configure(sim_http: httpx.AsyncClient, **changes: Any) -> dict[str, Any]:
    response = await sim_http.patch("/sim/config", json=changes)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def stats(sim_http: httpx.AsyncClient) -> dict[str, Any]:
    result: dict[str, Any] = (await sim_http.get("/sim/stats")).json()
    return result


async def poll_stats(sim_http: httpx.AsyncClient, key: str) -> dict[str, Any]:
    """Stats once ``key`` is non-zero (or after ~4 s, for the assertion to report)."""
    counters = await stats(sim_http)
    for _ in range(200):
        if counters[key]:
            break
        await asyncio.sleep(0.02)
        counters = await stats(sim_http)
    return counters


async def classify(sdk: openai.AsyncOpenAI, url: str) -> str:
    reply = await sdk.chat.completions.create(
        model=MODEL,
        messages=vision_messages(url),
        response_format=schema_format(),
        max_tokens=800,
    )
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert content is not None
    return content


async def test_json_schema_reply_is_valid_and_deterministic(sdk: openai.AsyncOpenAI) -> None:
    first = await classify(sdk, image_url((200, 30, 30)))
    document = json.loads(first)
    validate(document, SCHEMA, SCHEMA)
    assert document["extra"] is not None  # nullable branches still carry a value
    assert first == await classify(sdk, image_url((200, 30, 30)))

    colors = [(i * 31 % 256, i * 67 % 256, i * 113 % 256) for i in range(12)]
    categories = set()
    for color in colors:
        reply = json.loads(await classify(sdk, image_url(color)))
        validate(reply, SCHEMA, SCHEMA)
        categories.add(reply["category"])
    assert len(categories) >= 3


async def test_json_object_and_plain_text(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "답을 json으로 주세요"}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    text = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    content = text.choices[0].message.content or ""
    assert any("\uac00" <= ch <= "\ud7a3" for ch in content)
    assert text.usage is not None
    assert text.usage.completion_tokens == len(split_tokens(content))
    assert 40 <= text.usage.completion_tokens <= 80


async def test_stream_with_usage_matches_non_streamed(sdk: openai.AsyncOpenAI) -> None:
    url = image_url((10, 120, 240))
    plain = await sdk.chat.completions.create(
        model=MODEL, messages=vision_messages(url), response_format=schema_format()
    )
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=vision_messages(url),
        response_format=schema_format(),
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    roles: list[str] = []
    finish: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert finish == ["stop"]
    assert len(pieces) > 10
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage is not None and plain.usage is not None
    assert usage.completion_tokens == len(pieces) == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_max_tokens_truncates_with_length(sdk: openai.AsyncOpenAI) -> None:
    reply = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


RATE_HEADERS = [
    f"x-ratelimit-{what}-{unit}"
    for what in ("limit", "remaining", "reset")
    for unit in ("requests", "tokens")
]


async def test_rpm_exhaustion_and_headers(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, rpm=2)
    raw = await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=TEXT_MESSAGES, max_tokens=100
    )
    for name in RATE_HEADERS:
        assert name in raw.headers
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-request-id"].startswith("req_")
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=100)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=100)
    error = caught.value
    assert error.code == "rate_limit_exceeded"
    assert error.type == "requests"
    assert "(RPM): Limit 2" in error.message
    headers = error.response.headers
    for name in RATE_HEADERS:
        assert name in headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after-ms"]) > 0
    assert int(headers["retry-after"]) >= 1
    # Limits are per model.
    await sdk.chat.completions.create(model="gpt-4o", messages=TEXT_MESSAGES, max_tokens=100)
    counters = await stats(sim_http)
    assert counters["rate_limited_total"] == 1
    assert counters["by_status"] == {"200": 3, "429": 1}
    # Naming rpm in a PATCH refills the buckets.
    await configure(sim_http, rpm=2)
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=100)


async def test_tpm_exhaustion(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, tpm=1000)
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=600)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=600)
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.type == "tokens"
    assert "(TPM)" in caught.value.message
    assert int(caught.value.response.headers["retry-after-ms"]) > 0


async def test_tpm_charges_prompt_plus_cap_at_arrival(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient
) -> None:
    # The sum, not max(prompt, cap): two calls of 490 fit a 1,000 TPM budget under the
    # max reading (980) but not under the sum (2 x (prompt + 490) > 1,000).
    probe = await sdk.chat.completions.create(model="gpt-4o", messages=TEXT_MESSAGES, max_tokens=5)
    assert probe.usage is not None
    prompt = probe.usage.prompt_tokens
    await configure(sim_http, tpm=1000)
    await sim_http.post("/sim/stats/reset")
    reply = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=490)
    assert reply.usage is not None and reply.usage.completion_tokens < 490  # nothing given back
    assert (await stats(sim_http))["tokens_charged_total"] == prompt + 490
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, max_tokens=490)
    assert f"Requested {prompt + 490}" in caught.value.message
    # No cap: the default completion reservation (4,096) is added to the prompt.
    await configure(sim_http, tpm=100_000)
    await sim_http.post("/sim/stats/reset")
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert (await stats(sim_http))["tokens_charged_total"] == prompt + 4096


async def test_unlimited_omits_rate_headers(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, rpm=0, tpm=0)
    raw = await sdk.chat.completions.with_raw_response.create(model=MODEL, messages=TEXT_MESSAGES)
    assert not any(name in raw.headers for name in RATE_HEADERS)


async def test_quota_exhausted(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, quota_exhausted=True)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.type == "insufficient_quota"
    assert "x-ratelimit-limit-requests" in caught.value.response.headers
    assert (await stats(sim_http))["quota_rejected_total"] == 1


async def test_error_rate_for_vision_only(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, error_rate=1.0, error_kinds=["vision"])
    with pytest.raises(openai.InternalServerError) as caught:
        await classify(sdk, image_url((1, 2, 3)))
    assert caught.value.status_code == 500
    assert caught.value.type == "server_error"
    assert "x-ratelimit-remaining-tokens" in caught.value.response.headers
    reply = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert reply.choices[0].message.content
    counters = await stats(sim_http)
    assert counters["errors_injected_total"] == 1
    assert counters["by_kind"] == {"vision": 1, "text": 1}
    assert counters["by_status"] == {"500": 1, "200": 1}


async def test_reject_next(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, reject_next=2, reject_retry_after_ms=250)
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
        assert caught.value.code == "rate_limit_exceeded"
        assert caught.value.response.headers["retry-after-ms"] == "250"
        assert caught.value.response.headers["retry-after"] == "1"
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert (await sim_http.get("/sim/config")).json()["reject_next"] == 0
    assert (await stats(sim_http))["rate_limited_total"] == 2


async def test_client_cancel_is_counted(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient, sim_server: RunningSimulator
) -> None:
    # A guaranteed mid-stream stall keeps the stream open until the sdk leaves.
    await configure(sim_http, time_scale=0.01, stall_rate=1.0, stall_s=30.0)
    stream = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, stream=True)
    received = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received >= 2:
                break
    assert (await poll_stats(sim_http, "stalls_injected"))["stalls_injected"] == 1
    await stream.close()
    counters = await poll_stats(sim_http, "streams_cancelled")
    assert counters["streams_cancelled"] == 1
    assert counters["streams_started"] == 1
    assert counters["streams_completed"] == 0
    assert counters["stalls_injected"] == 1
    assert counters["inflight"] == 0
    assert 0 < counters["tokens"]["completion"] < 60
    assert sim_server.state.stats.streams_cancelled == 1


async def test_stall_then_complete(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, stall_rate=1.0, stall_s=0.05)
    stream = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await configure(sim_http, stall_rate=0.0)
    plain = await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert text == plain.choices[0].message.content
    counters = await stats(sim_http)
    assert counters["stalls_injected"] == 1
    assert counters["streams_completed"] == 1
    assert counters["streams_cancelled"] == 0


async def test_patch_config_validation(sim_http: httpx.AsyncClient, sim_server: RunningSimulator) -> None:
    for bad, field in [
        ({"error_rate": 2}, "error_rate"),
        ({"rpm": -1}, "rpm"),
        ({"time_scale": "fast"}, "time_scale"),
        ({"error_kinds": ["audio"]}, "error_kinds"),
        ({"error_status": 404}, "error_status"),
        ({"bogus": 1}, "bogus"),
    ]:
        response = await sim_http.patch("/sim/config", json=bad)
        assert response.status_code == 422, bad
        assert field in response.json()["error"]["message"]
    assert (await sim_http.patch("/sim/config", content=b"[1]")).status_code == 422
    updated = await configure(sim_http, rpm=7, error_kinds=["text"], latency_sigma=0)
    assert updated["rpm"] == 7 and updated["error_kinds"] == ["text"]
    assert sim_server.state.config.latency_sigma == 0.0
    assert (await sim_http.get("/sim/config")).json() == updated


def test_config_validation_and_env() -> None:
    with pytest.raises(ValueError, match="stall_rate"):
        SimConfig(stall_rate=-0.1)
    with pytest.raises(ValueError, match="first_token_fraction"):
        SimConfig(first_token_fraction=1.5)
    with pytest.raises(ValueError, match="tpm"):
        SimConfig(tpm=True)
    config = SimConfig.from_env(
        {"SIM_TIME_SCALE": "0.01", "SIM_ERROR_KINDS": "vision", "SIM_QUOTA_EXHAUSTED": "true"}
    )
    assert config.time_scale == 0.01
    assert config.error_kinds == ("vision",)
    assert config.quota_exhausted is True
    with pytest.raises(ValueError, match="rpm"):
        SimConfig.from_env({"SIM_RPM": "lots"})
    args = build_parser().parse_args(["--time-scale", "0.5", "--error-kinds", "vision"])
    merged = config_from_args(args, {"SIM_TIME_SCALE": "0.1", "SIM_RPM": "9"})
    assert (merged.time_scale, merged.rpm, merged.error_kinds) == (0.5, 9, ("vision",))


async def test_image_token_counting(sdk: openai.AsyncOpenAI) -> None:
    # gpt-4o bills tiles: 85 base + 170 per 512-px tile (other families: test_sim_models).
    url = image_url((90, 90, 90), size=(1024, 1024))
    prompt = {}
    details: list[Literal["low", "high", "auto"]] = ["low", "high", "auto"]
    for detail in details:
        reply = await sdk.chat.completions.create(
            model="gpt-4o", messages=vision_messages(url, detail), max_tokens=50
        )
        assert reply.usage is not None
        prompt[detail] = reply.usage.prompt_tokens
    assert prompt["high"] - prompt["low"] == 765 - 85
    assert prompt["auto"] == prompt["high"]
    assert tile_count(2048, 4096) == 6
    assert tile_count(512, 512) == 1
    gpt_4o = Tiles(85, 170)
    assert image_tokens(image_url((0, 0, 0), size=(2048, 4096)), "high", gpt_4o) == 85 + 170 * 6
    assert image_tokens("https://example.com/a.jpg", "high", gpt_4o) == 765
    assert image_tokens("https://example.com/a.jpg", "low", gpt_4o) == 85


async def test_bad_requests_are_openai_shaped(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    response = await sim_http.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = await sim_http.post("/v1/chat/completions", json={"model": MODEL, "messages": 3})
    assert response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(
            model=MODEL, messages=vision_messages("data:image/jpeg;base64,AAAA", "high")
        )
    assert caught.value.code == "invalid_image_format"
    models = await sdk.models.list()
    assert MODEL in [m.id for m in models.data]
    assert (await sim_http.get("/v1/nope")).json()["error"]["type"] == "invalid_request_error"


async def test_a_request_without_a_bearer_key_gets_openais_401(sim_server: RunningSimulator) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=sim_server.url) as anonymous:
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic c2ltOg=="}):
            response = await anonymous.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 401
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith("You didn't provide an API key.")
    async with openai.AsyncOpenAI(api_key="any-key", base_url=sim_server.base_url, max_retries=0) as sdk:
        reply = await sdk.chat.completions.create(model=MODEL, messages=body["messages"])  # type: ignore[arg-type]
    assert reply.choices[0].message.content


async def test_stats_reset(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await sdk.chat.completions.create(model=MODEL, messages=TEXT_MESSAGES)
    assert (await stats(sim_http))["requests_total"] == 1
    reset = (await sim_http.post("/sim/stats/reset")).json()
    assert reset["requests_total"] == 0
    assert reset["tokens"] == {"prompt": 0, "completion": 0, "reasoning": 0, "cached": 0}


def test_format_duration_and_stream_plan() -> None:
    assert format_duration(0) == "0s"
    assert format_duration(0.12) == "120ms"
    assert format_duration(1) == "1s"
    assert format_duration(8.64) == "8.64s"
    assert format_duration(90.5) == "1m30.5s"
    assert format_duration(360) == "6m0s"
    plan = plan_stream(4.0, 0.25, 61)
    assert plan.first_delay == 1.0 and plan.batch == 1 and plan.gap == pytest.approx(0.05)
    fast = plan_stream(0.004, 0.15, 61)
    assert fast.batch > 1 and fast.gap >= 0.002


def test_shared_key_usage_shrinks_the_budget_but_not_the_reported_limit() -> None:
    now = [0.0]
    limiter = RateLimiter(60, 0, lambda: now[0], shared_rpm=30)
    for _ in range(60):
        denial, _headers = limiter.acquire("m", 1)
        assert denial is None
    denial, headers = limiter.acquire("m", 1)
    assert denial is not None
    # Our net refill is 60 - 30 = 30 requests/min: one request every 2 s.
    assert denial.retry_after_s == pytest.approx(2.0)
    assert (b"x-ratelimit-limit-requests", b"60") in headers
    now[0] = 2.0
    assert limiter.acquire("m", 1)[0] is None
