"""The whole pipeline against the simulator's per-model rules (which are OpenAI's): the
families people run, the requests we send checked against the SDK's own types, and
the replies that are not answers (refusals, filters, cut-off streams, token limits,
an upstream that refuses the connection)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
from typing import Any, get_type_hints

import asyncpg
import pydantic
import pytest
from openai.types.chat import completion_create_params

from app.sim.server import RunningSimulator
from app.upstream.breaker import FAILURES_TO_OPEN

from .conftest import (
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    scan_row,
    settings_for,
    sim_configure,
    sim_stats,
)

KIND = {"vision": "vision", "answer": "text"}
MODEL_SETUPS = [
    pytest.param({"vision_model": "gpt-5.1", "answer_model": "gpt-5-mini"}, id="gpt-5.1+gpt-5-mini"),
    pytest.param({"vision_model": "gpt-4o-mini", "answer_model": "gpt-4o-mini"}, id="gpt-4o-mini"),
    pytest.param({"vision_model": "o4-mini", "answer_model": "gpt-4.1-nano"}, id="o4-mini+gpt-4.1-nano"),
    pytest.param({"openai_token_param": "max_tokens"}, id="token-param-max_tokens"),
]


async def scan(svc: Service, seed: int, user: str | None = None) -> Any:
    headers = {"X-User-ID": user} if user else {}
    return await run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))}, headers=headers)


def assert_budget_idle(svc: Service) -> None:
    assert svc.metric("ecoscan_budget_reservations_open") == 0
    for stage in ("vision", "answer"):
        assert svc.metric("ecoscan_stage_semaphore_in_use", {"stage": stage}) == 0


@pytest.mark.parametrize("models", MODEL_SETUPS)
async def test_a_scan_completes_with_each_model_family(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection, models: dict[str, str]
) -> None:
    await sim_configure(sim, capture_requests=8)
    async with running_service(settings_for(database_url, sim, **models)) as svc:
        outcome = await scan(svc, 41)
        assert outcome.terminal.event == "done", outcome.terminal.data
        row = await scan_row(db, outcome.terminal.data["job_id"])
        assert row["status"] == "completed"
        # Prompt reservations are never below what the upstream billed (images included).
        vision, answer = (svc.settings.call_shape(stage) for stage in ("vision", "answer"))
        reserved = sum(
            svc.metric("ecoscan_upstream_tokens_total", {"model": m, "kind": "estimated"})
            for m in {vision.model, answer.model}
        )
        prompt_reserved = reserved - vision.completion_cap - answer.completion_cap
        assert prompt_reserved >= (await sim_stats(sim))["tokens"]["prompt"] > 0
        assert_budget_idle(svc)
    bodies = sim.state.captured
    assert len(bodies) == 2
    for body, shape in zip(bodies, (vision, answer), strict=True):
        assert body["model"] == shape.model
        assert body[shape.token_param] == shape.completion_cap
        assert body.get("reasoning_effort") == shape.effort


async def test_every_request_body_validates_against_the_sdks_own_types(
    database_url: str, sim: RunningSimulator
) -> None:
    """`extra_body` bypasses the SDK's typing; this keeps our bodies inside it."""
    await sim_configure(sim, capture_requests=16)
    setups = [{}, {"vision_model": "gpt-5.1", "answer_model": "gpt-5-mini"}]
    for overrides in setups:
        async with running_service(settings_for(database_url, sim, **overrides)) as svc:
            assert (await scan(svc, 42, user="conformance-user")).terminal.event == "done"
    bodies = list(sim.state.captured)
    assert len(bodies) == 4
    for body in bodies:
        params = (
            completion_create_params.CompletionCreateParamsStreaming
            if body.get("stream")
            else completion_create_params.CompletionCreateParamsNonStreaming
        )
        unknown = set(body) - set(get_type_hints(params))
        assert not unknown, f"parameters the SDK does not know: {unknown}"
        pydantic.TypeAdapter(params).validate_python(body, strict=False)


async def test_safety_identifier_is_a_hash_of_the_user_never_the_id(
    service: Service, sim: RunningSimulator
) -> None:
    await sim_configure(sim, capture_requests=4)
    assert (await scan(service, 43, user="alice@example.com")).terminal.event == "done"
    assert (await scan(service, 44)).terminal.event == "done"
    named, named_answer, anonymous, _ = sim.state.captured
    identifier = named["safety_identifier"]
    assert identifier == named_answer["safety_identifier"]
    assert "alice" not in identifier and len(identifier) <= 64
    assert identifier == hashlib.sha256(b"ecoscan-user:alice@example.com").hexdigest()
    assert "safety_identifier" not in anonymous


FAILURES = [
    # knob, stage, code
    ("refuse_next", "vision", "UPSTREAM_REFUSED"),
    ("refuse_next", "answer", "UPSTREAM_REFUSED"),
    ("content_filter_next", "vision", "UPSTREAM_CONTENT_FILTERED"),
    ("content_filter_next", "answer", "UPSTREAM_CONTENT_FILTERED"),
    ("truncate_next", "answer", "UPSTREAM_ERROR"),
]


@pytest.mark.parametrize(("knob", "stage", "code"), FAILURES)
async def test_replies_that_are_not_answers_end_with_their_own_code(
    service: Service, sim: RunningSimulator, db: asyncpg.Connection, knob: str, stage: str, code: str
) -> None:
    kinds = knob.replace("_next", "_kinds")
    await sim_configure(sim, **{knob: 100, kinds: [KIND[stage]]})
    outcome = await scan(service, 45)
    assert [e.event for e in outcome.events].count("error") == 1
    assert not outcome.of("done")
    error = outcome.terminal
    assert (error.event, error.data["step"], error.data["code"]) == ("error", stage, code)
    row = await scan_row(db, error.data["job_id"])
    assert (row["status"], row["error_code"], row["error_step"]) == ("failed", code, stage)
    if code == "UPSTREAM_REFUSED":
        assert "can't help" in error.data["message"]  # the model's own words reach the client
    # The scan's own attempts (the service's probes of an open deployment are no attempt).
    attempts = service.metric("ecoscan_upstream_routed_total", {"upstream": "openai", "stage": stage})
    # A refusal or a filter is an answer: not retried. A cut-off stream is: retried.
    expected = service.settings.retry_max_attempts if knob == "truncate_next" else 1
    assert attempts == expected
    assert_budget_idle(service)


async def test_a_stream_cut_off_once_is_retried_and_the_scan_completes(
    service: Service, sim: RunningSimulator
) -> None:
    await sim_configure(sim, truncate_next=1, truncate_kinds=["text"])
    outcome = await scan(service, 46)
    assert outcome.terminal.event == "done", outcome.terminal.data
    labels = {"model": "gpt-4o-mini", "reason": "truncated"}
    assert service.metric("ecoscan_upstream_retries_total", labels) == 1


async def test_a_reply_spent_on_reasoning_is_a_token_limit_error(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    # gpt-5-mini at `minimal` reserves 512 reasoning tokens; make it think far longer.
    await sim_configure(sim, reasoning_scale=100.0)
    settings = settings_for(database_url, sim, vision_model="gpt-5-mini")
    async with running_service(settings) as svc:
        outcome = await scan(svc, 47)
        error = outcome.terminal
        assert (error.event, error.data["code"], error.data["step"]) == (
            "error",
            "UPSTREAM_TOKEN_LIMIT",
            "vision",
        )
        assert "no visible reply" in error.data["message"]
        row = await scan_row(db, error.data["job_id"])
        assert (row["status"], row["error_code"]) == ("failed", "UPSTREAM_TOKEN_LIMIT")
        assert (await sim_stats(sim))["requests_total"] == 1  # not retried
        assert_budget_idle(svc)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens here once the socket is closed


async def test_a_refused_connection_is_a_connection_error_and_costs_no_budget(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    # 6 requests a minute, all available at once: every attempt that was charged and not
    # refunded would still be missing from the budget after the scan.
    settings = settings_for(
        database_url,
        sim,
        openai_base_url=f"http://127.0.0.1:{closed_port()}/v1",
        openai_rpm=6,
        rate_burst_fraction=1.0,
        upstream_ride_out_s=0.5,  # it never comes back: the call's wait for it ends soon
    )
    async with running_service(settings) as svc:
        outcome = await scan(svc, 48)
        error = outcome.terminal
        assert (error.event, error.data["code"], error.data["step"]) == ("error", "UPSTREAM_ERROR", "vision")
        row = await scan_row(db, error.data["job_id"])
        assert (row["status"], row["error_code"]) == ("failed", "UPSTREAM_ERROR")
        # Attempts until its breaker opened, then a wait for its return (no attempts spent).
        retries = {"model": "gpt-4o-mini", "reason": "connection"}
        assert svc.metric("ecoscan_upstream_retries_total", retries) == FAILURES_TO_OPEN - 1
        assert svc.metric("ecoscan_upstream_retries_total", {**retries, "reason": "timeout"}) == 0
        available = {"model": "gpt-4o-mini", "resource": "requests"}
        assert await eventually(lambda: svc.metric("ecoscan_budget_available", available) >= 5.99)
        assert_budget_idle(svc)


class CannedUpstream:
    """An "OpenAI" on a loopback port that answers every request with the same raw bytes."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.requests = 0

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def __aexit__(self, *_: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length[1]) if length else 0)
        self.requests += 1
        writer.write(self.reply)
        await writer.drain()
        writer.close()


async def test_a_malformed_reply_is_a_retried_connection_error_not_an_internal_one(
    database_url: str, sim: RunningSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp refuses the header line.
    garbled = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nno colon here\r\n\r\n{}"
    upstream = CannedUpstream(garbled)
    async with (
        upstream as url,
        running_service(settings_for(database_url, sim, openai_base_url=url, upstream_ride_out_s=0.5)) as svc,
    ):
        error = (await scan(svc, 49)).terminal
        assert (error.event, error.data["code"], error.data["retryable"]) == ("error", "UPSTREAM_ERROR", True)
        # Attempts until its breaker opened (the requests beyond are the service's probes).
        calls = {"model": "gpt-4o-mini", "endpoint": "chat.completions", "status": "error"}
        assert svc.metric("ecoscan_upstream_calls_total", calls) == FAILURES_TO_OPEN
        assert upstream.requests >= FAILURES_TO_OPEN
        retries = {"model": "gpt-4o-mini", "reason": "connection"}
        assert svc.metric("ecoscan_upstream_retries_total", retries) == FAILURES_TO_OPEN - 1
    assert "unexpected error" not in caplog.text and "Traceback" not in caplog.text


async def test_an_unfollowed_3xx_is_a_rejection(database_url: str, sim: RunningSimulator) -> None:
    # Redirects with a Location are followed by the client, as the SDK's own requests are;
    # one without a Location is the final answer, and it is no completion.
    upstream = CannedUpstream(b"HTTP/1.1 300 Multiple Choices\r\nContent-Length: 0\r\n\r\n")
    async with upstream as url, running_service(settings_for(database_url, sim, openai_base_url=url)) as svc:
        error = (await scan(svc, 50)).terminal
        assert (error.event, error.data["code"]) == ("error", "UPSTREAM_REJECTED")
        assert upstream.requests == 1  # not retried
        calls = {"model": "gpt-4o-mini", "endpoint": "chat.completions", "status": "3xx"}
        assert svc.metric("ecoscan_upstream_calls_total", calls) == 1
