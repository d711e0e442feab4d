"""benchmarks/bench_router.py runs end to end at a tiny setting: its stub-worker and router
processes start, the router classifies with the real default classifier, every request is
answered OK, none from the classifier's cache, and every figure is there (no timing checks)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.integration


@pytest.fixture
def bench_router() -> Iterator[Any]:
    """The benchmark module; benchmarks/ is a folder of scripts that import `_machine`."""
    with benchmark_module("bench_router") as module:
        yield module


def test_every_request_is_answered_and_measured(
    bench_router: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "router.json"
    argv = ["--rates", "20", "--seconds", "1", "--workers", "2", "--json", str(out)]
    results = bench_router.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    [row] = results["rates"]
    assert row["offered_per_s"] == 20
    assert row["sent"] > 0
    assert row["ok"] == row["sent"]
    assert row["errors"] == {} and row["refused"] == 0 and row["cancelled"] == 0
    # every request was classified for real: distinct prompts, no cache hit
    assert row["classifier"]["cache_hits"] == 0
    assert row["classifier"]["cache_misses"] == row["classifier"]["items"] == row["sent"]
    for name in ("overhead_ms", "client_ms", "router_internal_ms", "route_ms", "worker_ms"):
        assert all(math.isfinite(v) for v in row[name].values()), name
    assert row["overhead_ms"]["p50"] <= row["overhead_ms"]["p99"] <= row["overhead_ms"]["max"]
    assert len(results["plan"]["assignment"]) == 2
    printed = capsys.readouterr().out
    assert "classifier: default (minilm-l2-logistic-int8; encoder runtime onnx" in printed
    assert "stub-fast workers on this machine" in printed
    assert "overhead ms: p50" in printed


def test_prompts_never_repeat_across_passes(bench_router: Any) -> None:
    base = ["a cat", "a dog", "a bus"]
    stream = bench_router.distinct_prompts(base, 0, 10)
    assert stream[:3] == base and stream[3] == "a cat, variation 1"
    assert len(set(stream)) == 10
    assert bench_router.distinct_prompts(base, 4, 3) == stream[4:7]


def test_the_floor_router_gets_the_same_arrivals_and_is_reported_beside(
    bench_router: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--rates", "20", "--seconds", "1", "--workers", "2", "--classifier", "stub"]
    results = bench_router.main([*argv, "--floor"])

    floor, argus = results["rates"]
    assert (floor["router"], argus["router"]) == ("floor", "argus")
    assert floor["sent"] == argus["sent"] > 0  # the same arrival times, one after the other
    assert floor["ok"] == floor["sent"] and argus["ok"] == argus["sent"]
    assert floor["classifier"] == {}  # the floor neither classifies nor routes
    assert all(math.isfinite(v) for v in floor["overhead_ms"].values())
    assert floor["router_cpu_ms_per_request"] > 0.0
    assert results["floor"] is True
    printed = capsys.readouterr().out
    assert "the router over the floor" in printed
    assert "20 req/s: overhead p50" in printed


def test_router_replicas_share_the_arrivals(bench_router: Any) -> None:
    argv = ["--rates", "20", "--seconds", "1", "--workers", "2", "--classifier", "stub"]
    results = bench_router.main([*argv, "--routers", "2"])

    [row] = results["rates"]
    assert results["routers"] == 2
    assert row["ok"] == row["sent"] > 1
    first, second = row["ok_by_router"]  # every other request to each replica
    assert first + second == row["sent"] and abs(first - second) <= 1
    assert row["router_cpu_ms_per_request"] > 0.0  # both processes counted together
