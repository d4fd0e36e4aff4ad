"""Traces over the wire: the service as a real uvicorn process with the standard `OTEL_*`
environment, exporting OTLP/HTTP protobuf to a receiver in this test (aiohttp on loopback,
decoded with opentelemetry-proto's `ExportTraceServiceRequest`, as a collector would)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from app.sim.server import RunningSimulator

from .conftest import data_url, make_jpeg, run_scan, scan_row, sim_configure
from .service_process import free_port, service_env, service_process
from .test_takeover import SLOW_ANSWER, kill_owner_mid_answer, two_replicas_env

NOTE = "note-that-must-never-reach-a-trace"
USER = "user-that-must-never-reach-a-trace"
SPAN_WAIT_S = 15.0


@dataclass
class Received:
    """What the receiver was sent: every request's raw bytes and every span, with the
    resource's attributes it came under."""

    payloads: list[bytes] = field(default_factory=list)
    spans: list[tuple[dict[str, Any], Span]] = field(default_factory=list)

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for _, s in self.spans if s.trace_id.hex() == trace_id]

    async def wait_for(self, trace_id: str, name: str, count: int = 1) -> list[Span]:
        async with asyncio.timeout(SPAN_WAIT_S):
            while len(found := [s for s in self.of_trace(trace_id) if s.name == name]) < count:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # another process sends them
        return found


def attributes(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, Received]]:
    received = Received()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        received.payloads.append(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                received.spans.extend((resource, s) for s in scope.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        await runner.cleanup()


def otel_env(endpoint: str, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "ecoscan-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        **more,
    }


@asynccontextmanager
async def traced_service(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Received]]:
    """A service process exporting its spans to a receiver, and a client of it. The receiver
    outlives the service, so what it flushes on its way out is in `Received` afterwards."""
    async with otlp_receiver() as (endpoint, received):
        env = service_env(database_url, sim, **otel_env(endpoint))
        async with (
            service_process(env, tmp_path / "svc.log") as svc,
            httpx.AsyncClient(base_url=svc.url, timeout=30) as client,
        ):
            yield client, received


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def test_one_scan_is_one_trace_under_the_clients_traceparent(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    photo = make_jpeg(71, (1600, 1200))  # larger than it is sent: prepared in the CPU lane
    header, trace_id, parent_id = traceparent()
    async with traced_service(database_url, sim, tmp_path) as (client, received):
        body = {"image_url": data_url(photo), "user_input": NOTE}
        headers = {"traceparent": header, "X-User-ID": USER}
        outcome = await run_scan(client, json=body, headers=headers)
        assert outcome.terminal.event == "done", outcome.events
        assert outcome.headers["x-trace-id"] == trace_id
        assert outcome.terminal.data["trace_id"] == trace_id
        await received.wait_for(trace_id, "scan")
        await received.wait_for(trace_id, "UPDATE scans")
        # A client's trace that is not sampled: named, followed, nothing of it exported.
        unsampled, unsampled_id, _ = traceparent()
        unsampled = unsampled[:-2] + "00"
        other = await run_scan(
            client, json={"image_url": data_url(make_jpeg(72))}, headers={"traceparent": unsampled}
        )
        assert other.headers["x-trace-id"] == other.terminal.data["trace_id"] == unsampled_id
        await asyncio.sleep(1.0)  # ten times the export delay
        assert received.of_trace(unsampled_id) == []
        openmetrics = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        text = (await client.get("/metrics")).text

    spans = received.of_trace(trace_id)
    by_name = {s.name: s for s in spans}
    request = by_name["POST /api/v1/scan/classify/completion"]
    assert request.parent_span_id.hex() == parent_id and request.kind == Span.SPAN_KIND_SERVER
    assert attributes(request)["http.response.status_code"] == 200
    scan = by_name["scan"]
    assert scan.parent_span_id == request.span_id
    for stage in ("vision", "rule", "answer", "reward"):
        assert by_name[f"stage {stage}"].parent_span_id == scan.span_id
    assert by_name["cpu_lane parse_scan_body"].parent_span_id == request.span_id
    assert by_name["INSERT scans"].parent_span_id == request.span_id
    assert attributes(by_name["UPDATE scans"])["db.system.name"] == "postgresql"
    resource = received.spans[0][0]
    assert resource["service.name"] == "ecoscan-under-test"

    calls = [s for s in spans if s.name.startswith("chat ")]
    assert len(calls) == 2, [s.name for s in spans]  # vision, answer: one attempt each
    stage_ids = {by_name["stage vision"].span_id, by_name["stage answer"].span_id}
    for call in calls:
        attrs = attributes(call)
        assert call.kind == Span.SPAN_KIND_CLIENT and call.parent_span_id in stage_ids
        assert call.name == f"chat {attrs['gen_ai.request.model']}"
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "openai"
        assert attrs["gen_ai.response.model"]
        assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
        assert "gen_ai.usage.cache_read.input_tokens" in attrs
        assert "gen_ai.usage.reasoning.output_tokens" in attrs
        assert attrs["server.address"] == "127.0.0.1"
        assert {e.name for e in call.events} >= {"gate_wait", "budget_wait"}
    assert "route" in {e.name for e in by_name["stage answer"].events}

    # Nothing of what the user sent or was told: no note, no answer, no image, no user id.
    wire = b"".join(received.payloads)
    answer = "".join(e.data["text"] for e in outcome.of("delta"))
    assert len(answer) > 40
    for secret in (NOTE, USER, answer[:24], answer[-24:], base64.b64encode(photo)[1000:1040].decode()):
        assert secret.encode() not in wire, secret
    assert b"data:image" not in wire and photo[200:240] not in wire

    # The GenAI metrics beside ours, and the scan histogram's exemplar pointing at the trace.
    usage = (
        r'gen_ai_client_token_usage_count\{[^}]*gen_ai_provider_name="openai"[^}]*gen_ai_token_type="input"'
    )
    assert re.search(usage, text), text
    assert re.search(r'gen_ai_client_operation_duration_seconds_count\{[^}]*error_type=""[^}]*\} [1-9]', text)
    assert "gen_ai_client_operation_time_to_first_chunk_seconds_count{" in text
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    exemplar = f'# {{trace_id="{trace_id}"}}'
    assert any(
        line.startswith("ecoscan_scan_duration_seconds_bucket") and exemplar in line
        for line in openmetrics.text.splitlines()
    )


async def test_a_dead_trace_endpoint_costs_no_scan_and_its_spans_are_dropped_and_counted(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # A queue of 4 spans: one scan's dozen overflow it while the exporter retries (backing
    # off 1, 2, 4 s within its 10 s).
    more = {"OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_EXPORTER_OTLP_TIMEOUT": "10"}
    env = service_env(database_url, sim, **otel_env(dead, **more))
    async with (
        service_process(env, tmp_path / "svc.log") as svc,
        httpx.AsyncClient(base_url=svc.url, timeout=30) as client,
    ):
        for seed in range(4):
            outcome = await run_scan(client, json={"image_url": data_url(make_jpeg(80 + seed))})
            assert outcome.terminal.event == "done", outcome.events
            # Never waiting for the exporter: a scan held by it would wait out its retries (7 s).
            assert outcome.terminal.data["timings"]["total_ms"] < 5000, outcome.terminal.data
        text = (await client.get("/metrics")).text
    dropped = re.search(r"^ecoscan_trace_spans_dropped_total (\S+)$", text, re.M)
    assert dropped is not None and float(dropped.group(1)) >= 4 * 10 - 4, text


async def test_a_scan_taken_over_goes_on_in_its_trace_on_the_replica_that_adopts_it(
    database_url: str,
    sim: RunningSimulator,
    db: asyncpg.Connection,
    redis_server_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    await sim_configure(sim, **SLOW_ANSWER)
    async with otlp_receiver() as (endpoint, received):
        env = two_replicas_env(database_url, sim, redis_server_url, redis_prefix, **otel_env(endpoint))
        async with (
            service_process(env, tmp_path / "a.log") as a,
            service_process(env, tmp_path / "b.log") as b,
        ):
            scan_id, follower, _ = await kill_owner_mid_answer(a, b, "traced", "k-trace")
            async with asyncio.timeout(60):
                await follower.task
            assert [e.event for e in follower.terminals()] == ["done"], follower.events
            trace_id = follower.terminals()[0].data["trace_id"]
            (adopted,) = await received.wait_for(trace_id, "scan")  # the dead owner's never ended
            await received.wait_for(trace_id, "stage answer")
        assert (await scan_row(db, scan_id))["status"] == "completed"

    (request,) = [s for s in received.of_trace(trace_id) if s.name.startswith("POST ")]
    assert attributes(adopted)["ecoscan.scan.taken_over"] is True
    assert adopted.parent_span_id == request.span_id  # the request span the owner sent
    (answer,) = [s for s in received.of_trace(trace_id) if s.name == "stage answer"]
    assert answer.parent_span_id == adopted.span_id
    assert any(
        s.name.startswith("chat ") and s.parent_span_id == answer.span_id for s in received.of_trace(trace_id)
    )
    assert json.dumps(follower.terminals()[0].data)  # the follower saw the adopter's `done`


def test_off_unless_the_environment_configures_an_exporter_and_then_nothing_is_imported() -> None:
    from app.runtime.tracing import configured

    assert not configured({})
    assert configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"})
    assert not configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    # The whole service imported, tracing started and a span made, in a process of its own
    # (this one has imported the SDK for the receiver): nothing of the trace SDK or the
    # exporter loaded. (FastAPI imports the OpenTelemetry API, its own dependency, for its
    # native telemetry, off without a global provider; redis-py the SDK's metrics if installed.)
    script = (
        "import sys, asyncio\n"
        "import app.main\n"
        "from app.runtime import tracing\n"
        "from app.runtime.metrics import Metrics\n"
        "close = tracing.start(Metrics(process=False))\n"
        "with tracing.span('x', {'a': 1}) as s:\n"
        "    s.set_attribute('b', 2)\n"
        "asyncio.run(close())\n"
        "assert tracing.trace_id() is None and tracing.traceparent() is None\n"
        "ours = ('opentelemetry.sdk.trace', 'opentelemetry.exporter', 'opentelemetry.proto')\n"
        "print(sorted(m for m in sys.modules if m.startswith(ours)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_traces_asked_for_without_the_sdk_installed_stop_the_start_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.runtime import tracing
    from app.runtime.metrics import Metrics

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(tracing.TracingUnavailable, match=re.escape("pip install 'ecoscan[otel]'")):
        tracing.start(Metrics(process=False))
    assert tracing.trace_id() is None  # still off


async def test_a_keep_alive_connection_does_not_carry_one_scans_trace_into_the_next(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    """A request without `traceparent` starts a trace of its own, whatever came before it on
    its connection. On the asyncio loop a transport's callbacks run in the context of
    whoever last resumed its reading: after a big body (over uvicorn's 64 KiB high water)
    that can be the last request's task inside its span, and the next request's task
    starts from there; the next scan then became a child of the last one (in about one
    round in ten here: ten rounds)."""
    photo = data_url(make_jpeg(73))
    big = '{"image_url": "' + photo + '"' + " " * 400_000 + "}"
    async with otlp_receiver() as (endpoint, received):
        # The asyncio loop (uvloop runs a transport's callbacks in the context it was made in).
        env = service_env(database_url, sim, **otel_env(endpoint), UVICORN_LOOP="asyncio")
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with (
            service_process(env, tmp_path / "svc.log") as svc,
            httpx.AsyncClient(base_url=svc.url, timeout=30, limits=limits) as client,
        ):
            for round_ in range(10):  # all on one connection: the pool holds one
                header, trace_id, _ = traceparent()
                headers = {"traceparent": header, "content-type": "application/json"}
                first = await run_scan(client, content=big, headers=headers)
                assert first.terminal.event == "done", first.events
                assert first.headers["x-trace-id"] == trace_id
                after = await run_scan(client, json={"image_url": data_url(make_jpeg(74 + round_))})
                assert after.terminal.event == "done", after.events
                assert after.headers["x-trace-id"] != trace_id, f"round {round_}: the last scan's trace"
                assert after.terminal.data["trace_id"] == after.headers["x-trace-id"]
            (request,) = await received.wait_for(after.headers["x-trace-id"], SCAN_REQUEST)
    assert request.parent_span_id == b""  # a root: no client parent, and none inherited


SCAN_REQUEST = "POST /api/v1/scan/classify/completion"


async def test_refusals_and_junk_traceparents_name_their_trace_too(
    database_url: str, sim: RunningSimulator, tmp_path: Path
) -> None:
    """An error response names the request's trace as a scan's does (its span, with the
    refusal's code, is exported); a `traceparent` that is not one starts a new trace and
    never fails the request."""
    header, trace_id, parent_id = traceparent()
    async with traced_service(database_url, sim, tmp_path) as (client, received):
        refused = await run_scan(client, json={"user_input": "no image"}, headers={"traceparent": header})
        assert refused.status == 400, refused.body
        assert refused.headers.get("x-trace-id") == trace_id, refused.headers
        (span,) = await received.wait_for(trace_id, SCAN_REQUEST)
        assert span.parent_span_id.hex() == parent_id
        assert attributes(span)["http.response.status_code"] == 400
        assert attributes(span)["error.type"] == refused.body["code"]
        junk = [
            "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # an invalid (all-zero) trace id
            "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # the forbidden version
            "00-" + "A" * 32 + "-" + "b" * 16 + "-01",  # upper case
            "00-" + "a" * 32 + "-" + "b" * 16 + "-01-more",  # version 00 with more
            "not a traceparent \u00e9",
        ]
        for value in junk:
            photo = data_url(make_jpeg(90 + len(value)))
            headers = {
                "traceparent": value.encode("latin-1"),
                "tracestate": "=,\u00e9=\u00e9".encode("latin-1"),
            }
            outcome = await run_scan(client, json={"image_url": photo}, headers=headers)
            assert outcome.terminal.event == "done", (value, outcome.events)
            new = outcome.headers["x-trace-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", new) and new not in value.lower(), value
        # A valid traceparent with a tracestate that is not one: the SDK's warning of it
        # (the client's text, a line per request any client can ask for) stays out of the log.
        valid, _, _ = traceparent()
        headers = {"traceparent": valid.encode(), "tracestate": b"bad key=x"}
        outcome = await run_scan(client, json={"image_url": data_url(make_jpeg(99))}, headers=headers)
        assert outcome.terminal.event == "done", outcome.events
    assert "bad key" not in (tmp_path / "svc.log").read_text(errors="replace")
