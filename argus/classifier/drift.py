"""Drift detection and retraining off the request path (Argus §4.1, §5.5).

The rule (the paper's, with a margin): quality scores of served images are grouped into
windows of ``window`` scores. When a window closes, its median is compared with the mean of
the medians of the up to ``history`` windows before it; the window **drifts** when at least
``min_history`` earlier windows exist and

    median(current window) < (1 - tolerance) × mean(medians of the earlier windows)

The paper retrains when the median "falls below the moving average" and gives no margin;
with none, a stationary stream would fall below its own average every other window, so
``tolerance`` defaults to 2% (ASSUMED: about two standard errors of the median of 200
PickScores around 20). Windows count scores, not seconds, so no clock is involved.

On drift, :class:`Retrainer` trains a new model in a background thread from the recent
labelled prompts, measures the new model's Q(v | c) (``measure``), then swaps it in through the
strategy's :class:`~argus.classifier.serving.HotSwapModel`: the new model is complete before
the swap, and the swap is one reference assignment, so requests keep using the old model until
then and never see a half-built one. A trigger while a retrain runs, or with too few labels,
is counted and dropped.

The labels and Q come from the quality scores workers send for a sample of their images
(the live router's :mod:`argus.router.drift`): :class:`ScoredPrompts` keeps what was observed,
a prompt scored at two levels or more is labelled by the δ rule on what was observed, and
:func:`observed_class_quality` measures the new model's Q(v | c). The router sends the new Q
to the allocator in its report, so the allocator prices the new classes with it.
``docs/control-plane-internals.md`` says why labels come only from prompts seen at several
levels, what a cell no observation reaches keeps, and what the allocator sees meanwhile.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from argus import defaults
from argus.classifier.calibration import shrink_cell_means
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import Backbone, LevelClassifier
from argus.classifier.prompts import clean_prompt
from argus.classifier.serving import HotSwapModel
from argus.classifier.train import TrainConfig
from argus.types import ClassQuality, Strategy


@dataclass(frozen=True)
class DriftConfig:
    """When a window of quality scores counts as drift."""

    window: int = 200
    """Scores per window."""

    history: int = 6
    """Earlier windows whose medians make the moving average."""

    min_history: int = 3
    """Earlier windows needed before any window can drift."""

    tolerance: float = 0.02
    """Relative margin below the moving average that counts as drift (0: the paper's rule)."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window}")
        if not 1 <= self.min_history <= self.history:
            raise ValueError(
                f"min_history: must be in [1, history={self.history}], got {self.min_history}"
            )
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance: must be in [0, 1), got {self.tolerance}")


@dataclass(frozen=True)
class WindowVerdict:
    """One closed window."""

    index: int  # 0 for the first window
    median: float  # median score of the window
    baseline: float | None  # moving average of earlier medians (None: too little history)
    drift: bool  # the rule of the module docstring held


class DriftMonitor:
    """Feeds on quality scores; says when a window drifts. Not thread-safe: one feeder."""

    def __init__(self, config: DriftConfig | None = None) -> None:
        self.config = config or DriftConfig()
        self._scores: list[float] = []
        self._medians: deque[float] = deque(maxlen=self.config.history)
        self.windows = 0
        self.drifts = 0

    def observe(self, score: float) -> WindowVerdict | None:
        """Add one score; returns the verdict when it closes a window, else ``None``."""
        self._scores.append(float(score))
        if len(self._scores) < self.config.window:
            return None
        median = statistics.median(self._scores)
        self._scores = []
        baseline = None
        if len(self._medians) >= self.config.min_history:
            baseline = statistics.fmean(self._medians)
        drift = baseline is not None and median < (1.0 - self.config.tolerance) * baseline
        verdict = WindowVerdict(self.windows, median, baseline, drift)
        self._medians.append(median)
        self.windows += 1
        self.drifts += int(drift)
        return verdict


class LabelSource(Protocol):
    """Where a :class:`Retrainer` takes its training data from."""

    strategy: Strategy

    def __len__(self) -> int: ...  # labelled prompts available now

    def snapshot(self) -> LabelledPrompts: ...


@dataclass(frozen=True)
class Observation:
    """Scores of one prompt at the levels it was served at."""

    prompt: str  # cleaned text
    scores: dict[int, float]  # level index → latest score


class ScoredPrompts:
    """The latest score of each of the last ``capacity`` prompts of one strategy at each level
    it was served at (a prompt seen again moves up); thread-safe.

    Labels follow the δ rule on the observed levels (module docstring): a prompt scored at two
    levels or more is labelled with the fastest of them whose score is ``>= δ ×`` its best
    observed score. ``len()`` counts labelled prompts, what a retrain can use.
    """

    def __init__(
        self,
        strategy: Strategy,
        levels: tuple[str, ...],
        capacity: int = 5000,
        delta: float = defaults.DELTA,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        if not 0.0 < delta <= 1.0:
            raise ValueError(f"delta: must be in (0, 1], got {delta}")
        self.strategy = strategy
        self.levels = levels
        self.capacity = capacity
        self.delta = delta
        self._items: OrderedDict[str, dict[int, float]] = OrderedDict()
        self._labelled = 0  # prompts with two scored levels or more
        self._lock = threading.Lock()

    def observe(self, prompt: str, level: int, score: float) -> None:
        """One served image's score; empty prompts and non-finite scores are ignored."""
        if not 0 <= level < len(self.levels):
            raise ValueError(f"level must be in [0, {len(self.levels)}), got {level}")
        text = clean_prompt(prompt)
        if text is None or not math.isfinite(score):
            return
        with self._lock:
            scores = self._items.pop(text, {})
            before = len(scores) >= 2
            scores[level] = float(score)
            self._items[text] = scores
            self._labelled += int(len(scores) >= 2) - int(before)
            while len(self._items) > self.capacity:
                _, gone = self._items.popitem(last=False)
                self._labelled -= int(len(gone) >= 2)

    def __len__(self) -> int:
        return self._labelled

    def observations(self) -> list[Observation]:
        """Every prompt held, oldest first, with its scores."""
        with self._lock:
            return [Observation(p, dict(s)) for p, s in self._items.items()]

    def label(self, scores: dict[int, float]) -> int:
        """The δ rule on observed scores: the fastest level within δ of the best score."""
        best = max(scores.values())
        return max(v for v, score in scores.items() if score >= self.delta * best)

    def snapshot(self) -> LabelledPrompts:
        """The labelled prompts, oldest first, as training data (no score table: it has
        holes)."""
        held = [o for o in self.observations() if len(o.scores) >= 2]
        return LabelledPrompts(
            strategy=self.strategy,
            levels=self.levels,
            prompts=tuple(o.prompt for o in held),
            labels=np.array([self.label(o.scores) for o in held], dtype=np.int64),
            scores=None,
            source="scored prompts served at several levels (drift retraining)",
            delta=self.delta,
        )


def observed_class_quality(
    classes: Sequence[int],
    observations: Sequence[Observation],
    levels: tuple[str, ...],
    strategy: Strategy,
    previous: ClassQuality | None,
    source: str,
) -> ClassQuality:
    """Q(v | c) of a model that puts ``observations[i]``'s prompt in class ``classes[i]``.

    ``Q[c][v]`` is the mean observed score of class ``c`` at level ``v``, shrunk towards the
    level's mean over all classes by how much of the class's difference its scores can tell
    from noise (:func:`~argus.classifier.calibration.shrink_cell_means`, as the calibration's
    Q is shrunk), over the mean observed score at level 0 (the best level) of every class;
    without any level-0 score, over the highest level mean. A cell with no score keeps
    ``previous``'s value, or without one the level's mean over all classes (its nearest
    level's when the level has no score at all). The prior is the share of the observed
    prompts in each class. ``ValueError`` when nothing was observed."""
    n = len(levels)
    if len(classes) != len(observations):
        raise ValueError(f"{len(classes)} classes for {len(observations)} observations")
    total = np.zeros((n, n))
    count = np.zeros((n, n))
    for c, observation in zip(classes, observations, strict=True):
        if not 0 <= c < n:
            raise ValueError(f"class {c} outside [0, {n})")
        for v, score in observation.scores.items():
            total[c, v] += score
            count[c, v] += 1
    if not count.any():
        raise ValueError(f"no {strategy} scores to measure Q(v | c) with")
    column = total.sum(axis=0) / np.maximum(count.sum(axis=0), 1)
    seen = np.flatnonzero(count.sum(axis=0) > 0)
    best = column[0] if count[:, 0].any() else float(column[seen].max())
    if not best > 0.0:
        raise ValueError(f"the {strategy} best-level mean score is {best}, not > 0")
    raw = np.where(count > 0, total / np.maximum(count, 1), column[None, :])
    within_ss = np.zeros(n)
    for c, observation in zip(classes, observations, strict=True):
        for v, score in observation.scores.items():
            within_ss[v] += (score - raw[c, v]) ** 2
    means = shrink_cell_means(raw, count, column, within_ss)
    quality = np.zeros((n, n))
    for c in range(n):
        for v in range(n):
            if count[c, v]:
                quality[c, v] = means[c, v] / best
            elif previous is not None:
                quality[c, v] = previous.quality[c][v]
            else:
                nearest = seen[int(np.argmin(np.abs(seen - v)))]
                quality[c, v] = column[nearest] / best
    members = np.bincount(np.asarray(classes, dtype=np.int64), minlength=n)[:n]
    prior = members / members.sum() if members.sum() else np.full(n, 1.0 / n)
    return ClassQuality(
        strategy=strategy,
        levels=levels,
        quality=tuple(tuple(max(0.0, float(x)) for x in row) for row in quality),
        prior=tuple(float(x) for x in prior),
        source=source,
    )


@dataclass(frozen=True)
class RetrainStats:
    """Counters of a :class:`Retrainer`."""

    retrains: int  # new models swapped in
    failures: int  # retrains that raised (the old model stays)
    skipped: int  # triggers dropped: a retrain was running, or too few labels
    version: int  # the holder's model version (0: the original model)
    running: bool
    last_error: str | None


class Retrainer:
    """Retrains one strategy's model in the background and hot-swaps the result.

    ``train(data)`` returns a complete :class:`LevelClassifier`; it runs on a worker thread,
    never on the caller's. ``measure(model)``, when given, returns the new model's
    Q(v | c) on the same thread, before the swap (a failure keeps the old model);
    :attr:`published` then holds it with the model's version. ``prepare(model)``, when
    given, returns the model to serve in its place (the same head on the serving encoder,
    say), after ``measure``. ``on_swap(version)`` is called after each swap. Only one retrain
    runs at a time.
    """

    def __init__(
        self,
        holder: HotSwapModel[LevelClassifier],
        train: Callable[[LabelledPrompts], LevelClassifier],
        recent: LabelSource,
        *,
        min_examples: int = 100,
        measure: Callable[[LevelClassifier], ClassQuality] | None = None,
        prepare: Callable[[LevelClassifier], LevelClassifier] | None = None,
        on_swap: Callable[[int], None] | None = None,
    ) -> None:
        self.holder = holder
        self.recent = recent
        self._train = train
        self._measure = measure
        self._prepare = prepare
        self._on_swap = on_swap
        self.min_examples = min_examples
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._retrains = self._failures = self._skipped = 0
        self._last_error: str | None = None
        self._published: tuple[int, ClassQuality | None] | None = None

    @property
    def published(self) -> tuple[int, ClassQuality | None] | None:
        """(version, Q(v | c)) of the last model swapped in, read together; None before the
        first swap. Q is None without ``measure``."""
        with self._lock:
            return self._published

    def trigger(self) -> bool:
        """Start a retrain unless one runs or labels are too few; True when started."""
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            if running or len(self.recent) < self.min_examples:
                self._skipped += 1
                return False
            data = self.recent.snapshot()
            self._thread = threading.Thread(
                target=self._retrain, args=(data,), name="argus-classifier-retrain", daemon=True
            )
            self._thread.start()
            return True

    def _retrain(self, data: LabelledPrompts) -> None:
        try:
            train = self._train
            if isinstance(train, LogisticRetrain):  # on the encoder layers the old model reads
                train = train.following(self.holder.current)
            model = train(data)
            if model.strategy is not self.holder.current.strategy:
                raise ValueError(
                    f"retrained a {model.strategy} model for a {self.recent.strategy} slot"
                )
            if model.levels != self.holder.current.levels:
                raise ValueError(f"retrained model has levels {model.levels}")
            quality = None if self._measure is None else self._measure(model)
            if self._prepare is not None:
                model = self._prepare(model)
            check_same_layers(model)
        except Exception as exc:  # the old model keeps serving; the error is kept for stats
            with self._lock:
                self._failures += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
            return
        version = self.holder.swap(model)
        with self._lock:
            self._retrains += 1
            self._published = (version, quality)
        if self._on_swap is not None:
            self._on_swap(version)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running retrain; True when none is running afterwards."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stats(self) -> RetrainStats:
        with self._lock:
            thread = self._thread
            return RetrainStats(
                retrains=self._retrains,
                failures=self._failures,
                skipped=self._skipped,
                version=self.holder.version,
                running=thread is not None and thread.is_alive(),
                last_error=self._last_error,
            )


class DriftRetraining:
    """A monitor wired to a retrainer: a drifting window starts a background retrain. Not
    thread-safe (the monitor is not): one feeder, or the caller's lock."""

    def __init__(self, monitor: DriftMonitor, retrainer: Retrainer) -> None:
        self.monitor = monitor
        self.retrainer = retrainer
        self.triggered = 0  # drifting windows that started a retrain

    def observe_quality(self, score: float, *, retrain: bool = True) -> WindowVerdict | None:
        """One served image's quality score; on drift, starts a retrain (unless ``retrain``
        is off: the router's ``--no-drift-retrain`` only watches)."""
        verdict = self.monitor.observe(score)
        if retrain and verdict is not None and verdict.drift and self.retrainer.trigger():
            self.triggered += 1
        return verdict


def check_same_layers(model: LevelClassifier) -> None:
    """``ValueError`` when ``model``'s encoder runs other layers than its head was fitted on
    (a student's head on the full encoder, or the reverse: they share the encoder's weights'
    SHA-256, so nothing else would tell). Encoders that do not say (test fakes) pass."""
    layers = getattr(model.encoder, "layers", model.config.layers)
    distilled = getattr(model.encoder, "layer_weights", None) is not None
    if layers != model.config.layers or (
        hasattr(model.encoder, "layer_weights") and distilled != bool(model.config.student_weights)
    ):
        raise ValueError(
            f"the {model.strategy} head was fitted on encoder layers {model.config.layers} "
            f"(distilled: {bool(model.config.student_weights)}), its encoder runs {layers} "
            f"(distilled: {distilled})"
        )


class LogisticRetrain:
    """A ``train`` function for :class:`Retrainer`: the logistic backbone on ``encoder_dir``
    (default all-MiniLM-L6-v2), so a retrain takes seconds on a CPU. The retrainer calls
    :meth:`following` first, so a retrained head reads the same encoder layers (a student's,
    with its distilled weights) as the model it replaces."""

    def __init__(self, encoder_dir: str | None = None, config: TrainConfig | None = None) -> None:
        self.encoder_dir = encoder_dir
        self.config = replace(config or TrainConfig(), backbone=Backbone.LOGISTIC)

    def following(self, model: LevelClassifier) -> LogisticRetrain:
        """The same training on the encoder layers ``model`` reads: its layer count, its
        runtime and, for a distilled student, the weights file its encoder loaded."""
        weights = getattr(model.encoder, "layer_weights", None)
        if model.config.student_weights and weights is None:
            raise ValueError(f"the {model.strategy} student's encoder has no layer weights file")
        config = replace(
            self.config,
            layers=model.config.layers,
            student_weights=weights,
            runtime=model.config.runtime,  # an int8 head's vectors are the int8 runtime's
        )
        return LogisticRetrain(self.encoder_dir, config)

    def __call__(self, data: LabelledPrompts) -> LevelClassifier:
        from argus.classifier.train import train_classifier

        return train_classifier(data, self.config, encoder_dir=self.encoder_dir).classifier


def logistic_retrain(
    encoder_dir: str | None = None, config: TrainConfig | None = None
) -> LogisticRetrain:
    """A :class:`LogisticRetrain` (what the router retrains its classifiers with)."""
    return LogisticRetrain(encoder_dir, config)
