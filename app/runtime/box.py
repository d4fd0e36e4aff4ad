"""What this box lets one process hold at once: the ceiling of every automatic limit
(app/limits/sizing.py) that the settings do not cap.

Two things run out as scans in flight grow: file descriptors (a scan holds its
client's socket, and a connection upstream while a call is in progress) and memory (a
scan in flight holds its prepared image, its event log and its buffers). The
process's soft descriptor limit is raised to the hard one at start-up (shells often
start programs with 1,024, far below what a server needs).
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Descriptors kept for everything but scans: the database pool, Redis, logs, the
# listening socket, the simulator when it runs in the process.
FD_RESERVE = 256
# Descriptors one scan may hold at once: its client's socket and one upstream connection.
FDS_PER_SCAN = 2
# Memory one scan in flight holds, with room to spare (measured: docs/benchmarks.md,
# "memory per scan in flight").
BYTES_PER_SCAN = 256 * 1024
# Of the memory the process may use, the share scans in flight may take.
MEMORY_SHARE_FOR_SCANS = 0.5


@dataclass(frozen=True)
class BoxLimits:
    fds: int  # the soft descriptor limit in force
    memory_bytes: int  # what the process may use: its cgroup's limit, or the box's memory

    @property
    def scans(self) -> int:
        """The most scans in flight the box holds, by descriptors and by memory."""
        by_fds = (self.fds - FD_RESERVE) // FDS_PER_SCAN
        by_memory = int(self.memory_bytes * MEMORY_SHARE_FOR_SCANS) // BYTES_PER_SCAN
        return max(1, min(by_fds, by_memory))


def box_limits(*, raise_fd_limit: bool = True) -> BoxLimits:
    """This process's limits; first raises the soft descriptor limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_fd_limit and soft != hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("file descriptor limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the file descriptor limit from %d: %s", soft, exc)
    return BoxLimits(fds=soft, memory_bytes=_memory_bytes())


def _memory_bytes() -> int:
    """The cgroup (v2, then v1) memory limit, when one is set, else the box's memory."""
    box = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(box, int(text))
    return box
