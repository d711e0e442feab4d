"""How good a level classifier is: label metrics and what its routing does to image quality.

Label metrics: accuracy, macro-F1 (the mean F1 over the levels that occur in the truth or
the predictions, scikit-learn's convention) and the confusion matrix (rows: optimal level,
columns: predicted level).

Downstream (Argus §5.5, where routing by the classifier scores 20.8 against 17.6 for a random
level on AC): the mean quality of the test prompts when each is served at the level the
classifier predicts, against a uniformly random level, the oracle (each prompt's optimal
level) and the slowest level. Quality alone flatters a classifier that plays safe: serving
everything at the slowest level scores higher than the oracle. So the speed side is reported
too: the mean level index served (higher is faster) and how often the prediction is faster
than the optimal level (quality lost) or slower (throughput lost). ``gap_closed`` is the share
of the random-to-oracle quality gap the classifier closes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from argus import defaults

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class DownstreamQuality:
    """Mean score of the evaluated prompts under four ways of picking their level."""

    classifier: float  # each prompt at its predicted level
    random: float  # expected score at a uniformly random level
    oracle: float  # each prompt at its optimal level
    slowest: float  # every prompt at the slowest (best) level
    gap_closed: float  # (classifier - random) / (oracle - random); 1 = as good as the oracle
    within_delta: float  # share of prompts whose predicted level passes the δ rule
    faster_than_optimal: float  # share predicted faster than optimal: quality at risk
    slower_than_optimal: float  # share predicted slower than optimal: throughput lost
    mean_level_classifier: float  # mean level index served (0 = slowest)
    mean_level_oracle: float
    mean_level_random: float


@dataclass(frozen=True)
class Evaluation:
    """Metrics of one classifier on one set of labelled prompts."""

    n: int
    accuracy: float
    macro_f1: float
    confusion: tuple[tuple[int, ...], ...]  # [optimal level][predicted level] counts
    quality: DownstreamQuality | None  # None when the prompts' scores are unknown

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["confusion"] = [list(row) for row in self.confusion]
        return out


def confusion_matrix(truth: IntArray, predicted: IntArray, n_levels: int) -> IntArray:
    """Counts ``[optimal, predicted]`` over ``n_levels`` levels."""
    matrix = np.zeros((n_levels, n_levels), dtype=np.int64)
    np.add.at(matrix, (truth, predicted), 1)
    return matrix


def macro_f1(matrix: IntArray) -> float:
    """Mean F1 over the levels that occur in the truth or the predictions."""
    true_pos = np.diag(matrix).astype(np.float64)
    actual = matrix.sum(axis=1).astype(np.float64)
    predicted = matrix.sum(axis=0).astype(np.float64)
    present = (actual + predicted) > 0
    if not present.any():
        return math.nan
    f1 = 2.0 * true_pos[present] / (actual[present] + predicted[present])
    return float(f1.mean())


def downstream_quality(
    truth: IntArray, predicted: IntArray, scores: FloatArray, delta: float
) -> DownstreamQuality:
    """The downstream figures of the module docstring for ``scores[prompt, level]``."""
    rows = np.arange(len(truth))
    served = scores[rows, predicted]
    threshold = delta * scores.max(axis=1)
    classifier = float(served.mean())
    random = float(scores.mean())
    oracle = float(scores[rows, truth].mean())
    gap = oracle - random
    n_levels = scores.shape[1]
    return DownstreamQuality(
        classifier=classifier,
        random=random,
        oracle=oracle,
        slowest=float(scores[:, 0].mean()),
        gap_closed=(classifier - random) / gap if gap > 0 else math.nan,
        within_delta=float(np.mean(served >= threshold)),
        faster_than_optimal=float(np.mean(predicted > truth)),
        slower_than_optimal=float(np.mean(predicted < truth)),
        mean_level_classifier=float(predicted.mean()),
        mean_level_oracle=float(truth.mean()),
        mean_level_random=(n_levels - 1) / 2.0,
    )


def evaluate(
    truth: IntArray,
    predicted: IntArray,
    n_levels: int,
    *,
    scores: FloatArray | None = None,
    delta: float = defaults.DELTA,
) -> Evaluation:
    """Label metrics, and downstream quality when ``scores`` ([prompts, levels]) are given."""
    truth = np.asarray(truth, dtype=np.int64)
    predicted = np.asarray(predicted, dtype=np.int64)
    if truth.shape != predicted.shape or truth.ndim != 1 or not len(truth):
        raise ValueError(f"need equal, non-empty 1-d labels, got {truth.shape} {predicted.shape}")
    matrix = confusion_matrix(truth, predicted, n_levels)
    quality = None
    if scores is not None:
        quality = downstream_quality(truth, predicted, np.asarray(scores, np.float64), delta)
    return Evaluation(
        n=len(truth),
        accuracy=float(np.mean(truth == predicted)),
        macro_f1=macro_f1(matrix),
        confusion=tuple(tuple(int(c) for c in row) for row in matrix),
        quality=quality,
    )
