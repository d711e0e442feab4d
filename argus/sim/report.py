"""Metrics of replay runs: per-minute series, a summary per policy, files and plots.

Definitions (Argus §5):

* offered QPM: arrivals per minute; served QPM: requests completed per minute of the trace
  (completions after the last arrival are not counted, so an overloaded policy shows it);
* SLO: ``slo_factor × the best level's latency`` (3 × SDXL by default); a request violates it
  when it finishes later than that after arriving;
* effective quality: mean quality score of the requests finished within the SLO; relative
  quality: the same for score / the prompt's score at the best level of its strategy;
* utilisation: busy GPU seconds (serving and loading models) / (GPUs × simulated time);
* adapter seconds: what ControlNets and LoRAs added to the service time, mean per request
  (0 without adapters; :mod:`argus.sim.adapters`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from argus.sim.cluster import RunResult


@dataclass(frozen=True)
class Summary:
    """Whole-run figures of one policy (the keys of ``summary.json``)."""

    policy: str
    requests: int
    offered_qpm: float
    served_qpm: float
    effective_quality: float
    relative_quality: float
    slo_violation_ratio: float
    model_switches: int
    plan_changes: int
    strategy_switches: int
    utilisation: float
    adapter_s_mean: float = 0.0


def summarise(result: RunResult) -> Summary:
    minutes = max(result.duration_s / 60.0, 1e-9)
    ok = ~result.violated
    n = len(result.arrivals_s)
    completed = int(np.count_nonzero(result.finish_s <= result.duration_s))
    return Summary(
        policy=result.policy,
        requests=n,
        offered_qpm=n / minutes,
        served_qpm=completed / minutes,
        effective_quality=float(result.score[ok].mean()) if ok.any() else 0.0,
        relative_quality=float(result.relative[ok].mean()) if ok.any() else 0.0,
        slo_violation_ratio=float(1.0 - ok.mean()) if n else 0.0,
        model_switches=result.model_switches,
        plan_changes=result.plan_changes,
        strategy_switches=result.strategy_switches,
        utilisation=min(1.0, result.busy_s / result.gpu_seconds) if result.gpu_seconds else 0.0,
        adapter_s_mean=result.adapter_s / n if n else 0.0,
    )


@dataclass(frozen=True)
class MinuteSeries:
    """Per-minute figures of one policy, minute i covering [60 i, 60 (i + 1)) seconds."""

    policy: str
    offered_qpm: np.ndarray
    served_qpm: np.ndarray
    effective_quality: np.ndarray  # NaN in minutes where nothing met the SLO
    slo_violation_ratio: np.ndarray  # NaN in minutes without arrivals
    model_switches: np.ndarray  # model loads begun in the minute
    plan_changes: np.ndarray  # re-plans in the minute that moved at least one worker
    utilisation: np.ndarray  # busy GPU-seconds / (GPUs x 60 s)


def per_minute(result: RunResult) -> MinuteSeries:
    minutes = int(result.duration_s // 60.0) + 1
    arrival_minute = (result.arrivals_s // 60.0).astype(np.int64)
    admitted = result.admitted
    finish_minute = np.where(admitted, result.finish_s // 60.0, minutes).astype(np.int64)
    offered = np.bincount(arrival_minute, minlength=minutes)[:minutes].astype(float)
    done = finish_minute < minutes
    served = np.bincount(finish_minute[done], minlength=minutes)[:minutes].astype(float)
    ok = ~result.violated

    def by_arrival_minute(weights: np.ndarray) -> np.ndarray:
        return np.bincount(arrival_minute, weights=weights, minlength=minutes)[:minutes]

    violations = by_arrival_minute((~ok).astype(float))
    good = by_arrival_minute(ok.astype(float))
    quality = by_arrival_minute(np.where(ok, result.score, 0.0))
    busy = np.zeros(minutes)
    recorded = np.asarray(result.busy_by_minute_s[:minutes], dtype=float)
    busy[: len(recorded)] = recorded
    with np.errstate(invalid="ignore", divide="ignore"):
        return MinuteSeries(
            policy=result.policy,
            offered_qpm=offered,
            served_qpm=served,
            effective_quality=np.where(good > 0, quality / good, np.nan),
            slo_violation_ratio=np.where(offered > 0, violations / offered, np.nan),
            model_switches=_count_by_minute(result.switch_times_s, minutes),
            plan_changes=_count_by_minute(result.plan_change_times_s, minutes),
            utilisation=np.minimum(1.0, busy / (60.0 * result.gpus)),
        )


def _count_by_minute(times_s: Sequence[float], minutes: int) -> np.ndarray:
    if not times_s:
        return np.zeros(minutes)
    index = (np.asarray(times_s) // 60.0).astype(np.int64)
    return np.bincount(index[index < minutes], minlength=minutes)[:minutes].astype(float)


def format_table(summaries: Sequence[Summary]) -> str:
    """A fixed-width table of the summaries, one row per policy."""
    header = (
        f"{'policy':<11} {'offered':>8} {'served':>8} {'quality':>8} {'rel.q':>6} "
        f"{'SLO viol':>8} {'switches':>8} {'util':>5}"
    )
    rows = [header, "-" * len(header)]
    for s in summaries:
        rows.append(
            f"{s.policy:<11} {s.offered_qpm:>8.1f} {s.served_qpm:>8.1f} "
            f"{s.effective_quality:>8.2f} {s.relative_quality:>6.3f} "
            f"{s.slo_violation_ratio:>8.1%} {s.model_switches:>8d} {s.utilisation:>5.0%}"
        )
    return "\n".join(rows)


def write_reports(
    results: Sequence[RunResult], out_dir: Path, *, description: dict[str, str]
) -> list[Summary]:
    """Write ``summary.json``, ``per_minute.csv`` and ``timeseries.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [summarise(r) for r in results]
    series = [per_minute(r) for r in results]
    document = {
        "description": description,
        "policies": {s.policy: asdict(s) for s in summaries},
    }
    (out_dir / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    _write_csv(series, out_dir / "per_minute.csv")
    _plot(series, out_dir / "timeseries.png", description.get("title", "replay"))
    return summaries


def _write_csv(series: Sequence[MinuteSeries], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "policy",
                "minute",
                "offered_qpm",
                "served_qpm",
                "effective_quality",
                "slo_violation_ratio",
                "model_switches",
                "plan_changes",
                "utilisation",
            ]
        )
        for s in series:
            for minute in range(len(s.offered_qpm)):
                writer.writerow(
                    [
                        s.policy,
                        minute,
                        f"{s.offered_qpm[minute]:.0f}",
                        f"{s.served_qpm[minute]:.0f}",
                        _fmt(s.effective_quality[minute]),
                        _fmt(s.slo_violation_ratio[minute]),
                        f"{s.model_switches[minute]:.0f}",
                        f"{s.plan_changes[minute]:.0f}",
                        f"{s.utilisation[minute]:.4f}",
                    ]
                )


def _fmt(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.4f}"


def _plot(series: Sequence[MinuteSeries], path: Path, title: str) -> None:
    """Three panels in the style of the paper's Fig. 16: throughput, quality, SLO violations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    minutes = np.arange(len(series[0].offered_qpm)) if series else np.arange(0)
    if series:
        axes[0].plot(minutes, series[0].offered_qpm, color="black", lw=2, label="offered load")
    for s in series:
        axes[0].plot(minutes, s.served_qpm, lw=1, label=s.policy)
        axes[1].plot(minutes, s.effective_quality, lw=1, label=s.policy)
        axes[2].plot(minutes, 100 * s.slo_violation_ratio, lw=1, label=s.policy)
    axes[0].set_ylabel("throughput (QPM)")
    axes[1].set_ylabel("effective quality")
    axes[2].set_ylabel("SLO violations (%)")
    axes[2].set_xlabel("minute")
    axes[0].set_title(title)
    axes[0].legend(ncol=4, fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
