"""The machine line every benchmark prints first, and the load average it ran under.

The benchmarks run on machines shared with other work, so each prints the 1/5/15-minute load
average when it starts (:func:`machine_line`) and when it ends (:func:`load_line`); a figure
taken while the load average was above the CPU count is a figure of a busy machine.
"""

import os
import platform
from pathlib import Path


def load_average() -> str:
    """``1.23 0.98 0.75`` (1, 5 and 15 minutes), or ``unknown`` where the OS has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def load_line(when: str) -> str:
    """``load average at WHEN: 1.23 0.98 0.75 (1/5/15 min, N CPUs)``."""
    return f"load average at {when}: {load_average()} (1/5/15 min, {os.cpu_count()} CPUs)"


def machine_line() -> str:
    """The machine, and the load average as the benchmark starts."""
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        f"; {load_line('start')}"
    )


def drop_page_cache(path: Path, suffix: str = "") -> bool:
    """Ask the kernel to forget the cached pages of ``path`` (a file, or every file below a
    folder whose name ends in ``suffix``), written back first, so the next read comes from
    the disk; no root needed. False where the OS has no ``posix_fadvise``."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    files = [path] if path.is_file() else [p for p in path.rglob(f"*{suffix}") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True
