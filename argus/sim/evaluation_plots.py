"""The PNG plots of ``argus evaluate``: one metric against offered load, a line per policy.

matplotlib is imported when a plot is drawn, so the sweep and the tables load without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from argus.sim.intervals import Aggregate


def plot_metric(
    aggregates: Sequence[Aggregate],
    metric: str,
    label: str,
    capacity_qpm: float,
    path: Path,
    *,
    offered: bool = False,
    percent: bool = False,
) -> None:
    """One metric against offered load, a line per policy, 95 % intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    factor = 100.0 if percent else 1.0
    policies = list(dict.fromkeys(a.policy for a in aggregates))
    for policy in policies:
        points = sorted((a for a in aggregates if a.policy == policy), key=lambda a: a.load)
        x = np.array([a.load * capacity_qpm for a in points])
        y = np.array([a.metrics[metric].mean for a in points]) * factor
        err = np.array([a.metrics[metric].half_width for a in points]) * factor
        ax.errorbar(x, y, yerr=np.nan_to_num(err), lw=1, marker="o", ms=3, capsize=2, label=policy)
    if offered and aggregates:
        loads = sorted({a.load for a in aggregates})
        x = np.array(loads) * capacity_qpm
        ax.plot(x, x, color="black", lw=2, ls="--", label="offered load")
    ax.axvline(capacity_qpm, color="grey", lw=1, ls=":")
    ax.set_xlabel(f"offered load (QPM); capacity {capacity_qpm:.0f} QPM (dotted)")
    ax.set_ylabel(label + (" (%)" if percent else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
