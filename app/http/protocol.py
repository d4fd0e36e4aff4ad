"""uvicorn's httptools protocol with two things the service needs from the HTTP layer:

- **A bound on the request head.** llhttp buffers a request line and headers of any
  size (a 16 MB header is accepted); here a head still incomplete after
  `MAX_REQUEST_HEAD_BYTES` is refused with 431 and the connection closed, so a
  connection never holds more than that plus one read's worth of head.
- **Scans the loop pacer refuses, answered here** (app/http/early_refusal.py): as soon
  as a scan's head is parsed, before an ASGI cycle, a task or anything of the app exists
  for it, with pre-built bytes; its body is skipped as the parser reads it, and the
  connection kept (closed if the body stops coming for the keep-alive timeout).
- **No idle close of a connection whose next request has arrived.** Under uvloop a loop
  iteration runs its due timers before it reads sockets: a loop that fell behind would let
  uvicorn's keep-alive timer close a connection with a request, sent in time, waiting in
  the kernel (a reset for the client, no answer, nothing counted). Bytes waiting: no close,
  the read that follows cancels the timer as any request does.
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

import fcntl
import json
import struct
import termios
import time
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

from app.http.early_refusal import STATE_KEY, EarlyRefusal, is_scan_post
from app.http.head_limits import MAX_REQUEST_HEAD_BYTES

__all__ = ["MAX_REQUEST_HEAD_BYTES", "HttpToolsProtocol"]


class HttpToolsProtocol(_UvicornHttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._heads_completed = 0
        self._refused: bool | None = None  # a request answered early: None, or whether to keep the connection
        self._reads_held = False  # reading paused until the client takes the answers given early

    def data_received(self, data: bytes) -> None:
        counting = self._in_head
        heads_before = self._heads_completed
        super().data_received(data)
        if self._refused is not None and not self._reads_held and not self.transport.is_closing():
            self._arm_keep_alive()  # the skipped body must keep coming
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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A request right behind one answered early, in the same read: the keep-alive
        # timer that answer armed must not close the connection under it.
        self._unset_keepalive_if_required()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._heads_completed += 1
        if not self._refuse_early():
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refused is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        if self._refused is None:
            super().on_message_complete()
            return
        keep_alive, self._refused = self._refused, None
        if keep_alive:
            self.on_response_complete()  # as uvicorn does once a response is sent: the keep-alive timer
            if self._reads_held:  # ...which resumed reading: not while the client takes no answers
                self.flow.pause_reading()
                self._unset_keepalive_if_required()
        else:
            self.transport.close()

    def _arm_keep_alive(self) -> None:
        """uvicorn's keep-alive timer (`--timeout-keep-alive`), (re)started. Also while the
        body of a request answered early is still to come: it must keep coming, with no gap
        over the timeout, or the connection is closed. Nothing else bounds it: no app reads
        it, no response is pending, so no keep-alive timer runs, and a client that stops
        sending would hold its connection for as long as it likes."""
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def _refuse_early(self) -> bool:
        """A scan the loop pacer refuses, answered now (app/http/early_refusal.py)."""
        refusal: EarlyRefusal | None = self.app_state.get(STATE_KEY)
        method = self.parser.get_method()
        if refusal is None or self.expect_100_continue or not is_scan_post(method, self.url):
            return False
        if self.cycle is not None and not self.cycle.response_complete:
            return False  # pipelined behind a response still being sent: answers go in order
        cpu_at = time.thread_time()
        answer = refusal.answer()
        if answer is None:
            return False
        version = self.parser.get_http_version()
        keep_alive = version != "1.0" and self.parser.should_keep_alive()
        line, fields, body = answer
        head = [line, *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)]
        head.append(fields if keep_alive else fields + b"connection: close\r\n")
        self.transport.write(b"".join(head) + b"\r\n" + body)
        if self.flow.write_paused:  # (again, if an app's response resumed reading meanwhile)
            # The client takes no answers: read none of its requests until it does, as
            # uvicorn does for pipelined requests (an answer is bigger than its request).
            self._reads_held = True
            self.flow.pause_reading()
        self._refused = keep_alive
        refusal.charge(time.thread_time() - cpu_at)
        if self.access_log:
            url = self.url.decode("latin-1")
            self.access_logger.info(
                '%s - "POST %s HTTP/%s" %s', get_client_addr(self.scope), url, version, line[9:12].decode()
            )
        return True

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self._reads_held:
            return
        self._reads_held = False
        if not self.pipeline:  # else the next response to go resumes reading
            self.flow.resume_reading()
        idle = self.cycle is None or self.cycle.response_complete
        if (self._refused is not None or idle) and not self.transport.is_closing():
            self._arm_keep_alive()  # held, the timer was not running

    def timeout_keep_alive_handler(self) -> None:
        if not self.flow.read_paused and self._bytes_waiting():
            # The next request is here: data_received, later this iteration, takes it (and
            # stops the timer); armed again in case those bytes start no request (a partial
            # TLS record), so that an idle connection is still closed.
            self._arm_keep_alive()
            return
        super().timeout_keep_alive_handler()

    def _bytes_waiting(self) -> bool:
        """Whether the kernel holds bytes from the client not yet read (FIONREAD)."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            waiting: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except (OSError, ValueError):
            return False
        return waiting > 0

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
