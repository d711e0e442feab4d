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
labelled prompts (:class:`RecentLabels`), then swaps it in through the strategy's
:class:`~argus.classifier.serving.HotSwapModel`: the new model is complete before the swap, and
the swap is one reference assignment, so requests keep using the old model until then and
never see a half-built one. A trigger while a retrain runs, or with too few labels, is
counted and dropped. What feeds the monitor is the caller's choice; note that a plan which
moves prompts to faster levels under load lowers quality too, without any drift in prompts.

**Not wired into the live router, and not safe to wire as it is.** ``argus router`` builds
no :class:`Retrainer` (its ``argus_router_classifier_retrains`` counter stays at 0). The
allocator prices the router's classes with the Q(v | c) it read at start-up from the
artifact's ``calibration.json`` (:func:`~argus.classifier.serving.read_planning_classes`),
and the router reports the :func:`~argus.classifier.serving.classifier_key` of the artifact
it loaded. A swapped-in model would break both: :class:`RecentLabels` carry no scores, so
the retrained model's calibration has new edges and temperature but no Q (or no calibration
at all when none of the recent prompts falls in the CALIBRATION split, and the router would
send arg-max levels where the allocator expects classes); the allocator would keep pricing
the new classes with the old head's Q, and the router would go on reporting the old key.
Wiring it needs scores for the recent prompts (so the retrain measures Q) and a way to give
the new Q to the allocator: a new artifact both processes reload, or Q in the router's report.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import Backbone, LevelClassifier
from argus.classifier.prompts import clean_prompt
from argus.classifier.serving import HotSwapModel
from argus.classifier.train import TrainConfig
from argus.types import Strategy


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


class RecentLabels:
    """The last ``capacity`` labelled prompts of one strategy (a prompt seen again moves up).

    Labels come from operation: a prompt whose images were scored at several levels gets its
    optimal level under the δ rule. Thread-safe.
    """

    def __init__(
        self, strategy: Strategy, levels: tuple[str, ...], capacity: int = 5000, delta: float = 0.9
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.strategy = strategy
        self.levels = levels
        self.capacity = capacity
        self.delta = delta
        self._items: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, prompt: str, level: int) -> None:
        if not 0 <= level < len(self.levels):
            raise ValueError(f"level must be in [0, {len(self.levels)}), got {level}")
        text = clean_prompt(prompt)
        if text is None:
            return  # empty prompts are answered without the model
        with self._lock:
            self._items.pop(text, None)
            self._items[text] = level
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> LabelledPrompts:
        """The current labels, oldest first, as training data."""
        with self._lock:
            items = list(self._items.items())
        return LabelledPrompts(
            strategy=self.strategy,
            levels=self.levels,
            prompts=tuple(p for p, _ in items),
            labels=np.array([label for _, label in items], dtype=np.int64),
            scores=None,
            source="recent labelled prompts",
            delta=self.delta,
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
    never on the caller's. Only one retrain runs at a time.
    """

    def __init__(
        self,
        holder: HotSwapModel[LevelClassifier],
        train: Callable[[LabelledPrompts], LevelClassifier],
        recent: RecentLabels,
        *,
        min_examples: int = 100,
    ) -> None:
        self.holder = holder
        self.recent = recent
        self._train = train
        self.min_examples = min_examples
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._retrains = self._failures = self._skipped = 0
        self._last_error: str | None = None

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
            model = self._train(data)
            if model.strategy is not self.holder.current.strategy:
                raise ValueError(
                    f"retrained a {model.strategy} model for a {self.recent.strategy} slot"
                )
            if model.levels != self.holder.current.levels:
                raise ValueError(f"retrained model has levels {model.levels}")
        except Exception as exc:  # the old model keeps serving; the error is kept for stats
            with self._lock:
                self._failures += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
            return
        self.holder.swap(model)
        with self._lock:
            self._retrains += 1

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
    """A monitor wired to a retrainer: a drifting window starts a background retrain."""

    def __init__(self, monitor: DriftMonitor, retrainer: Retrainer) -> None:
        self.monitor = monitor
        self.retrainer = retrainer
        self.triggered = 0  # drifting windows that started a retrain

    def observe_quality(self, score: float) -> WindowVerdict | None:
        """One served image's quality score; on drift, starts a retrain."""
        verdict = self.monitor.observe(score)
        if verdict is not None and verdict.drift and self.retrainer.trigger():
            self.triggered += 1
        return verdict

    def observe_label(self, prompt: str, level: int) -> None:
        """A prompt whose optimal level became known (images scored at several levels)."""
        self.retrainer.recent.add(prompt, level)


def logistic_retrain(
    encoder_dir: str | None = None, config: TrainConfig | None = None
) -> Callable[[LabelledPrompts], LevelClassifier]:
    """A ``train`` function for :class:`Retrainer`: the logistic backbone on ``encoder_dir``
    (default all-MiniLM-L6-v2), so a retrain takes seconds on a CPU."""
    from argus.classifier.train import train_classifier

    settings = replace(config or TrainConfig(), backbone=Backbone.LOGISTIC)

    def train(data: LabelledPrompts) -> LevelClassifier:
        return train_classifier(data, settings, encoder_dir=encoder_dir).classifier

    return train
