"""Scans that ended here a moment ago, kept as the rows they wrote.

A client that resumes or asks for the status right after a scan's end is answered from
memory, without a database query; and a scan whose terminal row the database refused
(deferred, app/scans/store.py) is still served as it ended, not as the `running` row the
database still holds. What is kept is that terminal row (`StoredScan`: owner, status,
times, the event log as the JSON string written with it): a few objects per scan, not
the run's events, task and input, which would otherwise live on for a minute and be
walked by every full garbage collection meanwhile.

Expiry needs no timer: entries are kept in the order they ended, and the expired ones at
the front are dropped whenever one is added or looked up.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from app.scans.store import StoredScan

# How long an ended scan stays in memory: resumes and replays right after the end (and
# while a deferred row waits for the database) read it here.
FINISHED_SCAN_KEPT_S = 60.0


class FinishedScans:
    def __init__(
        self, kept_s: float = FINISHED_SCAN_KEPT_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._kept_s = kept_s
        self._clock = clock
        self._scans: OrderedDict[uuid.UUID, tuple[float, StoredScan]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._scans)

    def keep(self, scan: StoredScan) -> None:
        now = self._clock()
        self._expire(now)
        self._scans[scan.id] = (now + self._kept_s, scan)
        self._scans.move_to_end(scan.id)

    def get(self, scan_id: uuid.UUID) -> StoredScan | None:
        self._expire(self._clock())
        kept = self._scans.get(scan_id)
        return kept[1] if kept is not None else None

    def _expire(self, now: float) -> None:
        scans = self._scans
        while scans:
            expires, _ = next(iter(scans.values()))
            if expires > now:
                return
            scans.popitem(last=False)
