"""What ``argus evaluate`` writes and prints: runs.csv, aggregate.csv, paired.csv,
summary.json, the plots (:mod:`argus.sim.evaluation_plots`) and the compact table.

The replay's reports (one run per policy, per-minute series) are :mod:`argus.sim.report`;
these are the sweep's, over loads and seeds, with the intervals of
:mod:`argus.sim.intervals`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from argus.sim.evaluate import Evaluation, EvaluationConfig, RunRow, cache_description
from argus.sim.evaluation_plots import plot_metric
from argus.sim.intervals import METRICS, Aggregate, Interval, Paired, aggregate, paired
from argus.sim.report import is_synthetic


def write_evaluation(evaluation: Evaluation, out_dir: Path) -> dict[str, Path]:
    """Write runs.csv, aggregate.csv, paired.csv, summary.json and the three PNG plots;
    returns their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "runs": out_dir / "runs.csv",
        "aggregate": out_dir / "aggregate.csv",
        "paired": out_dir / "paired.csv",
        "summary": out_dir / "summary.json",
        "quality_plot": out_dir / "quality_vs_load.png",
        "goodput_plot": out_dir / "goodput_vs_load.png",
        "slo_plot": out_dir / "slo_violations_vs_load.png",
    }
    _write_runs(evaluation.rows, paths["runs"])
    aggregates = aggregate(evaluation.rows)
    comparisons = paired(evaluation.rows)
    _write_aggregate(aggregates, paths["aggregate"])
    _write_paired(comparisons, paths["paired"])
    paths["summary"].write_text(json.dumps(describe(evaluation), indent=2) + "\n")
    capacity = evaluation.capacity_qpm
    quality = "effective quality" + (
        " (SYNTHETIC)" if is_synthetic(evaluation.quality_source) else ""
    )
    plot_metric(aggregates, "effective_quality", quality, capacity, paths["quality_plot"])
    goodput = "goodput (QPM served within the SLO)"
    plot_metric(aggregates, "goodput_qpm", goodput, capacity, paths["goodput_plot"], offered=True)
    violations = "SLO violations, refused included"
    plot_metric(
        aggregates, "slo_violation_ratio", violations, capacity, paths["slo_plot"], percent=True
    )
    return paths


def describe(evaluation: Evaluation) -> dict[str, Any]:
    """summary.json: the settings, the capacity and how the workloads were built."""
    config = evaluation.config
    return {
        "title": "argus evaluate: load sweep (Argus §5.3, Fig. 17)",
        "capacity_qpm": evaluation.capacity_qpm,
        "capacity": (
            f"sum over workers of the fastest {_capacity_strategy(config)} level's throughput on "
            "the worker's class, "
            "planning profiles" + ("" if config.adapters == "none" else " with adapters")
        ),
        "gpus": ",".join(f"{c}={n}" for c, n in evaluation.gpu_counts),
        "slo_s": evaluation.slo_s,
        "loads": [p.label for p in config.loads],
        "policies": list(config.run_names()),
        "seeds": config.seeds,
        "duration_min": config.duration_min,
        "trace": config.trace,
        "rescaling": (
            "per-minute rates mapped to the target mean (x mean / trace mean), or with a peak "
            "affinely (mean and busiest minute exact); whole counts per minute by rounding the "
            "running sum; each minute thinned to a random subset or filled with copies placed "
            "between an arrival and the next (seeded)"
        ),
        "prompts": f"eval set of argus.prompt_split ({_prompt_source(config)})",
        "quality_world": config.quality,
        "quality": evaluation.quality_source,
        "quality_notes": list(evaluation.quality_notes),
        "classifier": evaluation.classifier_label,
        "adapters": config.adapters,
        "admission": config.admission,
        "cache": cache_description(config),
        "wall_s": round(evaluation.wall_s, 2),
        "intervals": "mean ± t(0.975, n-1) · s / sqrt(n) over seeds",
    }


def _write_runs(rows: Sequence[RunRow], path: Path) -> None:
    records = [row.record() for row in rows]
    columns = list(records[0]) if records else ["load", "policy", "seed"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def aggregate_columns() -> list[str]:
    """Columns of aggregate.csv."""
    columns = ["load", "peak", "policy", "seeds"]
    for name in METRICS:
        columns += [f"{name}_mean", f"{name}_lo", f"{name}_hi"]
    columns.append("quality_seeds")
    return columns


def _write_aggregate(aggregates: Sequence[Aggregate], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(aggregate_columns())
        for a in aggregates:
            row: list[Any] = [a.load, "" if a.peak is None else a.peak, a.policy]
            row.append(a.metrics["offered_qpm"].n)
            for name in METRICS:
                interval = a.metrics[name]
                row += [_num(interval.mean), _num(interval.lo), _num(interval.hi)]
            row.append(a.metrics["effective_quality"].n)
            writer.writerow(row)


PAIRED_COLUMNS = (
    "load",
    "peak",
    "seeds",
    "quality_diff_mean",
    "quality_diff_lo",
    "quality_diff_hi",
    "goodput_diff_mean",
    "goodput_diff_lo",
    "goodput_diff_hi",
    "oracle_diff_mean",
    "oracle_diff_lo",
    "oracle_diff_hi",
    "argus_quality",
    "pac_quality",
    "argus_oracle_quality",
    "oracle_gap_closed",
)


def _write_paired(comparisons: Sequence[Paired], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(PAIRED_COLUMNS)
        for p in comparisons:
            q, g, o = p.quality_diff, p.goodput_diff, p.oracle_diff
            writer.writerow(
                [p.load, "" if p.peak is None else p.peak, q.n]
                + [_num(v) for v in (q.mean, q.lo, q.hi, g.mean, g.lo, g.hi, o.mean, o.lo, o.hi)]
                + [_num(v) for v in (p.argus_quality, p.pac_quality, p.oracle_quality)]
                + [_num(p.gap_closed)]
            )


def _num(value: float) -> str:
    return "" if not math.isfinite(value) else f"{value:.6g}"


def _capacity_strategy(config: EvaluationConfig) -> str:
    return "SM" if config.quality == "genai-bench" else "AC"  # genai-bench has no AC level


def _prompt_source(config: EvaluationConfig) -> str:
    if config.quality == "genai-bench":
        return "GenAI-Bench"
    return str(config.prompts_path or "PartiPrompts")


def format_evaluation(evaluation: Evaluation) -> str:
    """The compact table ``argus evaluate`` prints: per load and policy, means over the seeds
    ± the half-width of their 95 % interval; then argus − pac per load."""
    aggregates = aggregate(evaluation.rows)
    header = (
        f"{'load':>8} {'policy':<13} {'quality':>13} {'over n':>7} {'goodput QPM':>13} "
        f"{'refused QPM':>12} {'late/adm':>14} {'viol/all':>14}"
    )
    lines = [header, "-" * len(header)]
    previous: float | None = None
    for a in sorted(aggregates, key=lambda a: (a.load, a.peak or 0.0)):
        if previous is not None and a.load != previous:
            lines.append("")
        previous = a.load
        m = a.metrics
        lines.append(
            f"{_load_label(a.load, a.peak):>8} {a.policy:<13} "
            f"{_pm(m['effective_quality'], 2):>13} {m['quality_n'].mean:>7,.0f} "
            f"{_pm(m['goodput_qpm'], 1):>13} {_pm(m['refused_qpm'], 1):>12} "
            f"{_pm(m['slo_violation_ratio_admitted'], 1, 100):>14} "
            f"{_pm(m['slo_violation_ratio'], 1, 100):>14}"
        )
    config = evaluation.config
    named = "SYNTHETIC" if is_synthetic(evaluation.quality_source) else evaluation.quality_source
    lines.append(
        f"means over {config.seeds} seeds ± 95% t-interval half-width; quality: {named}, "
        "mean over the 'over n' requests served within the SLO (per run); late/adm and "
        "viol/all in %"
    )
    lines += format_cache(evaluation.rows, config.cache)
    comparisons = paired(evaluation.rows)
    if comparisons:
        lines += [
            "",
            f"{'load':>8} {'argus − pac quality [95%]':>28} {'oracle − pac [95%]':>28} "
            f"{'gap closed':>10}",
        ]
        for p in sorted(comparisons, key=lambda p: (p.load, p.peak or 0.0)):
            closed = f"{p.gap_closed + 0.0:.0%}" if math.isfinite(p.gap_closed) else "-"
            closed = "0%" if closed == "-0%" else closed  # no sign on a rounded zero
            lines.append(
                f"{_load_label(p.load, p.peak):>8} {format_difference(p.quality_diff):>28} "
                f"{format_difference(p.oracle_diff):>28} {closed:>10}"
            )
        lines.append(
            "paired over seeds; gap closed = (Q_argus − Q_pac) / (Q_argus-oracle − Q_pac), "
            "only where the oracle beats PAC (interval above 0)"
        )
        lines.append(f"argus classifier: {evaluation.classifier_label}")
    return "\n".join(lines)


def format_cache(rows: Sequence[RunRow], cache: str) -> list[str]:
    """Per load and policy: hit rate and mean similarity over all the seeds' lookups
    together, with their counts (``-`` where a policy looked nothing up)."""
    totals: dict[tuple[float, float | None, str], list[float]] = {}
    for row in rows:
        s = row.summary
        t = totals.setdefault((row.load, row.peak, row.policy), [0.0, 0.0, 0.0, 0.0])
        t[0] += s.cache_lookups
        t[1] += s.hit_rate * s.cache_lookups
        t[2] += s.similarity_n
        t[3] += s.mean_similarity * s.similarity_n
    if not any(t[0] for t in totals.values()):
        return []
    lines = [
        "",
        f"{'load':>8} {'policy':<13} {'hit rate':>9} {'of n':>8} {'similarity':>10} {'of n':>8}",
    ]
    # sorted by load; within a load the policies stay in the order they ran
    for (load, peak, policy), (n, hits, m, total) in sorted(
        totals.items(), key=lambda item: (item[0][0], item[0][1] or 0.0)
    ):
        rate = f"{hits / n:.1%}" if n else "-"
        similarity = f"{total / m:.3f}" if m else "-"
        lines.append(
            f"{_load_label(load, peak):>8} {policy:<13} {rate:>9} {n:>8,.0f} "
            f"{similarity:>10} {m:>8,.0f}"
        )
    lines.append(
        f"cache {cache}: hit rate over the AC lookups (requests routed at K > 0) of all seeds; "
        "similarity: mean cosine of the nearest cached prompt over the lookups that found one"
    )
    return lines


def _load_label(load: float, peak: float | None) -> str:
    return f"{load:g}x" if peak is None else f"{load:g}:{peak:g}x"


def format_difference(interval: Interval) -> str:
    """A paired difference as ``+m [+lo, +hi]`` (``+m`` over one seed, ``-`` over none)."""
    if interval.n == 0:
        return "-"
    if interval.n == 1:
        return f"{interval.mean:+.3f}"
    return f"{interval.mean:+.3f} [{interval.lo:+.3f}, {interval.hi:+.3f}]"


def _pm(interval: Interval, digits: int, factor: float = 1.0) -> str:
    if interval.n == 0:
        return "-"
    mean = interval.mean * factor
    if interval.n == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f}±{interval.half_width * factor:.{digits}f}"
