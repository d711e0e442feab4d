"""Means over an evaluation's seeds with their 95 % intervals, per (load, policy) and paired.

Intervals (:func:`mean_interval`): mean ± t(0.975, n − 1) × s / √n over the n seeds
(Student's t; none with one seed). A run whose requests all miss the SLO has no effective
quality; its seed is left out of the quality mean, and the interval says over how many seeds.

Argus against PAC (:func:`paired`) differences the two policies seed by seed (they saw the same
workload, tables and cluster), and reports the share of the oracle's gain over PAC that the
trained classifier keeps where the oracle has a gain.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from argus.sim.evaluate import ORACLE_POLICY
from argus.sim.report import Summary

if TYPE_CHECKING:
    from argus.sim.evaluate import RunRow

# metrics aggregated over seeds, in the order of aggregate.csv (Summary field names)
METRICS = (
    "effective_quality",
    "relative_quality",
    "quality_n",
    "offered_qpm",
    "admitted_qpm",
    "refused_qpm",
    "goodput_qpm",
    "slo_violation_ratio_admitted",
    "slo_violation_ratio",
    "refused_early",
    "fallbacks",
    "spills",
    "load_wait_ratio",
)

# t(0.975, df) for df = 1 … 30 (Student's t, two-sided 95 %)
_T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom: a table up to 30,
    the Cornish-Fisher expansion beyond (error below 1e-5 there)."""
    if df < 1:
        raise ValueError(f"df: must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its two-sided 95 % t-interval (NaN bounds with one value)."""

    mean: float
    lo: float
    hi: float
    n: int  # values averaged (finite ones)

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0


def mean_interval(values: Iterable[float]) -> Interval:
    """Mean ± t(0.975, n − 1) × sample standard deviation / √n of the finite ``values``."""
    data = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    n = int(data.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(data.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile_975(n - 1) * float(data.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def _metric(summary: Summary, name: str) -> float:
    value = float(getattr(summary, name))
    if name in ("effective_quality", "relative_quality") and summary.quality_n == 0:
        return math.nan  # no request met the SLO: no quality to average
    return value


@dataclass(frozen=True)
class Aggregate:
    """Every metric of one (load, policy) over the seeds."""

    load: float
    peak: float | None
    policy: str
    metrics: Mapping[str, Interval]


def aggregate(rows: Sequence[RunRow]) -> list[Aggregate]:
    """One :class:`Aggregate` per (load point, policy), in the order the rows came."""
    groups: dict[tuple[float, float | None, str], list[Summary]] = {}
    for row in rows:
        groups.setdefault((row.load, row.peak, row.policy), []).append(row.summary)
    return [
        Aggregate(
            load,
            peak,
            policy,
            {name: mean_interval(_metric(s, name) for s in summaries) for name in METRICS},
        )
        for (load, peak, policy), summaries in groups.items()
    ]


@dataclass(frozen=True)
class Paired:
    """Argus against PAC at one load, paired by seed."""

    load: float
    peak: float | None
    quality_diff: Interval  # effective quality, argus − pac
    goodput_diff: Interval  # goodput QPM, argus − pac
    oracle_diff: Interval  # effective quality, argus-oracle − pac (n = 0 when it did not run)
    argus_quality: float  # means over the seeds
    pac_quality: float
    oracle_quality: float  # argus-oracle's; NaN when it did not run
    gap_closed: float  # (argus − pac) / (argus-oracle − pac); NaN when there is no gap


def paired(rows: Sequence[RunRow]) -> list[Paired]:
    """Argus − PAC per load (seeds where both ran), and the share of the oracle's gain over
    PAC that Argus keeps (on the loads where argus, pac and argus-oracle all ran).

    The share is only defined where there is a gain to share: where argus-oracle beats PAC,
    by a paired 95 % interval above zero (with one seed, by a positive difference). Elsewhere
    (the oracle is no better than PAC, typically at loads where every policy runs the
    fastest level) it is NaN, as a ratio of two noisy near-zero numbers means nothing."""
    by_key: dict[tuple[float, float | None], dict[str, dict[int, Summary]]] = {}
    for row in rows:
        by_key.setdefault((row.load, row.peak), {}).setdefault(row.policy, {})[row.seed] = (
            row.summary
        )
    out = []
    for (load, peak), policies in by_key.items():
        argus, pac = policies.get("argus"), policies.get("pac")
        if argus is None or pac is None:
            continue
        seeds = sorted(set(argus) & set(pac))
        quality = [
            _metric(argus[s], "effective_quality") - _metric(pac[s], "effective_quality")
            for s in seeds
        ]
        goodput = [argus[s].goodput_qpm - pac[s].goodput_qpm for s in seeds]
        means = {
            name: mean_interval(_metric(runs[s], "effective_quality") for s in seeds).mean
            for name, runs in policies.items()
            if all(s in runs for s in seeds)
        }
        q_argus, q_pac = means["argus"], means["pac"]
        q_oracle = means.get(ORACLE_POLICY, math.nan)
        oracle = policies.get(ORACLE_POLICY, {})
        oracle_diff = mean_interval(
            _metric(oracle[s], "effective_quality") - _metric(pac[s], "effective_quality")
            for s in seeds
            if s in oracle
        )
        closed = math.nan
        if _gain(oracle_diff):
            closed = (q_argus - q_pac) / (q_oracle - q_pac)
        out.append(
            Paired(
                load,
                peak,
                mean_interval(quality),
                mean_interval(goodput),
                oracle_diff,
                q_argus,
                q_pac,
                q_oracle,
                closed,
            )
        )
    return out


def _gain(diff: Interval) -> bool:
    """Whether a paired difference is a gain: its interval is above zero (one seed: > 0)."""
    if diff.n == 0 or not diff.mean > 0.0:
        return False
    return diff.n == 1 or diff.lo > 0.0
