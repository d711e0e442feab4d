"""Calibrated probabilities, tolerance classes and the per-class quality table Q(v | c).

What the joint planner needs from the classifier is not an arg-max level (on the synthetic
labels the logistic heads' arg-max collapses onto the two extreme levels) but a *class* per
prompt whose quality at every level is known, mistakes included. Everything here is measured
on the CALIBRATION prompts of :mod:`argus.prompt_split`, which the classifier's weights never
saw:

1. **Temperature** (:func:`fit_temperature`): the head's logits are divided by one scalar
   ``T`` chosen to minimise the negative log-likelihood of the calibration labels (Guo et al.,
   ICML 2017). ``T > 1`` softens an over-confident model. The arg-max never changes.
2. **Tolerance** (:func:`tolerance_scores`): ``s = Σ_k k · p_k``, the expected optimal level
   index under the calibrated probabilities; higher means the prompt tolerates faster levels.
3. **Classes** (:func:`class_edges`, :func:`classes_of_scores`): as many classes as levels,
   equal-count bins of ``s`` over the calibration prompts; class 0 is the least tolerant.
   Each edge lies halfway between two neighbouring calibration scores, so the edges are
   strictly increasing and no class is empty whenever the calibration scores take at least
   as many distinct values as there are classes. With fewer distinct values some edges must
   coincide and the classes between them are empty (their count is 0 in the file). A score
   equal to an edge belongs to the lower class: ``class = #{edges e : e < s}``.
4. **Q(v | c)** (:func:`measure_class_quality`): the mean score at level ``v`` of the
   calibration prompts in class ``c`` (its drop from the best level shrunk towards the mean
   drop by how much of the class's difference the sample can tell from noise,
   :func:`shrunk_class_means`), divided by the mean score at the best level (index 0) over
   all calibration prompts. An empty class borrows the row of the nearest non-empty class
   (the less tolerant one on a tie), so the planner never sees a hole; its prior is 0.

The result is one :class:`Calibration` per strategy, written as ``calibration.json`` beside
the classifier's weights (``argus-classifier-calibration v1``, UTF-8 JSON: the levels, the
temperature, the edges, the counts and prior, and the mean scores and Q per class and level;
the fields are listed in ``docs/control-plane-internals.md``).

``best_mean``, ``mean_score`` and ``quality`` are ``null`` when the labels came without
scores (a retrain from labels alone): the classes still work, Q is unknown.
:func:`read_calibration` validates every field and raises ``ValueError`` naming the file and
the field. Nothing here imports torch; the allocator reads Q through
:func:`read_calibration` without loading a model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.types import ClassQuality, Strategy

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

CALIBRATION_FORMAT = "argus-classifier-calibration v1"
CALIBRATION_FILE = "calibration.json"
TEMPERATURE_BOUNDS = (0.05, 20.0)  # the search range of fit_temperature
ECE_BINS = 15  # equal-width confidence bins of expected_calibration_error


class CalibrationError(ValueError):
    """A ``calibration.json`` that cannot be used; the message names the file and field."""


# ---------------------------------------------------------------------------------------------
# Temperature scaling


def softmax_t(logits: npt.NDArray[np.floating[Any]], temperature: float = 1.0) -> FloatArray:
    """``softmax(logits / temperature)`` per row, in float64."""
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max(axis=1, keepdims=True)
    exp = np.exp(scaled)
    out: FloatArray = exp / exp.sum(axis=1, keepdims=True)
    return out


def negative_log_likelihood(
    logits: npt.NDArray[np.floating[Any]], labels: IntArray, temperature: float = 1.0
) -> float:
    """Mean ``-log p(label)`` under ``softmax(logits / temperature)`` (log-sum-exp, exact)."""
    scaled = logits.astype(np.float64) / temperature
    top = scaled.max(axis=1)
    log_norm = top + np.log(np.exp(scaled - top[:, None]).sum(axis=1))
    return float(np.mean(log_norm - scaled[np.arange(len(labels)), labels]))


def fit_temperature(
    logits: npt.NDArray[np.floating[Any]],
    labels: IntArray,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    iterations: int = 100,
) -> float:
    """The temperature in ``bounds`` with the lowest :func:`negative_log_likelihood`.

    A golden-section search over ``log T``: the NLL is convex in ``1/T``, so it has one
    minimum along ``log T`` and the search finds it (or the bound it lies beyond). Without
    prompts the answer is 1 (no change). Deterministic: no randomness, a fixed number of steps.
    """
    if len(labels) == 0:
        return 1.0
    low, high = math.log(bounds[0]), math.log(bounds[1])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0

    def loss(log_t: float) -> float:
        return negative_log_likelihood(logits, labels, math.exp(log_t))

    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(d)
    best = min((fc, c), (fd, d), (loss(low), low), (loss(high), high))
    return math.exp(best[1])


def expected_calibration_error(
    probabilities: FloatArray, labels: IntArray, bins: int = ECE_BINS
) -> float:
    """Top-label ECE: Σ_b (n_b / n) · |accuracy_b - mean confidence_b| over ``bins``
    equal-width bins of the arg-max probability (bin b holds confidences in ((b-1)/B, b/B])."""
    if len(labels) == 0:
        return math.nan
    confidence = probabilities.max(axis=1)
    correct = (np.argmax(probabilities, axis=1) == labels).astype(np.float64)
    which = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.sum() * abs(correct[inside].mean() - confidence[inside].mean())
    return float(total / len(labels))


# ---------------------------------------------------------------------------------------------
# Tolerance classes


def tolerance_scores(probabilities: FloatArray) -> FloatArray:
    """``Σ_k k · p_k`` per row: the expected optimal level index (0 = slowest)."""
    out: FloatArray = probabilities.astype(np.float64) @ np.arange(probabilities.shape[1])
    return out


def class_edges(scores: FloatArray, n_classes: int) -> tuple[float, ...]:
    """``n_classes - 1`` edges cutting ``scores`` into equal-count bins (module step 3).

    The ideal cut after ``c`` bins sits at rank ``c · N / n_classes`` of the sorted scores.
    Cuts may only fall between two *different* neighbouring scores; each takes the allowed
    position nearest its ideal rank (the lower one on a tie), keeping enough positions free
    for the cuts after it, so that no class is left empty while the scores allow it. An edge
    is the midpoint of the two scores around its cut.
    """
    if n_classes < 1:
        raise ValueError(f"n_classes: must be >= 1, got {n_classes}")
    values = np.sort(np.asarray(scores, dtype=np.float64))
    if len(values) == 0:
        raise ValueError("class edges need at least one score")
    if not np.all(np.isfinite(values)):
        raise ValueError("scores must be finite")
    needed = n_classes - 1
    if needed == 0:
        return ()
    n = len(values)
    gaps = np.flatnonzero(values[1:] > values[:-1]) + 1  # ranks i with values[i-1] < values[i]
    targets = [c * n / n_classes for c in range(1, n_classes)]
    if len(gaps) == 0:  # every score equal: one class (0) holds them all
        return (float(values[0]),) * needed
    if len(gaps) >= needed:
        ranks: list[int] = []
        low = 0
        for c, target in enumerate(targets):
            high = len(gaps) - (needed - c)  # leave one gap for every later cut
            window = gaps[low : high + 1]
            pick = low + int(np.argmin(np.abs(window - target)))
            ranks.append(int(gaps[pick]))
            low = pick + 1
    else:  # fewer distinct values than classes: some edges coincide, their classes are empty
        ranks = [int(gaps[int(np.argmin(np.abs(gaps - target)))]) for target in targets]
    return tuple(float((values[r - 1] + values[r]) / 2.0) for r in ranks)


def classes_of_scores(scores: FloatArray, edges: Sequence[float]) -> IntArray:
    """Class per score: the number of edges strictly below it (0 = least tolerant)."""
    result: IntArray = np.searchsorted(
        np.asarray(edges, dtype=np.float64), np.asarray(scores, dtype=np.float64), side="left"
    ).astype(np.int64)
    return result


@dataclass(frozen=True)
class ClassStats:
    """What :func:`measure_class_quality` measured on the calibration prompts."""

    counts: tuple[int, ...]  # calibration prompts per class
    best_mean: float  # mean score at level 0 over all calibration prompts
    mean_score: tuple[tuple[float, ...], ...]  # [class][level] absolute mean score
    quality: tuple[tuple[float, ...], ...]  # [class][level] mean_score / best_mean


def shrunk_class_means(classes: IntArray, scores: FloatArray, n_classes: int) -> FloatArray:
    """Each class's mean score per level, shrunk towards the mean over all prompts by how much
    of the class's difference the sample can tell from noise (James–Stein, as in a one-way
    random-effects model). Rows of empty classes are the means over all prompts.

    Shrunk are the best level's scores and each other level's *drop* from it, each column on
    its own: a prompt's scores at the levels move together, so what tells a class apart is
    its drop, and the drop's spread is what its noise is. Per column, the spread of the true
    class means is estimated by the method of moments: the between-class sum of squares less
    what the within-class spread alone would put there. A class mean then keeps the share
    ``tau² / (tau² + s² / n_c)`` of its distance from the column's mean, where ``s²`` is the
    pooled within-class variance and ``n_c`` the class's prompts.

    With hundreds of prompts and classes far apart the means are kept nearly as they are (the
    committed classifier's, on 333 synthetic calibration prompts: within 0.004). With a few
    dozen prompts per class and scores as noisy as human ratings they fall towards the mean
    drop, so the planner does not chase noise: on GenAI-Bench's 112 calibration prompts the
    raw means rated SD-2.1 above SDXL for one class, and the joint program put a third of the
    load on SD-2.1, the level the ratings rank last.
    """
    scores = np.asarray(scores, dtype=np.float64)
    # the best level's scores, then each level's drop from it: a prompt's scores at the levels
    # move together, so a class's drop is what tells it apart, and is shrunk on its own spread
    drops = scores.copy()
    drops[:, 1:] = scores[:, 1:] - scores[:, :1]
    shrunk = _shrunk_means(classes, drops, n_classes)
    shrunk[:, 1:] += shrunk[:, :1]
    return shrunk


def _shrunk_means(classes: IntArray, scores: FloatArray, n_classes: int) -> FloatArray:
    """Each column's class means shrunk on that column's own spread (the estimator of
    :func:`shrunk_class_means`)."""
    counts = np.bincount(classes, minlength=n_classes)[:n_classes].astype(np.float64)
    grand = scores.mean(axis=0)
    sums = np.zeros((n_classes, scores.shape[1]))
    np.add.at(sums, classes, scores)
    filled = counts > 0
    raw = np.where(filled[:, None], sums / np.maximum(counts, 1.0)[:, None], grand[None, :])
    within_ss = ((scores - raw[classes]) ** 2).sum(axis=0)
    cells = np.broadcast_to(counts[:, None], raw.shape)
    return shrink_cell_means(raw, cells, grand, within_ss)


def shrink_cell_means(
    raw: FloatArray, counts: FloatArray, grand: FloatArray, within_ss: FloatArray
) -> FloatArray:
    """Cell means ``raw[class, column]`` of ``counts[class, column]`` scores each, shrunk per
    column towards the column's mean ``grand[column]`` (James-Stein, a one-way random-effects
    model per column): the spread of the true class means, ``tau²``, by the method of moments
    (the between-class sum of squares less what the pooled within-class variance alone would
    put there; ``within_ss[column]`` is the sum of squared deviations from the cell means),
    then each cell keeps ``tau² / (tau² + s² / n)`` of its distance from ``grand``. An empty
    cell is ``grand``; a column with fewer than two filled cells, or no degrees of freedom
    within them, is kept as it is. The columns may have different counts (scores observed at
    some levels only, as in drift retraining)."""
    counts = np.asarray(counts, dtype=np.float64)
    filled = counts > 0
    total = counts.sum(axis=0)
    groups = filled.sum(axis=0)
    estimable = (groups >= 2) & (total > groups)
    if not estimable.any():
        return np.where(filled, raw, grand[None, :])
    # a column that cannot be estimated gets placeholders that divide safely; its cells keep
    # their raw means below
    safe_total = np.where(estimable, total, 1.0)
    within = np.where(estimable, within_ss / np.where(estimable, total - groups, 1.0), 0.0)
    between = (counts * (raw - grand[None, :]) ** 2).sum(axis=0)
    effective = np.where(estimable, safe_total - (counts**2).sum(axis=0) / safe_total, 1.0)
    tau2 = np.maximum(0.0, (between - (groups - 1) * within) / effective)
    spread = tau2[None, :] + within[None, :] / np.maximum(counts, 1.0)
    # the share of its distance from the column's mean a cell keeps: all of it where there
    # is no spread at all (or nothing to estimate it from), nothing for an empty cell
    keep = np.ones_like(spread)
    np.divide(np.broadcast_to(tau2, spread.shape), spread, out=keep, where=spread > 0.0)
    keep[:, ~estimable] = 1.0
    keep[~filled] = 0.0
    shrunk: FloatArray = grand[None, :] + keep * (raw - grand[None, :])
    return shrunk


def measure_class_quality(classes: IntArray, scores: FloatArray, n_classes: int) -> ClassStats:
    """Q(v | c) of module step 4 from each prompt's class and its ``scores[prompt, level]``."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] != len(classes) or not len(classes):
        raise ValueError(f"need one score row per class, got {scores.shape} for {len(classes)}")
    counts = np.bincount(classes, minlength=n_classes)[:n_classes]
    best_mean = float(scores[:, 0].mean())
    filled = np.flatnonzero(counts > 0)
    means = shrunk_class_means(classes, scores, n_classes)
    rows: list[tuple[float, ...]] = []
    for c in range(n_classes):
        donor = filled[int(np.argmin(np.abs(filled - c)))]  # itself when not empty
        rows.append(tuple(float(x) for x in means[donor]))
    return ClassStats(
        counts=tuple(int(x) for x in counts),
        best_mean=best_mean,
        mean_score=tuple(rows),
        quality=tuple(tuple(x / best_mean for x in row) for row in rows),
    )


# ---------------------------------------------------------------------------------------------
# The calibration of one classifier


@dataclass(frozen=True)
class CalibrationFit:
    """How much temperature scaling helped, on the calibration prompts."""

    log_loss_before: float
    log_loss_after: float
    ece_before: float
    ece_after: float


@dataclass(frozen=True)
class Calibration:
    """Temperature, class edges and Q(v | c) of one strategy's classifier (module docstring)."""

    strategy: Strategy
    levels: tuple[str, ...]  # slowest first: n levels, n classes
    temperature: float  # logits are divided by it
    edges: tuple[float, ...]  # n - 1 non-decreasing tolerance-score edges
    prompts: int  # calibration prompts measured
    counts: tuple[int, ...]  # calibration prompts per class
    stats: ClassStats | None  # None when the labels came without scores
    labels_source: str  # where the labels and scores came from
    fit: CalibrationFit

    def __post_init__(self) -> None:
        n = len(self.levels)
        if n == 0:
            raise ValueError("levels: at least one level is needed")
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise ValueError(f"temperature: must be finite and > 0, got {self.temperature}")
        if len(self.edges) != n - 1:
            raise ValueError(f"edges: expected {n - 1} values, got {len(self.edges)}")
        if any(not math.isfinite(e) for e in self.edges) or any(
            b < a for a, b in zip(self.edges, self.edges[1:], strict=False)
        ):
            raise ValueError(f"edges: must be finite and non-decreasing, got {self.edges}")
        if len(self.counts) != n or any(c < 0 for c in self.counts):
            raise ValueError(f"counts: expected {n} values >= 0, got {self.counts}")
        if sum(self.counts) != self.prompts or self.prompts < 1:
            raise ValueError(f"counts: sum {sum(self.counts)} differs from prompts {self.prompts}")
        if self.stats is not None:
            if self.stats.counts != self.counts:
                raise ValueError("stats: counts differ from the calibration's")
            if not (math.isfinite(self.stats.best_mean) and self.stats.best_mean > 0.0):
                raise ValueError(f"best_mean: must be finite and > 0, got {self.stats.best_mean}")
            for name in ("mean_score", "quality"):
                table = getattr(self.stats, name)
                if len(table) != n or any(len(row) != n for row in table):
                    raise ValueError(f"{name}: expected {n} classes × {n} levels")
                for c, row in enumerate(table):
                    for v, value in enumerate(row):
                        if not (math.isfinite(value) and value >= 0.0):
                            raise ValueError(f"{name}[{c}][{v}]: must be finite and >= 0")

    @property
    def n_classes(self) -> int:
        return len(self.levels)

    @property
    def prior(self) -> tuple[float, ...]:
        """Share of the calibration prompts in each class."""
        return tuple(c / self.prompts for c in self.counts)

    @property
    def synthetic(self) -> bool:
        return self.labels_source.startswith("synthetic")

    def classes_of_logits(self, logits: npt.NDArray[np.floating[Any]]) -> IntArray:
        """Class per row of head logits."""
        return classes_of_scores(tolerance_scores(softmax_t(logits, self.temperature)), self.edges)

    def class_quality(self, source: str) -> ClassQuality:
        """Q(v | c) as the planner takes it; ``ValueError`` when no scores were measured."""
        if self.stats is None:
            raise ValueError(
                f"the {self.strategy} calibration has no Q(v | c): its labels came without "
                "scores (retrain from a quality table)"
            )
        return ClassQuality(self.strategy, self.levels, self.stats.quality, self.prior, source)


def calibrate(
    strategy: Strategy,
    levels: tuple[str, ...],
    logits: npt.NDArray[np.floating[Any]],
    labels: IntArray,
    scores: FloatArray | None,
    labels_source: str,
) -> Calibration:
    """Steps 1–4 of the module docstring on the calibration prompts' head ``logits``, their
    optimal-level ``labels`` and, when known, their ``scores[prompt, level]``."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) == 0:
        raise ValueError("calibration needs at least one prompt")
    n = len(levels)
    temperature = fit_temperature(logits, labels)
    before, after = softmax_t(logits), softmax_t(logits, temperature)
    fit = CalibrationFit(
        log_loss_before=negative_log_likelihood(logits, labels),
        log_loss_after=negative_log_likelihood(logits, labels, temperature),
        ece_before=expected_calibration_error(before, labels),
        ece_after=expected_calibration_error(after, labels),
    )
    tolerance = tolerance_scores(after)
    edges = class_edges(tolerance, n)
    classes = classes_of_scores(tolerance, edges)
    counts = tuple(int(c) for c in np.bincount(classes, minlength=n))
    stats = None if scores is None else measure_class_quality(classes, scores, n)
    return Calibration(
        strategy, levels, temperature, edges, len(labels), counts, stats, labels_source, fit
    )


# ---------------------------------------------------------------------------------------------
# calibration.json


def calibration_json(calibration: Calibration) -> dict[str, Any]:
    """The document of the module docstring."""
    stats = calibration.stats
    return {
        "format": CALIBRATION_FORMAT,
        "strategy": calibration.strategy.value,
        "levels": list(calibration.levels),
        "temperature": calibration.temperature,
        "edges": list(calibration.edges),
        "prompts": calibration.prompts,
        "counts": list(calibration.counts),
        "prior": list(calibration.prior),
        "best_mean": None if stats is None else stats.best_mean,
        "mean_score": None if stats is None else [list(row) for row in stats.mean_score],
        "quality": None if stats is None else [list(row) for row in stats.quality],
        "labels_source": calibration.labels_source,
        "synthetic": calibration.synthetic,
        "fit": {
            "log_loss_before": calibration.fit.log_loss_before,
            "log_loss_after": calibration.fit.log_loss_after,
            "ece_before": calibration.fit.ece_before,
            "ece_after": calibration.fit.ece_after,
        },
    }


_FETCH: Any = object()  # "read the value from the document" (None is a JSON null)


class _Reader:
    """Typed fields of one JSON document; errors name the file and the field."""

    def __init__(self, document: Mapping[str, Any], path: Path) -> None:
        self.document = document
        self.path = path

    def fail(self, key: str, problem: str) -> CalibrationError:
        return CalibrationError(f"{self.path}: field {key!r}: {problem}")

    def get(self, key: str) -> Any:
        if key not in self.document:
            raise self.fail(key, "missing")
        return self.document[key]

    def number(self, key: str, value: Any = _FETCH) -> float:
        value = self.get(key) if value is _FETCH else value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        return float(value)

    def integer(self, key: str, value: Any = _FETCH) -> int:
        value = self.get(key) if value is _FETCH else value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        return value

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {value!r}")
        return value

    def array(self, key: str, length: int, value: Any = _FETCH) -> list[Any]:
        value = self.get(key) if value is _FETCH else value
        if not isinstance(value, list) or len(value) != length:
            raise self.fail(key, f"expected a list of {length} values, got {value!r}")
        return value

    def numbers(self, key: str, length: int) -> tuple[float, ...]:
        return tuple(self.number(key, v) for v in self.array(key, length))

    def matrix(self, key: str, n: int) -> tuple[tuple[float, ...], ...]:
        rows = self.array(key, n)
        return tuple(tuple(self.number(key, v) for v in self.array(key, n, row)) for row in rows)


def parse_calibration(document: Any, path: Path) -> Calibration:
    """A :class:`Calibration` from the parsed ``calibration.json`` at ``path``."""
    if not isinstance(document, dict):
        raise CalibrationError(f"{path}: expected a JSON object")
    read = _Reader(document, path)
    if read.get("format") != CALIBRATION_FORMAT:
        raise read.fail("format", f"{document['format']!r}, expected {CALIBRATION_FORMAT!r}")
    try:
        strategy = Strategy.parse(read.text("strategy"))
    except ValueError as exc:
        raise read.fail("strategy", str(exc)) from None
    levels_value = read.get("levels")
    if (
        not isinstance(levels_value, list)
        or not levels_value
        or not all(isinstance(v, str) for v in levels_value)
    ):
        raise read.fail("levels", f"expected a non-empty list of names, got {levels_value!r}")
    levels = tuple(levels_value)
    n = len(levels)
    counts = tuple(read.integer("counts", v) for v in read.array("counts", n))
    fit_value = read.get("fit")
    if not isinstance(fit_value, dict):
        raise read.fail("fit", f"expected an object, got {fit_value!r}")
    fit_reader = _Reader(fit_value, path)
    try:
        fit = CalibrationFit(
            **{key: fit_reader.number(key) for key in CalibrationFit.__dataclass_fields__}
        )
    except CalibrationError as exc:
        raise CalibrationError(str(exc).replace("field '", "field 'fit.", 1)) from None
    stats = None
    if read.get("quality") is not None:
        stats = ClassStats(
            counts=counts,
            best_mean=read.number("best_mean"),
            mean_score=read.matrix("mean_score", n),
            quality=read.matrix("quality", n),
        )
    prompts = read.integer("prompts")
    if sum(counts) != prompts or prompts < 1:
        raise read.fail("counts", f"sum {sum(counts)} differs from prompts {prompts}")
    prior = read.numbers("prior", n)
    if prompts >= 1 and any(
        abs(p - c / prompts) > 1e-9 for p, c in zip(prior, counts, strict=True)
    ):
        raise read.fail("prior", f"{prior} is not counts / prompts")
    try:
        return Calibration(
            strategy=strategy,
            levels=levels,
            temperature=read.number("temperature"),
            edges=read.numbers("edges", n - 1),
            prompts=prompts,
            counts=counts,
            stats=stats,
            labels_source=read.text("labels_source"),
            fit=fit,
        )
    except CalibrationError:
        raise
    except ValueError as exc:  # the dataclass names the field first: "edges: must be ..."
        field_name, _, problem = str(exc).partition(": ")
        raise read.fail(field_name, problem) from None


def read_calibration(path: str | Path) -> Calibration:
    """Read and validate a ``calibration.json``; :class:`CalibrationError` names the field."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: cannot read: {exc}") from None
    return parse_calibration(document, path)
