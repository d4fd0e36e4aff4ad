"""The SSE frames `app/streaming.py` writes by hand are the bytes sse-starlette's own
`ServerSentEvent` would write for the same event with the stdlib's compact JSON: clients,
stored logs and replays keep working across the switch to orjson."""

from __future__ import annotations

import json

import pytest
from sse_starlette import ServerSentEvent

from app.scan_events import AnswerDelta, LogEntry, ScanDone, ScanErrored, StageCompleted, StageStarted
from app.streaming import encode_batch, encode_event

TEXTS = [
    "plain",
    'quotes " and \\ backslash',
    "line\nbreak\r\nand\rreturns",
    "unicode: 페트병은 라벨을 떼고 \u2028 \u2029 \x85 🌱",
    "controls \x00 \x01 \x1f \x7f tab\t",
    "",
]


def stdlib_frame(job_id: str, entry: LogEntry) -> bytes:
    data = {"job_id": job_id, "step": entry.event.step, "seq": entry.seq, "progress": entry.progress}
    data.update(entry.event.fields())
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=text, event=entry.event.kind, id=str(entry.seq)).encode()


@pytest.mark.parametrize("text", TEXTS)
def test_every_event_kind_is_framed_as_sse_starlette_frames_it(text: str) -> None:
    events = [
        StageStarted("vision"),
        StageCompleted("vision", 1234.5, {"classification": {"item": text, "tags": [text]}, "score": 0.1}),
        AnswerDelta("answer", text),
        ScanDone("done", {"answer": {"text": text}, "reward": None}, {"total_ms": 2001.7, "vision_ms": 0.0}),
        ScanErrored("answer", "UPSTREAM_ERROR", text, True),
    ]
    for seq, event in enumerate(events, start=1):
        entry = LogEntry(seq, min(100, seq * 17), event)
        assert encode_event("3f2b", entry) == stdlib_frame("3f2b", entry)


def test_a_batch_is_its_frames_back_to_back() -> None:
    entries = [LogEntry(1, 5, StageStarted("vision")), LogEntry(2, 60, AnswerDelta("answer", "a\nb"))]
    assert encode_batch("j", entries) == b"".join(stdlib_frame("j", e) for e in entries)
