"""Per-component switch costs against the monolith's, paired seed by seed (issue 35).

Reads two sets of simulator outputs made with the same seeds, one with the default profiles
(``--profiles default``: a switch loads only the parts the worker does not hold) and one with
``--profiles default:monolithic`` (every switch loads the whole model), and prints for each
policy the share of admitted requests that waited on a model load, the effective quality,
the SLO violations (refused included) and the model switches: each set's mean over the seeds
and the paired difference, with 95 % t-intervals (:func:`argus.sim.intervals.mean_interval`).

Each argument is an ``argus evaluate`` output directory (its ``runs.csv``, one load point) or a
directory of ``argus replay`` outputs, one sub-directory per seed named ``seed-N``
(``summary.json``)::

    PYTHONPATH=. .venv/bin/python benchmarks/paired_switch_costs.py PARTS_DIR MONOLITH_DIR
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from argus.sim.intervals import mean_interval

METRICS = ("load_wait_ratio", "effective_quality", "slo_violation_ratio", "model_switches")
PERCENT = ("load_wait_ratio", "slo_violation_ratio")


def read_runs(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(policy, seed) → the run's summary."""
    runs = directory / "runs.csv"
    if runs.is_file():
        with runs.open() as handle:
            return {(r["policy"], r["seed"]): r for r in csv.DictReader(handle)}
    out = {}
    for seed_dir in sorted(directory.glob("seed-*")):
        policies = json.loads((seed_dir / "summary.json").read_text())["policies"]
        for policy, summary in policies.items():
            out[policy, seed_dir.name.removeprefix("seed-")] = summary
    return out


def interval(name: str, values: list[float], *, signed: bool = False) -> str:
    """Mean [95 % interval]; percentages for shares, signs for differences."""
    i = mean_interval(values)
    scale, unit = (100.0, "%") if name in PERCENT else (1.0, "")
    form = "+.2f" if signed else ".2f"
    return f"{scale * i.mean:{form}}{unit} [{scale * i.lo:{form}}, {scale * i.hi:{form}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", type=Path, help="outputs with the default (per-part) costs")
    parser.add_argument("monolith", type=Path, help="outputs with default:monolithic")
    args = parser.parse_args()
    parts, whole = read_runs(args.parts), read_runs(args.monolith)
    for policy in sorted({p for p, _ in parts}):
        seeds = sorted(s for p, s in parts if p == policy and (p, s) in whole)
        print(f"{policy} ({len(seeds)} seeds)")
        for name in METRICS:
            a = [float(parts[policy, s][name]) for s in seeds]
            b = [float(whole[policy, s][name]) for s in seeds]
            diff = [x - y for x, y in zip(a, b, strict=True)]
            print(
                f"  {name:20} parts {interval(name, a):28} monolith {interval(name, b):28} "
                f"difference {interval(name, diff, signed=True)}"
            )


if __name__ == "__main__":
    main()
