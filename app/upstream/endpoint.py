"""POST /chat/completions over HTTP: the connection pool, URL, headers and timeouts
(`ChatEndpoint`), and how a streamed reply's body is read — its stall timeout
(`StallWatch`) and the reader's pauses (`until_eof`)."""

from __future__ import annotations

import asyncio
import functools
import urllib.request
from dataclasses import dataclass

import aiohttp
import yarl

from app.upstream.credentials import Credential

# Who calls: an OpenAI-compatible server sees this, not the SDK's platform headers.
USER_AGENT = "ecoscan"


@dataclass(frozen=True)
class ChatEndpoint:
    """POST to one deployment's chat completions URL over one aiohttp session, the request
    built here from settings: the URL and auth header of its provider, a JSON body, the
    timeouts. Not
    through the SDK's client: its per-request layers (options model, header merges,
    httpx's request and response models, exception mapping) cost a large share of a
    scan's CPU for nothing we use (k6/cpu_side_by_side.py measures it), and retries are
    ours anyway.
    Replies are read as OpenAI documents them (status, headers, JSON `error` object; see
    app/upstream/wire.py), not through the SDK's classes."""

    session: aiohttp.ClientSession
    url: str
    # HTTP(S)_PROXY / NO_PROXY (credentials in the URL included), read once: aiohttp's own
    # trust_env would read the environment and ~/.netrc again on every request.
    proxy: yarl.URL | None
    proxy_auth: aiohttp.BasicAuth | None
    # The longest pause of a streamed body, and the least wait for a reply's head.
    read_timeout_s: float | None
    # A credential asked on every request (a token, a signature); None: a key, in the
    # session's headers.
    credential: Credential | None = None

    @classmethod
    def open(
        cls,
        url: str,
        credential: Credential,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        keepalive_s: float,
    ) -> ChatEndpoint:
        """The endpoint at `url` and its connection pool (an aiohttp session: `aclose` it);
        `credential`: the provider's auth (app/upstream/providers/, credentials.py)."""
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=keepalive_s),
            headers={
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
                **credential.session_headers(),
            },
            # `connect` bounds the wait for a pooled connection and the connect, `sock_connect`
            # the connect itself. The waits for the reply are ours: for its head (and a whole
            # reply) as long as the deployment's replies take (`Upstream._reply`), then a
            # streamed body's pauses (`watch_stream`). aiohttp has no write timeout.
            timeout=aiohttp.ClientTimeout(
                sock_connect=connect_timeout_s, sock_read=None, connect=connect_timeout_s
            ),
        )
        per_request = credential if credential.per_request else None
        return cls(session, url, *env_proxy(url), read_timeout_s, per_request)

    async def post(self, body: bytes) -> aiohttp.ClientResponse:
        """The response as soon as its head is in (redirects followed); the caller reads and
        releases it. `CredentialUnavailable` when the credential has no token to send."""
        if self.credential is None:
            return await self.session.post(self.url, data=body, proxy=self.proxy, proxy_auth=self.proxy_auth)
        headers = await self.credential.headers(self.url, body)
        return await self.session.post(
            self.url, data=body, headers=headers, proxy=self.proxy, proxy_auth=self.proxy_auth
        )

    def watch_stream(self, response: aiohttp.ClientResponse) -> StallWatch | None:
        """A streamed body's read timeout: a `StallWatch` rather than aiohttp's timer, which
        it re-arms on every chunk, and a streamed answer is many chunks (None: no read
        timeout, or the body has already ended)."""
        if self.read_timeout_s is None or response.connection is None:
            return None
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
    timer and the stream's end race to wake it: no cancellation and no exception, which
    a timeout scope that expires would cost on every pause."""
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


def env_proxy(url: str) -> tuple[yarl.URL | None, aiohttp.BasicAuth | None]:
    """The proxy HTTP(S)_PROXY names for `url` unless NO_PROXY exempts its host, as urllib
    reads them; credentials in the proxy's URL become its auth."""
    target = yarl.URL(url)
    proxy = urllib.request.getproxies().get(target.scheme)
    if not proxy or urllib.request.proxy_bypass(target.host or ""):
        return None, None
    proxy_url = yarl.URL(proxy)
    return proxy_url.with_user(None), aiohttp.BasicAuth.from_url(proxy_url)
