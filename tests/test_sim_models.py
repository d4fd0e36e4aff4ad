"""The simulator as a per-model double of OpenAI: parameter rules, reasoning, image billing,
200-path faults and request capture, exercised through the openai SDK over real HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionContentPartParam, ChatCompletionMessageParam

from app.sim.__main__ import build_parser, config_from_args
from app.sim.config import SimConfig
from app.sim.images import patch_count
from app.sim.models import family_for, listed_models
from app.sim.reply import REFUSAL_TEXT
from app.sim.server import RunningSimulator, run_simulator
from app.sim.tokens import split_tokens
from tests.test_sim import (
    SCHEMA,
    TEXT_MESSAGES,
    configure,
    image_url,
    schema_format,
    stats,
    validate,
    vision_messages,
)

Detail = Literal["low", "high", "auto"]


@pytest.fixture
async def sim_server() -> AsyncIterator[RunningSimulator]:
    async with run_simulator(SimConfig(time_scale=0.001, latency_sigma=0)) as running:
        yield running


async def create(sdk: openai.AsyncOpenAI, model: str, **params: Any) -> ChatCompletion:
    params.setdefault("messages", TEXT_MESSAGES)
    reply: ChatCompletion = await sdk.chat.completions.create(model=model, **params)
    return reply


async def rejected(sdk: openai.AsyncOpenAI, model: str, **params: Any) -> dict[str, Any]:
    """The ``error`` object of a 400 the SDK raised."""
    with pytest.raises(openai.BadRequestError) as caught:
        await create(sdk, model, **params)
    return cast(dict[str, Any], caught.value.body)


def unsupported(param: str, value: str, supported: str) -> dict[str, Any]:
    message = f"Unsupported value: '{param}' does not support {value} with this model. {supported}"
    return {"message": message, "type": "invalid_request_error", "param": param, "code": "unsupported_value"}


def bad_effort(value: str, supported: str) -> dict[str, Any]:
    return unsupported("reasoning_effort", f"'{value}'", supported)


MAX_TOKENS_ERROR = {
    "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
    "Use 'max_completion_tokens' instead.",
    "type": "invalid_request_error",
    "param": "max_tokens",
    "code": "unsupported_parameter",
}
ONLY_DEFAULT = "Only the default (1) value is supported."
GPT5_EFFORTS = "Supported values are: 'minimal', 'low', 'medium', and 'high'."
GPT51_EFFORTS = "Supported values are: 'none', 'low', 'medium', and 'high'."
O_EFFORTS = "Supported values are: 'low', 'medium', and 'high'."
TEMP_02 = unsupported("temperature", "0.2", ONLY_DEFAULT)


@pytest.mark.parametrize("model", ["gpt-5.1", "gpt-5-mini", "o4-mini", "gpt-5.4", "gpt-5-mini-2025-08-07"])
async def test_max_tokens_is_refused_by_reasoning_models(sdk: openai.AsyncOpenAI, model: str) -> None:
    assert await rejected(sdk, model, max_tokens=50) == MAX_TOKENS_ERROR
    reply = await create(sdk, model, max_completion_tokens=5000)
    assert reply.choices[0].finish_reason == "stop"


async def test_caps_on_a_chat_model(sdk: openai.AsyncOpenAI) -> None:
    for cap in ("max_tokens", "max_completion_tokens"):
        reply = await create(sdk, "gpt-4o-mini-2024-07-18", **{cap: 3})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 3
    error = await rejected(sdk, "gpt-4o-mini", max_tokens=3, max_completion_tokens=3)
    assert error["code"] == "invalid_parameter_combination"
    assert (await rejected(sdk, "gpt-4o-mini", max_completion_tokens=0))["code"] == "integer_below_min_value"


@pytest.mark.parametrize(
    ("model", "params", "error"),
    [
        ("gpt-5-mini", {"temperature": 0}, unsupported("temperature", "0", ONLY_DEFAULT)),
        ("o4-mini", {"top_p": 0.5}, unsupported("top_p", "0.5", ONLY_DEFAULT)),
        ("gpt-5.1", {"temperature": 0.2, "reasoning_effort": "low"}, TEMP_02),
        ("gpt-5.4", {"top_p": 0.9, "reasoning_effort": "xhigh"}, unsupported("top_p", "0.9", ONLY_DEFAULT)),
        ("gpt-5-mini", {"reasoning_effort": "none"}, bad_effort("none", GPT5_EFFORTS)),
        ("gpt-5.1", {"reasoning_effort": "minimal"}, bad_effort("minimal", GPT51_EFFORTS)),
        ("gpt-5.1", {"reasoning_effort": "xhigh"}, bad_effort("xhigh", GPT51_EFFORTS)),
        ("o4-mini", {"reasoning_effort": "minimal"}, bad_effort("minimal", O_EFFORTS)),
        (
            "gpt-4o-mini",
            {"reasoning_effort": "low"},
            {
                "message": "Unsupported parameter: 'reasoning_effort' is not supported with this model.",
                "type": "invalid_request_error",
                "param": "reasoning_effort",
                "code": "unsupported_parameter",
            },
        ),
    ],
)
async def test_per_model_parameter_errors(
    sdk: openai.AsyncOpenAI, model: str, params: dict[str, Any], error: dict[str, Any]
) -> None:
    assert await rejected(sdk, model, **params) == error


@pytest.mark.parametrize(
    ("model", "params"),
    [
        ("gpt-4o-mini", {"temperature": 0, "top_p": 0.3}),
        ("gpt-5-mini", {"temperature": 1, "top_p": 1, "reasoning_effort": "minimal"}),
        ("gpt-5.1", {"temperature": 0.2}),  # default effort is none
        ("gpt-5.1", {"temperature": 0.2, "top_p": 0.5, "reasoning_effort": "none"}),
        ("gpt-5.4", {"reasoning_effort": "xhigh", "max_completion_tokens": 20000}),
        ("o3", {"reasoning_effort": "high", "max_completion_tokens": 20000}),
        ("gpt-4.1-nano", {"user": "u-1", "safety_identifier": "s" * 64, "prompt_cache_key": "k"}),
    ],
)
async def test_accepted_parameters(sdk: openai.AsyncOpenAI, model: str, params: dict[str, Any]) -> None:
    assert (await create(sdk, model, **params)).choices[0].message.content


async def test_schema_level_errors(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    error = await rejected(sdk, "gpt-4.1", safety_identifier="s" * 65)
    assert (error["code"], error["param"]) == ("string_above_max_length", "safety_identifier")
    assert "maximum length 64, but got a string with length 65" in error["message"]
    error = await rejected(sdk, "gpt-5", reasoning_effort=cast(Any, "extreme"))
    assert (error["code"], error["param"]) == ("invalid_value", "reasoning_effort")
    assert (await rejected(sdk, "gpt-4o", temperature=2.5))["code"] == "decimal_above_max_value"
    assert await rejected(sdk, "gpt-4o", extra_body={"bogus": 1}) == {
        "message": "Unrecognized request argument supplied: bogus",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    response = await sim_http.post(
        "/v1/chat/completions", json={"model": "gpt-9-turbo", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `gpt-9-turbo` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError):
        await create(sdk, "gpt-4omg")
    listed = [m.id for m in (await sdk.models.list()).data]
    assert {"gpt-4o-mini", "gpt-4.1-mini", "gpt-5-mini", "gpt-5.1", "o4-mini"} <= set(listed)
    assert listed == list(listed_models())


def test_family_matching_and_patches() -> None:
    assert family_for("gpt-4o-mini-2024-07-18") == family_for("gpt-4o-mini")
    assert family_for("gpt-4o-2024-08-06") == family_for("gpt-4o") != family_for("gpt-4o-mini")
    assert family_for("gpt-5.4-mini") == family_for("gpt-5.2")
    assert family_for("gpt-4omg") is None and family_for("gpt-6") is None
    assert patch_count(1024, 1024) == 1024
    assert patch_count(1800, 2400) == 1452  # the vision guide's worked example (1056x1408)
    assert patch_count(4032, 3024) <= 1536


async def stream_reply(sdk: openai.AsyncOpenAI, model: str, **params: Any) -> dict[str, Any]:
    """A streamed call folded into content, refusal, finish reasons and usage."""
    params.setdefault("messages", TEXT_MESSAGES)
    stream = await sdk.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **params
    )
    out: dict[str, Any] = {"content": "", "refusal": "", "finish": [], "usage": None}
    async for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            out["refusal"] += choice.delta.refusal or ""
            if choice.finish_reason:
                out["finish"].append(choice.finish_reason)
    return out


async def test_reasoning_tokens_by_effort(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    ranges = {"minimal": (8, 64), "low": (128, 512), "medium": (512, 2048), "high": (2048, 8192)}
    for effort, (low, high) in ranges.items():
        reply = await create(sdk, "gpt-5-mini", reasoning_effort=effort)
        usage = reply.usage
        assert usage is not None and usage.completion_tokens_details is not None
        reasoning = usage.completion_tokens_details.reasoning_tokens or 0
        assert low <= reasoning <= high, effort
        visible = len(split_tokens(reply.choices[0].message.content or ""))
        assert usage.completion_tokens == reasoning + visible
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    default = await create(sdk, "gpt-5-mini")  # medium, drawn from the request digest
    again = await create(sdk, "gpt-5-mini", reasoning_effort="medium")
    assert default.usage is not None and again.usage is not None
    assert default.usage.completion_tokens_details == again.usage.completion_tokens_details
    none = await create(sdk, "gpt-5.1")
    assert none.usage is not None and none.usage.completion_tokens_details is not None
    assert none.usage.completion_tokens_details.reasoning_tokens == 0
    counters = await stats(sim_http)
    assert counters["tokens"]["reasoning"] > 0
    await configure(sim_http, reasoning_scale=0)
    off = await create(sdk, "o3")
    assert off.usage is not None and off.usage.completion_tokens_details is not None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


async def test_reasoning_spends_the_cap(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    # Medium effort reasons at least 512 tokens: a cap of 100 leaves nothing visible.
    reply = await create(sdk, "gpt-5-mini", max_completion_tokens=100)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == ""
    assert reply.usage is not None and reply.usage.completion_tokens == 100
    assert reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 100
    streamed = await stream_reply(sdk, "gpt-5-mini", max_completion_tokens=100)
    assert (streamed["content"], streamed["finish"]) == ("", ["length"])
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == 100
    # A smaller scale leaves room: the cap then cuts the visible part after reasoning.
    await configure(sim_http, reasoning_scale=0.01)
    free = await create(sdk, "gpt-5-mini")
    assert free.usage is not None and free.usage.completion_tokens_details is not None
    reasoning = free.usage.completion_tokens_details.reasoning_tokens or 0
    assert 5 <= reasoning <= 21
    cut = await create(sdk, "gpt-5-mini", max_completion_tokens=reasoning + 5)
    assert cut.choices[0].finish_reason == "length"
    assert len(split_tokens(cut.choices[0].message.content or "")) == 5
    assert cut.usage is not None and cut.usage.completion_tokens == reasoning + 5
    streamed = await stream_reply(sdk, "gpt-5-mini", max_completion_tokens=reasoning + 5)
    assert streamed["content"] == cut.choices[0].message.content
    assert streamed["usage"].completion_tokens == reasoning + 5
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == reasoning


def image_messages(url: str | None, detail: Detail) -> list[ChatCompletionMessageParam]:
    parts: list[ChatCompletionContentPartParam] = [{"type": "text", "text": "What is this?"}]
    if url is not None:
        parts.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
    return [{"role": "user", "content": parts}]


# Image tokens per the vision guide's table, written out: tiles are base + per_tile * n,
# patches are round(patches * multiplier) and ignore detail=low.
IMAGE_CASES: list[tuple[str, tuple[int, int] | None, Detail, int]] = [
    ("gpt-4o", (1024, 1024), "low", 85),
    ("gpt-4o", (1024, 1024), "high", 85 + 170 * 4),
    ("gpt-4o-mini", (1024, 1024), "low", 2833),
    ("gpt-4o-mini", (512, 512), "high", 2833 + 5667),
    ("gpt-4o-mini", None, "auto", 2833 + 5667 * 4),  # http URL: size unknown
    ("gpt-4.1-mini", (1024, 1024), "high", 1659),  # round(1024 * 1.62)
    ("gpt-4.1-mini", (1024, 1024), "low", 1659),
    ("gpt-4.1-nano", (512, 512), "auto", 630),  # round(256 * 2.46)
    ("gpt-5", (512, 512), "high", 70 + 140),
    ("gpt-5", (512, 512), "low", 70),
    ("gpt-5-mini", (512, 512), "low", 415),  # round(256 * 1.62)
    ("gpt-5-mini", None, "high", 1659),  # 1024 patches assumed
    ("gpt-5-nano", (1800, 2400), "high", 3572),  # round(1452 * 2.46)
    ("gpt-5.1", (1024, 1024), "high", 70 + 140 * 4),
    ("gpt-5.4", (1024, 1024), "high", 1229),  # round(1024 * 1.2)
    ("o1", (1024, 1024), "low", 75),
    ("o3", (512, 512), "high", 75 + 150),
    ("o4-mini", (1800, 2400), "high", 2497),  # round(1452 * 1.72)
]


@pytest.mark.parametrize(("model", "size", "detail", "expected"), IMAGE_CASES)
async def test_image_billing_per_family(
    sdk: openai.AsyncOpenAI, model: str, size: tuple[int, int] | None, detail: Detail, expected: int
) -> None:
    url = "https://example.com/photo.jpg" if size is None else image_url((40, 90, 160), size)
    with_image = await create(sdk, model, messages=image_messages(url, detail))
    text_only = await create(sdk, model, messages=image_messages(None, detail))
    assert with_image.usage is not None and text_only.usage is not None
    assert with_image.usage.prompt_tokens - text_only.usage.prompt_tokens == expected


async def test_images_count_against_tpm_and_need_vision(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient
) -> None:
    await configure(sim_http, tpm=4000)
    messages = image_messages(image_url((1, 2, 3)), "low")
    await create(sdk, "gpt-4o-mini", messages=messages, max_completion_tokens=10)
    with pytest.raises(openai.RateLimitError) as caught:
        await create(sdk, "gpt-4o-mini", messages=messages, max_completion_tokens=10)
    assert caught.value.type == "tokens"
    error = await rejected(sdk, "o3-mini", messages=messages)
    assert error["message"] == "Invalid content type. image_url is only supported by certain models."
    assert error["param"] == "messages.[0].content.[1].type"


async def test_refusal_knob(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    await configure(sim_http, refuse_next=2)
    reply = await create(sdk, "gpt-4o-mini")
    message = reply.choices[0].message
    assert (message.content, message.refusal) == (None, REFUSAL_TEXT)
    assert reply.choices[0].finish_reason == "stop"
    streamed = await stream_reply(sdk, "gpt-5.1")
    assert (streamed["content"], streamed["refusal"]) == ("", REFUSAL_TEXT)
    assert streamed["finish"] == ["stop"]
    assert streamed["usage"].completion_tokens == len(split_tokens(REFUSAL_TEXT))
    assert (await create(sdk, "gpt-4o-mini")).choices[0].message.refusal is None
    assert (await stats(sim_http))["refusals_injected"] == 2


async def test_content_filter_knob(sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient) -> None:
    full = (await create(sdk, "gpt-4.1")).choices[0].message.content or ""
    await configure(sim_http, content_filter_next=2, content_filter_kinds=["text"])
    cut = await create(sdk, "gpt-4.1")
    content = cut.choices[0].message.content or ""
    assert cut.choices[0].finish_reason == "content_filter"
    assert content and full.startswith(content) and len(content) < len(full)
    assert cut.usage is not None and cut.usage.completion_tokens == len(split_tokens(content))
    streamed = await stream_reply(sdk, "gpt-4.1")
    assert (streamed["content"], streamed["finish"]) == (content, ["content_filter"])
    assert (await stats(sim_http))["content_filters_injected"] == 2


async def test_truncate_knob_ends_the_stream_without_a_finish(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient
) -> None:
    full = (await create(sdk, "gpt-4o")).choices[0].message.content or ""
    await configure(sim_http, truncate_next=2)
    plain = await create(sdk, "gpt-4o")  # not streamed: unaffected, nothing consumed
    assert plain.choices[0].finish_reason == "stop"
    assert (await sim_http.get("/sim/config")).json()["truncate_next"] == 2
    streamed = await stream_reply(sdk, "gpt-4o")
    assert streamed["content"] and full.startswith(streamed["content"]) and streamed["content"] != full
    assert (streamed["finish"], streamed["usage"]) == ([], None)
    body = {"model": "gpt-4o", "messages": TEXT_MESSAGES, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with sim_http.stream("POST", "/v1/chat/completions", json=body) as response:
        raw = (await response.aread()).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert "[DONE]" not in raw and events
    assert all(e["choices"] and e["choices"][0]["finish_reason"] is None for e in events)
    assert all(e["usage"] is None for e in events)
    counters = await stats(sim_http)
    assert counters["truncations_injected"] == 2 and counters["streams_cancelled"] == 0


async def test_malformed_knob_ignores_the_schema_once(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient
) -> None:
    schema_call = {"messages": vision_messages(image_url((9, 9, 9))), "response_format": schema_format()}
    await configure(sim_http, malformed_next=1, malformed_kinds=["vision"])
    # The kind must match, and without a schema there is nothing to ignore: both pending.
    await create(sdk, "gpt-4o-mini", response_format=schema_format())
    await create(sdk, "gpt-4o-mini", messages=vision_messages(image_url((9, 9, 9))))
    assert (await sim_http.get("/sim/config")).json()["malformed_next"] == 1
    bad = await create(sdk, "gpt-4o-mini", **schema_call)
    content = bad.choices[0].message.content or ""
    assert bad.choices[0].finish_reason == "stop"
    assert list(json.loads(content)) == ["answer"]  # parses, but not the schema's shape
    assert bad.usage is not None and bad.usage.completion_tokens == len(split_tokens(content))
    good = json.loads((await create(sdk, "gpt-4o-mini", **schema_call)).choices[0].message.content or "")
    validate(good, SCHEMA, SCHEMA)  # consumed once: the next call follows the schema again
    await configure(sim_http, malformed_next=1)
    streamed = await stream_reply(sdk, "gpt-4o-mini", **schema_call)
    assert (streamed["content"], streamed["finish"]) == (content, ["stop"])
    counters = await stats(sim_http)
    assert counters["malformed_injected"] == 2
    assert (await sim_http.get("/sim/config")).json()["malformed_next"] == 0


async def test_request_capture(
    sdk: openai.AsyncOpenAI, sim_http: httpx.AsyncClient, sim_server: RunningSimulator
) -> None:
    await create(sdk, "gpt-4o-mini")
    assert (await sim_http.get("/sim/requests")).json() == []  # off by default
    await configure(sim_http, capture_requests=2)
    await create(sdk, "gpt-5-mini", max_completion_tokens=3000, reasoning_effort="low")
    await rejected(sdk, "gpt-5-mini", max_tokens=10)
    await create(sdk, "gpt-4.1-nano", safety_identifier="user-7")
    captured = (await sim_http.get("/sim/requests")).json()
    assert [b["model"] for b in captured] == ["gpt-5-mini", "gpt-4.1-nano"]
    assert captured[0]["max_tokens"] == 10 and "max_completion_tokens" not in captured[0]
    assert captured[1] == {"model": "gpt-4.1-nano", "messages": TEXT_MESSAGES, "safety_identifier": "user-7"}
    assert list(sim_server.state.captured) == captured
    assert (await sim_http.post("/sim/requests/reset")).json() == []
    assert list(sim_server.state.captured) == []


def test_new_knobs_from_env_and_validation() -> None:
    config = SimConfig.from_env(
        {
            "SIM_REFUSE_NEXT": "1",
            "SIM_CONTENT_FILTER_KINDS": "vision",
            "SIM_TRUNCATE_NEXT": "3",
            "SIM_REASONING_SCALE": "0.5",
            "SIM_CAPTURE_REQUESTS": "10",
            "SIM_MALFORMED_NEXT": "2",
            "SIM_MALFORMED_KINDS": "text",
        }
    )
    assert (config.refuse_next, config.content_filter_kinds) == (1, ("vision",))
    assert (config.truncate_next, config.reasoning_scale, config.capture_requests) == (3, 0.5, 10)
    assert (config.malformed_next, config.malformed_kinds) == (2, ("text",))
    bads: list[dict[str, Any]] = [
        {"refuse_next": -1},
        {"truncate_kinds": ["audio"]},
        {"reasoning_scale": -1.0},
        {"malformed_next": -1},
        {"malformed_kinds": ["audio"]},
    ]
    for bad in bads:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SimConfig().updated(bad)
    args = build_parser().parse_args(["--malformed-next", "4", "--malformed-kinds", "vision"])
    merged = config_from_args(args, {"SIM_MALFORMED_NEXT": "1"})
    assert (merged.malformed_next, merged.malformed_kinds) == (4, ("vision",))
