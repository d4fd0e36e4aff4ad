"""Accepting a scan, the whole of it: who asks, the body, idempotency, admission,
preparing it in the CPU lane, recording it, starting it. `ScanAcceptance` holds the
admission ticket from the moment it is granted until the pipeline owns it (the
pipeline releases it when the scan ends); any failure on the way gives it back. Every
refusal is an `EcoscanError`, rendered before any stream starts.

`Idempotency-Key`: the same caller and key within `IDEMPOTENCY_TTL_S` names the same
scan; a retried POST gets that scan's stream (replayed from the start, then live)
instead of a second scan, and the same key with another body is refused. A scan that
ended with a retryable error (`PROCESS_LOST`, `SERVER_SHUTDOWN`, an exhausted upstream)
does not pin its key: the same key starts a new attempt, whose row names the old one
(`retry_of`). Concurrent
duplicates race on a unique index, not on a check-then-insert.

The caller's scan rate and quota (app/limits/user_quota.py, when set): a scan without an
`Idempotency-Key` reserves its place before its body is read, so a refusal costs no upload;
one with a key reserves right before admission, once it is known not to repeat an earlier
scan (a retry is answered even at the quota). Any later refusal gives the place back: only
a scan that starts uses it.

The event loop's capacity (app/limits/loop_pacer.py, with LOOP_PACING): right after the
rate and quota, before the body is read, the scan waits for its turn at the rate the loop
can take, or is refused SERVER_BUSY; most refusals come earlier still, from the HTTP
protocol (`refused_early`, app/http/early_refusal.py). What a refusal cost the loop is
measured and counted apart from what scans cost it.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request

from app.errors import (
    DatabaseError,
    DatabaseUnavailable,
    IdempotencyKeyReused,
    InvalidRequest,
    ServerShuttingDown,
)
from app.images.prepare import NotInline
from app.intake.body_reader import BodyReader, BufferedBody
from app.intake.identity import Authenticator, Caller
from app.intake.parsing import InputLimits, check_content_encoding, parse_scan_body, request_kind
from app.limits.admission import Admission, Ticket
from app.limits.cpu_lane import CpuLane
from app.limits.loop_pacer import LoopBusy, LoopPacer
from app.limits.user_quota import Reservation, UserQuota
from app.runtime import tracing
from app.runtime.metrics import Metrics
from app.scans.pipeline import ScanPipeline
from app.scans.run import ScanRun
from app.scans.store import INSERT_SPAN, IdempotencyClaim, KeyTaken, ScanStore
from app.stages.context import AcceptedScan, ScanInput
from app.streaming.access import token_hash

MAX_IDEMPOTENCY_KEY_CHARS = 128
# A body this small is parsed on the event loop unless its image needs more than a check
# (JSON, base64, an https URL, or a sequential JPEG checked from its head at 1/8 scale:
# work bounded by the body's size, and no CPU-lane queue for it to wait in), where a hop
# to a lane thread and back costs more than the work (k6/cpu_per_scan.py; docs/benchmarks.md,
# CPU per completed scan).
INLINE_MAX_BODY_BYTES = 64 * 1024
# A draining replica asks clients to come back soon: by then the load balancer sends
# them to another one.
SHUTTING_DOWN_RETRY_AFTER_S = 2.0


@dataclass(frozen=True)
class NewScan:
    run: ScanRun
    caller: Caller
    token: str | None  # an anonymous scan's capability token, shown once


@dataclass(frozen=True)
class RepeatedScan:
    """The POST repeats an earlier one (same caller, key and body): that scan answers."""

    scan_id: uuid.UUID
    caller: Caller


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
        identity: Authenticator,
        metrics: Metrics,
        idempotency_ttl_s: float,
        quota: UserQuota | None = None,
        pacer: LoopPacer | None = None,
    ) -> None:
        self._identity = identity
        self._quota = quota
        self._pacer = pacer
        self._claims: dict[tuple[str, str], asyncio.Future[tuple[uuid.UUID, str]]] = {}
        self._idempotency_ttl_s = idempotency_ttl_s
        self._admission = admission
        self._cpu = cpu
        self._store = store
        self._pipeline = pipeline
        self._limits = limits
        self._bodies = bodies
        self._metrics = metrics

    async def accept(self, request: Request) -> NewScan | RepeatedScan:
        received_at = time.perf_counter()
        cpu_at = time.thread_time()
        if not self._pipeline.accepting:
            raise ServerShuttingDown(retry_after_s=SHUTTING_DOWN_RETRY_AFTER_S)
        content_type = request.headers.get("content-type", "")
        request_kind(content_type)  # 415 before reading anything
        check_content_encoding(request.headers)  # 415 too: bodies are never decompressed
        caller = await self._identity.caller(request)
        key = _idempotency_key(request)
        reservation = None if key else await self._reserve(caller)
        try:
            await self._paced(cpu_at)
            try:
                return await self._read_and_start(
                    request, caller, key, content_type, received_at, reservation
                )
            finally:
                if self._pacer is not None:
                    self._pacer.entered()
        except BaseException:
            if reservation is not None:
                reservation.give_back()
            raise

    async def _read_and_start(
        self,
        request: Request,
        caller: Caller,
        key: str | None,
        content_type: str,
        received_at: float,
        reservation: Reservation | None,
    ) -> NewScan | RepeatedScan:
        # Uploads cost time and memory, not admission: a slow upload holds no slot.
        body = await self._bodies.read(request, client=caller.rate_key)
        try:
            scan_input, prepare_s = await self._prepare(body, content_type)
        finally:
            body.release()
        if not key:
            return await self._start(
                caller, None, scan_input, prepare_s, received_at, reservation=reservation
            )
        claim = _claim(caller, key, scan_input)
        # A duplicate while the first is being accepted here: that one answers for both
        # (the duplicate must not be refused for the caller's cap meanwhile).
        first = self._claims.get((claim.scope, claim.key))
        if first is not None and (repeated := await _outcome(first, claim)) is not None:
            return RepeatedScan(repeated, caller)
        return await self._claim_and_start(caller, claim, scan_input, prepare_s, received_at)

    async def _claim_and_start(
        self,
        caller: Caller,
        claim: IdempotencyClaim,
        scan_input: ScanInput,
        prepare_s: float,
        received_at: float,
    ) -> NewScan | RepeatedScan:
        pending: asyncio.Future[tuple[uuid.UUID, str]] = asyncio.get_running_loop().create_future()
        self._claims[(claim.scope, claim.key)] = pending
        try:
            retry_of = None
            if (taken := await self._taken(claim)) is not None:
                if not taken.ended_retryably:
                    return RepeatedScan(_same_request(taken, claim), caller)
                retry_of = _same_request(taken, claim)  # the key starts a new attempt
            new = await self._start(caller, claim, scan_input, prepare_s, received_at, retry_of)
            pending.set_result((new.run.scan.id, claim.request_sha256))
            return new
        except KeyTaken as taken:  # a duplicate on another replica inserted first
            return RepeatedScan(_same_request(taken, claim), caller)
        finally:
            if not pending.done():
                pending.cancel()  # the duplicates waiting on it try for themselves
            self._claims.pop((claim.scope, claim.key), None)

    async def _start(
        self,
        caller: Caller,
        claim: IdempotencyClaim | None,
        scan_input: ScanInput,
        prepare_s: float,
        received_at: float,
        retry_of: uuid.UUID | None = None,
        *,
        reservation: Reservation | None = None,
    ) -> NewScan:
        if claim is not None:  # not a repeat: now it takes its place in the caller's windows
            reservation = await self._reserve(caller)
        try:
            return await self._admit_and_record(caller, claim, scan_input, prepare_s, received_at, retry_of)
        except BaseException:
            if reservation is not None:
                reservation.give_back()
            raise

    async def _admit_and_record(
        self,
        caller: Caller,
        claim: IdempotencyClaim | None,
        scan_input: ScanInput,
        prepare_s: float,
        received_at: float,
        retry_of: uuid.UUID | None,
    ) -> NewScan:
        ticket = await self._admit(caller.rate_key)
        try:
            token = secrets.token_urlsafe(24) if caller.user_id is None else None
            scan_id = await self._record(caller.user_id, scan_input, claim, token, retry_of)
        except BaseException:
            ticket.release()
            raise
        timings = {"prepare_ms": round(prepare_s * 1000, 1)}
        scan = AcceptedScan(
            scan_id,
            caller.user_id,
            scan_input,
            ticket,
            received_at,
            timings,
            retry_of=retry_of,
            traceparent=tracing.traceparent(),
        )
        run = self._pipeline.start(scan, token_sha256=token_hash(token) if token else None)
        return NewScan(run, caller, token)

    async def _reserve(self, caller: Caller) -> Reservation | None:
        """The scan's place in the caller's rate and quota (None when neither is set)."""
        return await self._quota.reserve(caller.rate_key) if self._quota is not None else None

    async def _paced(self, cpu_at: float) -> None:
        """This scan's turn at the rate the loop can take, and its place under the ceiling
        until it is admitted (app/limits/loop_pacer.py)."""
        if self._pacer is None:
            return
        try:
            await self._pacer.enter()
        except LoopBusy as busy:
            self._count_shed(busy)
            self.charge_shed(time.thread_time() - cpu_at)
            raise

    @property
    def paced(self) -> bool:
        """Whether new scans are paced by the loop's capacity (LOOP_PACING, and measured)."""
        return self._pacer is not None

    def refused_early(self) -> LoopBusy | None:
        """Whether the pacer refuses a scan whose head has just been parsed, asked by the
        HTTP protocol before the request reaches the app (app/http/early_refusal.py); a
        refusal is counted as the app counts its own, its CPU once it is sent
        (`charge_shed`)."""
        if self._pacer is None or not self._pipeline.accepting:
            return None
        busy = self._pacer.refusal()
        if busy is not None:
            self._count_shed(busy)
            self._metrics.scans.labels("rejected", busy.code).inc()
        return busy

    def charge_shed(self, cpu_s: float) -> None:
        """What refusing a scan cost the loop: kept out of the CPU a scan costs."""
        if self._pacer is not None:
            self._pacer.capacity.refused(cpu_s)
            self._metrics.loop_shed_cpu.inc(cpu_s)

    def _count_shed(self, busy: LoopBusy) -> None:
        self._metrics.loop_shed.labels(busy.reason).inc()
        self._metrics.admission_rejected.labels(busy.code).inc()

    async def _taken(self, claim: IdempotencyClaim) -> KeyTaken | None:
        try:
            return await self._store.find_key(claim, ttl_s=self._idempotency_ttl_s)
        except DatabaseError:
            raise DatabaseUnavailable() from None

    async def _prepare(self, body: BufferedBody, content_type: str) -> tuple[ScanInput, float]:
        """Parse, decode and resize in the CPU lane (a small body whose image needs only a
        check, here: `_parsed_inline`); the time it took."""
        started = time.perf_counter()
        scan_input = _parsed_inline(body.data, content_type, self._limits)
        inline = scan_input is not None
        if scan_input is None:  # the lane observes its queue and run time
            with tracing.span("cpu_lane parse_scan_body"):
                scan_input = await self._cpu.run(parse_scan_body, body.data, content_type, self._limits)
        prepare_s = time.perf_counter() - started
        if inline:
            self._metrics.stage_service.labels("prepare").observe(prepare_s)  # it never queued
        self._metrics.prepare_duration.observe(prepare_s)
        return scan_input, prepare_s

    async def _admit(self, user_key: str) -> Ticket:
        try:
            ticket = await self._admission.admit(user_key)
        except Exception as exc:
            self._metrics.admission_rejected.labels(getattr(exc, "code", "error")).inc()
            raise
        self._metrics.admission_wait.observe(ticket.waited_s)
        return ticket

    async def _record(
        self,
        user_id: str | None,
        scan_input: ScanInput,
        claim: IdempotencyClaim | None,
        token: str | None,
        retry_of: uuid.UUID | None,
    ) -> uuid.UUID:
        scan_id = uuid.uuid4()
        try:
            with tracing.span("INSERT scans", INSERT_SPAN, client=True):
                await self._store.create(
                    scan_id,
                    user_id=user_id,
                    image_source=scan_input.source,
                    image_sha256=scan_input.image.sha256 if scan_input.image else None,
                    user_input=scan_input.user_input,
                    claim=claim,
                    token_sha256=token_hash(token) if token else None,
                    retry_of=retry_of,
                )
        except DatabaseError:
            raise DatabaseUnavailable() from None
        return scan_id


def _parsed_inline(data: bytes | bytearray, content_type: str, limits: InputLimits) -> ScanInput | None:
    """A body of up to `INLINE_MAX_BODY_BYTES` parsed on the loop, where the hop to a
    worker thread and back costs more than the work; None when its image needs more than
    a check (`NotInline`: the lane does it all again, the header read twice)."""
    if len(data) > INLINE_MAX_BODY_BYTES:
        return None
    try:
        return parse_scan_body(data, content_type, limits, inline=True)
    except NotInline:
        return None


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not key.isprintable():
        raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable characters.")
    return key


def _claim(caller: Caller, key: str, scan_input: ScanInput) -> IdempotencyClaim:
    """What makes two requests "the same": the image (its bytes' hash, or its URL) and the
    question, not the body's bytes (a multipart retry has a new boundary)."""
    image = scan_input.image.sha256 if scan_input.image else scan_input.image_url  # of the original bytes
    what = f"{scan_input.source}\n{image}\n{scan_input.user_input or ''}"
    return IdempotencyClaim(
        caller.scope, key, hashlib.sha256(what.encode("utf-8", "surrogatepass")).hexdigest()
    )


async def _outcome(first: asyncio.Future[tuple[uuid.UUID, str]], claim: IdempotencyClaim) -> uuid.UUID | None:
    """The scan the first of some concurrent duplicates started (None if it started none)."""
    try:
        scan_id, request_sha256 = await asyncio.shield(first)
    except asyncio.CancelledError:
        if not first.cancelled():
            raise  # we are the ones being cancelled
        return None
    if request_sha256 != claim.request_sha256:
        raise IdempotencyKeyReused()
    return scan_id


def _same_request(taken: KeyTaken, claim: IdempotencyClaim | None) -> uuid.UUID:
    if claim is None or taken.request_sha256 != claim.request_sha256:
        raise IdempotencyKeyReused()
    return taken.scan_id
