"""Every close on the way out is bounded, and every background task is cancelled there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any

log = logging.getLogger("app")

# Each close on the way out (pool, client, listener...) gets this long; the whole exit
# stays well inside the drain's share of a 30 s termination grace.
CLOSE_TIMEOUT_S = 5.0


def background(stack: AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """`work` as a task, cancelled when the stack unwinds."""
    task = asyncio.create_task(work, name=name)
    stack.callback(task.cancel)


async def bounded_close(
    what: str, close: Callable[[], Awaitable[Any]], force: Callable[[], Any] | None = None
) -> None:
    """Every close on the way out gets `CLOSE_TIMEOUT_S`; a database that hangs must not
    keep the process from exiting."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await close()
    except TimeoutError:
        log.warning("shutdown: closing the %s took over %.0f s; abandoned", what, CLOSE_TIMEOUT_S)
        if force is not None:
            force()
