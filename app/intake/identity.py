"""Who is calling: one `Caller` per request, from the `Authenticator` built from Settings.

`AUTH_MODE=gateway` (the default): a gateway in front authenticates and sets `X-User-ID`;
the header is taken as said, once checked to be printable and at most
`MAX_USER_ID_CHARS` long (else 422 `INVALID_REQUEST`). With `AUTH_GATEWAY_SECRET` set, the
gateway proves itself: a request that carries `X-User-ID` (or `X-Gateway-Secret`) without
that secret in `X-Gateway-Secret` is 401 `GATEWAY_SECRET_INVALID`, so a client that reaches
the service past the gateway cannot name itself. Unset, the header is believed from anyone
(dev, `make run`): the service says so once at start.

`AUTH_MODE=jwt`: `Authorization: Bearer <token>`, verified here with PyJWT; `X-User-ID` is
ignored and the token's `sub` is the user id. Exactly one key source:

- `AUTH_JWT_SECRET`: HS256 (and only HS256) with that shared secret;
- `AUTH_JWKS_FILE`: RS256 / ES256 public keys from a JWK Set file, read once at start;
- `AUTH_JWKS_URL`: the same, fetched with httpx and cached for `AUTH_JWKS_TTL_S`. A token
  whose `kid` is not in the cache triggers a refetch (key rotation), but no fetch of any
  kind starts within `AUTH_JWKS_REFETCH_S` of the previous one, and each is bounded by
  `AUTH_JWKS_TIMEOUT_S`. An expired cache is still used while it is refreshed in the
  background, and kept when the refresh fails.

The key source fixes the accepted algorithms, so "none", HS256 with a public key as its
secret (the classic confusion) or RS256 against a shared secret never verify. `exp` and
`sub` are required; `exp`, `nbf` and `iat` are checked with `LEEWAY_S` of clock skew;
`iss` and `aud` are checked when `AUTH_JWT_ISSUER` / `AUTH_JWT_AUDIENCE` are set.

No identity (no token, no `X-User-ID`) is an anonymous caller when anonymous callers are
allowed (`AUTH_ALLOW_ANONYMOUS`, default: yes with a gateway, no with JWTs), else 401
`UNAUTHENTICATED`. A token that is given but bad is always 401 `TOKEN_INVALID` /
`TOKEN_EXPIRED`, never a silent downgrade to anonymous. Tokens, secrets and keys are never
logged.

Keys by kind: a named user's keys are `u:<id>`, an anonymous caller's `a:<address>`, so no
user id (`anon:127.0.0.1`, `a:...`) can share an anonymous caller's per-user caps or
replay its idempotent scans. An anonymous IPv6 caller's rate key is its /64 (one host
holds a whole /64 to rotate through); its idempotency scope stays the exact address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from starlette.requests import HTTPConnection

from app.errors import (
    GatewaySecretInvalid,
    InvalidRequest,
    ServerBusy,
    TokenExpired,
    TokenInvalid,
    Unauthorized,
)
from app.settings import Settings, SettingsError, display_url

log = logging.getLogger(__name__)

MAX_USER_ID_CHARS = 128
GATEWAY_SECRET_HEADER = "X-Gateway-Secret"
# Anonymous IPv6 callers share their rate key with their /64: the smallest block a site
# is given, which one client can rotate through at will.
ANONYMOUS_IPV6_PREFIX = 64
# Clock skew tolerated between the token issuer and us, on `exp`, `nbf` and `iat`.
LEEWAY_S = 30.0
# The algorithms each key source accepts: the source, not the token, decides.
SECRET_ALGORITHMS = ("HS256",)
JWKS_ALGORITHMS = ("RS256", "ES256")
REQUIRED_CLAIMS = ("exp", "sub")
MIN_RSA_BITS = 2048
# Bounds on what a client or a key server can make us parse.
MAX_TOKEN_CHARS = 8192
MAX_JWKS_BYTES = 1024 * 1024


def allow_anonymous(settings: Settings) -> bool:
    """`AUTH_ALLOW_ANONYMOUS`, or its mode's default when unset."""
    if settings.auth_allow_anonymous is not None:
        return settings.auth_allow_anonymous
    return settings.auth_mode == "gateway"


# --- the caller ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Caller:
    """`user_id` is None for an anonymous caller. `rate_key` keys the per-user caps, rate
    and quota; `scope` keys idempotency: `u:<id>` both for a user, `a:<address>` for an
    anonymous caller (its rate key `a:<prefix>/64` over IPv6)."""

    user_id: str | None
    rate_key: str
    scope: str

    @property
    def anonymous(self) -> bool:
        return self.user_id is None


def named_caller(user_id: str) -> Caller:
    return Caller(user_id, f"u:{user_id}", f"u:{user_id}")


def anonymous_caller(host: str | None) -> Caller:
    """An anonymous caller at `host` (None: unknown, e.g. a test client without one)."""
    if host is None:
        return Caller(None, "a:-", "a:-")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # not an IP (a Unix socket's peer): the host as given
        return Caller(None, f"a:{host}", f"a:{host}")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    rate_key = f"a:{address}"
    if isinstance(address, ipaddress.IPv6Address):
        block = ipaddress.IPv6Network((address.packed, ANONYMOUS_IPV6_PREFIX), strict=False)
        rate_key = f"a:{block}"
    return Caller(None, rate_key, f"a:{address}")


def _usable_user_id(value: str) -> bool:
    return 0 < len(value) <= MAX_USER_ID_CHARS and value.isprintable()


def gateway_user_id(request: HTTPConnection) -> str | None:
    """`X-User-ID` as the gateway set it; None when absent or blank."""
    value = request.headers.get("x-user-id")
    if value is None or not value.strip():
        return None
    value = value.strip()
    if not _usable_user_id(value):
        raise InvalidRequest(f"X-User-ID must be printable and at most {MAX_USER_ID_CHARS} characters.")
    return value


def bearer_token(request: HTTPConnection) -> str | None:
    """The bearer token, None without an `Authorization` header. Any other scheme, or a
    malformed header, is refused rather than taken for "no credentials"."""
    value = request.headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthorized("Only Bearer tokens are accepted in the Authorization header.")
    token = token.strip()
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise TokenInvalid()
    return token


class Authenticator:
    """Built once from Settings; `caller()` per request. `aclose()` at shutdown (it owns
    the HTTP client of `AUTH_JWKS_URL`)."""

    def __init__(self, settings: Settings) -> None:
        self.mode = settings.auth_mode
        self.allow_anonymous = allow_anonymous(settings)
        self._verifier: _TokenVerifier | None = None
        secret = settings.auth_gateway_secret
        self._gateway_secret = secret.encode("ascii") if secret else None
        if self.mode == "gateway" and self._gateway_secret is None:
            log.warning(
                "AUTH_MODE=gateway without AUTH_GATEWAY_SECRET: X-User-ID is believed as sent by "
                "anyone who reaches this service; set the secret or keep clients off it (docs/deploy.md)"
            )
        if self.mode == "jwt":
            keys = _key_source(settings)
            self._verifier = _TokenVerifier(
                keys, issuer=settings.auth_jwt_issuer, audience=settings.auth_jwt_audience
            )
            if settings.auth_jwt_audience is None and settings.auth_jwt_secret is None:
                log.warning(
                    "AUTH_JWT_AUDIENCE is unset: tokens for any audience of the keys' issuer are accepted"
                )

    async def caller(self, request: HTTPConnection) -> Caller:
        user_id = await self._user_id(request)
        if user_id is not None:
            return named_caller(user_id)
        if not self.allow_anonymous:
            if self._verifier is None:
                raise Unauthorized("Authentication is required (no X-User-ID).")
            raise Unauthorized("Authentication is required: send Authorization: Bearer <token>.")
        return anonymous_caller(request.client.host if request.client else None)

    async def _user_id(self, request: HTTPConnection) -> str | None:
        if self._verifier is None:
            self._check_gateway(request)
            return gateway_user_id(request)
        token = bearer_token(request)
        if token is None:
            return None
        return await self._verifier.subject(token)

    def _check_gateway(self, request: HTTPConnection) -> None:
        """With AUTH_GATEWAY_SECRET: a request carrying X-User-ID (or a gateway secret)
        must carry the right secret; one with neither is an anonymous caller."""
        if self._gateway_secret is None:
            return
        sent = request.headers.get(GATEWAY_SECRET_HEADER)
        if sent is None and "x-user-id" not in request.headers:
            return
        # Header values arrive as latin-1 text: back to their bytes, compared in constant time.
        if sent is None or not hmac.compare_digest(sent.encode("latin-1"), self._gateway_secret):
            raise GatewaySecretInvalid()

    async def prefetch(self) -> None:
        """Fetch `AUTH_JWKS_URL`'s keys now (at start-up) rather than on the first token;
        a failure is logged, not raised: the first token retries."""
        if self._verifier is not None:
            await self._verifier.keys.prefetch()

    async def aclose(self) -> None:
        if self._verifier is not None:
            await self._verifier.keys.aclose()


# --- verifying a token -----------------------------------------------------------------


class _TokenVerifier:
    def __init__(self, keys: _KeySource, *, issuer: str | None, audience: str | None) -> None:
        self.keys = keys
        self._issuer = issuer
        self._audience = audience

    async def subject(self, token: str) -> str:
        alg, kid = self._header(token)
        candidates = await self.keys.candidates(kid, alg)
        if not candidates:
            log.debug("bearer token refused: no %s key with kid %r", alg, kid)
            raise TokenInvalid()
        for key in candidates:
            try:
                claims = jwt.decode(
                    token,
                    key,
                    algorithms=[alg],
                    issuer=self._issuer,
                    audience=self._audience,
                    leeway=LEEWAY_S,
                    options={
                        "require": list(REQUIRED_CLAIMS),
                        "verify_aud": self._audience is not None,
                        "enforce_minimum_key_length": True,
                    },
                )
            except jwt.InvalidSignatureError:
                continue  # a token without `kid`: another key of its algorithm may have signed it
            except jwt.ExpiredSignatureError:
                raise TokenExpired() from None
            except (jwt.PyJWTError, ValueError, TypeError) as exc:
                log.debug("bearer token refused: %s", type(exc).__name__)
                raise TokenInvalid() from None
            return _subject(claims)
        log.debug("bearer token refused: bad signature")
        raise TokenInvalid()

    def _header(self, token: str) -> tuple[str, str | None]:
        """The token's algorithm (one its key source accepts) and `kid`, unverified."""
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise TokenInvalid() from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in self.keys.algorithms:
            log.debug("bearer token refused: algorithm not allowed")
            raise TokenInvalid()
        if kid is not None and not isinstance(kid, str):
            raise TokenInvalid()
        return alg, kid


def _subject(claims: dict[str, Any]) -> str:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not _usable_user_id(sub):
        raise TokenInvalid(
            f"The access token's sub must be printable and at most {MAX_USER_ID_CHARS} characters."
        )
    return sub


# --- key sources -----------------------------------------------------------------------


class _KeySource(Protocol):
    algorithms: tuple[str, ...]

    async def candidates(self, kid: str | None, alg: str) -> Sequence[jwt.PyJWK | str]: ...

    async def prefetch(self) -> None: ...

    async def aclose(self) -> None: ...


def _key_source(settings: Settings) -> _KeySource:
    if settings.auth_jwt_secret:
        return _SecretKey(settings.auth_jwt_secret)
    if settings.auth_jwks_file:
        return _StaticKeys(_read_jwks_file(settings.auth_jwks_file))
    assert settings.auth_jwks_url  # check_settings: exactly one source
    return _RemoteKeys(
        settings.auth_jwks_url,
        ttl_s=settings.auth_jwks_ttl_s,
        refetch_s=settings.auth_jwks_refetch_s,
        timeout_s=settings.auth_jwks_timeout_s,
    )


class _SecretKey:
    algorithms: tuple[str, ...] = SECRET_ALGORITHMS

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def candidates(self, kid: str | None, alg: str) -> Sequence[jwt.PyJWK | str]:
        return [self._secret]

    async def prefetch(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


@dataclass(frozen=True)
class KeySet:
    """The usable signing keys of a JWK Set."""

    keys: tuple[jwt.PyJWK, ...]

    def matching(self, kid: str | None, alg: str) -> list[jwt.PyJWK]:
        """Keys for a token: its algorithm, and its `kid` if it has one."""
        return [k for k in self.keys if k.algorithm_name == alg and (kid is None or k.key_id == kid)]


def parse_jwks(raw: bytes | str) -> KeySet:
    """The RS256 / ES256 public signing keys of a JWK Set; ValueError when there are none.
    Other keys are skipped: symmetric (`oct`) ones, private ones, encryption keys, other
    algorithms and RSA keys under `MIN_RSA_BITS`."""
    document = json.loads(raw)
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError('not a JWK Set (no "keys" list)')
    keys = [key for key in map(_signing_key, entries) if key is not None]
    if not keys:
        raise ValueError(
            f"none of its {len(entries)} keys is a usable {'/'.join(JWKS_ALGORITHMS)} public key"
        )
    if len(keys) < len(entries):
        log.info(
            "JWK Set: %d of %d keys skipped (not RS256/ES256 public signing keys)",
            len(entries) - len(keys),
            len(entries),
        )
    return KeySet(tuple(keys))


def _signing_key(entry: Any) -> jwt.PyJWK | None:
    if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
        return None
    if entry.get("kty") not in ("RSA", "EC") or "d" in entry:
        return None  # never a shared secret, never private key material
    alg, kid = entry.get("alg"), entry.get("kid")
    if (alg is not None and alg not in JWKS_ALGORITHMS) or (kid is not None and not isinstance(kid, str)):
        return None
    try:
        key = jwt.PyJWK(entry)
    except (jwt.PyJWTError, ValueError, TypeError):
        return None
    if key.algorithm_name not in JWKS_ALGORITHMS:
        return None
    if isinstance(key.key, RSAPublicKey) and key.key.key_size < MIN_RSA_BITS:
        return None
    return key


def _read_jwks_file(path: str) -> KeySet:
    try:
        return parse_jwks(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"AUTH_JWKS_FILE {path!r}: {exc}") from None


class _StaticKeys:
    algorithms: tuple[str, ...] = JWKS_ALGORITHMS

    def __init__(self, keys: KeySet) -> None:
        self._keys = keys

    async def candidates(self, kid: str | None, alg: str) -> Sequence[jwt.PyJWK | str]:
        return self._keys.matching(kid, alg)

    async def prefetch(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class _RemoteKeys:
    """`AUTH_JWKS_URL`'s keys. One fetch at a time, shared by every request waiting for
    it (shielded: a request that goes away does not cancel it), none within `refetch_s`
    of the previous attempt, each bounded by `timeout_s` in all (connect to last byte)."""

    algorithms: tuple[str, ...] = JWKS_ALGORITHMS

    def __init__(self, url: str, *, ttl_s: float, refetch_s: float, timeout_s: float) -> None:
        self._url = url
        self._shown = display_url(url)
        self._ttl_s = ttl_s
        self._refetch_s = refetch_s
        self._timeout_s = timeout_s
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            headers={"Accept": "application/json"},
        )
        self._keys: KeySet | None = None
        self._fetched_at = -math.inf
        self._attempted_at = -math.inf
        self._fetch: asyncio.Task[None] | None = None
        self.fetches = 0  # attempts, for tests and metrics

    async def candidates(self, kid: str | None, alg: str) -> Sequence[jwt.PyJWK | str]:
        if self._keys is None:
            await self._refresh()
            if self._keys is None:
                wait_s = self._attempted_at + self._refetch_s - time.monotonic()
                raise ServerBusy(
                    "The keys to verify access tokens are unavailable; retry later.",
                    retry_after_s=max(1.0, wait_s),
                )
        elif time.monotonic() - self._fetched_at >= self._ttl_s:
            self._start_fetch()  # meanwhile the expired keys still serve
        found = self._keys.matching(kid, alg)
        if not found and kid is not None:
            await self._refresh()  # an unknown kid: the keys may have rotated
            found = self._keys.matching(kid, alg)
        return found

    async def prefetch(self) -> None:
        await self._refresh()

    async def _refresh(self) -> None:
        fetch = self._start_fetch()
        if fetch is not None:
            await asyncio.shield(fetch)

    def _start_fetch(self) -> asyncio.Task[None] | None:
        """The fetch in progress, or a new one; None if the last began under `refetch_s` ago."""
        if self._fetch is not None and not self._fetch.done():
            return self._fetch
        now = time.monotonic()
        if now - self._attempted_at < self._refetch_s:
            return None
        self._attempted_at = now
        self.fetches += 1
        self._fetch = asyncio.create_task(self._fetch_keys(), name="jwks-fetch")
        return self._fetch

    async def _fetch_keys(self) -> None:
        """Never raises (but for cancellation): a failure keeps the keys we have."""
        try:
            async with asyncio.timeout(self._timeout_s):
                raw = await self._download()
            keys = parse_jwks(raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            kept = "keeping the keys fetched before" if self._keys else "no keys yet"
            log.warning("JWKS fetch from %s failed (%s); %s", self._shown, reason, kept)
            return
        self._keys = keys
        self._fetched_at = time.monotonic()
        log.info("JWKS: %d keys from %s", len(keys.keys), self._shown)

    async def _download(self) -> bytes:
        async with self._client.stream("GET", self._url) as response:
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_JWKS_BYTES:
                    raise ValueError(f"larger than {MAX_JWKS_BYTES} bytes")
            return bytes(body)

    async def aclose(self) -> None:
        if self._fetch is not None and not self._fetch.done():
            self._fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fetch
        await self._client.aclose()
