"""Where the oracle's gain over ``argus-text`` comes from, and where ``argus`` loses a pair.

``argus-oracle`` differs from ``argus-text`` in two ways: it knows each prompt's quality at
every level (the quality table, not the classifier), and it routes by what the caches hold.
Two ``argus evaluate`` runs on the same workloads split its gain (paired over seeds):

* ``--runs``: the sweep itself (``argus``, ``argus-text``, ``argus-oracle``, … with the
  trained classifier);
* ``--oracle-runs``: the same sweep with ``--classifier oracle --policies argus,argus-text``,
  whose ``argus-text`` is the *text oracle*: the table's levels, blind to the caches.

Then ``argus-oracle − argus-text`` = (text oracle − ``argus-text``: what knowing the table
gives) + (``argus-oracle`` − text oracle: what seeing the caches gives once the levels are
right). The second part is the similarity-aware oracle's own gain: the share of the oracle's
gain that the caches' evidence can reach. ``argus − argus-text`` is printed beside it.

Second, for every other policy and load of ``--runs``: the pairs where ``argus`` is clearly
below in quality (the paired 95 % interval below 0) or clearly above in SLO violations, and
whether that policy dominates ``argus`` (both at once)::

    .venv/bin/python benchmarks/cache_oracle_split.py \\
        --runs docs/evaluation/cache-sweep/poisson-realistic-best/runs.csv \\
        --oracle-runs docs/evaluation/cache-oracle/poisson-best/runs.csv

Quality here is what ``runs.csv`` calls ``effective_quality``: the mean over the requests
served within the SLO (SYNTHETIC in the synthetic world).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from argus.sim.intervals import Interval, mean_interval

Runs = dict[tuple[str, int, str], dict[str, str]]  # (load, seed, policy) → runs.csv row


def read_runs(path: Path) -> Runs:
    with path.open(newline="") as handle:
        return {(r["load"], int(r["seed"]), r["policy"]): r for r in csv.DictReader(handle)}


def paired(a: Runs, a_policy: str, b: Runs, b_policy: str, load: str, metric: str) -> Interval:
    """``a_policy`` of ``a`` − ``b_policy`` of ``b`` on ``metric``, seed by seed, over the
    seeds both ran at ``load``."""
    seeds = sorted(
        s for (lo, s, p) in a if lo == load and p == a_policy and (load, s, b_policy) in b
    )
    if not seeds:
        raise SystemExit(f"no seed has both {a_policy} and {b_policy} at load {load}")
    return mean_interval(
        float(a[(load, s, a_policy)][metric]) - float(b[(load, s, b_policy)][metric]) for s in seeds
    )


@dataclass(frozen=True)
class Split:
    load: str
    oracle: Interval  # argus-oracle − argus-text
    table: Interval  # text oracle − argus-text
    similarity: Interval  # argus-oracle − text oracle
    argus: Interval  # argus − argus-text


def split(runs: Runs, oracle_runs: Runs) -> list[Split]:
    """The oracle's gain over argus-text, split per load (see the module's text)."""
    loads = sorted({lo for (lo, _, p) in runs if p == "argus-oracle"}, key=float)
    q = "effective_quality"
    return [
        Split(
            load,
            paired(runs, "argus-oracle", runs, "argus-text", load, q),
            paired(oracle_runs, "argus-text", runs, "argus-text", load, q),
            paired(runs, "argus-oracle", oracle_runs, "argus-text", load, q),
            paired(runs, "argus", runs, "argus-text", load, q),
        )
        for load in loads
    ]


@dataclass(frozen=True)
class Loss:
    load: str
    policy: str
    quality: Interval  # argus − policy
    violations: Interval  # argus − policy, share of offered requests

    @property
    def dominated(self) -> bool:
        """The other policy has clearly higher quality and clearly fewer violations."""
        return self.quality.hi < 0 and self.violations.lo > 0


def losses(runs: Runs) -> list[Loss]:
    """Every (load, policy) where argus is clearly below in quality or above in violations."""
    out = []
    pairs = {(lo, p) for (lo, _, p) in runs if p not in ("argus", "argus-oracle")}
    for load, policy in sorted(pairs, key=lambda k: (float(k[0]), k[1])):
        quality = paired(runs, "argus", runs, policy, load, "effective_quality")
        violations = paired(runs, "argus", runs, policy, load, "slo_violation_ratio")
        if quality.hi < 0 or violations.lo > 0:
            out.append(Loss(load, policy, quality, violations))
    return out


def _fmt(i: Interval, scale: float = 1.0) -> str:
    return f"{i.mean * scale:+.3f} [{i.lo * scale:+.3f}, {i.hi * scale:+.3f}]"


def main(argv: Sequence[str] | None = None) -> tuple[list[Split], list[Loss]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--oracle-runs", type=Path, required=True)
    args = parser.parse_args(argv)
    runs, oracle_runs = read_runs(args.runs), read_runs(args.oracle_runs)
    splits = split(runs, oracle_runs)
    print(
        "| load | argus-oracle − argus-text | of which the table (text oracle − argus-text) "
        "| of which the caches (argus-oracle − text oracle) | argus − argus-text |"
    )
    print("|---|---|---|---|---|")
    for s in splits:
        print(
            f"| {s.load} | {_fmt(s.oracle)} | {_fmt(s.table)} | {_fmt(s.similarity)} "
            f"| {_fmt(s.argus)} |"
        )
    found = losses(runs)
    print()
    print(
        "| load | policy | argus − policy, quality "
        "| argus − policy, violations (points) | dominated |"
    )
    print("|---|---|---|---|---|")
    for loss in found:
        print(
            f"| {loss.load} | {loss.policy} | {_fmt(loss.quality)} "
            f"| {_fmt(loss.violations, 100)} | {'yes' if loss.dominated else 'no'} |"
        )
    if not found:
        print("| – | none | | | |")
    return splits, found


if __name__ == "__main__":
    main()
