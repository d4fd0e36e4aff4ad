"""HTTP routes. Thin on purpose: the acceptance service takes a scan in, the streaming
module answers with its events. Errors are raised as `EcoscanError`s and rendered in
one place (`app/main.py`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse

from app import openapi as doc
from app.resources import Resources
from app.scan_store import DB_ERRORS
from app.streaming import scan_response

router = APIRouter()

# Readiness probes time out at 1-2 s by default (Kubernetes: 1 s): answer within that.
READY_TIMEOUT_S = 1.0


def resources(request: Request) -> Resources:
    res: Resources = request.state.resources
    return res


@router.post(
    "/api/v1/scan/classify/completion",
    operation_id="scan_classify_completion",
    tags=["scan"],
    summary="Classify a photo and stream the disposal guidance",
    description=doc.SCAN_DESCRIPTION,
    response_class=EventSourceResponse,
    responses=doc.scan_responses(),
    openapi_extra=doc.SCAN_OPENAPI_EXTRA,
)
async def classify_completion(request: Request) -> Response:
    r = resources(request)
    run = await r.acceptance.accept(request)
    return scan_response(run, r.metrics, ping_s=r.settings.sse_ping_s)


@router.get(
    "/api/v1/scan/categories",
    operation_id="list_categories",
    tags=["scan"],
    summary="The taxonomy: categories, known items, situation tags",
    response_model=doc.Categories,
)
async def categories(request: Request) -> Response:
    return JSONResponse(resources(request).taxonomy.to_json())


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
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


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
    return Response(resources(request).metrics.render(), media_type="text/plain; version=0.0.4")
