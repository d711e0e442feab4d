"""benchmarks/gain_bound.py: the mixed-integer exact bound agrees with enumerating every split,
and an ``argus evaluate`` output directory is read into paired differences as paired.csv has
them (no figures of the real worlds are checked: the benchmark prints those)."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.benchmark_modules import benchmark_module

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gain_bound() -> Iterator[Any]:
    """The benchmark module; benchmarks/ is a folder of scripts that import `_machine`."""
    with benchmark_module("gain_bound") as module:
        yield module


def _caps(levels: int, gpus: int, rng: np.random.Generator) -> dict[tuple[int, int], float]:
    """Caps that grow with the pool, as a queue's do."""
    caps = {}
    for v in range(levels):
        grow = np.sort(rng.uniform(0.2, 1.0, gpus))
        caps[v, 0] = 0.0
        for n in range(1, gpus + 1):
            caps[v, n] = float(grow[n - 1])
    return caps


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_enumeration(gain_bound: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    levels, classes, gpus = 4, 3, 5
    # slower levels are better, differently per class
    quality = np.sort(rng.uniform(15.0, 21.0, (classes, levels)), axis=1)[:, ::-1].copy()
    weights = rng.dirichlet(np.ones(classes))
    rate = np.sort(rng.uniform(10.0, 30.0, levels))
    caps = _caps(levels, gpus, rng)
    for load in (0.3, 0.6, 0.9):
        qpm = load * gpus * rate[-1]
        want, _ = gain_bound.exact(quality, weights, qpm, rate, caps, gpus)
        got, split = gain_bound.exact_milp(quality, weights, qpm, rate, caps, gpus)
        if not math.isfinite(want):
            assert got == float("-inf")
            continue
        assert got == pytest.approx(want, abs=1e-6)
        assert sum(split) == gpus
        # the split it names reaches that optimum
        capacity = np.array([split[v] * rate[v] * caps[v, split[v]] for v in range(levels)])
        assert gain_bound.best_shares(quality, weights, qpm, capacity) == pytest.approx(
            got, abs=1e-6
        )


def test_milp_does_not_fit(gain_bound: Any) -> None:
    quality = np.array([[20.0, 18.0]])
    rate = np.array([10.0, 20.0])
    caps = {(v, n): (0.5 if n else 0.0) for v in range(2) for n in range(3)}
    assert gain_bound.exact_milp(quality, np.ones(1), 100.0, rate, caps, 2) == (
        float("-inf"),
        (),
    )


FIELDS = ["load", "peak", "seed", "policy", "effective_quality", "quality_n", "slo_violation_ratio"]


def _write_runs(path: Path, rows: list[tuple[float, int, str, float]]) -> None:
    with (path / "runs.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        writer.writeheader()
        for load, seed, policy, quality in rows:
            writer.writerow(
                {
                    "load": load,
                    "peak": "",
                    "seed": seed,
                    "policy": policy,
                    "effective_quality": quality,
                    "quality_n": 100,
                    "slo_violation_ratio": 0.01 * seed,
                }
            )


def test_measured_rows_pair_by_seed(gain_bound: Any, tmp_path: Path) -> None:
    rows = []
    for seed in range(3):
        base = 18.0 + seed  # seeds differ a lot, the pairs little
        rows += [
            (0.5, seed, "pac", base),
            (0.5, seed, "argus", base + 0.1 + 0.01 * seed),
            (0.5, seed, "argus-oracle", base + 0.2 + 0.02 * (seed - 1)),
            (0.5, seed, "proteus", base - 0.3),
            (0.5, seed, "sommelier", base + 0.5),
        ]
    _write_runs(tmp_path, rows)
    (row,) = gain_bound.measured_rows(tmp_path)
    assert row.seeds == 3
    assert row.argus_pac.mean == pytest.approx(0.11)
    assert 0.0 < row.argus_pac.lo < 0.11 < row.argus_pac.hi  # paired: seeds' spread gone
    assert row.oracle_pac.mean == pytest.approx(0.2)
    assert row.kept == pytest.approx(0.11 / 0.2)
    assert row.argus_proteus.mean == pytest.approx(0.41)
    assert row.argus_sommelier.mean == pytest.approx(-0.39)
    assert row.violations["argus"] == pytest.approx(0.01)
    assert row.requests == 100


def test_kept_only_where_the_oracle_gains(gain_bound: Any, tmp_path: Path) -> None:
    rows = []
    for seed in range(3):
        rows += [
            (0.3, seed, "pac", 20.0),
            (0.3, seed, "argus", 20.0 + 0.01 * (seed - 1)),
            (0.3, seed, "argus-oracle", 20.0 + 0.02 * (seed - 1)),
        ]
    _write_runs(tmp_path, rows)
    (row,) = gain_bound.measured_rows(tmp_path)
    assert math.isnan(row.kept)
    assert math.isnan(row.argus_proteus.mean)
    assert gain_bound.format_interval(row.argus_proteus) == "-"


def test_acceptance_names_each_failure(gain_bound: Any, tmp_path: Path) -> None:
    rows = []
    for seed in range(3):
        jitter = 0.01 * (seed - 1)
        rows += [
            (0.5, seed, "pac", 18.0 + seed),
            (0.5, seed, "argus", 18.1 + seed + jitter),  # above PAC
            (0.5, seed, "argus-oracle", 18.5 + seed + jitter),  # clear gain, 20% kept
            (0.5, seed, "proteus", 18.5 + seed + jitter),  # Argus clearly below Proteus
            (0.5, seed, "sommelier", 18.1 + seed - jitter),  # within the interval
        ]
    _write_runs(tmp_path, rows)
    measured = gain_bound.measured_rows(tmp_path)
    failures = gain_bound.acceptance(measured, uniform=False)
    assert any("quality below proteus" in line for line in failures)
    assert any("kept 20%" in line for line in failures)
    assert not any("sommelier" in line or "pac:" in line for line in failures)
    assert any("excludes 0" in line for line in gain_bound.acceptance(measured, uniform=True))
