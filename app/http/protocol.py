"""uvicorn's httptools protocol with two things the service needs from the HTTP layer:

- **A bound on the request head.** llhttp buffers a request line and headers of any
  size (a 16 MB header is accepted); here a head still incomplete after
  `MAX_REQUEST_HEAD_BYTES` is refused with 431 and the connection closed, so a
  connection never holds more than that plus one read's worth of head.
- **JSON error bodies** for rejections the application never sees (malformed
  request lines, bad `Content-Length`, control characters in headers): the same
  `{"detail", "code"}` shape as every other error, with code `BAD_HTTP_REQUEST`.

Use it with `uvicorn app.main:app --http app.http.protocol:HttpToolsProtocol` (what
`make run` and the tests do), or with `UVICORN_HTTP=app.http.protocol:HttpToolsProtocol`
in the environment (what the image sets, so a bare command run in it has it too). A bare
`uvicorn app.main:app` elsewhere still refuses big heads, once parsed
(app/http/head_limits.py), but answers malformed HTTP with uvicorn's plain-text 400s.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHttpToolsProtocol

from app.http.head_limits import MAX_REQUEST_HEAD_BYTES

__all__ = ["MAX_REQUEST_HEAD_BYTES", "HttpToolsProtocol"]


class HttpToolsProtocol(_UvicornHttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._heads_completed = 0

    def data_received(self, data: bytes) -> None:
        counting = self._in_head
        heads_before = self._heads_completed
        super().data_received(data)
        # Only a chunk that started inside a head and completed none counts: body bytes
        # that arrive with the end of a head (or whole small requests) are not head bytes.
        if not counting or self._heads_completed != heads_before or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
            self.logger.warning("request head over %d bytes: refused with 431", MAX_REQUEST_HEAD_BYTES)
            self._send_json_error(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                "REQUEST_HEADERS_TOO_LARGE",
                f"The request line and headers exceed {MAX_REQUEST_HEAD_BYTES} bytes.",
            )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._heads_completed += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    def send_400_response(self, msg: str) -> None:
        self._send_json_error(HTTPStatus.BAD_REQUEST, "BAD_HTTP_REQUEST", msg)

    def _send_json_error(self, status: HTTPStatus, code: str, detail: str) -> None:
        body = json.dumps({"detail": detail, "code": code}).encode()
        head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(b"".join(head) + body)
        self.transport.close()
