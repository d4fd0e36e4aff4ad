"""Domain events of a scan and the per-scan log they go to.

The pipeline publishes plain event objects; `EventLog` stamps each with its `seq`
(1, 2, 3...) and the scan's `progress` (0-100, never decreasing) and keeps them in
order. Readers follow the log from any position (`follow`), so a stream can start late,
and a later store or replay reads the same entries. Only `app/streaming/responses.py` knows the
wire format (SSE).

    StageStarted     {"status": "started"}
    StageCompleted   {"status": "completed", "duration_ms", ...the stage's fields}
    AnswerDelta      {"text"}
    ItemEvent        `items` {"count", "main", "dropped"}; `item`, `item_rule` {"index", ...}
    ScanDone         terminal success: the result fields and `timings`
    ScanErrored      terminal failure: {"code", "message", "retryable"}
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson


@dataclass(frozen=True, slots=True)
class ScanEvent:
    kind: ClassVar[str]  # the SSE event name
    terminal: ClassVar[bool] = False
    step: str

    def fields(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True)
class StageStarted(ScanEvent):
    kind = "stage"

    def fields(self) -> dict[str, Any]:
        return {"status": "started"}


@dataclass(frozen=True, slots=True)
class StageCompleted(ScanEvent):
    kind = "stage"
    duration_ms: float
    result: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        return {"status": "completed", "duration_ms": self.duration_ms, **self.result}


@dataclass(frozen=True, slots=True)
class AnswerDelta(ScanEvent):
    kind = "delta"
    text: str

    def fields(self) -> dict[str, Any]:
        return {"text": self.text}


@dataclass(frozen=True, slots=True)
class _ItemEvent(ScanEvent):
    """An item event's fields are its `data`, as the stage built them."""

    data: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        return self.data


@dataclass(frozen=True, slots=True)
class ItemsFound(_ItemEvent):
    """How many items the photo holds (vision, always), which is the main one, how many the
    reply named that were left out."""

    kind = "items"


@dataclass(frozen=True, slots=True)
class ItemClassified(_ItemEvent):
    """One item of a photo of several, classified (vision)."""

    kind = "item"


@dataclass(frozen=True, slots=True)
class ItemRuled(_ItemEvent):
    """One item of a photo of several, its rules found (rule)."""

    kind = "item_rule"


ITEM_EVENTS: dict[str, type[ItemsFound | ItemClassified | ItemRuled]] = {
    cls.kind: cls for cls in (ItemsFound, ItemClassified, ItemRuled)
}


def item_event_key(kind: str, fields: dict[str, Any]) -> tuple[str, int] | None:
    """What makes an item event the same one sent again (a stage run over after a
    takeover): its kind and item; None for any other event."""
    if kind not in ITEM_EVENTS:
        return None
    index = fields.get("index", -1)
    return kind, index if isinstance(index, int) else -1


@dataclass(frozen=True, slots=True)
class TextDiscarded(ScanEvent):
    """The stage's streamed text so far is void: its call failed after its first token and
    starts again on another route; the `delta`s that follow are the new text."""

    kind = "discard"


@dataclass(frozen=True, slots=True)
class ScanDone(ScanEvent):
    kind = "done"
    terminal = True
    result: dict[str, Any]
    timings: dict[str, float]

    def fields(self) -> dict[str, Any]:
        return {**self.result, "timings": self.timings}


@dataclass(frozen=True, slots=True)
class ScanErrored(ScanEvent):
    kind = "error"
    terminal = True
    code: str
    message: str
    retryable: bool
    retry_after: int | None = None  # seconds until a retry may succeed, when known

    def fields(self) -> dict[str, Any]:
        fields = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.retry_after is not None:
            fields["retry_after"] = self.retry_after
        return fields


@dataclass(frozen=True, slots=True)
class RecordedEvent(ScanEvent):
    """An event read back from a stored log: its kind and fields as they were sent."""

    kind: str  # type: ignore[misc]  # an instance field here, a class constant elsewhere
    recorded: dict[str, Any]

    @property
    def terminal(self) -> bool:  # type: ignore[override]
        return self.kind in ("done", "error")

    def fields(self) -> dict[str, Any]:
        return self.recorded


@dataclass(frozen=True, slots=True)
class LogEntry:
    seq: int
    progress: int
    event: ScanEvent


@dataclass
class EventLog:
    """Append-only, in order; readers are woken on every append."""

    entries: list[LogEntry] = field(default_factory=list)
    progress: int = 0
    # Readers waiting for the next append: a future each, made only when one waits (an
    # asyncio.Event per append would cost an allocation and a loop lookup on every event).
    _waiting: list[asyncio.Future[None]] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        return bool(self.entries) and self.entries[-1].event.terminal

    def append(self, event: ScanEvent, progress: int | None = None) -> LogEntry:
        return self.publish(self.next_entry(event, progress))

    def next_entry(self, event: ScanEvent, progress: int | None = None) -> LogEntry:
        """The entry `event` would become, without publishing it: the terminal event is
        stored with the scan's row before any reader sees it."""
        if self.closed:
            raise RuntimeError(f"{event.kind} after the terminal event")
        stamped = self.progress if progress is None else max(self.progress, min(100, progress))
        return LogEntry(len(self.entries) + 1, stamped, event)

    def publish(self, entry: LogEntry) -> LogEntry:
        if entry.seq != len(self.entries) + 1:
            raise RuntimeError(f"entry {entry.seq} out of order")
        self.progress = entry.progress
        self.entries.append(entry)
        waiting, self._waiting = self._waiting, []
        for reader in waiting:
            if not reader.done():  # a reader cancelled while waiting left its future
                reader.set_result(None)
        return entry

    def to_json(self, *extra: LogEntry) -> str:
        """The log (plus `extra` entries not yet published) as stored with the row: each
        event's kind, step and fields exactly as sent, so a replay is identical."""
        entries = (*self.entries, *extra)
        return orjson.dumps(
            [[e.seq, e.progress, e.event.kind, e.event.step, e.event.fields()] for e in entries]
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> EventLog:
        log = cls()
        for seq, progress, kind, step, fields in orjson.loads(text):
            log.publish(LogEntry(seq, progress, RecordedEvent(kind=kind, step=step, recorded=fields)))
        return log

    async def follow(self, after_seq: int = 0) -> AsyncIterator[LogEntry]:
        """Entries after `after_seq`, waiting for new ones, until the terminal one."""
        async for batch in self.follow_batches(after_seq):
            for entry in batch:
                yield entry

    async def follow_batches(self, after_seq: int = 0) -> AsyncIterator[list[LogEntry]]:
        """`follow`, but everything already appended comes at once: a reader that fell
        behind (or replays) writes it in one send instead of one per event."""
        position = after_seq
        while True:
            if self.closed and position >= len(self.entries):
                return  # nothing after the terminal event, ever
            if position < len(self.entries):
                batch = self.entries[position:]
                position += len(batch)
                yield batch
                if batch[-1].event.terminal:
                    return
            appended = asyncio.get_running_loop().create_future()
            self._waiting.append(appended)
            await appended
