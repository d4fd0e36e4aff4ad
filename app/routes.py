"""HTTP routes. Thin on purpose: the acceptance service takes a scan in, the streaming
module answers with its events. Errors are raised as `EcoscanError`s and rendered in
one place (`app/main.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.resources import Resources
from app.scan_store import DB_ERRORS
from app.streaming import scan_response

router = APIRouter()


def resources(request: Request) -> Resources:
    res: Resources = request.state.resources
    return res


@router.post("/api/v1/scan/classify/completion")
async def classify_completion(request: Request) -> Response:
    r = resources(request)
    run = await r.acceptance.accept(request)
    return scan_response(run, r.metrics, ping_s=r.settings.sse_ping_s)


@router.get("/api/v1/scan/categories")
async def categories(request: Request) -> Response:
    return JSONResponse(resources(request).taxonomy.to_json())


@router.get("/healthz")
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    r = resources(request)
    checks: dict[str, str] = {}
    try:
        await r.pool.fetchval("SELECT 1", timeout=2.0)
        checks["database"] = "ok"
    except DB_ERRORS:  # TimeoutError is an OSError
        checks["database"] = "unreachable"
    checks["upstream"] = "simulator" if r.simulator is not None else "configured"
    ready = checks["database"] == "ok"
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(resources(request).metrics.render(), media_type="text/plain; version=0.0.4")
