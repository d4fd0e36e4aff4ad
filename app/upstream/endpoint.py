"""POST /chat/completions over HTTP: the connection pool, URL, headers and timeouts
(`ChatEndpoint`), and how a streamed reply's body is read — its stall timeout
(`StallWatch`) and the reader's pauses (`until_eof`)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

import aiohttp
import httpx
import openai
import yarl


@dataclass(frozen=True)
class ChatEndpoint:
    """POST /chat/completions as the SDK's client would send it: its base URL, its headers
    (API key, User-Agent, X-Stainless-* platform headers) and its timeouts, taken from the
    client once at start-up, sent over aiohttp, the HTTP client under the SDK's own aiohttp
    option, without the SDK's and httpx's per-request layers in between. Per call only the
    body is new: those layers (options model, header merges, httpx's request and response
    models over the aiohttp transport, its exception mapping) cost ~0.8 ms of CPU per scan
    over this (k6/cpu_per_scan.py; README, cost per scan). Replies are read here as OpenAI
    documents them (status, headers, JSON `error` object), not through the SDK's classes."""

    session: aiohttp.ClientSession
    url: str
    # HTTP(S)_PROXY / NO_PROXY (credentials in the URL included), read once: aiohttp's own
    # trust_env would read the environment and ~/.netrc again on every request.
    proxy: yarl.URL | None
    proxy_auth: aiohttp.BasicAuth | None
    read_timeout_s: float | None  # the longest wait for a byte of the reply

    @classmethod
    def open(cls, client: openai.AsyncOpenAI, *, max_connections: int, keepalive_s: float) -> ChatEndpoint:
        """The endpoint and its connection pool (an aiohttp session: `aclose` it)."""
        sdk = {**client.default_headers, **client.auth_headers, "X-Stainless-Retry-Count": "0"}
        timeout = (
            client.timeout if isinstance(client.timeout, httpx.Timeout) else httpx.Timeout(client.timeout)
        )
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=keepalive_s),
            headers={k: v for k, v in sdk.items() if isinstance(v, str)},  # not the SDK's Omit
            # What the SDK's aiohttp transport makes of the client's httpx timeout: `read`
            # bounds every wait for bytes (past a streamed reply's head, through
            # `watch_stream`), `pool` the wait for a connection, `connect` the connect
            # itself. aiohttp has no write timeout.
            timeout=aiohttp.ClientTimeout(
                sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool
            ),
        )
        url = str(client.base_url.join("chat/completions"))
        try:
            proxy, proxy_auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(url))
        except LookupError:
            proxy, proxy_auth = None, None
        return cls(session, url, proxy, proxy_auth, timeout.read)

    async def post(self, body: bytes) -> aiohttp.ClientResponse:
        """The response as soon as its head is in (redirects followed, as the SDK's client
        does); the caller reads and releases it."""
        return await self.session.post(self.url, data=body, proxy=self.proxy, proxy_auth=self.proxy_auth)

    def watch_stream(self, response: aiohttp.ClientResponse) -> StallWatch | None:
        """From here on, a streamed body's read timeout is a `StallWatch`, not aiohttp's
        timer (None: no read timeout, or the body has already ended)."""
        connection = response.connection
        protocol = connection.protocol if connection is not None else None
        if self.read_timeout_s is None or protocol is None:
            return None
        # aiohttp re-arms its read timer on every chunk it receives (~140 in a streamed
        # answer: ~0.3 ms of CPU a scan); the setting lasts until the connection's next
        # request, which sets its own.
        protocol.read_timeout = None
        return StallWatch(response.content, self.read_timeout_s)

    async def aclose(self) -> None:
        await self.session.close()


class StallWatch:
    """A streamed body that sends no byte for `read_timeout_s` fails with aiohttp's own
    read-timeout error, as under aiohttp's timer; only this looks at the byte count
    every quarter of that time instead of re-arming a timer on every chunk. So a stall
    is noticed after 1 to 1.25 times the timeout. (aiohttp's timer also paused while
    aiohttp stopped reading for flow control, past 128 KiB unread; the reader here never
    leaves more than one delta interval's tokens unread.)"""

    CHECKS = 4  # per timeout

    def __init__(self, content: aiohttp.StreamReader, read_timeout_s: float) -> None:
        self._content = content
        self._every_s = read_timeout_s / self.CHECKS
        self._seen = content.total_bytes
        self._idle_checks = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self._every_s, self._check)

    def _check(self) -> None:
        total = self._content.total_bytes
        if total != self._seen:
            self._seen, self._idle_checks = total, 0
        else:
            self._idle_checks += 1
        if self._idle_checks < self.CHECKS:
            self._handle = self._loop.call_later(self._every_s, self._check)
        elif not self._content.is_eof():
            self._content.set_exception(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))

    def stop(self) -> None:
        self._handle.cancel()


async def until_eof(content: aiohttp.StreamReader, seconds: float) -> None:
    """A pause of the reader: tokens pile up unread meanwhile, unless the stream ends. A
    timer and the stream's end race to wake it (no cancellation, no exception: a timeout
    scope that expires costs several times a timer)."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    timer = loop.call_later(seconds, _wake, woken)
    content.on_eof(functools.partial(_wake, woken))  # at once if it has ended
    try:
        await woken
    finally:
        timer.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
