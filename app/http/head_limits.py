"""The request head's bounds, checked by the app itself: the second line behind
app/http/protocol.py.

The protocol refuses a head while it is still arriving, so a connection never holds more
than `MAX_REQUEST_HEAD_BYTES` of it. A server started without it (a bare
`uvicorn app.main:app`, whose httptools parser buffers a head of any size) or a head that
arrives whole in one read reaches the app parsed: here it is refused all the same, with the
same 431 and code, before any route reads it. Under the bare command a big head has cost
its size in memory while it was read, once; it goes no further.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["MAX_REQUEST_HEADERS", "MAX_REQUEST_HEAD_BYTES", "HeadLimits", "head_refusal"]

log = logging.getLogger("app")

# Browsers send 1-4 KiB of headers; common servers refuse at 8-16 KiB (nginx's large
# buffers default to 4 x 8 KiB). 16 KiB leaves room for long cookies or tokens.
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# Browsers send about 15 header fields, proxies add a few; Apache refuses past 100
# (`LimitRequestFields`). Each field is one more object per request in every layer.
MAX_REQUEST_HEADERS = 100

# The bytes a head takes on the wire beyond its parts: "GET /path HTTP/1.1\r\n" has
# three, each "name: value\r\n" four, and the blank line ending the head two.
_REQUEST_LINE_EXTRA = len(" HTTP/1.1\r\n") + 1
_FIELD_EXTRA = len(": \r\n")


def head_refusal(scope: Scope) -> str | None:
    """Why this request's head is refused (the detail of the 431), or None."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    if len(headers) > MAX_REQUEST_HEADERS:
        return f"The request has more than {MAX_REQUEST_HEADERS} header fields."
    size = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    size += _REQUEST_LINE_EXTRA + 2
    size += sum(len(name) + len(value) + _FIELD_EXTRA for name, value in headers)
    if size > MAX_REQUEST_HEAD_BYTES:
        return f"The request line and headers exceed {MAX_REQUEST_HEAD_BYTES} bytes."
    return None


class HeadLimits:
    """Pure ASGI middleware: a head over the bounds gets 431 `REQUEST_HEADERS_TOO_LARGE`
    and the connection closed; every other request passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            detail = head_refusal(scope)
            if detail is not None:
                log.warning("%s; refused with 431", detail.removesuffix("."))
                response = JSONResponse(
                    {"detail": detail, "code": "REQUEST_HEADERS_TOO_LARGE"},
                    status_code=431,
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
