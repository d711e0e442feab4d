"""Accuracy of the two predictors of the allocator (Argus §4.2, §5.7).

1. Load forecast W_t on the real Azure LLM inference trace 2023 (Microsoft, CC-BY 4.0): the
   default ``LoadPredictorConfig`` and a small grid of alternatives, with over- and
   under-forecast reported separately, so the choice of defaults can be checked.
2. Affinity histogram H(v) error on a SYNTHETIC label stream. Real optimal-level labels come
   from the prompt classifier (a separate issue); until then the labels here are derived from the
   PartiPrompts prompts (Google Research, Apache-2.0) by a fixed rule on text features
   (challenge column and word count mapped to 6 levels, plus seeded noise), one label per
   arrival of the Azure trace, cycling through the prompts.

Run from the repository root::

    .venv/bin/python benchmarks/predictor_error.py
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.allocator.predictor import (
    LoadPredictorConfig,
    forecast_errors,
    histogram_l2_error,
)
from argus.traces import (
    PromptRecord,
    default_arrival_trace,
    default_prompt_trace,
    load_arrivals,
    load_prompts,
)

NUM_LEVELS = 6
SEED = 20240601

# How demanding each PartiPrompts challenge is assumed to be (0: easy). Synthetic, not measured.
_CHALLENGE_DIFFICULTY = {
    "Basic": 0,
    "Simple Detail": 1,
    "Style & Format": 1,
    "Imagination": 2,
    "Perspective": 2,
    "Quantity": 2,
    "Properties & Positioning": 2,
    "Linguistic Structures": 3,
    "Writing & Symbols": 3,
    "Fine-grained Detail": 3,
    "Complex": 4,
}

# (label, config) rows of the load-forecast grid; the default comes first.
_GRID: list[tuple[str, LoadPredictorConfig]] = [
    ("default", LoadPredictorConfig()),
    ("last period", LoadPredictorConfig(alpha=1.0, peak_window=1, peak_fraction=0.0)),
    ("EWMA 0.5 alone", LoadPredictorConfig(alpha=0.5, peak_window=1, peak_fraction=0.0)),
    ("EWMA 0.3 alone", LoadPredictorConfig(alpha=0.3, peak_window=1, peak_fraction=0.0)),
    ("max(EWMA 0.5, last)", LoadPredictorConfig(alpha=0.5, peak_window=1, peak_fraction=1.0)),
    ("max(EWMA 0.3, last)", LoadPredictorConfig(alpha=0.3, peak_window=1, peak_fraction=1.0)),
    ("alpha 0.2", LoadPredictorConfig(alpha=0.2, peak_window=2, peak_fraction=1.0)),
    ("alpha 0.5", LoadPredictorConfig(alpha=0.5, peak_window=2, peak_fraction=1.0)),
    ("peak fraction 0.9", LoadPredictorConfig(alpha=0.3, peak_window=2, peak_fraction=0.9)),
    ("peak window 3", LoadPredictorConfig(alpha=0.3, peak_window=3, peak_fraction=1.0)),
    ("peak window 3, 0.95", LoadPredictorConfig(alpha=0.5, peak_window=3, peak_fraction=0.95)),
    ("peak window 5", LoadPredictorConfig(alpha=0.5, peak_window=5, peak_fraction=1.0)),
    ("peak window 10", LoadPredictorConfig(alpha=0.5, peak_window=10, peak_fraction=1.0)),
]


def synthetic_level(record: PromptRecord, rng: np.random.Generator) -> int:
    """SYNTHETIC optimal level (0 = slowest/best) of one prompt: demanding prompts → low index."""
    difficulty = _CHALLENGE_DIFFICULTY.get(record.challenge, 2)
    words = len(record.prompt.split())
    difficulty += (words > 12) + (words > 30)
    level = (NUM_LEVELS - 1) - difficulty + int(rng.integers(-1, 2))  # noise in {-1, 0, 1}
    return min(max(level, 0), NUM_LEVELS - 1)


def synthetic_labels(
    prompts: list[PromptRecord], length: int, *, shuffle: bool, seed: int = SEED
) -> list[int]:
    """``length`` SYNTHETIC labels cycling through ``prompts``: in file order (grouped by
    category, so the mix drifts) or reshuffled on every pass (a stationary mix)."""
    rng = np.random.default_rng(seed)
    labels: list[int] = []
    while len(labels) < length:
        order = rng.permutation(len(prompts)) if shuffle else np.arange(len(prompts))
        for i in order[: length - len(labels)]:
            labels.append(synthetic_level(prompts[int(i)], rng))
    return labels


def _forecast_row(
    label: str, config: LoadPredictorConfig, arrivals: list[float], period_s: float
) -> str:
    e = forecast_errors(arrivals, config, period_s=period_s)
    knobs = f"{config.alpha:4.2f} {config.peak_window:3d} {config.peak_fraction:4.2f}"
    return (
        f"{label:<22} {knobs}  {e.mape_pct:5.1f} {e.p95_ape_pct:6.1f} {e.mae_qpm:6.1f}"
        f"  {e.under_fraction * 100:5.0f} {e.mean_under_qpm:6.1f} {e.mean_shortfall_qpm:6.1f}"
        f"  {e.over_fraction * 100:5.0f} {e.mean_over_qpm:6.1f}"
    )


def main() -> None:
    started = time.perf_counter()
    print(f"machine: {platform.machine()} {platform.system()}, os.cpu_count()={os.cpu_count()}")
    print(f"python {platform.python_version()}, numpy {np.__version__}")

    trace = default_arrival_trace()
    arrivals = load_arrivals(trace)
    span = arrivals[-1] - arrivals[0]
    print(f"\n== Load forecast W_t on {trace.name} (Azure LLM inference trace 2023, Microsoft,")
    print(f"   CC-BY 4.0): {len(arrivals)} arrivals over {span / 60:.1f} min")
    print("   forecast made at each period start vs realised rate of that period;")
    print("   under/over columns: share of periods, mean gap when under/over (QPM);")
    print("   shortfall: mean max(actual - forecast, 0) over all periods (QPM)")
    header = (
        f"{'config':<22} {'alph':>4} {'win':>3} {'frac':>4}  {'MAPE%':>5} {'p95%':>6} "
        f"{'MAE':>6}  {'under%':>5} {'u_QPM':>6} {'short':>6}  {'over%':>5} {'o_QPM':>6}"
    )
    for period_s in (60.0, 30.0, 120.0):
        print(f"\n-- period_s = {period_s:g}")
        print(header)
        for label, config in _GRID:
            if period_s != 60.0 and label not in ("default", "last period", "peak window 5"):
                continue
            print(_forecast_row(label, config, arrivals, period_s))

    prompts = load_prompts(default_prompt_trace())
    length = len(arrivals)
    print(f"\n== Affinity histogram H(v): SYNTHETIC labels ({NUM_LEVELS} levels), {length} labels")
    print(f"   derived from {len(prompts)} PartiPrompts prompts by a fixed rule (challenge +")
    print("   word count + seeded noise); real labels come with the classifier issue.")
    print("   Prediction of window j = histogram of window j-1 (non-overlapping windows).")
    print("   l2: ||H_pred - H_next||_2; mse: mean over bins of the squared difference;")
    print("   noise_rms: expected RMS of l2 from sampling alone for a stationary mix.")
    print(
        f"{'stream':<12} {'window':>6} {'pairs':>5} {'mean_l2':>8} {'p95_l2':>8} "
        f"{'mean_mse':>9} {'noise_rms':>9}"
    )
    for name, shuffle in (("file order", False), ("shuffled", True)):
        labels = synthetic_labels(prompts, length, shuffle=shuffle)
        p = np.bincount(labels, minlength=NUM_LEVELS) / len(labels)
        for window in (250, 500, 1000, 2000):
            h = histogram_l2_error(labels, NUM_LEVELS, window)
            floor = float(np.sqrt(2.0 * (1.0 - float((p**2).sum())) / window))
            print(
                f"{name:<12} {window:6d} {h.windows:5d} {h.mean_l2:8.4f} {h.p95_l2:8.4f} "
                f"{h.mean_mse:9.6f} {floor:9.4f}"
            )
        mix = " ".join(f"{x:.3f}" for x in p)
        print(f"{name:<12} overall H (slowest first): {mix}")
    print(f"\n(total {time.perf_counter() - started:.2f} s)")


if __name__ == "__main__":
    print(machine_line())
    main()
    print(load_line("end"))
