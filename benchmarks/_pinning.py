"""The benchmarks' ``--pin`` and ``--noisy-neighbour``: the router on a core of its own, and a
CPU-bound stranger beside the workers.

``--pin`` splits this process's CPUs as a node that honours the Helm chart's CPU requests
would: the router gets the first CPU (:func:`split_cpus`), everything else (workers,
ControlNet service, allocator, the load generator) the rest. Child processes are pinned from
their first instruction (:func:`~argus.tools.local_cluster.inherited_affinity`); the load
generator pins its own threads (:func:`pin_this_process`), before it starts its clients.

``--noisy-neighbour`` starts :class:`NoisyNeighbour`: one child that spins a pure-Python busy
loop on the workers' CPU set, at the workers' nice value, for the whole run, so the workers
share their core with a tenant the scheduler treats as their equal. It is stopped by its own
pid at the end; the CPU time it got is printed, so a run shows the neighbour really ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from argus.router.config import RouterServiceConfig
from argus.tools.local_cluster import inherited_affinity

BUSY_LOOP = "import os, sys\nos.nice(int(sys.argv[1]))\nwhile True:\n    pass\n"


def cpu_list(cpus: Sequence[int]) -> str:
    """``CPU 1`` or ``CPUs 0, 2``."""
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ", ".join(map(str, sorted(cpus)))


def split_cpus() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the router's CPUs, everyone else's): the first CPU this process may use, and the rest.
    SystemExit with fewer than two: there is no core to give the router."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs at least 2 CPUs; this process may use {cpus}")
    return (cpus[0],), tuple(cpus[1:])


def pin_this_process(cpus: Sequence[int]) -> None:
    """Every thread of this process onto ``cpus``; threads started later inherit it. On Linux
    a CPU set is per thread, so each one in ``/proc/self/task`` is set, not only the caller."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class NoisyNeighbour:
    """A busy-loop child on ``cpus`` (None: wherever the calling thread may run) at ``nice``
    more than this process; a context manager that starts it and stops it by its pid."""

    def __init__(self, cpus: Sequence[int] | None, nice: int) -> None:
        self.cpus = None if cpus is None else tuple(cpus)
        self.nice = nice
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0  # time.monotonic() at its start

    def describe(self) -> str:
        where = "any CPU" if self.cpus is None else cpu_list(self.cpus)
        return f"noisy neighbour: a pure-Python busy loop at nice +{self.nice} on {where}"

    def usage_line(self) -> str:
        """The CPU time it has had so far, as a share of one core over its lifetime."""
        if self.process is None or self.process.poll() is not None:
            return "noisy neighbour: not running"
        used_s, wall_s = cpu_seconds(self.process.pid), time.monotonic() - self.started
        return (
            f"noisy neighbour (pid {self.process.pid}) had {used_s:.1f} CPU s in {wall_s:.0f} s "
            f"({used_s / max(wall_s, 1e-9):.0%} of a core)"
        )

    def __enter__(self) -> NoisyNeighbour:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        with inherited_affinity(self.cpus):
            self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.nice)])
        self.started = time.monotonic()

    def stop(self) -> None:
        """Stop it, if started (by its own pid)."""
        process = self.process
        if process is None:
            return
        process.terminate()  # ours, by its pid
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def mode_line(pinned: tuple[Sequence[int], Sequence[int]] | None, rest: str) -> str:
    """The header line that says how a run was placed: ``pinned`` is (router CPUs, the
    others' CPUs) or None; ``rest`` names what shares the others' set."""
    if pinned is None:
        return (
            f"mode: unpinned (every process may run on {cpu_list(sorted(os.sched_getaffinity(0)))})"
        )
    router, others = pinned
    return f"mode: pinned (the router on {cpu_list(router)}; {rest} on {cpu_list(others)})"


def add_window_argument(parser: argparse.ArgumentParser) -> None:
    """``--late-binding-window N``: the router's, for an A/B against sending every admitted
    request at once (0); None leaves the router's own default."""
    parser.add_argument(
        "--late-binding-window",
        type=int,
        default=None,
        help="the router's late-binding window (default: its own; 0: every admitted request "
        "sent to its worker at once, the router before late binding)",
    )


def with_window(config: RouterServiceConfig, window: int | None) -> RouterServiceConfig:
    """``config`` with the late-binding window of :func:`add_window_argument` (None: as it
    is)."""
    if window is None:
        return config
    return replace(config, routing=replace(config.routing, late_binding_window=window))
