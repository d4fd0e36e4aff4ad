"""Traces of scans over OpenTelemetry, when the standard `OTEL_*` environment asks for them.

Configured as the SDK itself decides it (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, `OTEL_SDK_DISABLED` not `true`, `OTEL_TRACES_EXPORTER`
not `none`), `start` builds the SDK's `TracerProvider` (sampler, resource and exporter all
read from the environment by the SDK) with the OTLP/HTTP exporter behind the SDK's
`BatchSpanProcessor`: spans leave in batches from its own thread. Otherwise nothing of
OpenTelemetry is imported and `span` hands back one shared do-nothing context: a call of a
function and a test of a global, so the hot path pays nothing for tracing that is off.

The export is bounded so that it can never slow a scan: at most `OTEL_BSP_MAX_QUEUE_SIZE`
spans wait (or are being sent); a span ended while that many do is dropped and counted
(`ecoscan_trace_spans_dropped_total`), as is every span of a batch the endpoint did not take
within `OTEL_EXPORTER_OTLP_TIMEOUT`. What spans carry is chosen where they are made: counts,
names and timings, never a prompt, an answer, an image or (unless `TRACE_USER_ID`) a user id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Tracer

    from app.runtime.metrics import Metrics

log = logging.getLogger(__name__)

# The SDK's own default for OTEL_BSP_MAX_QUEUE_SIZE: spans held at most, waiting or in export.
DEFAULT_MAX_QUEUE = 2048
DEFAULT_MAX_BATCH = 512  # ...and for OTEL_BSP_MAX_EXPORT_BATCH_SIZE (at most the queue)
# On the way out, the spans still queued get this long to leave (the lifespan's close is bounded too).
FLUSH_ON_EXIT_S = 2.0

Attributes = Mapping[str, str | int | float | bool]


class SpanLike(Protocol):
    """What the code that makes spans uses of one: the SDK's `Span`, or `_NoSpan`."""

    def set_attribute(self, key: str, value: Any) -> None: ...


class _NoSpan:
    """The span when tracing is off: every call does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass


NO_SPAN = _NoSpan()
_OFF: contextlib.nullcontext[SpanLike] = contextlib.nullcontext(NO_SPAN)  # reusable: it holds no state


class _Otel:
    """What the hot path uses of OpenTelemetry, imported once, when tracing starts."""

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.current = trace.get_current_span
        self.in_context = trace.set_span_in_context
        self.attach, self.detach = context.attach, context.detach
        self.internal, self.server, self.client = (
            trace.SpanKind.INTERNAL,
            trace.SpanKind.SERVER,
            trace.SpanKind.CLIENT,
        )
        self.error = trace.StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()
        self.format_trace_id = trace.format_trace_id

    def extract(self, parent: str | Mapping[str, str]) -> Any:
        return self.propagator.extract({"traceparent": parent} if isinstance(parent, str) else parent)


_otel: _Otel | None = None
_user_ids = False


class TracingUnavailable(RuntimeError):
    """OTEL_* asks for traces in a build without the trace SDK: the start stops, naming the extra."""


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces, as the SDK reads it."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def enabled() -> bool:
    return _otel is not None


def recording() -> bool:
    """Whether spans made here are recorded (tracing on, and this trace sampled)."""
    return _otel is not None and bool(_otel.current().get_span_context().trace_flags.sampled)


def user_ids() -> bool:
    """Whether spans may carry the user id (`TRACE_USER_ID`, an operator's choice)."""
    return _user_ids


def span(
    name: str,
    attributes: Attributes | None = None,
    *,
    server: bool = False,
    client: bool = False,
    parent: str | Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[SpanLike]:
    """A span around a block, the current one's child (or `parent`'s: a W3C `traceparent`,
    or headers holding one; headers holding none, or no valid one: a root); an exception
    leaving the block marks it failed (`error.type`).
    Inside a trace that is not sampled, nothing: its children would not be sampled either
    (every sampler the SDK has decides alike for a trace), and its id is the parent's."""
    otel = _otel
    if otel is None:
        return _OFF
    context = None
    if parent is not None:
        context = otel.extract(parent)
    else:
        # (Sampled, not recording: the parent has ended, a scan's request span has.)
        found = otel.current().get_span_context()
        if found.is_valid and not found.trace_flags.sampled:
            return _OFF
    kind = otel.server if server else otel.client if client else otel.internal
    return _LiveSpan(otel, otel.tracer.start_span(name, context, kind, attributes))


class _LiveSpan:
    """The SDK's span made current for a block, then ended (`start_as_current_span` without
    its two generator-based context managers: this runs for every span)."""

    __slots__ = ("_otel", "_span", "_token")

    def __init__(self, otel: _Otel, started: Any) -> None:
        self._otel = otel
        self._span = started
        self._token: object = None

    def __enter__(self) -> SpanLike:
        self._token = self._otel.attach(self._otel.in_context(self._span))
        span: SpanLike = self._span
        return span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and self._span.is_recording():
                self._span.set_attribute("error.type", error_type(exc))
                if not isinstance(exc, asyncio.CancelledError):  # a lost hedge, a client gone
                    self._span.set_status(self._otel.error)
        finally:
            self._otel.detach(self._token)  # type: ignore[arg-type]
            self._span.end()


def error_type(exc: BaseException) -> str:
    """The low-cardinality name of a failure: an attempt's reason, an error's code, else its class."""
    for attribute in ("reason", "code"):
        value = getattr(exc, attribute, None)
        if isinstance(value, str) and value:
            return value
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__qualname__


def event(name: str, attributes: Attributes | None = None) -> None:
    """An event on the current span (a routing decision, a wait, a failover)."""
    if _otel is not None:
        _otel.current().add_event(name, attributes)


def attributes(values: Mapping[str, Any]) -> None:
    """Attributes on the current span (known only once it has run: a reply's usage)."""
    if _otel is None:
        return
    current = _otel.current()
    if current.is_recording():
        current.set_attributes(values)


def failed(code: str, *, error: bool = True) -> None:
    """Mark the current span as ended by `code` (`error.type`); `error`: an error's status too."""
    if _otel is None:
        return
    current = _otel.current()
    current.set_attribute("error.type", code)
    if error:
        current.set_status(_otel.error)


def traceparent() -> str | None:
    """The current span's context as a W3C `traceparent`: what continues its trace elsewhere."""
    if _otel is None:
        return None
    carrier: dict[str, str] = {}
    _otel.propagator.inject(carrier)
    return carrier.get("traceparent")


def trace_id(*, sampled: bool = False) -> str | None:
    """The current trace's id (32 hex digits); with `sampled`, only if its spans are recorded
    (an exemplar points only at a trace the backend has)."""
    if _otel is None:
        return None
    context = _otel.current().get_span_context()
    if not context.is_valid or (sampled and not context.trace_flags.sampled):
        return None
    return _otel.format_trace_id(context.trace_id)


def start(metrics: Metrics, *, user_ids: bool = False) -> Callable[[], Awaitable[None]]:
    """Tracing on, if the environment configures it; returns its close (bounded: queued
    spans get `FLUSH_ON_EXIT_S` to leave). Off: a close that does nothing."""
    global _otel, _user_ids
    if not configured():
        return _nothing
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )
    if protocol.strip() != "http/protobuf":
        log.warning("traces: OTLP protocol %r is not supported; exporting http/protobuf", protocol)
    # The SDK warns, with the client's own text, of each invalid `tracestate` it is sent:
    # a log line per request that any client can ask for. The header is ignored all the same.
    logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
    try:
        provider = _provider(metrics)
    except ImportError as exc:  # configured for traces, built without them: say what is missing
        raise TracingUnavailable(
            f"OTEL_* asks for traces but the trace SDK is not installed (pip install 'ecoscan[otel]'): {exc}"
        ) from None
    _otel, _user_ids = _Otel(provider.get_tracer("ecoscan")), user_ids

    async def close() -> None:
        global _otel
        _otel = None
        closing = threading.Thread(target=_shut_down, args=(provider,), name="trace-close", daemon=True)
        closing.start()
        await asyncio.to_thread(closing.join, FLUSH_ON_EXIT_S + 1.0)

    return close


async def _nothing() -> None:
    pass


def _shut_down(provider: TracerProvider) -> None:
    provider.force_flush(int(FLUSH_ON_EXIT_S * 1000))
    provider.shutdown()


def _provider(metrics: Metrics) -> TracerProvider:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "ecoscan"}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # sampler: OTEL_TRACES_SAMPLER
    dropped = metrics.trace_spans_dropped
    provider.add_span_processor(
        _bounded_processor(
            OTLPSpanExporter(), _env_int("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE), dropped.inc
        )
    )
    return provider


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return max(1, int(raw)) if raw.strip() else default
    except ValueError:
        return default


def _bounded_processor(exporter: SpanExporter, max_queue: int, dropped: Callable[[int], None]) -> Any:
    """The SDK's `BatchSpanProcessor`, admitting a span only while fewer than `max_queue`
    are held (queued or being sent), and counting what it does not admit or could not send.
    Its own queue then never overflows (it would drop the oldest span silently, logging
    each)."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Counting(SpanExporter):
        """The exporter, telling after each batch how many spans it took and if they left."""

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            result = SpanExportResult.FAILURE
            try:
                result = exporter.export(spans)
            finally:
                bounded.sent(len(spans), result)
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    class Bounded(SpanProcessor):
        def __init__(self) -> None:
            self._held = 0
            self._lock = threading.Lock()
            batch = min(max_queue, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_MAX_BATCH))
            self._batch = BatchSpanProcessor(
                Counting(), max_queue_size=max_queue, max_export_batch_size=batch
            )

        def on_end(self, span: ReadableSpan) -> None:
            if span.context is None or not span.context.trace_flags.sampled:
                return  # recorded, not sampled: the batch processor would not send it either
            with self._lock:
                full = self._held >= max_queue
                if not full:
                    self._held += 1
            if full:
                dropped(1)
            else:
                self._batch.on_end(span)

        def sent(self, count: int, result: SpanExportResult) -> None:
            with self._lock:
                self._held -= count
            if result is not SpanExportResult.SUCCESS:
                dropped(count)

        def shutdown(self) -> None:
            self._batch.shutdown()  # type: ignore[no-untyped-call]

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return self._batch.force_flush(timeout_millis)

    bounded = Bounded()
    return bounded
