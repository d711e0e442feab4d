"""benchmarks/_pinning.py: the noisy neighbour runs on the CPU set and at the nice value it
was given, really spins, and is gone once its ``with`` ends; the load generator's pin covers
every thread it already has."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.fixture
def pinning() -> Iterator[Any]:
    with benchmark_module("_pinning") as module:
        yield module


def allowed(pid: int | str) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return status.split("Cpus_allowed_list:", 1)[1].split()[0]


@pytest.mark.skipif(len(CPUS) < 2, reason="pinning shows only with 2+ CPUs")
def test_the_neighbour_spins_on_its_cpus_at_its_nice_until_stopped(pinning: Any) -> None:
    with pinning.NoisyNeighbour((CPUS[-1],), 7) as neighbour:
        pid = neighbour.process.pid
        time.sleep(0.5)
        assert allowed(pid) == str(CPUS[-1])
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.nice(0) + 7)
        assert pinning.cpu_seconds(pid) > 0.05
        assert "of a core" in neighbour.usage_line()
    assert neighbour.process.poll() is not None  # stopped, by its own pid


@pytest.mark.skipif(len(CPUS) < 2, reason="pinning shows only with 2+ CPUs")
def test_pinning_this_process_moves_the_threads_it_already_has(pinning: Any) -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    before = os.sched_getaffinity(0)
    try:
        pinning.pin_this_process((CPUS[-1],))
        assert allowed(f"self/task/{thread.native_id}") == str(CPUS[-1])
    finally:
        pinning.pin_this_process(sorted(before))
        release.set()
        thread.join()


def test_the_router_gets_the_first_cpu_and_the_rest_the_others(pinning: Any) -> None:
    if len(CPUS) < 2:
        with pytest.raises(SystemExit):
            pinning.split_cpus()
        return
    router, others = pinning.split_cpus()
    assert router == (CPUS[0],) and others == tuple(CPUS[1:])
    assert "the router on CPU" in pinning.mode_line((router, others), "workers")
