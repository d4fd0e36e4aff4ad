"""Housekeeping of the scans table: purging old scans, and finding scans whose process
died (SIGKILL, OOM, a lost host), whose rows would otherwise stay `running` forever.
Each process sweeps at start-up and then every `interval_s`; the store's sweep
(`ScanStore.sweep_lost`) decides who is dead from PostgreSQL's own list of
connections, so replicas sharing one database never sweep each other's live scans.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from app.errors import DatabaseError
from app.runtime.metrics import Metrics
from app.scans.store import ScanStore

log = logging.getLogger(__name__)

# After a PostgreSQL restart every live process needs a moment to reconnect (its pool
# on the next query, its rule listener within its backoff); until then its connections
# are missing too, so rows older than the server are not swept while it is younger than this.
RESTART_GRACE_S = 30.0


async def sweep_lost_scans(
    store: ScanStore,
    *,
    metrics: Metrics,
    interval_s: float,
    spared: Callable[[], Awaitable[list[uuid.UUID]]] | None = None,
) -> None:
    """Sweep now and every `interval_s`; each row swept counts in `ecoscan_scans_lost_total`
    (a scan lost with its process, which no other metric records: the process that ran it
    is gone, and the sweeping one never ran it). `spared` names the instances whose scans
    are takeover's (app/scans/liveness.py: they hold, or lately held, a liveness lease)."""
    first = True
    database_was_down = False
    while True:
        try:
            spare = await spared() if spared is not None else []
            lost = await store.sweep_lost(restart_grace_s=RESTART_GRACE_S, spared=spare)
        except DatabaseError:
            if not database_was_down:
                log.warning("lost-scan sweep: database unavailable; will retry")
            database_was_down = True
        else:
            database_was_down = False
            metrics.scans_lost.inc(len(lost))
            if lost or first:
                when = "start-up sweep" if first else "lost-scan sweep"
                log.log(
                    logging.WARNING if lost else logging.INFO,
                    "%s: %d scans of dead processes marked PROCESS_LOST",
                    when,
                    len(lost),
                )
            first = False
        await asyncio.sleep(interval_s)


# Deleting old scans a batch at a time keeps each statement short (no long locks, no
# giant transaction); a backlog is worked through batch after batch.
PURGE_BATCH = 1000


async def purge_old_scans(store: ScanStore, *, retention_days: float, interval_s: float) -> None:
    """Delete scans (rows and stored event logs) older than `retention_days`."""
    while True:
        try:
            while (deleted := await store.purge(older_than_days=retention_days, batch=PURGE_BATCH)) > 0:
                log.info("purged %d scans older than %g days", deleted, retention_days)
                if deleted < PURGE_BATCH:
                    break
        except DatabaseError:
            log.warning("scan purge: database unavailable; will retry")
        await asyncio.sleep(interval_s)
