"""The outage switch (``SimConfig.outage``, set at ``PATCH /sim/config``): one simulated
upstream goes down and comes back while the others keep serving.

- ``503``: every API request is answered at once with 503 and the flavour's body.
- ``hang``: requests are read and never answered while the switch stays there; the
  connection stays open. Switched back, held requests go on as if they had just arrived
  (to ``503``: they get the 503). A client that gives up is let go; shutdown answers 503.
- ``refuse``: the API port stops listening (clients see connection refused) and its open
  connections are reset (app/sim/listener.py); the control port stays up, and switching
  back listens again on the same port.

Only the provider's paths are affected, never ``/sim/*``. Requests that arrive during an
outage are counted in ``/sim/stats`` (``outage_requests``, by mode), so a benchmark can
report what the dead upstream still received.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from app.sim.completions import send_json
from app.sim.flavors import flavor_of
from app.sim.state import SimState


async def hold(state: SimState, scope: Scope, receive: Receive, send: Send) -> Receive | None:
    """Apply the switch to one API request: None if it was answered (or abandoned) here,
    else the ``receive`` to serve it with."""
    stats = state.stats
    mode = state.config.outage
    stats.count_outage(mode)
    if mode != "hang":
        # "503"; "refuse" only reaches here on a connection accepted just before the switch.
        await _unavailable(state, send)
        return None
    body = await _read_body(receive)
    gone = asyncio.ensure_future(receive())  # resolves when the client disconnects
    stats.held += 1
    try:
        while state.config.outage == "hang":
            back = asyncio.ensure_future(state.not_hanging.wait())
            closing = asyncio.ensure_future(state.closing.wait())
            done, _ = await asyncio.wait({gone, back, closing}, return_when=asyncio.FIRST_COMPLETED)
            back.cancel()
            closing.cancel()
            if gone in done:
                return None
            if closing in done:
                await _unavailable(state, send)
                return None
    finally:
        stats.held -= 1
    if state.config.outage != "none":
        gone.cancel()
        await _unavailable(state, send)
        return None
    return _replay(body, gone)


async def _unavailable(state: SimState, send: Send) -> None:
    state.stats.count_status(503)
    await send_json(send, 503, flavor_of(state.config).unavailable())


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, gone: asyncio.Future[Any]) -> Receive:
    """A ``receive`` that hands out the body read while held, then waits for the disconnect."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: Message = await gone
        return message

    return receive
