"""Scans the loop pacer refuses, answered by the HTTP protocol (app/http/protocol.py) as
soon as their head is parsed, before anything of the app runs for them.

When the event loop is out of CPU, every refusal competes for that CPU with the scans it
protects; and a refused client comes back after its Retry-After, again and again. Through
the app a refusal cost the process 0.29-0.38 ms of CPU (an ASGI cycle and its task,
middleware, routing, a request object, the error handler, a JSON response and its sends);
here 0.13-0.21 ms, on the same box (docs/benchmarks.md): the socket's reads, the head's
parse, the pacer's question and one write of bytes built once per `Retry-After` value.
The body is never read into memory (the protocol lets the parser skip it and keeps the
connection, since closing one with unread bytes resets it, and the client might never see
its 503).

The lifespan puts an `EarlyRefusal` in the app's state under `STATE_KEY`; a server without
our protocol, a request with `Expect: 100-continue` and a pipelined request behind one
still being answered reach the app, whose acceptance asks the pacer again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from http import HTTPStatus

from app.errors import Overloaded
from app.http.errors import error_response
from app.http.routes import SCAN_PATH

__all__ = ["STATE_KEY", "EarlyRefusal", "is_scan_post"]

# The key of the lifespan state (uvicorn's `app_state`) that holds the `EarlyRefusal`.
STATE_KEY = "early_refusal"
_SCAN_PATH = SCAN_PATH.encode("ascii")
_SCAN_PATH_QUERY = _SCAN_PATH + b"?"


def is_scan_post(method: bytes, url: bytes) -> bool:
    """A POST to the scan route (`url` as the request line has it: path and query)."""
    return method == b"POST" and (url == _SCAN_PATH or url.startswith(_SCAN_PATH_QUERY))


class EarlyRefusal:
    """`ask()`: the refusal of a scan whose head was parsed now, or None; `charge(cpu_s)`:
    what answering it cost the loop (ScanAcceptance.refused_early and .charge_shed, which
    count them as the app counts its own)."""

    def __init__(self, ask: Callable[[], Overloaded | None], charge: Callable[[float], None]) -> None:
        self._ask = ask
        self.charge = charge
        self._answers: dict[tuple[str, int], tuple[bytes, bytes, bytes]] = {}

    def answer(self) -> tuple[bytes, bytes, bytes] | None:
        """(status line, header fields, body) of the refusal, or None to let the scan in.
        Status line and fields end in CRLF; the server's default headers go between them."""
        refusal = self._ask()
        if refusal is None:
            return None
        key = (refusal.code, math.ceil(refusal.retry_after_s))  # at most MAX_RETRY_AFTER_S of them
        if (built := self._answers.get(key)) is None:
            built = self._answers[key] = _built(refusal)
        return built


def _built(refusal: Overloaded) -> tuple[bytes, bytes, bytes]:
    """What the app's error handler would send (app/http/errors.py)."""
    response = error_response(refusal)
    status = HTTPStatus(response.status_code)
    line = b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode("ascii"))
    fields = b"".join(name + b": " + value + b"\r\n" for name, value in response.raw_headers)
    return line, fields, bytes(response.body)
