"""Opt-in memory probe for the soak: every process that starts with this folder on its
``PYTHONPATH`` and ``ARGUS_MEMPROBE_DIR`` set runs a daemon thread that appends one line of
JSON to ``ARGUS_MEMPROBE_DIR/<pid>.jsonl`` every ``ARGUS_MEMPROBE_S`` seconds (default 30).

A line tells live objects from allocator retention, cheaply enough to run under load:

* ``rss_mb`` and ``anon_mb``: the resident memory (VmRSS) and its anonymous part (RssAnon:
  the heap, not the mapped libraries);
* ``py_blocks``: ``sys.getallocatedblocks()``, the blocks Python's own allocator holds live;
* ``gc_objects`` and ``types``: ``len(gc.get_objects())`` and, per type, the change in count
  since the first sample (the 12 largest changes), the one walk over every object (a few
  hundred ms in a worker);
* ``malloc_used_mb`` / ``malloc_free_mb`` / ``mmap_mb``: glibc's ``mallinfo2``: bytes handed
  out by malloc (Python, torch, grpc, Qdrant alike), bytes malloc holds free in its arenas, and
  bytes in separate mmaps. RSS that grows with ``malloc_free_mb`` while ``malloc_used_mb`` stays
  is retention by the allocator, not a leak.

``ARGUS_MEMPROBE_TRIM=1`` calls ``malloc_trim(0)`` after each sample (and logs the RSS after
it), to measure how much of the growth the allocator gives back. ``ARGUS_MEMPROBE_TRACE=1``
starts tracemalloc with one frame and logs the 12 largest per-line growths since the first
sample (slower: every allocation is traced). Growth (types, trace) counts from the first sample
at least ``ARGUS_MEMPROBE_BASE_S`` seconds after the process started (default 0), so the
soak can leave its warm-up out.

Nothing in Argus imports this file; ``benchmarks/soak.py --probe-dir`` puts it on the path.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _role() -> str:
    with open("/proc/self/cmdline", "rb") as cmdline:
        words = cmdline.read().split(b"\0")
    # python -m argus worker ...: the command after the module
    for i, word in enumerate(words):
        if word == b"argus" and i + 1 < len(words):
            return words[i + 1].decode(errors="replace")
    return os.path.basename(words[0].decode(errors="replace"))


def _probe(directory: str, every_s: float, base_s: float, trim: bool, trace: bool) -> None:
    import tracemalloc

    libc = _libc()
    if trace:
        tracemalloc.start(1)
    path = os.path.join(directory, f"{os.getpid()}.jsonl")
    began = time.monotonic()
    first_types: collections.Counter[str] | None = None
    first_trace: tracemalloc.Snapshot | None = None
    while True:
        time.sleep(every_s)
        walk_began = time.monotonic()
        types = _type_counts()
        line: dict[str, Any] = {
            "t": round(time.monotonic() - began, 1),
            "role": _role(),
            "rss_mb": round(_rss_mb(), 1),
            "anon_mb": round(_rss_mb("RssAnon"), 1),
            "py_blocks": sys.getallocatedblocks(),
            "gc_objects": sum(types.values()),
            "threads": threading.active_count(),
        }
        if first_types is None or line["t"] < base_s:
            first_types = types
        growth = {k: types[k] - first_types[k] for k in types | first_types}
        top = sorted(growth.items(), key=lambda kv: -abs(kv[1]))[:12]
        line["types"] = {k: v for k, v in top if v}
        line["walk_s"] = round(time.monotonic() - walk_began, 3)
        if libc is not None:
            info = libc.mallinfo2()
            line["malloc_used_mb"] = round(info.uordblks / 2**20, 1)
            line["malloc_free_mb"] = round(info.fordblks / 2**20, 1)
            line["mmap_mb"] = round(info.hblkhd / 2**20, 1)
        if trace:
            snapshot = tracemalloc.take_snapshot()
            if first_trace is None or line["t"] < base_s:
                first_trace = snapshot
            line["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
            diff = snapshot.compare_to(first_trace, "lineno")[:12]
            line["trace"] = {str(d.traceback[0]): round(d.size_diff / 1024) for d in diff}
        if trim and libc is not None:
            libc.malloc_trim(0)
            line["rss_after_trim_mb"] = round(_rss_mb(), 1)
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


def _start() -> None:
    directory = os.environ.get("ARGUS_MEMPROBE_DIR")
    if not directory:
        return
    thread = threading.Thread(
        target=_probe,
        args=(
            directory,
            float(os.environ.get("ARGUS_MEMPROBE_S", "30")),
            float(os.environ.get("ARGUS_MEMPROBE_BASE_S", "0")),
            os.environ.get("ARGUS_MEMPROBE_TRIM") == "1",
            os.environ.get("ARGUS_MEMPROBE_TRACE") == "1",
        ),
        name="argus-memprobe",
        daemon=True,
    )
    thread.start()


_start()
