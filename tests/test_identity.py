"""Who is calling (app/intake/identity.py), with real tokens: HS256 with a shared secret; RS256
and ES256 with keys generated here, from a JWK Set file and from a JWK Set served over
loopback HTTP (caching, rotation by unknown `kid`, throttled refetches, outages).
Requests are real `starlette.requests.Request`s built from an ASGI scope."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import (
    EcoscanError,
    GatewaySecretInvalid,
    InvalidRequest,
    ServerBusy,
    TokenExpired,
    TokenInvalid,
    Unauthorized,
)
from app.intake.identity import (
    LEEWAY_S,
    MAX_USER_ID_CHARS,
    Authenticator,
    Caller,
    anonymous_caller,
    named_caller,
)
from app.runtime.serving import serve_in_loop
from app.settings import Settings, SettingsError

SECRET = "an HS256 secret of at least thirty-two bytes, for tests only"
ISSUER = "https://issuer.example"
AUDIENCE = "ecoscan"
CLIENT = ("203.0.113.9", 40123)


# --- helpers -----------------------------------------------------------------------


def request(headers: dict[str, str] | None = None, client: tuple[str, int] | None = CLIENT) -> Request:
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/scan/classify/completion",
        "raw_path": b"/api/v1/scan/classify/completion",
        "query_string": b"",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()],
        "client": client,
        "server": ("127.0.0.1", 8000),
        "scheme": "http",
        "http_version": "1.1",
    }
    return Request(scope)


def bearer(token: str, **headers: str) -> Request:
    return request({"Authorization": f"Bearer {token}", **headers})


def claims(sub: str | None = "user-1", **changes: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {"sub": sub, "iat": now, "exp": now + 300, "iss": ISSUER, "aud": AUDIENCE}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade(header: dict[str, Any], payload: dict[str, Any], sign: Any = None) -> str:
    """A token PyJWT would refuse to make (alg none, a PEM as HMAC secret)."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    signature = b"" if sign is None else sign(signing_input.encode())
    return f"{signing_input}.{b64(signature)}"


@asynccontextmanager
async def authenticator(**settings: Any) -> AsyncIterator[Authenticator]:
    auth = Authenticator(Settings(**settings))
    try:
        yield auth
    finally:
        await auth.aclose()


def hs_settings(**more: Any) -> dict[str, Any]:
    return {"auth_mode": "jwt", "auth_jwt_secret": SECRET, "auth_jwt_issuer": ISSUER, **more}


async def refused(auth: Authenticator, req: Request) -> EcoscanError:
    with pytest.raises(EcoscanError) as raised:
        await auth.caller(req)
    return raised.value


@dataclass
class Keys:
    rsa1: rsa.RSAPrivateKey
    rsa2: rsa.RSAPrivateKey
    ec1: ec.EllipticCurvePrivateKey

    def jwk(self, name: str) -> dict[str, Any]:
        key = getattr(self, name)
        if isinstance(key, rsa.RSAPrivateKey):
            jwk = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
            return {**jwk, "kid": name, "alg": "RS256", "use": "sig"}
        jwk = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
        return {**jwk, "kid": name, "alg": "ES256", "use": "sig"}

    def jwks(self, *names: str) -> dict[str, Any]:
        return {"keys": [self.jwk(name) for name in names]}

    def token(self, name: str, payload: dict[str, Any] | None = None, *, kid: str | None = "") -> str:
        alg = "ES256" if name.startswith("ec") else "RS256"
        headers = {} if kid is None else {"kid": kid or name}
        return jwt.encode(payload or claims(), getattr(self, name), algorithm=alg, headers=headers)

    def public_pem(self, name: str) -> bytes:
        key: rsa.RSAPrivateKey = getattr(self, name)
        return key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(
        rsa1=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        rsa2=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec1=ec.generate_private_key(ec.SECP256R1()),
    )


def jwks_file(tmp_path: Path, document: Any) -> str:
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return str(path)


# --- gateway mode ------------------------------------------------------------------


async def test_gateway_takes_x_user_id_as_said() -> None:
    async with authenticator() as auth:
        assert auth.mode == "gateway" and auth.allow_anonymous
        assert await auth.caller(request({"X-User-ID": "  alice  "})) == named_caller("alice")
        # A gateway may pass Authorization through: it is not ours to read.
        assert await auth.caller(request({"X-User-ID": "bob", "Authorization": "Bearer x"})) == named_caller(
            "bob"
        )


@pytest.mark.parametrize("value", [None, "", "   "])
async def test_gateway_without_user_is_anonymous_keyed_by_address(value: str | None) -> None:
    headers = {} if value is None else {"X-User-ID": value}
    async with authenticator() as auth:
        caller = await auth.caller(request(headers))
        assert caller == Caller(None, "a:203.0.113.9", "a:203.0.113.9") and caller.anonymous
        assert await auth.caller(request(headers, client=None)) == Caller(None, "a:-", "a:-")


@pytest.mark.parametrize("value", ["x" * (MAX_USER_ID_CHARS + 1), "tab\there", "bell\x07"])
async def test_gateway_refuses_unprintable_or_long_user_ids(value: str) -> None:
    async with authenticator() as auth:
        error = await refused(auth, request({"X-User-ID": value}))
    assert isinstance(error, InvalidRequest)
    assert (error.status, error.code) == (422, "INVALID_REQUEST")
    async with authenticator() as auth:
        assert (await auth.caller(request({"X-User-ID": "é" * MAX_USER_ID_CHARS}))).user_id


async def test_gateway_without_anonymous_requires_a_user() -> None:
    async with authenticator(auth_allow_anonymous=False) as auth:
        error = await refused(auth, request())
        assert await auth.caller(request({"X-User-ID": "carol"})) == named_caller("carol")
    assert isinstance(error, Unauthorized) and not isinstance(error, TokenInvalid)
    assert (error.status, error.code) == (401, "UNAUTHENTICATED")
    assert error.headers() == {"WWW-Authenticate": "Bearer"}


GATEWAY_SECRET = "a-gateway-secret-for-tests-0123"


async def test_a_user_id_is_never_an_anonymous_callers_key() -> None:
    """A user may call itself `anon:<address>` (or `a:<address>`): its keys stay a user's."""
    async with authenticator() as auth:
        anonymous = await auth.caller(request())
        for name in ("anon:203.0.113.9", "a:203.0.113.9", "203.0.113.9"):
            named = await auth.caller(request({"X-User-ID": name}))
            assert (named.rate_key, named.scope) == (f"u:{name}", f"u:{name}")
            assert named.rate_key != anonymous.rate_key and named.scope != anonymous.scope


@pytest.mark.parametrize(
    ("host", "rate_key", "scope"),
    [
        ("2001:db8:1:2:aaaa::1", "a:2001:db8:1:2::/64", "a:2001:db8:1:2:aaaa::1"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "a:2001:db8:1:2::/64", "a:2001:db8:1:2:ffff:ffff:ffff:ffff"),
        ("2001:db8:1:3::1", "a:2001:db8:1:3::/64", "a:2001:db8:1:3::1"),
        ("::ffff:198.51.100.7", "a:198.51.100.7", "a:198.51.100.7"),
        ("198.51.100.7", "a:198.51.100.7", "a:198.51.100.7"),
        ("testclient", "a:testclient", "a:testclient"),
    ],
)
def test_anonymous_ipv6_callers_share_a_rate_key_per_64(host: str, rate_key: str, scope: str) -> None:
    caller = anonymous_caller(host)
    assert (caller.rate_key, caller.scope, caller.user_id) == (rate_key, scope, None)


async def test_gateway_secret_is_required_with_a_user_id() -> None:
    async with authenticator(auth_gateway_secret=GATEWAY_SECRET) as auth:
        proven = {"X-User-ID": "alice", "X-Gateway-Secret": GATEWAY_SECRET}
        assert await auth.caller(request(proven)) == named_caller("alice")
        for headers in (
            {"X-User-ID": "alice"},
            {"X-User-ID": "alice", "X-Gateway-Secret": GATEWAY_SECRET[:-1]},
            {"X-User-ID": "alice", "X-Gateway-Secret": GATEWAY_SECRET + "x"},
            {"X-User-ID": "alice", "X-Gateway-Secret": ""},
            {"X-User-ID": "", "X-Gateway-Secret": "wrong"},
            {"X-Gateway-Secret": "wrong"},
            # An unproven header is refused for what it is, not checked for its form first.
            {"X-User-ID": "tab\there"},
        ):
            error = await refused(auth, request(headers))
            assert isinstance(error, GatewaySecretInvalid), headers
            assert (error.status, error.code) == (401, "GATEWAY_SECRET_INVALID")
            assert "WWW-Authenticate" in error.headers()
        # Without a user id (the gateway's anonymous callers, with or without its secret).
        assert await auth.caller(request()) == anonymous_caller(CLIENT[0])
        only_secret = request({"X-Gateway-Secret": GATEWAY_SECRET})
        assert await auth.caller(only_secret) == anonymous_caller(CLIENT[0])


async def test_gateway_without_a_secret_warns_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="app.intake.identity"):
        async with authenticator() as auth:
            await auth.caller(request({"X-User-ID": "alice"}))
            await auth.caller(request({"X-User-ID": "bob"}))
    warnings = [r.getMessage() for r in caplog.records if "AUTH_GATEWAY_SECRET" in r.getMessage()]
    assert len(warnings) == 1 and "believed as sent" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="app.intake.identity"):
        async with authenticator(auth_gateway_secret=GATEWAY_SECRET):
            pass
        async with authenticator(**hs_settings()):
            pass
    assert not [r for r in caplog.records if "AUTH_GATEWAY_SECRET" in r.getMessage()]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AUTH_GATEWAY_SECRET": "short"}, "AUTH_GATEWAY_SECRET must be at least 16"),
        ({"AUTH_GATEWAY_SECRET": "sixteen chars with spaces"}, "AUTH_GATEWAY_SECRET must be visible ASCII"),
        ({"AUTH_GATEWAY_SECRET": "ünïcödé-sëcrét-lóng"}, "AUTH_GATEWAY_SECRET must be visible ASCII"),
        (
            {"AUTH_MODE": "jwt", "AUTH_JWT_SECRET": SECRET, "AUTH_GATEWAY_SECRET": GATEWAY_SECRET},
            "AUTH_GATEWAY_SECRET only applies with AUTH_MODE=gateway",
        ),
    ],
)
def test_gateway_secret_settings_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_gateway_secret_is_read_from_a_file_and_never_shown(tmp_path: Path) -> None:
    (tmp_path / "gateway").write_text(GATEWAY_SECRET + "\n")
    s = Settings.from_env({"AUTH_GATEWAY_SECRET_FILE": str(tmp_path / "gateway")})
    assert s.auth_gateway_secret == GATEWAY_SECRET
    assert GATEWAY_SECRET not in repr(s)
    with pytest.raises(SettingsError, match="AUTH_GATEWAY_SECRET or AUTH_GATEWAY_SECRET_FILE"):
        Settings.from_env(
            {"AUTH_GATEWAY_SECRET": GATEWAY_SECRET, "AUTH_GATEWAY_SECRET_FILE": str(tmp_path / "gateway")}
        )


# --- HS256 -----------------------------------------------------------------------------


async def test_hs256_token_names_the_caller_and_x_user_id_is_ignored() -> None:
    token = jwt.encode(claims("dave"), SECRET, algorithm="HS256")
    async with authenticator(**hs_settings()) as auth:
        assert not auth.allow_anonymous
        caller = await auth.caller(bearer(token, **{"X-User-ID": "mallory"}))
        assert caller == named_caller("dave")
        # The scheme is case-insensitive.
        assert await auth.caller(request({"Authorization": f"bearer  {token}"})) == caller


async def test_audience_is_checked_when_set() -> None:
    async with authenticator(**hs_settings(auth_jwt_audience=AUDIENCE)) as auth:
        good = jwt.encode(claims(), SECRET, algorithm="HS256")
        assert (await auth.caller(bearer(good))).user_id == "user-1"
        for aud in ("someone-else", None):
            token = jwt.encode(claims(aud=aud), SECRET, algorithm="HS256")
            assert isinstance(await refused(auth, bearer(token)), TokenInvalid), aud


def hs(payload: dict[str, Any], secret: str = SECRET) -> str:
    return jwt.encode(payload, secret, algorithm="HS256")


NOW = int(time.time())


@pytest.mark.parametrize(
    ("token", "error"),
    [
        pytest.param(hs(claims(exp=NOW - LEEWAY_S - 60)), TokenExpired, id="expired"),
        pytest.param(hs(claims(nbf=NOW + LEEWAY_S + 3600, exp=NOW + 7200)), TokenInvalid, id="not-yet-valid"),
        pytest.param(hs(claims(iss="https://other.example")), TokenInvalid, id="wrong-issuer"),
        pytest.param(hs(claims(iss=None)), TokenInvalid, id="no-issuer"),
        pytest.param(hs(claims(exp=None)), TokenInvalid, id="no-exp"),
        pytest.param(hs(claims(sub=None)), TokenInvalid, id="no-sub"),
        pytest.param(hs(claims(sub="x" * (MAX_USER_ID_CHARS + 1))), TokenInvalid, id="long-sub"),
        pytest.param(hs(claims(sub="line\nbreak")), TokenInvalid, id="unprintable-sub"),
        pytest.param(hs(claims(), SECRET[::-1]), TokenInvalid, id="bad-signature"),
        pytest.param(hs(claims())[:-4] + "AAAA", TokenInvalid, id="tampered-signature"),
        pytest.param(handmade({"alg": "none", "typ": "JWT"}, claims()), TokenInvalid, id="alg-none"),
        pytest.param(
            handmade(
                {"alg": "HS512", "typ": "JWT"},
                claims(),
                lambda data: hmac.new(SECRET.encode(), data, hashlib.sha512).digest(),
            ),
            TokenInvalid,
            id="hs512-not-allowed",
        ),
        pytest.param("not-a-jwt", TokenInvalid, id="garbage"),
        pytest.param("a.b.c", TokenInvalid, id="garbage-segments"),
        pytest.param("x" * 10_000, TokenInvalid, id="oversized"),
    ],
)
async def test_bad_hs256_tokens_are_refused(token: str, error: type[EcoscanError]) -> None:
    async with authenticator(**hs_settings()) as auth:
        refusal = await refused(auth, bearer(token))
    assert type(refusal) is error
    assert refusal.status == 401
    assert refusal.code == ("TOKEN_EXPIRED" if error is TokenExpired else "TOKEN_INVALID")
    assert refusal.headers()["WWW-Authenticate"].startswith('Bearer error="invalid_token"')


async def test_clock_skew_within_the_leeway_is_tolerated() -> None:
    now = int(time.time())
    async with authenticator(**hs_settings()) as auth:
        late = hs(claims(exp=now - LEEWAY_S + 10))
        early = hs(claims(nbf=now + LEEWAY_S - 10, iat=now + LEEWAY_S - 10))
        assert (await auth.caller(bearer(late))).user_id == "user-1"
        assert (await auth.caller(bearer(early))).user_id == "user-1"


async def test_rs256_token_against_a_shared_secret_is_refused(keys: Keys) -> None:
    async with authenticator(**hs_settings()) as auth:
        assert isinstance(await refused(auth, bearer(keys.token("rsa1"))), TokenInvalid)


# --- no token, or not a bearer token -----------------------------------------------------


async def test_jwt_mode_without_token_is_401_unless_anonymous_allowed() -> None:
    async with authenticator(**hs_settings()) as auth:
        error = await refused(auth, request({"X-User-ID": "alice"}))
    assert type(error) is Unauthorized
    assert (error.status, error.code, error.headers()) == (
        401,
        "UNAUTHENTICATED",
        {"WWW-Authenticate": "Bearer"},
    )

    async with authenticator(**hs_settings(auth_allow_anonymous=True)) as auth:
        assert await auth.caller(request({"X-User-ID": "alice"})) == anonymous_caller("203.0.113.9")
        # A bad token is never a silent downgrade to anonymous.
        assert isinstance(await refused(auth, bearer("not-a-jwt")), TokenInvalid)
        assert isinstance(await refused(auth, request({"Authorization": "Bearer "})), TokenInvalid)


@pytest.mark.parametrize("value", ["Basic dXNlcjpwYXNz", "", "Token abc"])
async def test_other_authorization_schemes_are_refused(value: str) -> None:
    async with authenticator(**hs_settings(auth_allow_anonymous=True)) as auth:
        error = await refused(auth, request({"Authorization": value}))
    assert type(error) is Unauthorized and error.status == 401


# --- RS256 / ES256 from a JWK Set file ----------------------------------------------------


async def test_rs256_and_es256_from_a_jwks_file(keys: Keys, tmp_path: Path) -> None:
    path = jwks_file(tmp_path, keys.jwks("rsa1", "ec1"))
    async with authenticator(auth_mode="jwt", auth_jwks_file=path, auth_jwt_audience=AUDIENCE) as auth:
        assert await auth.caller(bearer(keys.token("rsa1", claims("erin")))) == named_caller("erin")
        assert (await auth.caller(bearer(keys.token("ec1", claims("frank"))))).user_id == "frank"
        # Without a kid, the keys of the token's algorithm are tried.
        assert (await auth.caller(bearer(keys.token("rsa1", kid=None)))).user_id == "user-1"

        refusals = {
            "unknown key": keys.token("rsa2"),
            "kid of another key": keys.token("rsa2", kid="rsa1"),
            "expired": keys.token("rsa1", claims(exp=int(time.time()) - 3600)),
            "wrong audience": keys.token("rsa1", claims(aud="other")),
            "alg none": handmade({"alg": "none", "kid": "rsa1"}, claims()),
            # The classic confusion: HS256 "signed" with the RSA public key as the secret.
            "hs256 with the public key": handmade(
                {"alg": "HS256", "kid": "rsa1", "typ": "JWT"},
                claims(),
                lambda data: hmac.new(keys.public_pem("rsa1"), data, hashlib.sha256).digest(),
            ),
            "hs256 with the public jwk": handmade(
                {"alg": "HS256", "kid": "rsa1", "typ": "JWT"},
                claims(),
                lambda data: hmac.new(json.dumps(keys.jwk("rsa1")).encode(), data, hashlib.sha256).digest(),
            ),
            "rs256 header on the ec key": handmade(
                {"alg": "RS256", "kid": "ec1"}, claims(), lambda _: b"\0" * 64
            ),
        }
        for name, token in refusals.items():
            error = await refused(auth, bearer(token))
            assert isinstance(error, TokenInvalid), name


async def test_unusable_keys_in_a_jwks_are_skipped_and_none_usable_stops_startup(
    keys: Keys, tmp_path: Path
) -> None:
    oct_key = {"kty": "oct", "k": b64(SECRET.encode()), "kid": "shared", "alg": "HS256"}
    private = {**RSAAlgorithm.to_jwk(keys.rsa2, as_dict=True), "kid": "rsa2"}
    encryption = {**keys.jwk("rsa2"), "use": "enc"}
    small = {
        **RSAAlgorithm.to_jwk(rsa.generate_private_key(65537, 1024).public_key(), as_dict=True),
        "kid": "s",
    }
    mixed = {"keys": [oct_key, private, encryption, small, keys.jwk("ec1")]}
    async with authenticator(auth_mode="jwt", auth_jwks_file=jwks_file(tmp_path, mixed)) as auth:
        assert (await auth.caller(bearer(keys.token("ec1")))).user_id == "user-1"
        hs_token = jwt.encode(claims(), SECRET, algorithm="HS256", headers={"kid": "shared"})
        assert isinstance(await refused(auth, bearer(hs_token)), TokenInvalid)
        assert isinstance(await refused(auth, bearer(keys.token("rsa2"))), TokenInvalid)

    unusable: list[Any] = [{"keys": [oct_key, private, small]}, {"nope": []}, ["not", "a", "set"]]
    for document in unusable:
        with pytest.raises(SettingsError, match="AUTH_JWKS_FILE"):
            Authenticator(Settings(auth_mode="jwt", auth_jwks_file=jwks_file(tmp_path, document)))
    with pytest.raises(SettingsError, match="AUTH_JWKS_FILE"):
        Authenticator(Settings(auth_mode="jwt", auth_jwks_file=str(tmp_path / "missing.json")))


# --- RS256 / ES256 from a JWK Set URL -----------------------------------------------------


@dataclass
class JwksServer:
    document: dict[str, Any]
    status: int = 200
    delay_s: float = 0.0
    hits: int = 0
    url: str = ""
    served: list[float] = field(default_factory=list)

    async def endpoint(self, _request: Request) -> Response:
        self.hits += 1
        self.served.append(time.monotonic())
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return JSONResponse(self.document, status_code=self.status)


@asynccontextmanager
async def jwks_server(document: dict[str, Any]) -> AsyncIterator[JwksServer]:
    server = JwksServer(document)
    app = Starlette(routes=[Route("/.well-known/jwks.json", server.endpoint)])
    async with serve_in_loop(app) as base_url:
        server.url = f"{base_url}/.well-known/jwks.json"
        yield server


def url_settings(server: JwksServer, **more: Any) -> dict[str, Any]:
    return {
        "auth_mode": "jwt",
        "auth_jwks_url": server.url,
        "auth_jwks_refetch_s": 0.3,
        "auth_jwks_timeout_s": 0.5,
        **more,
    }


async def test_jwks_url_is_fetched_once_for_concurrent_callers_and_cached(keys: Keys) -> None:
    async with jwks_server(keys.jwks("rsa1", "ec1")) as server, authenticator(**url_settings(server)) as auth:
        tokens = [keys.token("rsa1", claims(f"u{i}")) for i in range(20)] + [keys.token("ec1")]
        callers = await asyncio.gather(*(auth.caller(bearer(t)) for t in tokens))
        assert [c.user_id for c in callers] == [f"u{i}" for i in range(20)] + ["user-1"]
        await asyncio.sleep(0.4)
        assert (await auth.caller(bearer(keys.token("rsa1")))).user_id == "user-1"
        assert server.hits == 1


async def test_key_rotation_refetches_on_an_unknown_kid_at_most_once_per_interval(keys: Keys) -> None:
    async with jwks_server(keys.jwks("rsa1")) as server, authenticator(**url_settings(server)) as auth:
        await auth.prefetch()
        assert server.hits == 1
        server.document = keys.jwks("rsa1", "rsa2")  # the issuer rotates in a new key

        # Within the interval of the last fetch, an unknown kid fetches nothing.
        assert isinstance(await refused(auth, bearer(keys.token("rsa2"))), TokenInvalid)
        assert server.hits == 1

        await asyncio.sleep(0.35)
        assert (await auth.caller(bearer(keys.token("rsa2", claims("gina"))))).user_id == "gina"
        assert (await auth.caller(bearer(keys.token("rsa1")))).user_id == "user-1"
        assert server.hits == 2

        # Made-up kids, all at once: one fetch at most, and they stay refused.
        await asyncio.sleep(0.35)
        forged = [keys.token("rsa2", kid=f"made-up-{i}") for i in range(10)]
        errors = await asyncio.gather(*(refused(auth, bearer(t)) for t in forged))
        assert all(isinstance(e, TokenInvalid) for e in errors)
        assert server.hits == 3
        errors = await asyncio.gather(*(refused(auth, bearer(t)) for t in forged))
        assert server.hits == 3


async def test_expired_cache_serves_while_refreshing_and_survives_an_outage(keys: Keys) -> None:
    async with (
        jwks_server(keys.jwks("rsa1")) as server,
        authenticator(**url_settings(server, auth_jwks_ttl_s=0.2, auth_jwks_refetch_s=0.2)) as auth,
    ):
        await auth.prefetch()
        await asyncio.sleep(0.25)
        server.status, server.document = 500, {"error": "down"}
        # Expired: still served from the cache while a refresh runs, which fails.
        assert (await auth.caller(bearer(keys.token("rsa1")))).user_id == "user-1"
        assert await wait_for_hits(server, 2)
        await asyncio.sleep(0.05)
        assert (await auth.caller(bearer(keys.token("rsa1")))).user_id == "user-1"

        # Back again with a new key set: the next refresh replaces the cache.
        server.status, server.document = 200, keys.jwks("rsa2")
        await asyncio.sleep(0.25)
        assert (await auth.caller(bearer(keys.token("rsa1")))).user_id == "user-1"  # starts the refresh
        assert await wait_for_hits(server, 3)
        await asyncio.sleep(0.05)
        assert (await auth.caller(bearer(keys.token("rsa2")))).user_id == "user-1"
        assert isinstance(await refused(auth, bearer(keys.token("rsa1"))), TokenInvalid)


async def wait_for_hits(server: JwksServer, hits: int) -> bool:
    for _ in range(200):
        if server.hits >= hits:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_no_keys_yet_is_503_with_retry_after_and_fetches_are_bounded(keys: Keys) -> None:
    async with jwks_server(keys.jwks("rsa1")) as server:
        server.delay_s = 1.0  # hangs past AUTH_JWKS_TIMEOUT_S
        async with authenticator(**url_settings(server, auth_jwks_refetch_s=5.0)) as auth:
            started = time.monotonic()
            errors = await asyncio.gather(*(refused(auth, bearer(keys.token("rsa1"))) for _ in range(5)))
            assert time.monotonic() - started < 1.5
            assert all(type(e) is ServerBusy and e.status == 503 for e in errors)
            assert all(isinstance(e, ServerBusy) and 4 <= e.retry_after_s <= 5 for e in errors)
            # Within the refetch interval: refused at once, no new fetch.
            assert type(await refused(auth, bearer(keys.token("rsa1")))) is ServerBusy
            assert server.hits == 1


async def test_an_unreachable_or_bad_jwks_url_is_503_not_401(keys: Keys, tmp_path: Path) -> None:
    async with jwks_server({"keys": "nonsense"}) as server, authenticator(**url_settings(server)) as auth:
        assert type(await refused(auth, bearer(keys.token("rsa1")))) is ServerBusy
    async with authenticator(auth_mode="jwt", auth_jwks_url="http://127.0.0.1:9/jwks.json") as auth:
        assert type(await refused(auth, bearer(keys.token("rsa1")))) is ServerBusy
        # A token refused on its own merits does not need the keys.
        assert type(await refused(auth, bearer(handmade({"alg": "none"}, claims())))) is TokenInvalid


# --- settings and secrecy ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AUTH_MODE": "oauth"}, "AUTH_MODE"),
        ({"AUTH_MODE": "jwt"}, "AUTH_JWT_SECRET, AUTH_JWKS_FILE, AUTH_JWKS_URL"),
        ({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET": SECRET, "AUTH_JWKS_URL": "https://x/j"}, "exactly one"),
        ({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET": "short"}, "AUTH_JWT_SECRET"),
        ({"AUTH_MODE": "jwt", "AUTH_JWKS_URL": "http://idp.example/jwks"}, "AUTH_JWKS_URL"),
        ({"AUTH_MODE": "jwt", "AUTH_JWKS_URL": "file:///etc/jwks"}, "AUTH_JWKS_URL"),
        ({"AUTH_JWT_SECRET": SECRET}, "AUTH_MODE=jwt"),
        ({"AUTH_JWT_AUDIENCE": "ecoscan"}, "AUTH_JWT_AUDIENCE"),
        ({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET": SECRET, "AUTH_JWKS_TTL_S": "0"}, "AUTH_JWKS_TTL_S"),
        ({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET": SECRET, "AUTH_JWKS_TIMEOUT_S": "-1"}, "AUTH_JWKS_TIMEOUT_S"),
    ],
)
def test_identity_settings_nonsense_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_identity_settings_from_the_environment() -> None:
    s = Settings.from_env(
        {"AUTH_MODE": "jwt", "AUTH_JWKS_URL": "https://idp.example/jwks", "AUTH_ALLOW_ANONYMOUS": "false"}
    )
    assert (s.auth_mode, s.auth_allow_anonymous, s.auth_jwks_url) == (
        "jwt",
        False,
        "https://idp.example/jwks",
    )
    assert Settings.from_env({}).auth_allow_anonymous is None
    assert Settings.from_env({"AUTH_ALLOW_ANONYMOUS": "yes"}).auth_allow_anonymous is True
    assert SECRET not in repr(Settings(auth_mode="jwt", auth_jwt_secret=SECRET))


async def test_tokens_and_secrets_are_never_logged(keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="app")  # a service started earlier may have set it higher
    tokens = [
        hs(claims(exp=int(time.time()) - 3600)),
        hs(claims(), SECRET[::-1]),
        hs(claims(aud="x")),
        keys.token("rsa1"),
        handmade({"alg": "none"}, claims()),
    ]
    async with authenticator(**hs_settings(auth_jwt_audience=AUDIENCE)) as auth:
        for token in tokens:
            await refused(auth, bearer(token))
    assert caplog.records, "the refusals are logged (at debug)"
    for token in tokens:
        signature = token.split(".")[2]
        assert token not in caplog.text and (not signature or signature not in caplog.text)
    assert SECRET not in caplog.text
