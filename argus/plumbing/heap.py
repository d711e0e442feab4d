"""The C heap of Argus's long-running processes: how many malloc arenas glibc may keep.

glibc gives every thread that allocates its own arena, up to 8 per core, and memory freed in
an arena is reused by that arena alone: it stays resident while other arenas grow. A worker
or a router allocates on tens of threads (the gRPC pool, torch's, the cache writer), so under
a soak at 2 × capacity the memory glibc held free grew for minutes after the live memory had
stopped (``benchmarks/soak.py --probe-dir`` shows both). Two arenas keep that retention small
at no cost we could measure on these CPU workers: the threads share the arenas rather than
each keeping a reserve.

The ``argus`` command calls :func:`limit_malloc_arenas` before any thread starts (a later call
leaves the arenas already made). ``MALLOC_ARENA_MAX`` in the environment is the operator's
choice and wins; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
DEFAULT_ARENAS = 2


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas``; returns whether the cap was set (False when
    ``MALLOC_ARENA_MAX`` is set or the C library is not glibc)."""
    if arenas < 1:
        raise ValueError(f"arenas: must be >= 1, got {arenas}")
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))
