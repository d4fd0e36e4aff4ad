"""The simulator as Azure OpenAI and as Gemini's OpenAI-compatible endpoint, several upstreams
side by side, and the outage switch: real HTTP against in-process simulators, through the
openai SDK the way each provider's docs use it, and raw httpx for bodies and headers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from app.sim.__main__ import build_parser, config_from_args, read_upstreams
from app.sim.config import SimConfig
from app.sim.images import gemini_image_tokens
from app.sim.server import RunningSimulator, run_simulator
from tests.test_sim import image_url

FAST = {"time_scale": 0.001, "latency_sigma": 0.0}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "페트병은 어떻게 버리나요?"}]
OPENAI_SIX = [f"x-ratelimit-{w}-{u}" for w in ("limit", "remaining", "reset") for u in ("requests", "tokens")]
# What ecoscan sends: an OpenAI strict schema (additionalProperties false on every object).
STRICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["item", "tags"],
    "properties": {
        "item": {"type": "string"},
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": {"type": "string"}},
            },
        },
    },
}
GEMINI_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["item", "tags"],
    "propertyOrdering": ["item", "tags"],
    "properties": {
        "item": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["label", "cap"]}},
    },
}


def json_schema(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "scan", "strict": True, "schema": schema}}


@contextlib.asynccontextmanager
async def simulator(**fields: Any) -> AsyncIterator[RunningSimulator]:
    async with run_simulator(SimConfig(**{**FAST, **fields})) as running:
        yield running


async def stats(sim: RunningSimulator) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=sim.control_url) as control:
        result: dict[str, Any] = (await control.get("/sim/stats")).json()
    return result


async def configure(sim: RunningSimulator, **changes: Any) -> None:
    async with httpx.AsyncClient(base_url=sim.control_url) as control:
        response = await control.patch("/sim/config", json=changes)
    assert response.status_code == 200, response.text


async def eventually(sim: RunningSimulator, key: str, value: int) -> dict[str, Any]:
    counters = await stats(sim)
    for _ in range(200):
        if counters[key] == value:
            break
        await asyncio.sleep(0.02)
        counters = await stats(sim)
    return counters


# --- Azure OpenAI ----------------------------------------------------------------------


@pytest.fixture
async def azure() -> AsyncIterator[RunningSimulator]:
    async with simulator(flavor="azure", deployments=("scan=gpt-4o-mini", "scan-b=gpt-4o-mini")) as running:
        yield running


def azure_sdk(sim: RunningSimulator, key: str = "azure-key") -> openai.AsyncAzureOpenAI:
    return openai.AsyncAzureOpenAI(
        azure_endpoint=sim.url, api_key=key, api_version="2024-10-21", max_retries=0
    )


async def test_azure_classic_and_v1_layouts_with_the_sdks(azure: RunningSimulator) -> None:
    async with azure_sdk(azure) as sdk:
        reply = await sdk.chat.completions.create(model="scan", messages=QUESTION, max_tokens=20)
    assert reply.model == "gpt-4o-mini" and reply.choices[0].message.content
    body = reply.model_dump()
    assert body["prompt_filter_results"][0]["content_filter_results"]["hate"]["severity"] == "safe"
    assert body["choices"][0]["content_filter_results"]["violence"]["filtered"] is False
    # The v1 API: the plain OpenAI client, the deployment as `model`, the key as a bearer.
    async with openai.AsyncOpenAI(base_url=azure.base_url, api_key="azure-key", max_retries=0) as v1:
        assert azure.base_url.endswith("/openai/v1")
        v1_reply = await v1.chat.completions.create(model="scan", messages=QUESTION, max_tokens=20)
    assert v1_reply.choices[0].finish_reason in ("stop", "length")
    # A deployment named like a model needs no mapping.
    async with azure_sdk(azure) as sdk:
        assert (await sdk.chat.completions.create(model="gpt-4o", messages=QUESTION)).model == "gpt-4o"
    # Azure's own paths only: OpenAI's layout is not there.
    async with httpx.AsyncClient(base_url=azure.url, headers={"api-key": "k"}) as http:
        wrong = await http.post("/v1/chat/completions", json={"model": "scan", "messages": QUESTION})
        assert (wrong.status_code, wrong.json()) == (
            404,
            {"error": {"code": "404", "message": "Resource not found"}},
        )
        no_version = await http.post("/openai/deployments/scan/chat/completions", json={"messages": QUESTION})
        assert no_version.status_code == 404 and no_version.json()["error"]["message"] == "Resource not found"
        unknown = await http.post(
            "/openai/deployments/nope/chat/completions?api-version=2024-10-21", json={"messages": QUESTION}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "DeploymentNotFound"


async def test_azure_key_goes_in_api_key_and_bad_keys_get_azures_401() -> None:
    async with simulator(flavor="azure", api_key="right") as azure:
        path = "/openai/deployments/gpt-4o-mini/chat/completions?api-version=2024-10-21"
        body = {"messages": QUESTION}
        async with httpx.AsyncClient(base_url=azure.url) as http:
            cases = [
                ({}, "missing subscription key"),
                ({"api-key": "wrong"}, "invalid subscription key"),
                (
                    {"Authorization": "Bearer right"},
                    "Access token is missing, invalid",
                ),  # classic: Entra only
            ]
            for headers, words in cases:
                response = await http.post(path, json=body, headers=headers)
                assert response.status_code == 401
                error = response.json()["error"]
                assert error["code"] == "401" and words in error["message"], headers
            assert (await http.post(path, json=body, headers={"api-key": "right"})).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            async with azure_sdk(azure, "wrong") as sdk:
                await sdk.chat.completions.create(model="gpt-4o-mini", messages=QUESTION)


async def test_azure_first_stream_chunk_is_the_prompt_filter(azure: RunningSimulator) -> None:
    path = "/openai/deployments/scan/chat/completions?api-version=2024-10-21"
    request = {"messages": QUESTION, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=azure.url, headers={"api-key": "k"}) as http:
        response = await http.post(path, json=request)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    first = events[0]
    assert first["choices"] == [] and first["id"] == ""
    assert first["prompt_filter_results"][0]["content_filter_results"]["jailbreak"]["detected"] is False
    tokens = [e for e in events[1:] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert tokens and all(
        e["choices"][0]["content_filter_results"]["sexual"]["filtered"] is False for e in tokens
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] > 0
    # The SDK copes with the empty-choices chunk.
    async with azure_sdk(azure) as sdk:
        stream = await sdk.chat.completions.create(model="scan", messages=QUESTION, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices == [] and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_azure_429_says_retry_after_in_words_and_both_headers(azure: RunningSimulator) -> None:
    await configure(azure, tpm=1000)
    async with azure_sdk(azure) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="scan", messages=QUESTION, max_tokens=600
        )
        # Only the two remaining-* headers: no limit, no reset.
        assert (
            "x-ratelimit-remaining-tokens" in raw.headers and "x-ratelimit-remaining-requests" in raw.headers
        )
        assert not any(name in raw.headers for name in OPENAI_SIX if "remaining" not in name)
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.chat.completions.create(model="scan", messages=QUESTION, max_tokens=600)
        # Another deployment of the same model has its own limits.
        await sdk.chat.completions.create(model="scan-b", messages=QUESTION, max_tokens=600)
    response = caught.value.response
    error = response.json()["error"]
    assert set(error) == {"code", "message"} and error["code"] == "429"
    assert "exceeded token rate limit" in error["message"] and "API version 2024-10-21" in error["message"]
    seconds = int(response.headers["retry-after"])
    assert f"Please retry after {seconds} second" in error["message"]
    assert int(response.headers["retry-after-ms"]) > 0


async def test_azure_counts_prompt_plus_max_tokens_and_its_500_body(azure: RunningSimulator) -> None:
    async with azure_sdk(azure) as sdk:
        reply = await sdk.chat.completions.create(model="scan", messages=QUESTION, max_tokens=300)
        assert reply.usage is not None
        assert (await stats(azure))["tokens_charged_total"] == reply.usage.prompt_tokens + 300
        await configure(azure, error_rate=1.0)
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk.chat.completions.create(model="scan", messages=QUESTION)
    error = caught.value.response.json()["error"]
    assert error["type"] == "server_error" and "Azure support request" in error["message"]


# --- Gemini ---------------------------------------------------------------------------


@pytest.fixture
async def gemini() -> AsyncIterator[RunningSimulator]:
    async with simulator(flavor="gemini") as running:
        yield running


def gemini_sdk(sim: RunningSimulator, key: str = "gemini-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.base_url + "/", api_key=key, max_retries=0)


async def test_gemini_layout_usage_and_models(gemini: RunningSimulator) -> None:
    assert gemini.base_url.endswith("/v1beta/openai")
    async with gemini_sdk(gemini) as sdk:
        reply = await sdk.chat.completions.create(model="gemini-2.0-flash", messages=QUESTION)
        prefixed = await sdk.chat.completions.create(model="models/gemini-2.5-flash-lite", messages=QUESTION)
        models = [m.id for m in (await sdk.models.list()).data]
    assert reply.model == "gemini-2.0-flash" and reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens_details is None
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert prefixed.model == "gemini-2.5-flash-lite"
    assert "models/gemini-2.5-pro" in models
    async with httpx.AsyncClient(base_url=gemini.url, headers={"Authorization": "Bearer k"}) as http:
        assert (await http.post("/v1/chat/completions", json={})).status_code == 404
        unknown = await http.post(
            "/v1beta/openai/chat/completions", json={"model": "gpt-4o", "messages": QUESTION}
        )
    assert unknown.status_code == 404
    error = unknown.json()[0]["error"]
    assert error["status"] == "NOT_FOUND" and error["message"].startswith("models/gpt-4o is not found")


async def test_gemini_refuses_unknown_fields_in_a_json_array(gemini: RunningSimulator) -> None:
    async with gemini_sdk(gemini) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model="gemini-2.5-flash", messages=QUESTION, safety_identifier="u-1", seed=7
            )
    body = caught.value.response.json()
    assert isinstance(body, list) and len(body) == 1
    error = body[0]["error"]
    assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
    assert error["message"].splitlines() == [
        'Invalid JSON payload received. Unknown name "safety_identifier": Cannot find field.',
        'Invalid JSON payload received. Unknown name "seed": Cannot find field.',
    ]
    assert error["details"][0]["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert len(error["details"][0]["fieldViolations"]) == 2
    # stream_options and max_completion_tokens are known.
    async with gemini_sdk(gemini) as sdk:
        stream = await sdk.chat.completions.create(
            model="gemini-2.5-flash",
            messages=QUESTION,
            max_completion_tokens=4000,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert [chunk async for chunk in stream]


async def test_gemini_refuses_schema_keywords_outside_its_subset(gemini: RunningSimulator) -> None:
    async with gemini_sdk(gemini) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(
                model="gemini-2.5-flash", messages=QUESTION, response_format=json_schema(STRICT_SCHEMA)
            )
        error = caught.value.response.json()[0]["error"]
        assert error["message"].splitlines() == [
            'Invalid JSON payload received. Unknown name "additionalProperties" at '
            "'generation_config.response_schema': Cannot find field.",
            'Invalid JSON payload received. Unknown name "additionalProperties" at '
            "'generation_config.response_schema.properties[1].value.items': Cannot find field.",
        ]
        fields = [v["field"] for v in error["details"][0]["fieldViolations"]]
        assert fields == [
            "generation_config.response_schema",
            "generation_config.response_schema.properties[1].value.items",
        ]
        nullable = {"type": "object", "properties": {"note": {"type": ["string", "null"]}}}
        with pytest.raises(openai.BadRequestError) as listed:
            await sdk.chat.completions.create(
                model="gemini-2.5-flash", messages=QUESTION, response_format=json_schema(nullable)
            )
        assert "Proto field is not repeating" in listed.value.response.json()[0]["error"]["message"]
        reply = await sdk.chat.completions.create(
            model="gemini-2.5-flash", messages=QUESTION, response_format=json_schema(GEMINI_SCHEMA)
        )
        assert set(json.loads(reply.choices[0].message.content or "")) == {"item", "tags"}
        # JSON mode without the word "json" is fine here (an OpenAI-only rule).
        await sdk.chat.completions.create(
            model="gemini-2.5-flash", messages=QUESTION, response_format={"type": "json_object"}
        )
    await configure(gemini, schema_subset=False)  # Gemini's JSON-Schema path
    async with gemini_sdk(gemini) as sdk:
        await sdk.chat.completions.create(
            model="gemini-2.5-flash", messages=QUESTION, response_format=json_schema(STRICT_SCHEMA)
        )


async def test_gemini_stream_carries_role_in_the_first_delta_and_usage_unasked(
    gemini: RunningSimulator,
) -> None:
    request = {"model": "gemini-2.5-flash", "messages": QUESTION, "stream": True, "reasoning_effort": "low"}
    async with httpx.AsyncClient(base_url=gemini.url, headers={"Authorization": "Bearer k"}) as http:
        response = await http.post("/v1beta/openai/chat/completions", json=request)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert response.text.rstrip().endswith("data: [DONE]")
    assert (
        events[0]["choices"][0]["delta"]["role"] == "assistant"
        and events[0]["choices"][0]["delta"]["content"]
    )
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert not any("service_tier" in e or "system_fingerprint" in e for e in events)
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and "usage" in last
    usage = last["usage"]
    visible = sum(1 for e in events if e["choices"][0]["delta"].get("content"))
    assert usage["completion_tokens"] >= visible  # deltas may batch tokens
    assert usage["total_tokens"] > usage["prompt_tokens"] + usage["completion_tokens"]  # thinking


async def test_gemini_429_puts_the_wait_in_retry_info_and_sends_no_rate_headers(
    gemini: RunningSimulator,
) -> None:
    await configure(gemini, rpm=1)
    async with gemini_sdk(gemini) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(model="gemini-2.5-flash", messages=QUESTION)
        assert not any(name.startswith("x-ratelimit") for name in raw.headers)
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.chat.completions.create(model="gemini-2.5-flash", messages=QUESTION)
    response = caught.value.response
    assert "retry-after" not in response.headers and "retry-after-ms" not in response.headers
    error = response.json()[0]["error"]
    assert (error["code"], error["status"]) == (429, "RESOURCE_EXHAUSTED")
    kinds = {d["@type"].rsplit(".", 1)[-1]: d for d in error["details"]}
    assert kinds["RetryInfo"]["retryDelay"] in ("59s", "60s")
    violation = kinds["QuotaFailure"]["violations"][0]
    assert violation["quotaId"] == "GenerateRequestsPerMinutePerProjectPerModel"
    assert violation["quotaDimensions"]["model"] == "gemini-2.5-flash"
    assert "Please retry in" in error["message"]


async def test_gemini_counts_input_tokens_only_and_bills_images_per_tile(gemini: RunningSimulator) -> None:
    async with gemini_sdk(gemini) as sdk:
        text = await sdk.chat.completions.create(model="gemini-2.0-flash", messages=QUESTION, max_tokens=500)
        assert text.usage is not None
        assert (await stats(gemini))["tokens_charged_total"] == text.usage.prompt_tokens  # no cap added
        costs = []
        for size in [(300, 200), (384, 384), (800, 600), (1600, 1200)]:
            messages: list[ChatCompletionMessageParam] = [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "페트병은 어떻게 버리나요?"},
                        {"type": "image_url", "image_url": {"url": image_url((9, 9, 9), size)}},
                    ],
                }
            ]
            reply = await sdk.chat.completions.create(model="gemini-2.0-flash", messages=messages)
            assert reply.usage is not None
            costs.append(reply.usage.prompt_tokens - text.usage.prompt_tokens)
    assert costs == [258, 258, 258 * 2 * 1, 258 * 3 * 2]
    assert gemini_image_tokens(769, 768) == 258 * 2


async def test_gemini_thinking_rules_auth_and_5xx_bodies() -> None:
    async with simulator(flavor="gemini", api_key="AIza-right") as gemini:
        async with gemini_sdk(gemini, "AIza-right") as sdk:
            cases: list[tuple[str, Any, str]] = [
                ("gemini-2.5-pro", "none", "only works in thinking mode"),
                ("gemini-2.0-flash", "low", "Thinking is not enabled"),
                ("gemini-2.5-flash", "minimal", "Invalid reasoning_effort"),
            ]
            for model, effort, words in cases:
                with pytest.raises(openai.BadRequestError) as caught:
                    await sdk.chat.completions.create(model=model, messages=QUESTION, reasoning_effort=effort)
                assert words in caught.value.response.json()[0]["error"]["message"]
            off = await sdk.chat.completions.create(
                model="gemini-2.5-flash", messages=QUESTION, reasoning_effort="none"
            )
            assert (
                off.usage is not None
                and off.usage.total_tokens == off.usage.prompt_tokens + off.usage.completion_tokens
            )
            await configure(gemini, error_rate=1.0)
            with pytest.raises(openai.InternalServerError) as failed:
                await sdk.chat.completions.create(model="gemini-2.5-flash", messages=QUESTION)
            assert failed.value.response.json()[0]["error"]["status"] == "INTERNAL"
        body = {"model": "gemini-2.5-flash", "messages": QUESTION}
        async with httpx.AsyncClient(base_url=gemini.base_url) as http:
            anonymous = await http.post("/chat/completions", json=body)
            assert anonymous.status_code == 403
            assert anonymous.json()[0]["error"]["status"] == "PERMISSION_DENIED"
            wrong = await http.post(
                "/chat/completions", json=body, headers={"Authorization": "Bearer AIza-no"}
            )
            assert wrong.status_code == 400
            assert wrong.json()[0]["error"]["details"][0]["reason"] == "API_KEY_INVALID"
        await configure(gemini, error_array=False)
        async with httpx.AsyncClient(base_url=gemini.base_url) as http:
            bare = await http.post("/chat/completions", json=body)
        assert bare.json()["error"]["code"] == 403


# --- several upstreams ----------------------------------------------------------------


async def test_several_upstreams_each_with_its_own_limits_and_stats() -> None:
    async with (
        simulator(flavor="openai", rpm=1) as first,
        simulator(flavor="openai", rpm=100) as second,
        simulator(flavor="gemini") as third,
    ):
        assert len({first.port, second.port, third.port}) == 3
        async with (
            openai.AsyncOpenAI(base_url=first.base_url, api_key="a", max_retries=0) as one,
            openai.AsyncOpenAI(base_url=second.base_url, api_key="b", max_retries=0) as two,
            gemini_sdk(third) as three,
        ):
            raw = await one.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=QUESTION)
            assert raw.headers["x-ratelimit-limit-requests"] == "1"
            with pytest.raises(openai.RateLimitError):
                await one.chat.completions.create(model="gpt-4o-mini", messages=QUESTION)
            for _ in range(3):
                await two.chat.completions.create(model="gpt-4o-mini", messages=QUESTION)
            await configure(second, outage="503")
            await three.chat.completions.create(model="gemini-2.5-flash", messages=QUESTION)
        counts = [(await stats(sim))["by_status"] for sim in (first, second, third)]
    assert counts == [{"200": 1, "429": 1}, {"200": 3}, {"200": 1}]


def test_upstreams_file_and_flavor_flags(tmp_path: Path) -> None:
    toml = tmp_path / "upstreams.toml"
    toml.write_text(
        '[[upstream]]\nname = "org-a"\nport = 8101\ncontrol_port = 8201\ntpm = 9000\n\n'
        '[[upstream]]\nname = "eu"\nflavor = "azure"\ndeployments = ["scan=gpt-4o-mini"]\n\n'
        '[[upstream]]\nname = "g"\nflavor = "gemini"\nerror_array = false\n'
    )
    base = SimConfig(time_scale=0.5)
    first, second, third = read_upstreams(toml, base, "127.0.0.1")
    assert (first.name, first.port, first.control_port, first.config.tpm) == ("org-a", 8101, 8201, 9000)
    assert second.config.flavor == "azure" and second.config.deployments == ("scan=gpt-4o-mini",)
    assert third.config.error_array is False and third.config.time_scale == 0.5
    as_json = tmp_path / "upstreams.json"
    as_json.write_text(json.dumps([{"name": "x", "flavor": "gemini", "rpm": 5}]))
    assert read_upstreams(as_json, base, "::1")[0].host == "::1"
    as_json.write_text(json.dumps([{"name": "x", "flavor": "bedrock"}]))
    with pytest.raises(ValueError, match="flavor"):
        read_upstreams(as_json, base, "127.0.0.1")
    args = build_parser().parse_args(
        ["--flavor", "azure", "--deployments", "a=gpt-4o,b=o4-mini", "--outage", "503"]
    )
    config = config_from_args(args, {"SIM_API_KEY": "k"})
    assert (config.flavor, config.deployments, config.outage, config.api_key) == (
        "azure",
        ("a=gpt-4o", "b=o4-mini"),
        "503",
        "k",
    )
    for bad in ({"flavor": "bedrock"}, {"outage": "down"}, {"deployments": ["scan"]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SimConfig().updated(bad)


# --- the outage switch ------------------------------------------------------------------

OUTAGE_BODIES = {
    "openai": lambda body: body["error"]["type"] == "server_error",
    "azure": lambda body: body["error"]["code"] == "ServiceUnavailable",
    "gemini": lambda body: body[0]["error"]["status"] == "UNAVAILABLE",
}


@pytest.mark.parametrize("flavor", ["openai", "azure", "gemini"])
async def test_outage_503_answers_in_the_flavours_words_and_comes_back(flavor: str) -> None:
    async with simulator(flavor=flavor) as sim:
        path = {"openai": "/chat/completions", "azure": "/chat/completions", "gemini": "/chat/completions"}[
            flavor
        ]
        model = {"openai": "gpt-4o-mini", "azure": "gpt-4o-mini", "gemini": "gemini-2.0-flash"}[flavor]
        headers = {"Authorization": "Bearer k"}
        body = {"model": model, "messages": QUESTION}
        await configure(sim, outage="503")
        async with httpx.AsyncClient(base_url=sim.base_url, headers=headers) as http:
            for _ in range(3):
                down = await http.post(path, json=body)
                assert down.status_code == 503 and OUTAGE_BODIES[flavor](down.json())
            await configure(sim, outage="none")
            assert (await http.post(path, json=body)).status_code == 200
        counters = await stats(sim)
    assert counters["outage_requests"] == {"503": 3} and counters["outage_requests_total"] == 3


async def test_outage_hang_holds_requests_until_switched_back() -> None:
    async with simulator() as sim:
        await configure(sim, outage="hang")
        async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="k", max_retries=0) as sdk:
            held = asyncio.create_task(sdk.chat.completions.create(model="gpt-4o-mini", messages=QUESTION))
            assert (await eventually(sim, "held", 1))["held"] == 1
            await asyncio.sleep(0.2)
            assert not held.done()
            # A client that gives up is let go.
            impatient = asyncio.create_task(
                sdk.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, timeout=0.3)
            )
            assert (await eventually(sim, "held", 2))["held"] == 2
            with pytest.raises(openai.APITimeoutError):
                await impatient
            assert (await eventually(sim, "held", 1))["held"] == 1
            await configure(sim, outage="none")
            reply = await asyncio.wait_for(held, 5)
        assert reply.choices[0].message.content
        counters = await stats(sim)
    assert counters["outage_requests"] == {"hang": 2} and counters["held"] == 0
    assert counters["by_status"] == {"200": 1}


async def test_outage_refuse_closes_the_port_and_reopens_it() -> None:
    async with simulator(stall_rate=1.0, stall_s=30.0, time_scale=0.01) as sim:
        body = {"model": "gpt-4o-mini", "messages": QUESTION, "stream": True}
        async with httpx.AsyncClient(base_url=sim.url, headers={"Authorization": "Bearer k"}) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                assert (await eventually(sim, "stalls_injected", 1))["stalls_injected"] == 1
                # The switch may come over the API port itself: the reply goes out first.
                switched = await http.patch("/sim/config", json={"outage": "refuse"})
                assert switched.status_code == 200 and switched.json()["outage"] == "refuse"
                with pytest.raises(httpx.TransportError):
                    async for _ in stream.aiter_bytes():
                        pass
            with pytest.raises(httpx.ConnectError):
                await http.get("/v1/models")
            with pytest.raises(httpx.ConnectError):
                await http.get("/v1/models")
            counters = await stats(sim)  # the control port is still up
            assert counters["connections_reset"] >= 1
            await configure(sim, outage="none", stall_rate=0.0)
            listed = await http.get("/v1/models")
            assert listed.status_code == 200 and listed.json()["data"]
        assert (await stats(sim))["streams_cancelled"] == 1


async def test_an_upstream_can_start_refused() -> None:
    async with simulator(outage="refuse") as sim:
        async with httpx.AsyncClient(base_url=sim.url) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get("/v1/models")
        async with httpx.AsyncClient(base_url=sim.control_url) as control:
            info = (await control.get("/sim/info")).json()
            assert info["base_url"] == sim.base_url and info["control_url"] == sim.control_url
            assert (await control.post("/v1/chat/completions")).status_code == 404  # /sim/* only
        await configure(sim, outage="none")
        async with httpx.AsyncClient(base_url=sim.url, headers={"Authorization": "Bearer k"}) as http:
            assert (await http.get("/v1/models")).status_code == 200
