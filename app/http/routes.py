"""HTTP routes. Thin on purpose: the acceptance service takes a scan in, the streaming
module answers with its events. Errors are raised as `EcoscanError`s and rendered in
one place (`app/main.py`)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from sse_starlette import EventSourceResponse
from starlette.convertors import Convertor, register_url_convertor

from app.db.pool import DB_ERRORS
from app.errors import EcoscanError, InvalidRequest, ScanNotFound, Unauthorized
from app.http.errors import JsonErrorRoute, ecoscan_error
from app.http.openapi import operations as doc
from app.intake.acceptance import RepeatedScan
from app.resources import Resources
from app.runtime import tracing
from app.streaming.access import Reader
from app.streaming.responses import scan_response

router = APIRouter(route_class=JsonErrorRoute)

# Readiness probes time out at 1-2 s by default (Kubernetes: 1 s): answer within that.
READY_TIMEOUT_S = 1.0
SCAN_PATH = "/api/v1/scan/classify/completion"
# The scan request's span attributes (HTTP conventions), and the header that names its trace.
SCAN_SPAN_NAME = f"POST {SCAN_PATH}"
SCAN_SPAN = {"http.request.method": "POST", "http.route": SCAN_PATH}
TRACE_ID_HEADER = "X-Trace-Id"
CATEGORIES = "categories"


class _ScanIdConvertor(Convertor[str]):
    """A scan id segment: anything but the name of a sibling resource. Without it,
    `DELETE /api/v1/scan/categories` is a cancel of the scan "categories" (404) instead
    of a method the categories do not allow (405). Ids that are not UUIDs still reach
    the routes, which answer them SCAN_NOT_FOUND like an unknown scan."""

    regex = f"(?!{CATEGORIES}$)[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("scan_id", _ScanIdConvertor())


def resources(request: Request) -> Resources:
    res: Resources = request.state.resources
    return res


@router.post(
    SCAN_PATH,
    operation_id="scan_classify_completion",
    tags=["scan"],
    summary="Classify a photo and stream the disposal guidance",
    description=doc.SCAN_DESCRIPTION,
    response_class=EventSourceResponse,
    responses=doc.scan_responses(),
    openapi_extra=doc.SCAN_OPENAPI_EXTRA,
)
async def classify_completion(request: Request) -> Response:
    # The request's span (tracing on): the client's `traceparent` its parent, the scan its
    # child. Without one, a root, never the current context's span: a connection's reads
    # can run in the context of the last request on it (asyncio resumes a transport's
    # reading in the context of the task that resumed it), so it may hold that one's span.
    with tracing.span(SCAN_SPAN_NAME, SCAN_SPAN, server=True, parent=request.headers) as span:
        try:
            response = await _classify(request)
        except EcoscanError as exc:
            # Answered here, as the app's handler would: a refusal names its trace too.
            tracing.failed(exc.code)
            response = ecoscan_error(request, exc)
        span.set_attribute("http.response.status_code", response.status_code)
        if (trace_id := tracing.trace_id()) is not None:
            response.headers[TRACE_ID_HEADER] = trace_id
        return response


async def _classify(request: Request) -> Response:
    r = resources(request)
    accepted = await r.acceptance.accept(request)
    if isinstance(accepted, RepeatedScan):
        return await r.access.replay(
            accepted.scan_id, follower=accepted.caller.rate_key, headers={"Idempotent-Replayed": "true"}
        )
    headers = {"X-Scan-Token": accepted.token} if accepted.token else {}
    if (retry_of := accepted.run.scan.retry_of) is not None:
        headers["X-Retry-Of"] = str(retry_of)
    return scan_response(accepted.run, r.metrics, ping_s=r.settings.sse_ping_s, headers=headers)


@router.get(
    f"/api/v1/scan/{CATEGORIES}",
    operation_id="list_categories",
    tags=["scan"],
    summary="The taxonomy: categories, known items, situation tags",
    response_model=doc.Categories,
)
async def categories(request: Request) -> Response:
    return JSONResponse(resources(request).taxonomy.to_json())


@router.get(
    "/api/v1/scan/{job_id:scan_id}",
    operation_id="get_scan",
    tags=["scan"],
    summary="A scan's status and result",
    description=doc.SCAN_STATUS_DESCRIPTION,
    responses=doc.scan_status_responses(),
    openapi_extra=doc.SCAN_STATUS_OPENAPI_EXTRA,
)
async def get_scan(request: Request, job_id: str) -> Response:
    r = resources(request)
    return JSONResponse(await r.access.status(_scan_id(job_id), await _reader(r, request)))


@router.get(
    "/api/v1/scan/{job_id:scan_id}/events",
    operation_id="get_scan_events",
    tags=["scan"],
    summary="A scan's events from Last-Event-ID (or ?after=) on, then live",
    description=doc.SCAN_EVENTS_DESCRIPTION,
    response_class=EventSourceResponse,
    responses=doc.scan_events_responses(),
    openapi_extra=doc.SCAN_EVENTS_OPENAPI_EXTRA,
)
async def get_scan_events(request: Request, job_id: str) -> Response:
    r = resources(request)
    after = _after(request)
    return await r.access.events(_scan_id(job_id), await _reader(r, request), after=after)


@router.delete(
    "/api/v1/scan/{job_id:scan_id}",
    operation_id="cancel_scan",
    tags=["scan"],
    summary="Cancel a running scan",
    description=doc.CANCEL_SCAN_DESCRIPTION,
    status_code=202,
    response_model=doc.CancelAccepted,
    responses=doc.cancel_scan_responses(),
    openapi_extra=doc.CANCEL_SCAN_OPENAPI_EXTRA,
)
async def cancel_scan(request: Request, job_id: str) -> Response:
    r = resources(request)
    return JSONResponse(await r.access.cancel(_scan_id(job_id), await _reader(r, request)), status_code=202)


@router.get(
    "/api/v1/users/me/characters",
    operation_id="my_characters",
    tags=["users"],
    summary="The caller's collection of characters",
    description=doc.MY_CHARACTERS_DESCRIPTION,
    response_model=doc.CharacterCollection,
    responses=doc.my_characters_responses(),
    openapi_extra=doc.MY_CHARACTERS_OPENAPI_EXTRA,
)
async def my_characters(request: Request) -> Response:
    r = resources(request)
    caller = await r.identity.caller(request)
    if caller.user_id is None:
        raise Unauthorized("Sign in (or send X-User-ID through the gateway) to have a collection.")
    return JSONResponse({"characters": await r.collections.of(caller.user_id)})


def _scan_id(job_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise ScanNotFound() from None


def _after(request: Request) -> int:
    raw = request.query_params.get("after") or request.headers.get("last-event-id") or "0"
    raw = raw.strip(" \t")  # optional whitespace around a header value is not part of it (RFC 9110)
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise InvalidRequest("Last-Event-ID / after must be a non-negative integer (an event's id).")
    return int(raw)


async def _reader(r: Resources, request: Request) -> Reader:
    caller = await r.identity.caller(request)
    token = request.query_params.get("token") or request.headers.get("x-scan-token")
    return Reader(caller.user_id, token, caller.rate_key)


@router.get(
    "/healthz", operation_id="healthz", tags=["operations"], summary="Liveness", response_model=doc.Health
)
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    operation_id="readyz",
    tags=["operations"],
    summary="Readiness",
    description=doc.READYZ_DESCRIPTION,
    response_model=doc.Readiness,
    responses=doc.READYZ_RESPONSES,
)
async def readyz(request: Request) -> Response:
    """Ready = accepting scans and the database answers within `READY_TIMEOUT_S`
    (acquire included). Turns 503 the moment the shutdown drain begins."""
    r = resources(request)
    checks = {
        "accepting": "no (shutting down)" if r.drain.draining else "yes",
        "database": await _database_check(r),
        "upstream": "simulator" if r.simulator is not None else "configured",
    }
    ready = checks["accepting"] == "yes" and checks["database"] == "ok"
    # Deployments open or taken out are shown, not judged: another replica would find the
    # same deployments in the same state, so readiness does not turn on them.
    now = time.monotonic()
    upstreams = {name: breaker.describe(now) for name, breaker in r.breakers.items()}
    body = {"ready": ready, "checks": {**checks, "upstreams": upstreams}}
    return JSONResponse(body, status_code=200 if ready else 503)


async def _database_check(r: Resources) -> str:
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await r.pool.fetchval("SELECT 1")
    except DB_ERRORS:  # TimeoutError is an OSError
        return "unreachable"
    return "ok"


@router.get(
    "/metrics",
    operation_id="metrics",
    tags=["operations"],
    summary="Prometheus metrics",
    response_class=PlainTextResponse,
    response_description=doc.METRICS_DESCRIPTION,
)
async def metrics(request: Request) -> Response:
    # OpenMetrics when the scraper asks for it (Prometheus does): the only format with exemplars.
    if "application/openmetrics-text" in request.headers.get("accept", ""):
        return Response(resources(request).metrics.render(openmetrics=True), media_type=OPENMETRICS)
    return Response(resources(request).metrics.render(), media_type="text/plain; version=0.0.4")
