"""The SSE event contract. Every event's `data` is JSON with `job_id`, `step`, `seq`
(monotonic from 1, also the SSE `id:`) and `progress` (0-100, never decreasing).

    stage   {"step", "status": "started"|"completed", ...result, "duration_ms"}
    delta   {"step": "answer", "text"}
    done    terminal success: the full result and `timings`
    error   terminal failure: {"step", "code", "message", "retryable"}
"""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

TERMINAL = frozenset({"done", "error"})


class EventBuilder:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.seq = 0
        self.progress = 0

    def make(self, event: str, step: str, progress: int | None = None, **fields: Any) -> ServerSentEvent:
        self.seq += 1
        if progress is not None:
            self.progress = max(self.progress, min(100, progress))
        data = {
            "job_id": self.job_id,
            "step": step,
            "seq": self.seq,
            "progress": self.progress,
            **fields,
        }
        return ServerSentEvent(
            data=json.dumps(data, ensure_ascii=False, separators=(",", ":")),
            event=event,
            id=str(self.seq),
        )
