"""What another replica needs to finish a scan whose process died (app/scans/liveness.py):
the input the owner keeps in Redis while the scan runs (`Handover`), and what the
scan's mirrored event log says it had done (`recover`).

The input is what the vision call sends — the prepared image as a data URL (re-encoded,
or a bare JPEG without metadata: never the upload's own bytes, name or EXIF), or the
https URL — the user's note, who asked and the scan's deadline on the wall clock. An
image larger than `HANDOVER_IMAGE_MAX_CHARS` is left out: such a scan can be taken over
once its vision stage has completed, not before.

Recovering: each stage whose `completed` event is in the log is done — its result is
rebuilt from the event's fields (`StageResult.event_fields` is what the event carries),
its timing from its `duration_ms` — and is not run again: a completed vision call is
never paid for twice. The stage the owner was in starts over; if it had streamed text,
that text is void (`discard`, as after a failed stream elsewhere). Item events it had sent
(`items`, `item`, `item_rule`) are remembered, so the stage run over does not send them
again: a reader sees each once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.images.prepare import PreparedImage
from app.limits.admission import Ticket
from app.scans.events import EventLog, LogEntry, item_event_key
from app.stages.base import Stage, StageResult
from app.stages.context import AcceptedScan, ImageSource, ScanInput

# A prepared image is ~100-200 KB of base64 (IMAGE_LONG_SIDE 768); one sent on as it came
# may be larger. Past this, it is not kept (see the module docstring).
HANDOVER_IMAGE_MAX_CHARS = 1024 * 1024


@dataclass(frozen=True)
class Handover:
    source: ImageSource
    image_url: str  # "" when the image was too large to keep
    image: tuple[str, int, int] | None  # prepared_sha256, width, height
    user_input: str | None
    user_id: str | None
    rate_key: str  # the per-user caps' key (an anonymous caller's address)
    token_sha256: str | None
    retry_of: str | None
    timings: dict[str, float]
    received_at: float  # wall clock
    deadline_at: float  # wall clock
    traceparent: str | None = None  # its trace (W3C), when traced: the adopter continues it

    @classmethod
    def of(cls, scan: AcceptedScan, *, token_sha256: str | None, deadline_s: float) -> Handover:
        now = time.time()
        received_at = now - (time.perf_counter() - scan.received_at)
        scan_input, image = scan.input, scan.input.image
        kept = len(scan_input.image_url) <= HANDOVER_IMAGE_MAX_CHARS
        return cls(
            source=scan_input.source,
            image_url=scan_input.image_url if kept else "",
            image=(image.prepared_sha256, image.width, image.height) if image and kept else None,
            user_input=scan_input.user_input,
            user_id=scan.user_id,
            rate_key=scan.ticket.user_key,
            token_sha256=token_sha256,
            retry_of=str(scan.retry_of) if scan.retry_of else None,
            timings=dict(scan.timings),
            received_at=received_at,
            deadline_at=now + deadline_s,
            traceparent=scan.traceparent,
        )

    def encode(self) -> bytes:
        # An untraced scan's record carries no `traceparent` key: a replica of the version
        # before traces (mid-rollout) reads the record and can still take the scan over.
        fields = self.__dict__
        if self.traceparent is None:
            fields = {k: v for k, v in fields.items() if k != "traceparent"}
        return orjson.dumps(fields)

    @classmethod
    def decode(cls, raw: bytes) -> Handover | None:
        """None for what this version cannot read (another version's record)."""
        try:
            fields = orjson.loads(raw)
            image = fields.pop("image")
            return cls(image=tuple(image) if image else None, **fields)
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):
            return None

    def accepted(self, scan_id: uuid.UUID, ticket: Ticket) -> AcceptedScan:
        """The scan as its owner accepted it, but for the upload's own details (never kept)."""
        image = None
        if self.image is not None:
            prepared_sha256, width, height = self.image
            image = PreparedImage(self.image_url, "", prepared_sha256, width, height, width, height, 0)
        scan_input = ScanInput(self.source, self.image_url, self.user_input, image)
        received_at = time.perf_counter() - max(0.0, time.time() - self.received_at)
        retry_of = uuid.UUID(self.retry_of) if self.retry_of else None
        return AcceptedScan(
            scan_id,
            self.user_id,
            scan_input,
            ticket,
            received_at,
            dict(self.timings),
            retry_of=retry_of,
            traceparent=self.traceparent,
        )


@dataclass
class Recovered:
    """What a scan's log says it has done."""

    step: str  # the stage it was in (or the first)
    timings: dict[str, float]
    result: dict[str, Any]  # `done`'s fields so far
    results: dict[type, object]  # the completed stages' results, by type
    completed: set[str]
    text_void: bool  # the stage it was in had streamed text, now void
    item_events: set[tuple[str, int]] = field(default_factory=set)  # item events already sent

    def runs(self, stage: Stage[StageResult]) -> bool:
        return stage.name not in self.completed


def recover(log: EventLog, stages: Sequence[Stage[StageResult]]) -> Recovered:
    by_name = {stage.name: stage for stage in stages}
    recovered = Recovered(stages[0].name, {}, {}, {}, set(), False)
    for entry in log.entries:
        _replay(entry, by_name, recovered)
    return recovered


def _replay(entry: LogEntry, stages: dict[str, Stage[StageResult]], into: Recovered) -> None:
    event = entry.event
    fields = event.fields()
    if (key := item_event_key(event.kind, fields)) is not None:
        into.item_events.add(key)
    elif event.kind == "delta":
        into.text_void = True
    elif event.kind == "discard":
        into.text_void = False
    elif event.kind == "stage" and fields.get("status") == "started":
        into.step, into.text_void = event.step, False
    elif event.kind == "stage" and fields.get("status") == "completed":
        stage = stages[event.step]
        own = {k: v for k, v in fields.items() if k not in ("status", "duration_ms")}
        result = stage.result_type.model_validate(own)
        into.results[type(result)] = result
        into.result.update(result.done_fields(own))
        if stage.upstream_calls:  # which deployment served it died with its owner
            into.result.setdefault("upstreams", {})[stage.name] = None
        into.timings[f"{stage.name}_ms"] = fields["duration_ms"]
        into.completed.add(stage.name)
        into.text_void = False
