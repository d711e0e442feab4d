"""Metrics of replay runs: per-minute series, a summary per policy, files and plots.

Definitions (Argus §5, with the router's admission added):

* offered: the requests of the trace (QPM: per minute of the trace); each one is either
  *admitted* (routed to a worker and served) or *refused* (admission predicted it would miss
  its deadline, :mod:`argus.router.admission`; it gets no image), so
  ``offered = admitted + refused``;
* served QPM: requests completed per minute of the trace (completions after the trace's end,
  its horizon or else its last arrival, are not counted, so an overloaded policy without
  admission shows it);
* SLO: ``slo_factor × the best level's latency`` (3 × SDXL by default); an admitted request is
  *late* when it finishes later than that after arriving;
* goodput: requests served within the SLO (admitted and not late), per minute of the trace;
* SLO violation ratio of admitted requests: late / admitted; of all requests:
  (late + refused) / offered — a refused request is a violation of "all";
* effective quality: mean quality score of the requests served within the SLO, with
  ``quality_n``, how many that is (the goodput's count); relative quality: the same mean of
  score / the prompt's score at the best level of its strategy, over the same requests;
* utilisation: busy GPU seconds (serving and loading models) / (GPUs × simulated time);
* adapter seconds: what ControlNets and LoRAs added to the service time, mean per request
  (0 without adapters; :mod:`argus.sim.adapters`);
* cache: ``hit_rate`` is hits / ``cache_lookups``, the admitted requests served at an AC
  level with K > 0 as their ceiling (a hit resumed from a cached latent; in the ``perfect``
  cache every one is, unless retrieval was down); ``mean_similarity`` is the mean cosine
  similarity of the nearest cached prompt over the ``similarity_n`` lookups that found one
  (1 for a perfect-cache hit; :mod:`argus.sim.cluster_cache`).

Per-minute series count arrivals, refusals, goodput, violations and quality by the minute the
request *arrived*, and served QPM by the minute it finished. Every printed average says how
many requests it covers; quality columns say SYNTHETIC when the quality table is.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from argus.sim.cluster import RunResult


@dataclass(frozen=True)
class Summary:
    """Whole-run figures of one policy (the keys of ``summary.json``)."""

    policy: str
    requests: int  # offered: every request of the trace
    offered_qpm: float
    admitted: int  # let through by admission (served, within the SLO or late)
    admitted_qpm: float
    refused: int  # refused by admission (no image)
    refused_qpm: float
    served_qpm: float  # completions per minute within the trace
    goodput: int  # requests served within the SLO
    goodput_qpm: float
    slo_violation_ratio: float  # (late + refused) / offered
    slo_violation_ratio_admitted: float  # late / admitted (0 when nothing was admitted)
    effective_quality: float  # mean score over the quality_n requests (0 when there are none)
    relative_quality: float  # mean relative score over the same requests
    quality_n: int  # requests the two quality means average: those served within the SLO
    model_switches: int
    plan_changes: int
    strategy_switches: int
    utilisation: float
    adapter_s_mean: float = 0.0
    refused_early: int = 0  # of the refused: by the router's check before classification
    fallbacks: int = 0  # served by a worker of another level than the PASM's target
    spills: int = 0  # admitted at another level than routed: the chosen worker was too late
    # of the admitted requests, the share queued behind a model load on their worker
    load_wait_ratio: float = 0.0
    cache: str = "perfect"  # SimConfig.cache: perfect or realistic
    cache_lookups: int = 0  # admitted requests at an AC level of K > 0 (the hit rate's n)
    hit_rate: float = 0.0  # of those, the share resumed from a cached latent (0 when none)
    mean_similarity: float = 0.0  # nearest cached prompt's similarity, over similarity_n
    similarity_n: int = 0  # lookups that found a cached prompt of their key


def summarise(result: RunResult) -> Summary:
    minutes = max(result.duration_s / 60.0, 1e-9)
    good = result.good
    admitted = result.admitted
    n = len(result.arrivals_s)
    n_admitted = int(np.count_nonzero(admitted))
    n_good = int(np.count_nonzero(good))
    n_late = int(np.count_nonzero(result.late))
    completed = int(np.count_nonzero(admitted & (result.finish_s <= result.duration_s)))
    return Summary(
        policy=result.policy,
        requests=n,
        offered_qpm=n / minutes,
        admitted=n_admitted,
        admitted_qpm=n_admitted / minutes,
        refused=n - n_admitted,
        refused_qpm=(n - n_admitted) / minutes,
        served_qpm=completed / minutes,
        goodput=n_good,
        goodput_qpm=n_good / minutes,
        slo_violation_ratio=float(1.0 - n_good / n) if n else 0.0,
        slo_violation_ratio_admitted=n_late / n_admitted if n_admitted else 0.0,
        effective_quality=float(result.score[good].mean()) if n_good else 0.0,
        relative_quality=float(result.relative[good].mean()) if n_good else 0.0,
        quality_n=n_good,
        model_switches=result.model_switches,
        plan_changes=result.plan_changes,
        strategy_switches=result.strategy_switches,
        utilisation=min(1.0, result.busy_s / result.gpu_seconds) if result.gpu_seconds else 0.0,
        adapter_s_mean=result.adapter_s / n if n else 0.0,
        refused_early=result.refused_early,
        fallbacks=result.fallbacks,
        spills=result.spills,
        load_wait_ratio=(
            int(np.count_nonzero(result.load_waits)) / n_admitted if n_admitted else 0.0
        ),
        **_cache_figures(result),
    )


def _cache_figures(result: RunResult) -> dict[str, Any]:
    """The cache columns of :class:`Summary` (see the module docstring)."""
    looked = result.cache_lookup & result.admitted
    lookups = int(np.count_nonzero(looked))
    hits = int(np.count_nonzero(result.cache_hit & looked))
    similarity = result.similarity[looked]
    found = similarity[~np.isnan(similarity)]
    return {
        "cache": result.cache,
        "cache_lookups": lookups,
        "hit_rate": hits / lookups if lookups else 0.0,
        "mean_similarity": float(found.mean()) if len(found) else 0.0,
        "similarity_n": len(found),
    }


@dataclass(frozen=True)
class MinuteSeries:
    """Per-minute figures of one policy, minute i covering [60 i, 60 (i + 1)) seconds."""

    policy: str
    offered_qpm: np.ndarray  # arrivals in the minute
    admitted_qpm: np.ndarray  # arrivals in the minute that admission let through
    refused_qpm: np.ndarray  # arrivals in the minute that admission refused
    served_qpm: np.ndarray  # completions in the minute
    goodput_qpm: np.ndarray  # arrivals in the minute later served within the SLO
    effective_quality: np.ndarray  # mean score of those; NaN in minutes where none met the SLO
    quality_n: np.ndarray  # how many requests each minute's quality averages (= goodput)
    slo_violation_ratio: np.ndarray  # (late + refused) / offered; NaN without arrivals
    slo_violation_ratio_admitted: np.ndarray  # late / admitted; NaN when nothing was admitted
    model_switches: np.ndarray  # model loads begun in the minute
    plan_changes: np.ndarray  # re-plans in the minute that moved at least one worker
    utilisation: np.ndarray  # busy GPU-seconds / (GPUs x 60 s)


def per_minute(result: RunResult) -> MinuteSeries:
    minutes = max(1, math.ceil(result.duration_s / 60.0))
    # an arrival exactly at the end of the run counts in its last minute
    arrival_minute = np.minimum((result.arrivals_s // 60.0).astype(np.int64), minutes - 1)
    admitted = result.admitted
    finish_minute = np.where(admitted, result.finish_s // 60.0, minutes).astype(np.int64)
    done = finish_minute < minutes
    good = result.good

    def by_arrival_minute(weights: np.ndarray | None = None) -> np.ndarray:
        counts = np.bincount(arrival_minute, weights=weights, minlength=minutes)[:minutes]
        return counts.astype(float)

    offered = by_arrival_minute()
    admitted_n = by_arrival_minute(admitted.astype(float))
    late = by_arrival_minute(result.late.astype(float))
    good_n = by_arrival_minute(good.astype(float))
    quality = by_arrival_minute(np.where(good, result.score, 0.0))
    served = np.bincount(finish_minute[done], minlength=minutes)[:minutes].astype(float)
    busy = np.zeros(minutes)
    recorded = np.asarray(result.busy_by_minute_s[:minutes], dtype=float)
    busy[: len(recorded)] = recorded
    with np.errstate(invalid="ignore", divide="ignore"):
        return MinuteSeries(
            policy=result.policy,
            offered_qpm=offered,
            admitted_qpm=admitted_n,
            refused_qpm=offered - admitted_n,
            served_qpm=served,
            goodput_qpm=good_n,
            effective_quality=np.where(good_n > 0, quality / good_n, np.nan),
            quality_n=good_n,
            slo_violation_ratio=np.where(offered > 0, (offered - good_n) / offered, np.nan),
            slo_violation_ratio_admitted=np.where(admitted_n > 0, late / admitted_n, np.nan),
            model_switches=_count_by_minute(result.switch_times_s, minutes),
            plan_changes=_count_by_minute(result.plan_change_times_s, minutes),
            utilisation=np.minimum(1.0, busy / (60.0 * result.gpus)),
        )


def _count_by_minute(times_s: Sequence[float], minutes: int) -> np.ndarray:
    if not times_s:
        return np.zeros(minutes)
    index = (np.asarray(times_s) // 60.0).astype(np.int64)
    return np.bincount(index[index < minutes], minlength=minutes)[:minutes].astype(float)


def is_synthetic(quality_description: str) -> bool:
    """Whether a report's quality description names the SYNTHETIC quality model."""
    return "synthetic" in quality_description.lower()


def format_table(summaries: Sequence[Summary], *, synthetic_quality: bool = True) -> str:
    """A fixed-width table of the summaries, one row per policy, with a legend.

    Rates are per minute of the trace with the request count they cover in parentheses; each
    ratio and mean says over how many requests it is taken.
    """
    header = (
        f"{'policy':<12} {'offered QPM (n)':>16} {'refused QPM (n)':>16} "
        f"{'goodput QPM (n)':>16} {'late/admitted':>16} {'violated/all':>16} "
        f"{'quality':>7} {'rel.q':>6} {'over n':>7} {'switches':>8} {'util':>5}"
    )
    rows = [header, "-" * len(header)]
    for s in summaries:
        rows.append(
            f"{s.policy:<12} {_rate(s.offered_qpm, s.requests):>16} "
            f"{_rate(s.refused_qpm, s.refused):>16} {_rate(s.goodput_qpm, s.goodput):>16} "
            f"{_share(s.slo_violation_ratio_admitted, s.admitted):>16} "
            f"{_share(s.slo_violation_ratio, s.requests):>16} "
            f"{_mean(s.effective_quality, s.quality_n, 2):>7} "
            f"{_mean(s.relative_quality, s.quality_n, 3):>6} {s.quality_n:>7,} "
            f"{s.model_switches:>8d} {s.utilisation:>5.0%}"
        )
    source = (
        "SYNTHETIC scores, argus/profiles/synthetic_quality.py"
        if synthetic_quality
        else "measured scores"
    )
    rows.append(
        f"quality ({source}), rel.q: means over the 'over n' requests served within the SLO"
    )
    rows.append("late/admitted: SLO violations of admitted requests; violated/all: late + refused")
    return "\n".join(rows)


def _rate(qpm: float, count: int) -> str:
    return f"{qpm:.1f} ({count:,})"


def _share(ratio: float, count: int) -> str:
    return f"{ratio:.1%} of {count:,}"


def _mean(value: float, count: int, digits: int) -> str:
    return f"{value:.{digits}f}" if count else "-"


def write_reports(
    results: Sequence[RunResult], out_dir: Path, *, description: dict[str, str]
) -> list[Summary]:
    """Write ``summary.json``, ``per_minute.csv`` and ``timeseries.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [summarise(r) for r in results]
    series = [per_minute(r) for r in results]
    document = {
        "description": description,
        "definitions": DEFINITIONS,
        "policies": {s.policy: asdict(s) for s in summaries},
    }
    (out_dir / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    _write_csv(series, out_dir / "per_minute.csv")
    synthetic = is_synthetic(description.get("quality", ""))
    _plot(series, out_dir / "timeseries.png", description.get("title", "replay"), synthetic)
    return summaries


DEFINITIONS = {
    "requests": "offered requests (= admitted + refused)",
    "refused": "refused by admission: predicted to miss the deadline, never served",
    "refused_early": "of the refused, by the router's check before classification: no live "
    "worker could finish the request in time at the cheapest level it may be served at "
    "(planned policies; the baselines are admitted after routing only)",
    "fallbacks": "requests the router sent to a worker of another level than the PASM's "
    "target (none of the target's workers was live, or the request's cap forced it)",
    "spills": "requests the router admitted at another level than it routed them to, because "
    "the chosen worker could not finish them in time (planned policies; the spill on refusal)",
    "goodput": "requests served within the SLO",
    "slo_violation_ratio": "(late + refused) / offered",
    "slo_violation_ratio_admitted": "late / admitted",
    "effective_quality": "mean score of the quality_n requests served within the SLO",
    "relative_quality": "mean score / best-level score over the same quality_n requests",
}

_CSV_COLUMNS = (
    "policy",
    "minute",
    "offered_qpm",
    "admitted_qpm",
    "refused_qpm",
    "served_qpm",
    "goodput_qpm",
    "effective_quality",
    "quality_n",
    "slo_violation_ratio",
    "slo_violation_ratio_admitted",
    "model_switches",
    "plan_changes",
    "utilisation",
)


def _write_csv(series: Sequence[MinuteSeries], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(_CSV_COLUMNS)
        for s in series:
            for minute in range(len(s.offered_qpm)):
                writer.writerow(
                    [
                        s.policy,
                        minute,
                        f"{s.offered_qpm[minute]:.0f}",
                        f"{s.admitted_qpm[minute]:.0f}",
                        f"{s.refused_qpm[minute]:.0f}",
                        f"{s.served_qpm[minute]:.0f}",
                        f"{s.goodput_qpm[minute]:.0f}",
                        _fmt(s.effective_quality[minute]),
                        f"{s.quality_n[minute]:.0f}",
                        _fmt(s.slo_violation_ratio[minute]),
                        _fmt(s.slo_violation_ratio_admitted[minute]),
                        f"{s.model_switches[minute]:.0f}",
                        f"{s.plan_changes[minute]:.0f}",
                        f"{s.utilisation[minute]:.4f}",
                    ]
                )


def _fmt(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.4f}"


def _plot(series: Sequence[MinuteSeries], path: Path, title: str, synthetic: bool) -> None:
    """Four panels in the style of the paper's Fig. 16: offered load and goodput, refusals,
    effective quality, SLO violations of all requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    minutes = np.arange(len(series[0].offered_qpm)) if series else np.arange(0)
    if series:
        axes[0].plot(minutes, series[0].offered_qpm, color="black", lw=2, label="offered load")
    for s in series:
        axes[0].plot(minutes, s.goodput_qpm, lw=1, label=s.policy)
        axes[1].plot(minutes, s.refused_qpm, lw=1, label=s.policy)
        axes[2].plot(minutes, s.effective_quality, lw=1, label=s.policy)
        axes[3].plot(minutes, 100 * s.slo_violation_ratio, lw=1, label=s.policy)
    axes[0].set_ylabel("goodput (QPM within SLO)")
    axes[1].set_ylabel("refused (QPM)")
    axes[2].set_ylabel("effective quality" + (" (SYNTHETIC)" if synthetic else ""))
    axes[3].set_ylabel("SLO violations,\nrefused included (%)")
    axes[3].set_xlabel("minute of arrival")
    axes[0].set_title(title)
    axes[0].legend(ncol=4, fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
