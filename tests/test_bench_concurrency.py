"""benchmarks/bench_concurrency.py runs end to end at a small setting: its worker and router
processes start, a burst goes over each transport and its figures are printed (the counts
add up; nothing about timing is checked: it depends on the machine)."""

from __future__ import annotations

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
