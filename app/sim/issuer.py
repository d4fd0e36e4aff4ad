"""A token service for simulators in `auth: token` mode: it issues short-lived access
tokens the way two real ones do, and a simulator sharing its secret accepts only those,
and only until they expire (app/sim/flavors.py), as Azure with Microsoft Entra ID and
Vertex AI do.

- Azure's managed identity endpoint as App Service serves it (`IDENTITY_ENDPOINT`,
  `IDENTITY_HEADER`; api-version 2019-08-01): `GET /msi/token?resource=...` with the
  `X-IDENTITY-HEADER` secret, answering `access_token`, `expires_on` (epoch seconds),
  `resource`, `token_type`, and `refresh_in`: when to ask again (half the life), which
  azure-identity's token cache honours.
- Google's OAuth 2.0 token endpoint for a service account (the `token_uri` of its key
  file): `POST /token`, `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` and
  the signed `assertion`, answering `access_token`, `expires_in`, `token_type`.

A token is `sim.<expiry in ms>.<HMAC of both>`: a simulator checks it with the secret
alone. Each reply states an end no later than the real one. `fail_status` makes every
token request fail (400: refused, 500: broken), as a token service can.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.sim.listener import Listener, serve

PREFIX = "sim"
AZURE_PATH = "/msi/token"
GOOGLE_PATH = "/token"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
# What a service account's assertion names as its audience, wherever it is sent.
GOOGLE_AUDIENCE = "https://oauth2.googleapis.com/token"


def mint(secret: str, expires_at: float) -> str:
    ends = str(int(expires_at * 1000))
    return f"{PREFIX}.{ends}.{_signature(secret, ends)}"


def token_left(token: str, secret: str, now: float | None = None) -> float | None:
    """Seconds `token` has left (<= 0: expired); None when it is not one this secret signed."""
    prefix, _, rest = token.partition(".")
    ends, _, signature = rest.partition(".")
    if prefix != PREFIX or not ends.isdigit():
        return None
    if not hmac.compare_digest(signature, _signature(secret, ends)):
        return None
    return int(ends) / 1000 - (time.time() if now is None else now)


def _signature(secret: str, ends: str) -> str:
    return hmac.new(secret.encode(), ends.encode(), hashlib.sha256).hexdigest()[:32]


class TokenIssuer:
    def __init__(self, secret: str, ttl_s: float, identity_header: str = "sim-identity-header") -> None:
        self.secret = secret
        self.ttl_s = ttl_s
        self.identity_header = identity_header
        self.fail_status = 0  # 0: tokens are issued; 400 or 500: every request fails so
        self.issued = 0
        self.refused = 0
        self.app = Starlette(
            routes=[
                Route(AZURE_PATH, self._azure, methods=["GET"]),
                Route(GOOGLE_PATH, self._google, methods=["POST"]),
            ]
        )

    def _issue(self) -> tuple[str, float]:
        now = time.time()
        self.issued += 1
        return mint(self.secret, now + self.ttl_s), now

    def _failed(self, error: str) -> Response | None:
        if not self.fail_status:
            return None
        self.refused += 1
        code = error if self.fail_status < 500 else "server_error"
        return JSONResponse({"error": code, "error_description": "simulated"}, status_code=self.fail_status)

    async def _azure(self, request: Request) -> Response:
        if request.headers.get("x-identity-header") != self.identity_header:
            self.refused += 1
            return JSONResponse({"statusCode": 400, "message": "Invalid identity header"}, status_code=400)
        failed = self._failed("invalid_request")
        if failed is not None:
            return failed
        resource = request.query_params.get("resource", "")
        token, now = self._issue()
        body = {
            "access_token": token,
            "expires_on": str(int(now + self.ttl_s)),  # rounded down: never past the real end
            "resource": resource,
            "token_type": "Bearer",
            "client_id": "00000000-0000-0000-0000-000000000000",
            "refresh_in": int(self.ttl_s / 2),
        }
        return JSONResponse(body)

    async def _google(self, request: Request) -> Response:
        form = parse_qs((await request.body()).decode())
        grant, assertion = form.get("grant_type", [""])[0], form.get("assertion", [""])[0]
        claims = _claims(assertion)
        if grant != JWT_BEARER or claims.get("aud") != GOOGLE_AUDIENCE or not claims.get("scope"):
            self.refused += 1
            return JSONResponse(
                {"error": "invalid_grant", "error_description": "Invalid JWT"}, status_code=400
            )
        failed = self._failed("invalid_grant")
        if failed is not None:
            return failed
        token, _ = self._issue()
        # Google states one second less than the token lives (3599 for an hour's).
        return JSONResponse(
            {"access_token": token, "expires_in": int(self.ttl_s) - 1, "token_type": "Bearer"}
        )


def _claims(assertion: str) -> dict[str, object]:
    """A JWT's claims, unverified (the simulator trusts the key it gave the test)."""
    try:
        payload = assertion.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return claims if isinstance(claims, dict) else {}


@dataclass(frozen=True)
class RunningIssuer:
    issuer: TokenIssuer
    url: str
    listener: Listener  # `stop()`: the token service is down; `resume()`: back

    @property
    def azure_endpoint(self) -> str:
        return self.url + AZURE_PATH

    @property
    def google_token_uri(self) -> str:
        return self.url + GOOGLE_PATH


@contextlib.asynccontextmanager
async def run_token_issuer(
    secret: str, ttl_s: float, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningIssuer]:
    issuer = TokenIssuer(secret, ttl_s)
    async with serve(issuer.app, host, port) as (server, bound):
        yield RunningIssuer(issuer, f"http://{host}:{bound}", Listener(server, host, bound))
