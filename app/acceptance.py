"""Accepting a scan, the whole of it: admission, reading the body, preparing it in the
CPU lane, recording it, starting it. `ScanAcceptance` holds the admission ticket from
the moment it is granted until the pipeline owns it (the pipeline releases it when the
scan ends); any failure on the way gives it back. Every refusal is an `EcoscanError`,
rendered before any stream starts.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request

from app.body_reader import BodyReader, BufferedBody
from app.errors import DatabaseError, DatabaseUnavailable, InvalidRequest, ServerShuttingDown
from app.limits.admission import Admission, Ticket
from app.limits.cpu_lane import CpuLane
from app.metrics import Metrics
from app.pipeline import ScanPipeline, ScanRun
from app.scan_context import AcceptedScan
from app.scan_input import InputLimits, ScanInput, check_content_encoding, parse_scan_body, request_kind
from app.scan_store import ScanStore

MAX_USER_ID_CHARS = 128
# A draining replica asks clients to come back soon: by then the load balancer sends
# them to another one.
SHUTTING_DOWN_RETRY_AFTER_S = 2.0


class ScanAcceptance:
    def __init__(
        self,
        *,
        admission: Admission,
        cpu: CpuLane,
        store: ScanStore,
        pipeline: ScanPipeline,
        limits: InputLimits,
        bodies: BodyReader,
        metrics: Metrics,
    ) -> None:
        self._admission = admission
        self._cpu = cpu
        self._store = store
        self._pipeline = pipeline
        self._limits = limits
        self._bodies = bodies
        self._metrics = metrics

    async def accept(self, request: Request) -> ScanRun:
        received_at = time.perf_counter()
        if not self._pipeline.accepting:
            raise ServerShuttingDown(retry_after_s=SHUTTING_DOWN_RETRY_AFTER_S)
        content_type = request.headers.get("content-type", "")
        request_kind(content_type)  # 415 before reading anything
        check_content_encoding(request.headers)  # 415 too: bodies are never decompressed
        user_id = _user_id(request)
        # Uploads cost time and memory, not admission: a slow upload holds no slot.
        body = await self._bodies.read(request)
        try:
            ticket = await self._admit(user_id or f"anon:{request.client.host if request.client else '-'}")
            try:
                scan_input, prepare_s = await self._prepare(body, content_type)
                scan_id = await self._record(user_id, scan_input)
            except BaseException:
                ticket.release()
                raise
        finally:
            body.release()
        timings = {"prepare_ms": round(prepare_s * 1000, 1)}
        scan = AcceptedScan(scan_id, user_id, scan_input, ticket, received_at, timings)
        return self._pipeline.start(scan)

    async def _prepare(self, body: BufferedBody, content_type: str) -> tuple[ScanInput, float]:
        """Parse, decode and resize in the CPU lane; the time it took."""
        started = time.perf_counter()
        scan_input = await self._cpu.run(parse_scan_body, body.data, content_type, self._limits)
        prepare_s = time.perf_counter() - started
        self._metrics.prepare_duration.observe(prepare_s)
        return scan_input, prepare_s

    async def _admit(self, user_key: str) -> Ticket:
        try:
            return await self._admission.admit(user_key)
        except Exception as exc:
            self._metrics.admission_rejected.labels(getattr(exc, "code", "error")).inc()
            raise

    async def _record(self, user_id: str | None, scan_input: ScanInput) -> uuid.UUID:
        scan_id = uuid.uuid4()
        try:
            await self._store.create(
                scan_id,
                user_id=user_id,
                image_source=scan_input.source,
                image_sha256=scan_input.image.sha256 if scan_input.image else None,
                user_input=scan_input.user_input,
            )
        except DatabaseError:
            raise DatabaseUnavailable() from None
        return scan_id


def _user_id(request: Request) -> str | None:
    value = request.headers.get("x-user-id")
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > MAX_USER_ID_CHARS or not value.isprintable():
        raise InvalidRequest(f"X-User-ID must be printable and at most {MAX_USER_ID_CHARS} characters.")
    return value
