"""HTTP routes. Thin on purpose: parse, admit, hand to the pipeline, respond.
Errors are raised as `EcoscanError`s and rendered in one place (`app/main.py`)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.errors import DatabaseError, DatabaseUnavailable, InvalidRequest, PayloadTooLarge
from app.pipeline import AcceptedScan
from app.resources import Resources
from app.scan_input import parse_scan_body, request_kind
from app.scan_store import DB_ERRORS
from app.streaming import scan_response

router = APIRouter()

MAX_USER_ID_CHARS = 128


def resources(request: Request) -> Resources:
    res: Resources = request.state.resources
    return res


@router.post("/api/v1/scan/classify/completion")
async def classify_completion(request: Request) -> Response:
    received_at = time.perf_counter()
    r = resources(request)
    content_type = request.headers.get("content-type", "")
    request_kind(content_type)  # 415 before reading anything
    user_id = _user_id(request)
    user_key = user_id or f"anon:{request.client.host if request.client else '-'}"
    try:
        ticket = await r.admission.admit(user_key)
    except Exception as exc:
        r.metrics.admission_rejected.labels(getattr(exc, "code", "error")).inc()
        raise
    try:
        body = await _read_body(request, r.input_limits.max_body_bytes)
        prepare_started = time.perf_counter()
        scan_input = await r.cpu.run(parse_scan_body, body, content_type, r.input_limits)
        prepare_s = time.perf_counter() - prepare_started
        r.metrics.prepare_duration.observe(prepare_s)
        scan_id = uuid.uuid4()
        try:
            await r.store.create(
                scan_id,
                user_id=user_id,
                image_source=scan_input.source,
                image_sha256=scan_input.image.sha256 if scan_input.image else None,
                user_input=scan_input.user_input,
            )
        except DatabaseError:
            raise DatabaseUnavailable() from None
    except BaseException:
        ticket.release()
        raise
    scan = AcceptedScan(
        id=scan_id,
        user_id=user_id,
        input=scan_input,
        ticket=ticket,
        received_at=received_at,
        timings={"prepare_ms": round(prepare_s * 1000, 1)},
    )
    return scan_response(r.pipeline.start(scan), r.metrics, ping_s=r.settings.sse_ping_s)


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


def _user_id(request: Request) -> str | None:
    value = request.headers.get("x-user-id")
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > MAX_USER_ID_CHARS or not value.isprintable():
        raise InvalidRequest(f"X-User-ID must be printable and at most {MAX_USER_ID_CHARS} characters.")
    return value


async def _read_body(request: Request, limit: int) -> bytearray:
    """The body, capped at `limit`; returned as the buffer it was read into (no copy)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge()
    return body
