"""Who may follow scans of other replicas from here, and how many at once.

Each follow of a scan running elsewhere holds one of this process's
`FOLLOW_MAX_CONNECTIONS` blocked reads on Redis (app/scans/mirror.py) for as long as the
scan runs. Unbounded, one user could take them all and every other user's resume would
fail. So a follow takes a slot before its response starts: at most
`FOLLOWERS_MAX_PER_USER` per user (the caller's rate key: the user, or the client
address when anonymous) and `FOLLOWERS_MAX_PER_SCAN` per scan → 429 `FOLLOWER_LIMIT`
with `Retry-After`; and no more than the pool has connections → 503 `SERVER_BUSY`. Since
slots never outnumber the pool's connections, a follower never waits for one.

A slot is given back when the follow's response closes its body, however it ends
(`FollowerSlot.release`, idempotent).
"""

from __future__ import annotations

import uuid
from collections import Counter

from app.errors import FollowerLimit, ServerBusy

# When to try again: a follower that left is noticed at its next send, within a ping.
FOLLOWER_RETRY_AFTER_S = 5.0


class FollowerSlot:
    def __init__(self, caps: FollowerCaps, user: str, scan_id: uuid.UUID) -> None:
        self._caps = caps
        self._user = user
        self._scan_id = scan_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._caps._give(self._user, self._scan_id)


class FollowerCaps:
    def __init__(self, *, per_user: int, per_scan: int, total: int) -> None:
        self.per_user = per_user
        self.per_scan = per_scan
        self.total = total
        self.in_use = 0
        self._by_user: Counter[str] = Counter()  # only keys with followers now
        self._by_scan: Counter[uuid.UUID] = Counter()

    def take(self, user: str, scan_id: uuid.UUID) -> FollowerSlot:
        if self._by_user[user] >= self.per_user:
            raise FollowerLimit(
                f"This user already follows {self.per_user} scans of other replicas from here "
                "(FOLLOWERS_MAX_PER_USER); close one, then retry.",
                retry_after_s=FOLLOWER_RETRY_AFTER_S,
            )
        if self._by_scan[scan_id] >= self.per_scan:
            raise FollowerLimit(
                f"This scan already has {self.per_scan} followers here (FOLLOWERS_MAX_PER_SCAN); "
                "close one, then retry.",
                retry_after_s=FOLLOWER_RETRY_AFTER_S,
            )
        if self.in_use >= self.total:
            raise ServerBusy(
                "This server follows as many scans of other replicas as it can; retry later.",
                retry_after_s=FOLLOWER_RETRY_AFTER_S,
            )
        self.in_use += 1
        self._by_user[user] += 1
        self._by_scan[scan_id] += 1
        return FollowerSlot(self, user, scan_id)

    def held_by(self, user: str) -> int:
        return self._by_user[user]

    def _give(self, user: str, scan_id: uuid.UUID) -> None:
        self.in_use -= 1
        self._by_user[user] -= 1
        if self._by_user[user] <= 0:
            del self._by_user[user]
        self._by_scan[scan_id] -= 1
        if self._by_scan[scan_id] <= 0:
            del self._by_scan[scan_id]
