"""The SSE frames `app/streaming/responses.py` writes by hand are the bytes sse-starlette's own
`ServerSentEvent` would write for the same event with the stdlib's compact JSON: clients,
stored logs and replays keep working across the switch to orjson. And every kind of
stream it makes counts as open while it is."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import pytest
from sse_starlette import ServerSentEvent

from app.runtime.metrics import Metrics
from app.scans.events import (
    AnswerDelta,
    EventLog,
    LogEntry,
    ScanDone,
    ScanErrored,
    StageCompleted,
    StageStarted,
)
from app.streaming.responses import encode_batch, encode_event, followed_response, replayed_response

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


async def test_a_replayed_or_followed_stream_counts_as_open_while_it_is() -> None:
    """`ecoscan_sse_streams_open` is every open event stream, not only those of a scan
    running here: a replay of a finished one, or one followed from another replica, too."""
    metrics = Metrics(process=False)

    def open_streams() -> float | None:
        return metrics.registry.get_sample_value("ecoscan_sse_streams_open")

    log = EventLog()
    log.append(StageStarted("vision"), 2)
    log.append(ScanErrored("vision", "UPSTREAM_ERROR", "boom", True))
    replay = replayed_response("job", log, metrics, after=0, ping_s=0).body_iterator
    assert open_streams() == 0
    assert b"event: error" in await anext(replay)
    assert open_streams() == 1
    with pytest.raises(StopAsyncIteration):
        await anext(replay)
    assert open_streams() == 0

    async def mirrored() -> AsyncGenerator[LogEntry, None]:
        for entry in log.entries:
            yield entry

    followed = followed_response("job", mirrored(), metrics, ping_s=0).body_iterator
    await anext(followed)
    assert open_streams() == 1
    await followed.aclose()  # type: ignore[attr-defined]  # the client went away
    assert open_streams() == 0
