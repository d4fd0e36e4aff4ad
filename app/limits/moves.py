"""How an automatic limit's moves are told: counted on every change (with why it moved),
logged when it moved by more than `LOG_CHANGE_RATIO` since the value last logged, so the
log shows the big moves without a line a second."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

# A limit that moved by more than this factor since it was last logged is logged again.
LOG_CHANGE_RATIO = 1.5

K = TypeVar("K", bound=Hashable)


class Moves(Generic[K]):
    """The moves of limits keyed by `K`: `on_change(key, reason)` when a value changes;
    `describe(key)` names the limit in the log line."""

    def __init__(
        self,
        on_change: Callable[[K, str], None],
        describe: Callable[[K], str],
        initial: Mapping[K, int],
    ) -> None:
        self._on_change = on_change
        self._describe = describe
        self._values: dict[K, int] = dict(initial)
        self._logged: dict[K, int] = dict(initial)

    def moved(self, key: K, value: int, reason: str) -> None:
        if value != self._values.get(key):
            self._on_change(key, reason)
            self._values[key] = value
        logged = self._logged.get(key, value)
        if max(value, logged) > LOG_CHANGE_RATIO * min(value, logged):
            log.info("limit %s: %d -> %d (%s)", self._describe(key), logged, value, reason)
            self._logged[key] = value
