"""The cost model of a batch of masked edits: one denoising step's seconds from the batch's size
and the sum of its edits' effective mask ratios (InstGenIE §4.4, Fig. 11).

With the mask-aware activation cache an edit of a template whose record the worker holds
computes only its region's tokens inside the transformer blocks; everything outside the blocks
(resnets, convolutions, the scheduler) still runs for every row. A batch's FLOPs are therefore
``b · F_outside + F_blocks · Σ m_i`` and InstGenIE maps FLOPs to latency with a linear fit
(R² 0.998-0.999 for SDXL and Flux on H800), so one step of a batch costs::

    t(b, Σm) = a + p · b + c · Σm

``a`` is what a step costs whatever its batch (launches, the loop's own work), ``p`` each edit's
work outside the blocks and ``c`` the blocks' work per unit of mask ratio. An edit's effective
ratio is its mask ratio on a cache hit and 1 on a miss (the first edit of a template runs in
full and records). :func:`fit_cost_model` fits the three by least squares on measured
``(b, Σm, seconds)`` points and reports R².

It lives with the profiles (below the services, ``tests/test_layers.py``) because the worker's
batching, the router's balancing and admission, and the allocator's capacity all price edits
with the same model, and the simulator prices them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# The default points are DERIVED from InstGenIE's published SDXL figures, not measured here:
# the transformer blocks are 82 % of SDXL's computation (§2.1, footnote), an edit at mask ratio
# 0.2 runs 2.2x faster than in full (§6.3, Fig. 15) and a batch's latency is linear in its
# FLOPs (§4.4, Fig. 11: R² 0.9989 on H800). Latency α + β·FLOPs with FLOPs = F·(b(1 − s) + s·Σm)
# and the 2.2x at 0.2 fix α = βF·(1 − S·r)/(S − 1), r = 1 − s(1 − 0.2): α ≈ 0.20 βF. The time
# scale (one edit's full step, FULL_STEP_S) is our assumption; ratios between balancers do not
# depend on it. benchmarks/bench_edit_cost.py measures such points on a real UNet.
PAPER_BLOCK_SHARE = 0.82  # s: SDXL's share of computation in the transformer blocks
PAPER_SPEEDUP = (0.2, 2.2)  # (mask ratio, speed-up against the full edit), SDXL
FULL_STEP_S = 0.06  # one SDXL 1024² step of one edit in full: 3 s for 50 steps (assumption)
PAPER_SOURCE = (
    "DERIVED from InstGenIE's SDXL figures (82% in blocks, 2.2x at m=0.2, latency linear in "
    "FLOPs); full step 0.06 s assumed"
)


def paper_points(
    batches: Sequence[int] = (1, 2, 4, 8), ratios: Sequence[float] = (0.05, 0.1, 0.2, 0.5, 1.0)
) -> tuple[tuple[int, float, float], ...]:
    """``(b, Σm, seconds)`` of a step from the paper-derived model (every edit of a point at the
    same ratio), the default table :func:`default_cost_model` fits."""
    share, (ratio, speedup) = PAPER_BLOCK_SHARE, PAPER_SPEEDUP
    reduced = 1.0 - share * (1.0 - ratio)
    alpha = (1.0 - speedup * reduced) / (speedup - 1.0)  # in units of βF
    unit = FULL_STEP_S / (alpha + 1.0)
    a, p, c = alpha * unit, (1.0 - share) * unit, share * unit
    return tuple((b, b * m, a + p * b + c * b * m) for b in batches for m in ratios)


class CostModelError(ValueError):
    """Too few or bad points to fit, or a bad coefficient; the message names the value."""


@dataclass(frozen=True)
class EditCostModel:
    """Seconds of one denoising step of a batch of edits: ``a + p·b + c·Σm``."""

    base_s: float  # a: seconds per step of any batch
    per_edit_s: float  # p: seconds per edit in the batch per step (work outside the blocks)
    per_mask_s: float  # c: seconds per unit of effective mask ratio per step (the blocks)
    r2: float = math.nan  # coefficient of determination of the fit (NaN: not fitted)
    source: str = ""  # where the points came from

    def __post_init__(self) -> None:
        for name in ("base_s", "per_edit_s", "per_mask_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise CostModelError(f"{name} must be finite and >= 0, got {value!r}")
        if self.base_s + self.per_edit_s + self.per_mask_s <= 0:
            raise CostModelError("a step must cost something: a, p and c are all 0")

    def step_s(self, batch: int, mask_sum: float) -> float:
        """Seconds of one step of ``batch`` edits whose effective mask ratios sum to
        ``mask_sum`` (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_edit_s * batch + self.per_mask_s * mask_sum

    def alone_s(self, mask_ratio: float, steps: int) -> float:
        """Seconds of a whole run of one edit alone at effective ratio ``mask_ratio``."""
        return steps * self.step_s(1, mask_ratio)


def fit_cost_model(points: Iterable[tuple[int, float, float]], source: str = "") -> EditCostModel:
    """Least-squares ``a, p, c`` over ``(b, Σm, seconds)`` points, with R². Coefficients the fit
    makes negative are refitted without them (a step never gets cheaper with more work)."""
    rows = [(float(b), float(m), float(t)) for b, m, t in points]
    if len(rows) < 3:
        raise CostModelError(f"a fit needs at least 3 points, got {len(rows)}")
    data = np.asarray(rows)
    design = np.column_stack([np.ones(len(rows)), data[:, 0], data[:, 1]])
    seconds = data[:, 2]
    keep = [0, 1, 2]
    while True:
        solution, *_ = np.linalg.lstsq(design[:, keep], seconds, rcond=None)
        negative = [k for k, value in zip(keep, solution, strict=True) if value < 0]
        if not negative or len(keep) == 1:
            break
        keep = [k for k in keep if k not in negative]
    coef = np.zeros(3)
    coef[keep] = np.maximum(solution, 0.0)
    predicted = design @ coef
    total = float(np.sum((seconds - seconds.mean()) ** 2))
    residual = float(np.sum((seconds - predicted) ** 2))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return EditCostModel(float(coef[0]), float(coef[1]), float(coef[2]), r2, source)


def default_cost_model() -> EditCostModel:
    """The fit of :func:`paper_points` (R² is 1 by construction: the points are derived)."""
    return fit_cost_model(paper_points(), PAPER_SOURCE)
