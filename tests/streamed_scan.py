"""A scan whose SSE stream is read in the background, for tests that stop the service
(a process, a container) while scans are in flight."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
from httpx_sse import aconnect_sse

from .conftest import SCAN_URL, Event, data_url, make_jpeg


class StreamedScan:
    """`started` is set at its first event. A stream cut without a terminal event
    surfaces as the task's exception (httpx's incomplete body)."""

    def __init__(self, url: str, seed: int, *, user: str, user_input: str | None = None) -> None:
        self.events: list[Event] = []
        self.started = asyncio.Event()
        body = {"image_url": data_url(make_jpeg(seed))}
        if user_input is not None:
            body["user_input"] = user_input
        self.task = asyncio.create_task(self._read(url, body, user))

    async def _read(self, url: str, body: dict[str, str], user: str) -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            aconnect_sse(client, "POST", SCAN_URL, json=body, headers={"X-User-ID": user}) as source,
        ):
            assert source.response.status_code == 200, await source.response.aread()
            async for sse in source.aiter_sse():
                self.events.append(Event(sse.event, sse.id, json.loads(sse.data)))
                self.started.set()

    @property
    def job_id(self) -> uuid.UUID:
        return uuid.UUID(self.events[0].data["job_id"])

    def terminals(self) -> list[Event]:
        return [e for e in self.events if e.event in ("done", "error")]
