"""``LocalCluster``'s CPU sets: a part started through the cluster's own spawn path runs every
thread on its set (the router on ``router_cpus``, the rest on ``compute_cpus``), and a set
this process may not use is refused, naming the field.

Two allocators (the quickest part to start, no model) stand in for the parts; one is started
under the router's name, which is what picks the set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from argus.tools.local_cluster import ClusterSpec, LocalCluster, inherited_affinity

pytestmark = pytest.mark.integration

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning shows only with 2+ CPUs")


def thread_cpus(pid: int) -> dict[int, str]:
    """Each thread of ``pid``: its ``Cpus_allowed_list`` (``1``, ``0-1``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


@needs_two_cpus
def test_every_thread_of_a_part_runs_on_its_cpu_set(tmp_path: Path) -> None:
    router_cpu, compute_cpu = CPUS[0], CPUS[-1]
    spec = ClusterSpec(
        workdir=tmp_path, metrics=False, router_cpus=(router_cpu,), compute_cpus=(compute_cpu,)
    )
    cluster = LocalCluster(spec)
    before = os.sched_getaffinity(0)
    try:
        cluster._launch("allocator", "allocator")
        cluster._launch("router", "allocator")  # a quick part, under the router's name
        for name in ("allocator", "router"):
            cluster._wait_address(name)  # serving: its gRPC threads are running
        assert os.sched_getaffinity(0) == before  # the spawning thread got its own set back
        for name, cpu in (("allocator", compute_cpu), ("router", router_cpu)):
            threads = thread_cpus(cluster.parts[name].process.pid)
            assert len(threads) > 1, name  # gRPC's threads, not only the main one
            assert set(threads.values()) == {str(cpu)}, name
    finally:
        cluster.stop()


def test_unpinned_parts_inherit_the_spawning_threads_set() -> None:
    before = os.sched_getaffinity(0)
    with inherited_affinity(None):
        assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("field", ["router_cpus", "compute_cpus"])
@pytest.mark.parametrize("cpus", [(), (max(CPUS, default=0) + 1,), (0, 4096)])
def test_a_cpu_set_outside_this_process_is_refused_by_name(
    field: str, cpus: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        ClusterSpec(workdir=Path("unused"), **{field: cpus})  # type: ignore[arg-type]
