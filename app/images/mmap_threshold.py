"""Big freed blocks given back to the OS: glibc's mmap threshold pinned.

glibc serves allocations from 128 KiB up with mmap and unmaps them on free, but once it
sees such a chunk freed it raises that threshold to the chunk's size (up to 32 MiB) and
the trim threshold to twice that. After the first big image, Pillow's 16 MiB blocks and
multi-megabyte request bodies come from the heaps instead, and up to 64 MiB per arena
(one per thread that allocated) stays with the process when they are freed: after a
burst of big images, the idle process keeps it. Pinning the threshold turns that
adaptation off: blocks of 1 MiB and more are unmapped on free, and the heaps are trimmed
above 128 KiB again. There is no `malloc_trim(0)` after big decodes: with the threshold
pinned, their blocks never reach the heaps it trims.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter, <malloc.h>
_MMAP_THRESHOLD_BYTES = 2**20


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at 1 MiB, unless the operator set one (MALLOC_MMAP_THRESHOLD_
    or GLIBC_TUNABLES). Process-wide; done once, when app/images/prepare.py is imported.
    True if pinned here."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has none
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
