"""The kit's trace backend (deploy/images/phoenix) from outside: a span made and exported
over OTLP/HTTP protobuf by the OpenTelemetry SDK, as the service exports its own, and
found again through Phoenix's REST API (GET /v1/projects/<project>/spans/otlpv1)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

# Phoenix files a span under the project its resource names (openinference.project.name),
# else under "default": deploy/ecoscan.env names this one.
PROJECT = "ecoscan"
EXPORT_TIMEOUT_S = 10.0
# Phoenix writes spans to its database in batches, after it answered the export.
FIND_TIMEOUT_S = 30.0


class _Kept(SpanExporter):
    """Keeps the finished spans, for the test to export (or encode) itself."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def make_span(name: str, service: str = "ecoscan-test") -> tuple[ReadableSpan, str]:
    """A finished span of its own trace (sampled), and that trace's id in hex."""
    kept = _Kept()
    resource = Resource.create({"service.name": service, "openinference.project.name": PROJECT})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(kept))
    with provider.get_tracer("tests.trace_backend").start_as_current_span(name) as span:
        span.set_attribute("test.nonce", secrets.token_hex(8))
    provider.shutdown()
    (finished,) = kept.spans
    assert finished.context is not None
    return finished, format(finished.context.trace_id, "032x")


def export(endpoint: str, span: ReadableSpan) -> None:
    """OTLP/HTTP protobuf to <endpoint>/v1/traces, as OTEL_EXPORTER_OTLP_ENDPOINT is read."""
    exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=EXPORT_TIMEOUT_S)
    try:
        assert exporter.export([span]) is SpanExportResult.SUCCESS, f"{endpoint} refused the span"
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]


def encoded(span: ReadableSpan) -> bytes:
    """The span as an OTLP ExportTraceServiceRequest body (what the exporter POSTs)."""
    body: bytes = encode_spans([span]).SerializeToString()
    return body


def find_spans(ui: str, trace_id: str, timeout: float = FIND_TIMEOUT_S) -> list[dict[str, Any]]:
    """The trace's spans as Phoenix's API lists them, once it lists any."""
    url = f"{ui.rstrip('/')}/v1/projects/{PROJECT}/spans/otlpv1"
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            answer = client.get(url, params={"trace_id": trace_id})
            if answer.status_code == 200 and answer.json()["data"]:
                found: list[dict[str, Any]] = answer.json()["data"]
                return found
            last = f"{answer.status_code} {answer.text[:300]}"
            time.sleep(0.5)
    raise AssertionError(f"Phoenix lists no span of trace {trace_id} within {timeout:.0f} s: {last}")
