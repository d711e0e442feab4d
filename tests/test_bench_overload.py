"""benchmarks/bench_overload.py runs end to end at a small setting: its worker and router
processes start, load is offered above capacity and the table is printed (no figures are
checked: they depend on the machine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration


@pytest.fixture
def bench_overload() -> Iterator[Any]:
    """The benchmark module; benchmarks/ is a folder of scripts that import `_machine`."""
    with benchmark_module("bench_overload") as module:
        yield module


def test_a_short_overload_prints_its_table(
    bench_overload: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--duration-s", "3", "--window-s", "1.5", "--load", "2", "--classifier", "stub"]
    results = bench_overload.main(argv)

    printed = capsys.readouterr().out
    assert "capacity" in printed and "(2 × capacity)" in printed
    header = next(line for line in printed.splitlines() if "offered/s" in line)
    for column in ("served/s", "% cap", "refused", "ref p50 ms", "ref p95 ms", "deadline"):
        assert column in header
    assert "0-1.5 s" in printed and "1.5-3 s" in printed  # one row per window
    assert "refusals p50" in printed
    assert "load average after:" in printed
    assert [row["window"] for row in results["windows"]] == ["0-1.5 s", "1.5-3 s"]
