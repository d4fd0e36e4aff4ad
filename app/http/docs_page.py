"""`/docs`: Swagger UI for `/openapi.json`, served from this service, never from a CDN.

FastAPI's own page loads swagger-ui from a CDN with no integrity check: whoever serves
those files runs script on our origin. Here the page is FastAPI's (`get_swagger_ui_html`)
pointed at the swagger-ui build the `fastapi-offline` package ships (its `static/`
folder), served under `/static/docs/` (routed wherever `/static` is). The page's one inline
script — swagger-ui's start-up call — is allowed by its hash in the page's
Content-Security-Policy, and nothing else: no other origin, no eval, no framing. FastAPI's
ReDoc page (also from a CDN) is not served.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import re
from dataclasses import dataclass
from functools import cache

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

DOCS_PATH = "/docs"
ASSETS_PATH = "/static/docs"
OPENAPI_PATH = "/openapi.json"
ASSET_MAX_AGE_S = 86_400
# The files the page uses, and their types; nothing else of the package is served.
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
# swagger-ui's stylesheet draws its icons with data: SVGs.
_POLICY = (
    "default-src 'self'; script-src 'self' {scripts}; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def assets() -> dict[str, Asset]:
    """swagger-ui's files, read once; the ETag (a hash of the bytes) versions their URLs."""
    folder = importlib.resources.files("fastapi_offline").joinpath("static")
    found: dict[str, Asset] = {}
    for name, media_type in _ASSETS.items():
        body = folder.joinpath(name).read_bytes()
        found[name] = Asset(body, media_type, hashlib.sha256(body).hexdigest()[:16])
    return found


@dataclass(frozen=True, slots=True)
class DocsPage:
    html: bytes
    policy: str


@cache
def docs_page(title: str) -> DocsPage:
    """The page, and the policy that allows exactly its inline script."""
    files = assets()

    def url(name: str) -> str:
        return f"{ASSETS_PATH}/{name}?v={files[name].etag}"

    html = get_swagger_ui_html(
        openapi_url=OPENAPI_PATH,
        title=f"{title} - Swagger UI",
        swagger_js_url=url("swagger-ui-bundle.js"),
        swagger_css_url=url("swagger-ui.css"),
        swagger_favicon_url=url("favicon.png"),
        oauth2_redirect_url=None,
    ).body
    text = bytes(html).decode()
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
        for s in _INLINE_SCRIPT.findall(text)
    )
    return DocsPage(bytes(html), _POLICY.format(scripts=hashes))


@router.api_route(DOCS_PATH, methods=["GET", "HEAD"])
async def docs(request: Request) -> Response:
    page = docs_page(request.app.title)
    headers = {
        "Content-Security-Policy": page.policy,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    body = b"" if request.method == "HEAD" else page.html
    headers["Content-Length"] = str(len(page.html))
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)


@router.api_route(ASSETS_PATH + "/{name}", methods=["GET", "HEAD"])
async def docs_asset(request: Request, name: str) -> Response:
    asset = assets().get(name)
    if asset is None:
        return Response(
            b'{"detail":"Not Found","code":"NOT_FOUND"}', status_code=404, media_type="application/json"
        )
    etag = f'"{asset.etag}"'
    versioned = request.query_params.get("v") == asset.etag
    headers = {
        "ETag": etag,
        "Cache-Control": f"public, max-age={ASSET_MAX_AGE_S}, immutable" if versioned else "no-cache",
        "X-Content-Type-Options": "nosniff",
    }
    sent = request.headers.get("if-none-match", "")
    if etag in (tag.strip().removeprefix("W/") for tag in sent.split(",")):
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else asset.body
    headers["Content-Length"] = str(len(asset.body))
    return Response(body, media_type=asset.media_type, headers=headers)
