"""The "try it" web page: `/` and `/static/<name>`, served from the package's
`app/static/` directory (plain HTML/CSS/ES modules, no build step).

Files are read once and kept in memory. The page carries the service's
`IMAGE_LONG_SIDE` (a `<meta>` the script reads), so the photo it downscales is one
the service sends on as it came instead of decoding and re-encoding it, and the
service's stage list (the progress list's items, by each stage's `name` and `label`). Each response
carries a strong ETag (the package version plus a hash of the bytes) and answers
`If-None-Match` with 304. The page itself is revalidated on every load (`no-cache`);
the assets it links carry `?v=<package version>` in their URL and are cached for a day
when the version matches.
"""

from __future__ import annotations

import hashlib
import html
import importlib.metadata
import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.resources import Resources

router = APIRouter(include_in_schema=False)

VERSION_PLACEHOLDER = "__VERSION__"
LONG_SIDE_PLACEHOLDER = "__IMAGE_LONG_SIDE__"
STAGES_PLACEHOLDER = "__STAGES__"
_STAGE_ITEM = (
    '        <li data-step="{name}" data-status="waiting"><span class="stage-name">{label}</span> '
    '<span class="stage-state">대기</span></li>'
)
ASSET_MAX_AGE_S = 86_400
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# No inline script or style anywhere: the page only talks to its own origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' blob: data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    media_type: str
    etag: str


def package_version() -> str:
    try:
        return importlib.metadata.version("ecoscan")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare tree
        return "0"


def stage_items(stages: Sequence[tuple[str, str]]) -> str:
    """The progress list's items, one per stage (name, label), in order."""
    return "\n".join(_STAGE_ITEM.format(name=html.escape(n), label=html.escape(label)) for n, label in stages)


@cache
def static_files(image_long_side: int, stages: tuple[tuple[str, str], ...]) -> dict[str, StaticFile]:
    version = package_version()
    files: dict[str, StaticFile] = {}
    for entry in importlib.resources.files("app").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in _TYPES:
            continue
        body = entry.read_bytes()
        if suffix in (".html", ".js", ".css"):
            body = body.replace(VERSION_PLACEHOLDER.encode(), version.encode())
            body = body.replace(LONG_SIDE_PLACEHOLDER.encode(), str(image_long_side).encode())
            body = body.replace(STAGES_PLACEHOLDER.encode(), stage_items(stages).encode())
        digest = hashlib.sha256(body).hexdigest()[:16]
        files[entry.name] = StaticFile(body, _TYPES[suffix], f'"{version}-{digest}"')
    return files


def _matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    candidates = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in candidates or etag in candidates


def _serve(request: Request, name: str, cache_control: str) -> Response:
    resources: Resources = request.state.resources
    stages = tuple((stage.name, stage.label) for stage in resources.stages)
    file = static_files(resources.settings.image_long_side, stages).get(name)
    if file is None:
        return Response(
            b'{"detail":"Not Found","code":"NOT_FOUND"}', status_code=404, media_type="application/json"
        )
    headers = {
        "ETag": file.etag,
        "Cache-Control": cache_control,
        "X-Content-Type-Options": "nosniff",
    }
    if file.media_type.startswith("text/html"):
        headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        headers["Referrer-Policy"] = "no-referrer"
    if _matches(request.headers.get("if-none-match"), file.etag):
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else file.body
    headers["Content-Length"] = str(len(file.body))
    return Response(body, media_type=file.media_type, headers=headers)


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request) -> Response:
    return _serve(request, "index.html", "no-cache")


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
async def asset(request: Request, name: str) -> Response:
    versioned = request.query_params.get("v") == package_version()
    cache_control = f"public, max-age={ASSET_MAX_AGE_S}" if versioned else "no-cache"
    return _serve(request, name, cache_control)
