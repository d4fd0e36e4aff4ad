"""Event-loop health: a timer that should fire every `interval_s`; how late it fires
is how long some callback held the loop. Cheap enough to run always."""

from __future__ import annotations

import asyncio

from app.runtime.metrics import Metrics


async def probe_loop_lag(metrics: Metrics, interval_s: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    worst = 0.0
    while True:
        scheduled = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - scheduled)
        metrics.loop_lag.observe(lag)
        if lag > worst:
            worst = lag
            metrics.loop_lag_max.set(worst)
