"""benchmarks/bench_concurrency.py runs end to end at a small setting: its worker and router
processes start, a burst goes over each transport and its figures are printed (the counts
add up; nothing about timing is checked: it depends on the machine)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration


@pytest.fixture
def bench_concurrency() -> Iterator[Any]:
    """The benchmark module; benchmarks/ is a folder of scripts that import `_machine`."""
    with benchmark_module("bench_concurrency") as module:
        yield module


def test_a_small_burst_over_both_transports(
    bench_concurrency: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    results = bench_concurrency.main(["--requests", "20", "--deadline-ms", "500"])
    printed = capsys.readouterr().out
    assert "gRPC's own bound" in printed and "load average at end" in printed
    for transport in ("grpc", "http"):
        figures = results[transport]
        assert f"-- {transport}: 20 requests at once" in printed
        assert figures["answered"] == 20  # loopback, far below every bound: all answered
        kinds = ("served", "refused_argus", "refused_transport")
        assert sum(figures[k] for k in kinds) + sum(figures["other"].values()) == 20
        assert figures["refused_transport"] == 0


def test_a_pinned_burst_beside_a_noisy_neighbour_reports_health_during_it(
    bench_concurrency: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs 2+ CPUs")
    before = os.sched_getaffinity(0)
    try:
        argv = ["--requests", "20", "--deadline-ms", "500", "--transports", "http"]
        results = bench_concurrency.main([*argv, "--pin", "--noisy-neighbour"])
    finally:
        bench_concurrency.pin_this_process(sorted(before))  # it pinned this process (its loadgen)
    printed = capsys.readouterr().out
    assert "mode: pinned (the router on CPU" in printed and "noisy neighbour (pid" in printed
    assert results["pinned"] is not None and results["noisy_neighbour"]
    for protocol in ("http", "grpc"):
        health = results["http"]["health"][protocol]
        assert health["probes"] > 0 and health["failed"] == 0  # loopback, 20 requests
        assert health["p50_ms"] <= health["p99_ms"] <= health["max_ms"]
