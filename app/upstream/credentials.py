"""How a deployment proves who calls: a `Credential` its provider makes
(`Provider.credential`, app/upstream/providers/).

A key never changes while the process runs: `StaticHeaders` go into the connection pool's
headers once and cost a request nothing. A token that expires (Microsoft Entra ID,
Google's OAuth access tokens: about an hour) is a `RefreshingToken`: every request asks
it for its headers; it answers from memory while the token has time left, starts one
refresh in the background ahead of the expiry (the requests meanwhile go on with the
token they have), and only when a token is too close to its end do requests wait for the
new one, each at most `max_wait_s`. One refresh at a time, whoever asks. A refresh that
fails while the token still has time is tried again a little later; one that leaves
requests without a usable token raises `CredentialUnavailable`, which takes the
deployment out as a refused key does (app/upstream/client.py, probes.py) until its
probe gets a token again.

A provider that signs each request instead (a signature over the URL and body) is a
`Credential` whose `headers` computes it: `per_request` says the pool cannot hold it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# A refresh starts this long before the token's end (at half its life, for a shorter one).
REFRESH_AHEAD_S = 300.0
# A token with less than this left is not sent (a quarter of its life, for a short one):
# the request and the provider's clock must both still find it valid.
MIN_LEFT_S = 30.0
# The longest a request waits for a token, and one refresh may take.
TOKEN_WAIT_S = 10.0
# After a refresh ahead of time failed, or gave back the same token: the next try.
RETRY_S = 5.0


# Where a token goes (Entra ID and Google alike: `Bearer <token>`).
TOKEN_HEADER = "Authorization"


class CredentialUnavailable(Exception):
    """No usable credential: the token service refused, failed or did not answer in time."""


@dataclass(frozen=True)
class Token:
    """An access token as its service states it; times on the wall clock (epoch seconds)."""

    value: str = field(repr=False)  # a bearer secret: never in a log line or a traceback
    expires_at: float
    refresh_at: float | None = None  # when the service advises a refresh, if it does


Fetch = Callable[[], Awaitable[Token]]


class Credential:
    """What every request to one deployment carries. The base: nothing."""

    # Whether `headers` must be asked for each request (a token, a signature).
    per_request = False

    def session_headers(self) -> Mapping[str, str]:
        """Headers fixed into the deployment's connection pool."""
        return {}

    async def headers(self, url: str, body: bytes) -> Mapping[str, str]:
        """This request's headers (only asked when `per_request`)."""
        return {}

    def refused(self, sent: Mapping[str, str]) -> None:
        """The provider answered 401 to a request that carried `sent` (its headers): forget
        what it carried, the next use fetches anew."""

    async def aclose(self) -> None:
        """Release what it holds (a token service's client)."""


class StaticHeaders(Credential):
    """A key: the same headers for every request, in the pool's headers."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._headers = dict(headers)

    def session_headers(self) -> Mapping[str, str]:
        return self._headers


class RefreshingToken(Credential):
    """A token from `fetch`, sent as `Authorization: Bearer <token>`, refreshed ahead of its
    end, one refresh at a time (see the module's doc)."""

    per_request = True

    def __init__(
        self,
        name: str,
        fetch: Fetch,
        *,
        refresh_ahead_s: float = REFRESH_AHEAD_S,
        min_left_s: float = MIN_LEFT_S,
        max_wait_s: float = TOKEN_WAIT_S,
        retry_s: float = RETRY_S,
        close: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self._fetch = fetch
        self._ahead_s = refresh_ahead_s
        self._min_left_s = min_left_s
        self.max_wait_s = max_wait_s
        self._retry_s = retry_s
        self._close = close
        self._clock = clock
        self._token: Token | None = None
        self._headers: Mapping[str, str] = {}
        # Before `_refresh_from` the token is simply sent; until `_usable_until` it is sent
        # while one refresh runs; past it, requests wait for the next token.
        self._refresh_from = 0.0
        self._usable_until = 0.0
        self._refresh: asyncio.Task[None] | None = None
        self.refreshes = 0  # tokens fetched (the tests count them)

    async def headers(self, url: str, body: bytes) -> Mapping[str, str]:
        now = self._clock()
        if now < self._refresh_from:
            return self._headers
        refresh = self._start_refresh()
        if now < self._usable_until:
            return self._headers
        try:
            async with asyncio.timeout(self.max_wait_s):
                await asyncio.shield(refresh)  # one waiter leaving does not end it for the others
        except TimeoutError:
            raise CredentialUnavailable(f"{self.name}: no token within {self.max_wait_s:.0f} s") from None
        if self._clock() >= self._usable_until:  # it failed, or gave a token as old
            raise CredentialUnavailable(f"{self.name}: the token service gave no usable token")
        return self._headers

    def refused(self, sent: Mapping[str, str]) -> None:
        # A 401 to a token already replaced (requests that carried it were still on their
        # way) says nothing of the one held: forgetting it would ask the library again,
        # whose cache hands it back, taken as no new token, and the deployment went out.
        if sent.get(TOKEN_HEADER) != self._headers.get(TOKEN_HEADER):
            return
        self._refresh_from = self._usable_until = 0.0

    async def aclose(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
        if self._close is not None:
            await self._close()

    def _start_refresh(self) -> asyncio.Task[None]:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._refreshed(), name=f"token-{self.name}")
        return self._refresh

    async def _refreshed(self) -> None:
        """Fetch a token and take it if it is newer; never raises (the waiters look at
        `_usable_until`), but logs why it failed."""
        before = self._token
        try:
            async with asyncio.timeout(self.max_wait_s):
                token = await self._fetch()
        except Exception as exc:  # the library's own errors, a timeout, a refused connection
            now = self._clock()
            left = self._usable_until - now
            level = logging.WARNING if left > 0 else logging.ERROR
            log.log(level, "upstream %s: token refresh failed (%s: %s)", self.name, type(exc).__name__, exc)
            self._refresh_from = now + min(self._retry_s, max(0.0, left) / 2)
            return
        now = self._clock()
        if before is not None and token.value == before.value:
            # The service (or its library's cache) gave the same token: asked again later.
            self._refresh_from = now + min(self._retry_s, max(0.0, self._usable_until - now) / 2)
            return
        self._take(token, now)

    def _take(self, token: Token, now: float) -> None:
        life = max(0.0, token.expires_at - now)
        self._token = token
        self._headers = {TOKEN_HEADER: "Bearer " + token.value}
        self._usable_until = token.expires_at - min(self._min_left_s, life / 4)
        due = token.expires_at - min(self._ahead_s, life / 2)
        if token.refresh_at is not None:
            due = min(due, token.refresh_at)
        self._refresh_from = min(max(now, due), self._usable_until)
        self.refreshes += 1
        log.info("upstream %s: new token, %.0f s to its end", self.name, life)
