"""benchmarks/cache_oracle_split.py: the oracle's gain over argus-text splits, seed by seed,
into the table's part and the caches' part (the two add up to it), and a policy with clearly
higher quality and fewer violations than argus is reported as dominating it."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.unit

FIELDS = ("load", "seed", "policy", "effective_quality", "slo_violation_ratio")


@pytest.fixture
def split_module() -> Iterator[Any]:
    with benchmark_module("cache_oracle_split") as module:
        yield module


def write_runs(path: Path, rows: list[tuple[str, int, str, float, float]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(FIELDS)
        writer.writerows(rows)
    return path


def runs_of(quality: dict[str, list[float]], violations: dict[str, float]) -> list[Any]:
    return [
        ("0.7", seed, policy, q, violations.get(policy, 0.01))
        for policy, values in quality.items()
        for seed, q in enumerate(values)
    ]


def test_the_split_adds_up_and_a_dominating_policy_is_named(
    split_module: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = write_runs(
        tmp_path / "runs.csv",
        runs_of(
            {
                "argus": [16.0, 16.1, 16.2],
                "argus-text": [16.0, 16.0, 16.1],
                "argus-oracle": [16.5, 16.6, 16.8],
                "nirvana": [17.0, 17.1, 17.2],  # higher quality, far more violations
                "proteus": [16.5, 16.6, 16.7],  # higher quality, fewer violations
            },
            {"nirvana": 0.5, "argus": 0.02, "argus-text": 0.02, "proteus": 0.001},
        ),
    )
    oracle = write_runs(
        tmp_path / "oracle.csv",
        runs_of({"argus": [16.5, 16.6, 16.8], "argus-text": [16.4, 16.4, 16.5]}, {}),
    )
    splits, losses = split_module.main(["--runs", str(sweep), "--oracle-runs", str(oracle)])
    (s,) = splits
    assert s.oracle.mean == pytest.approx(s.table.mean + s.similarity.mean)
    assert s.table.mean == pytest.approx((0.4 + 0.4 + 0.4) / 3)
    assert s.similarity.mean == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert s.argus.mean == pytest.approx((0.0 + 0.1 + 0.1) / 3)
    named = {loss.policy: loss.dominated for loss in losses}
    assert named == {"nirvana": False, "proteus": True}
    assert "| 0.7 | proteus |" in capsys.readouterr().out


def test_a_policy_missing_from_the_oracle_runs_is_named(split_module: Any, tmp_path: Path) -> None:
    sweep = write_runs(
        tmp_path / "runs.csv",
        runs_of({"argus": [1.0, 1.0], "argus-text": [1.0, 1.0], "argus-oracle": [1.0, 1.0]}, {}),
    )
    oracle = write_runs(tmp_path / "oracle.csv", runs_of({"argus": [1.0, 1.0]}, {}))
    with pytest.raises(SystemExit, match="argus-text"):
        split_module.main(["--runs", str(sweep), "--oracle-runs", str(oracle)])
