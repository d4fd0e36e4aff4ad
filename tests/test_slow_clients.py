"""Slow and lying uploads: they cost time and memory, never admission slots. Bodies
have a deadline that moves with progress (408 `BODY_READ_TIMEOUT`), and the bytes
buffered at once are capped (503 `UPLOADS_AT_CAPACITY`) — all over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from app.sim.server import RunningSimulator

from .conftest import (
    SCAN_URL,
    Service,
    data_url,
    eventually,
    make_jpeg,
    run_scan,
    running_service,
    settings_for,
)


class SlowUpload:
    """A raw connection that sends a scan request's headers and then its body slowly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def trickle(self, data: bytes, *, every_s: float, for_s: float) -> None:
        """`data` every `every_s` for `for_s`. Stopping before the server's deadline
        matters: bytes still unread when it closes would turn its FIN into a reset that
        can discard the response before the test reads it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + for_s
        while loop.time() < until:
            await self.send(data)
            await asyncio.sleep(every_s)

    async def response(self, timeout_s: float = 30) -> tuple[int, dict[str, str], dict[str, Any]]:
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            body = await self.reader.readexactly(int(headers["content-length"]))
        return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)

    async def response_head(self, timeout_s: float = 30) -> tuple[int, dict[str, str], bytes]:
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
        return int(lines[0].split()[1]), headers, head

    async def closed_by_server(self, timeout_s: float = 10) -> bool:
        async with asyncio.timeout(timeout_s):
            return await self.reader.read() == b""


@asynccontextmanager
async def slow_upload(svc: Service, declared: int, *, user: str | None = None) -> AsyncIterator[SlowUpload]:
    host, port = svc.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    user_header = f"X-User-ID: {user}\r\n" if user else ""
    writer.write(
        f"POST {SCAN_URL} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"{user_header}Content-Length: {declared}\r\n\r\n".encode()
    )
    await writer.drain()
    try:
        yield SlowUpload(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_a_trickling_upload_gets_408_and_its_connection_closed(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, body_read_timeout_s=0.5, body_min_bytes_per_s=1_000_000)
    async with running_service(settings) as svc, slow_upload(svc, 100_000) as upload:
        # 10 bytes every 50 ms for 0.25 s: far below the minimum rate, done before the deadline.
        await upload.trickle(b"{" * 10, every_s=0.05, for_s=0.25)
        status, headers, body = await upload.response()
        assert (status, body["code"]) == (408, "BODY_READ_TIMEOUT")
        assert headers["connection"] == "close"
        assert await upload.closed_by_server()
        assert svc.metric("ecoscan_request_body_bytes_buffered") == 0


async def test_a_body_shorter_than_its_content_length_is_cut_off_by_the_deadline(
    database_url: str, sim: RunningSimulator
) -> None:
    settings = settings_for(database_url, sim, body_read_timeout_s=0.5)
    async with running_service(settings) as svc, slow_upload(svc, 5000) as upload:
        await upload.send(b'{"image_url": "data:image/jpeg;base64,AAAA')
        status, _, body = await upload.response()
        assert (status, body["code"]) == (408, "BODY_READ_TIMEOUT")
        assert await upload.closed_by_server()


async def test_fifty_slow_anonymous_uploads_do_not_lock_anyone_out(
    database_url: str, sim: RunningSimulator
) -> None:
    """Admission comes after the body: uploads still arriving hold no slot, so the four
    per-address slots of 127.0.0.1 stay free for a complete request."""
    settings = settings_for(database_url, sim, body_read_timeout_s=60)
    async with running_service(settings) as svc, contextlib.AsyncExitStack() as stack:
        uploads = [await stack.enter_async_context(slow_upload(svc, 10_000)) for _ in range(50)]
        for upload in uploads:
            await upload.send(b'{"image_url": "data:')
        for seed in range(3):
            outcome = await run_scan(svc.client, json={"image_url": data_url(make_jpeg(seed))})
            assert outcome.status == 200, outcome.body
            assert outcome.terminal.event == "done"
        assert svc.metric("ecoscan_admission_slots_in_use") == 0


async def test_the_buffered_bytes_cap_refuses_with_503_and_counts_bytes_not_connections(
    database_url: str, sim: RunningSimulator
) -> None:
    image_max = 600_000
    cap = image_max * 4 // 3 + 64 * 1024  # the smallest cap allowed: one largest body
    settings = settings_for(
        database_url, sim, image_max_bytes=image_max, body_buffer_max_bytes=cap, body_read_timeout_s=60
    )
    photo = make_jpeg(5)
    async with running_service(settings) as svc:
        async with contextlib.AsyncExitStack() as stack:
            await _fill_the_cap(svc, stack, cap, photo)
        # Connections gone, their bytes are given back.
        assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") == 0)


async def _fill_the_cap(svc: Service, stack: contextlib.AsyncExitStack, cap: int, photo: bytes) -> None:
    # Sixty slow connections holding 600 bytes each take 36 KB: a photo still fits.
    for _ in range(60):
        upload = await stack.enter_async_context(slow_upload(svc, 700_000))
        await upload.send(b" " * 600)
    assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") == 36_000)
    outcome = await run_scan(svc.client, json={"image_url": data_url(photo)})
    assert outcome.terminal.event == "done"

    # One upload holding most of the cap leaves no room for the next photo.
    hog = await stack.enter_async_context(slow_upload(svc, cap))
    await hog.send(b" " * (cap - 36_000 - 10_000))
    assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") > cap - 20_000)
    refused = await svc.client.post(SCAN_URL, json={"image_url": data_url(photo)})
    assert refused.status_code == 503 and refused.json()["code"] == "UPLOADS_AT_CAPACITY"
    assert int(refused.headers["Retry-After"]) >= 1


async def test_a_slow_upload_above_the_minimum_rate_outlasts_the_base_timeout(
    database_url: str, sim: RunningSimulator
) -> None:
    """The deadline moves with progress: 5 KB/s against a 2 KB/s minimum gets through
    although the whole body takes several times BODY_READ_TIMEOUT_S."""
    settings = settings_for(database_url, sim, body_read_timeout_s=0.3, body_min_bytes_per_s=2000)
    body = json.dumps({"image_url": data_url(make_jpeg(9, (160, 120)))}).encode()
    assert len(body) > 3000  # > 0.6 s at 5 KB/s: twice the base timeout
    async with running_service(settings) as svc, slow_upload(svc, len(body)) as upload:
        for start in range(0, len(body), 100):
            await upload.send(body[start : start + 100])
            await asyncio.sleep(0.02)
        status, headers, _ = await upload.response_head()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")


def _smallest_caps(image_max: int) -> int:
    return image_max * 4 // 3 + 64 * 1024  # the smallest cap allowed: one largest body


async def test_a_stalled_large_body_gives_its_bytes_back_within_the_gap_timeout(
    database_url: str, sim: RunningSimulator
) -> None:
    """Issue 34: a client sends most of a big body fast, then nothing. Its deadline, fixed
    when reading began, is minutes away and bytes received do not stretch it; the gap
    timeout cuts it off, and the room it held takes another client's photo."""
    image_max = 600_000
    cap = _smallest_caps(image_max)
    settings = settings_for(
        database_url,
        sim,
        image_max_bytes=image_max,
        body_buffer_max_bytes=cap,
        body_read_timeout_s=600,
        body_gap_timeout_s=1.0,
    )
    photo = {"image_url": data_url(make_jpeg(5))}
    assert len(photo["image_url"]) > 5_000
    other = {"X-User-ID": "other"}
    async with running_service(settings) as svc, slow_upload(svc, cap - 1000, user="hog") as hog:
        start = b'{"image_url": "data:image/jpeg;base64,'
        await hog.send(start + b"A" * (cap - 5_000 - len(start)))
        assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") == cap - 5_000)
        held = await svc.client.post(SCAN_URL, json=photo, headers=other)
        assert (held.status_code, held.json()["code"]) == (503, "UPLOADS_AT_CAPACITY")

        # Far inside the 600 s deadline: only the gap can have ended it.
        status, headers, body = await hog.response(timeout_s=60)
        assert (status, body["code"]) == (408, "BODY_READ_TIMEOUT")
        assert "BODY_GAP_TIMEOUT_S" in body["detail"] and headers["connection"] == "close"
        assert await hog.closed_by_server()
        assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") == 0)
        outcome = await run_scan(svc.client, json=photo, headers=other)
        assert outcome.terminal.event == "done"


async def test_a_fast_start_then_a_trickle_is_cut_at_the_pace_of_what_is_missing(
    database_url: str, sim: RunningSimulator
) -> None:
    """Issue 34: most of a big body fast, then a byte now and then, each inside the gap
    timeout. The deadline fixed at the start (50 s here) is not what ends it: after the fast
    part, what is missing at the minimum rate is due within about 2 s."""
    settings = settings_for(
        database_url, sim, body_read_timeout_s=1.0, body_min_bytes_per_s=1000, body_gap_timeout_s=10
    )
    async with running_service(settings) as svc, slow_upload(svc, 50_000) as upload:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await upload.send(b" " * 49_000)
        await upload.trickle(b" ", every_s=0.25, for_s=1.0)
        status, _, body = await upload.response(timeout_s=40)
        assert (status, body["code"]) == (408, "BODY_READ_TIMEOUT")
        assert "BODY_GAP_TIMEOUT_S" not in body["detail"]
        assert loop.time() - started < 30  # the deadline fixed at the start was 51 s away
        assert await eventually(lambda: svc.metric("ecoscan_request_body_bytes_buffered") == 0)


async def test_one_client_cannot_hold_more_than_its_upload_cap(
    database_url: str, sim: RunningSimulator
) -> None:
    """`BODY_BUFFER_MAX_BYTES_PER_CLIENT`: a client holding its share gets 429
    `CLIENT_UPLOADS_AT_CAPACITY` for one more upload, while the room left in the service's
    buffer still takes other clients' photos."""
    image_max = 600_000
    per_client = _smallest_caps(image_max)
    settings = settings_for(
        database_url,
        sim,
        image_max_bytes=image_max,
        body_buffer_max_bytes=4 * per_client,
        body_buffer_max_bytes_per_client=per_client,
        body_read_timeout_s=600,
    )
    photo = {"image_url": data_url(make_jpeg(6))}
    assert len(photo["image_url"]) > 5_000
    async with running_service(settings) as svc, contextlib.AsyncExitStack() as stack:
        for share in (per_client // 2, per_client // 2 - 5_000):  # two connections, one client
            upload = await stack.enter_async_context(slow_upload(svc, per_client, user="hog"))
            await upload.send(b" " * share)
        assert await eventually(
            lambda: svc.metric("ecoscan_request_body_bytes_buffered") == per_client - 5_000
        )
        refused = await svc.client.post(SCAN_URL, json=photo, headers={"X-User-ID": "hog"})
        assert (refused.status_code, refused.json()["code"]) == (429, "CLIENT_UPLOADS_AT_CAPACITY")
        assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["connection"] == "close"
        for user in ("other", "third"):
            outcome = await run_scan(svc.client, json=photo, headers={"X-User-ID": user})
            assert outcome.terminal.event == "done", outcome.body
        # The refused body gave back what it took; the hog's two still hold theirs.
        assert await eventually(
            lambda: svc.metric("ecoscan_request_body_bytes_buffered") == per_client - 5_000
        )
