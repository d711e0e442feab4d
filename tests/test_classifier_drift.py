"""Drift detection and background retraining with an atomic hot-swap."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from argus.classifier.drift import (
    DriftConfig,
    DriftMonitor,
    DriftRetraining,
    RecentLabels,
    Retrainer,
    logistic_retrain,
)
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import LevelClassifier
from argus.classifier.serving import ClassifierSet, HotSwapModel
from argus.classifier.train import TrainConfig
from argus.types import Strategy
from tests.classifier_factories import (
    AC_LEVELS,
    EASY,
    HARD,
    FakeEncoder,
    constant_classifier,
    make_tiny_bert,
)


def reference_verdicts(scores: list[float], config: DriftConfig) -> list[bool]:
    """The rule written out: window medians against the mean of the earlier ones."""
    medians: list[float] = []
    drifts = []
    for start in range(0, len(scores) - config.window + 1, config.window):
        median = statistics.median(scores[start : start + config.window])
        earlier = medians[-config.history :]
        drift = len(earlier) >= config.min_history and median < (
            1 - config.tolerance
        ) * statistics.fmean(earlier)
        drifts.append(drift)
        medians.append(median)
    return drifts


def feed(monitor: DriftMonitor, scores: list[float]) -> list[bool]:
    verdicts = [monitor.observe(s) for s in scores]
    return [v.drift for v in verdicts if v is not None]


def test_drift_when_the_median_falls_below_the_moving_average() -> None:
    config = DriftConfig(window=3, history=2, min_history=2, tolerance=0.0)
    medians = [20.0, 20.0, 19.9, 20.5, 20.0, 20.3]
    # window 2: 19.9 < mean(20, 20) → drift; window 3: 20.5 ≥ mean(20, 19.9); window 4:
    # 20.0 < mean(19.9, 20.5) = 20.2 → drift; window 5: 20.3 ≥ mean(20.5, 20.0)
    scores = [value for m in medians for value in (m - 5.0, m, m + 1.0)]
    assert feed(DriftMonitor(config), scores) == [False, False, True, False, True, False]


def test_tolerance_and_minimum_history() -> None:
    config = DriftConfig(window=1, history=3, min_history=3, tolerance=0.05)
    # 10 → 1 in the second window is no drift: one earlier window, three are needed.
    # Then the baseline is mean(10, 1, 10) = 7: 6.66 is not below 0.95 × 7 = 6.65, 6.64 is.
    assert feed(DriftMonitor(config), [10.0, 1.0, 10.0, 6.66]) == [False] * 4
    monitor = DriftMonitor(config)
    assert feed(monitor, [10.0, 1.0, 10.0, 6.64]) == [False, False, False, True]
    assert monitor.windows == 4 and monitor.drifts == 1


@pytest.mark.parametrize("seed", range(5))
def test_monitor_matches_the_written_out_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = DriftConfig(
        window=int(rng.integers(1, 20)),
        history=int(rng.integers(2, 8)),
        min_history=2,
        tolerance=float(rng.choice([0.0, 0.01, 0.05])),
    )
    level = np.repeat(rng.uniform(15.0, 21.0, size=40), 30)
    scores = (level + rng.normal(0.0, 1.0, size=level.size)).tolist()
    assert feed(DriftMonitor(config), scores) == reference_verdicts(scores, config)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="min_history"):
        DriftConfig(history=2, min_history=3)
    with pytest.raises(ValueError, match="tolerance"):
        DriftConfig(tolerance=1.5)


# ---------------------------------------------------------------------------------- retraining


def recent(n: int) -> RecentLabels:
    labels = RecentLabels(Strategy.AC, AC_LEVELS, capacity=1000)
    for i in range(n):
        labels.add(f"prompt {i}", i % 3)
    return labels


def test_drift_starts_exactly_one_retrain_and_swaps_a_complete_model() -> None:
    classifiers = ClassifierSet({Strategy.AC: constant_classifier(1)})
    holder = classifiers.holders[Strategy.AC]
    started = threading.Event()
    finish = threading.Event()
    trained: list[LabelledPrompts] = []

    def train(data: LabelledPrompts) -> LevelClassifier:
        trained.append(data)
        encoder = FakeEncoder(ready=False)  # a model being built: unusable until the end
        model = constant_classifier(5, encoder=encoder)
        started.set()
        finish.wait(30)
        encoder.ready = True
        return model

    retrainer = Retrainer(holder, train, recent(50), min_examples=10)
    loop = DriftRetraining(DriftMonitor(DriftConfig(window=2, history=2, min_history=1)), retrainer)
    for score in (20.0, 20.0, 20.0, 20.0):
        loop.observe_quality(score)
    assert loop.monitor.windows == 2 and loop.monitor.drifts == 0
    assert retrainer.stats().retrains == 0 and not started.is_set()

    stop = threading.Event()
    seen: set[int] = set()
    errors: list[BaseException] = []

    def predictor() -> None:
        try:
            while not stop.is_set():
                seen.update(classifiers.predict(["a", "b", "c"])[Strategy.AC].tolist())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=predictor) for _ in range(3)]
    for thread in threads:
        thread.start()
    loop.observe_quality(15.0)
    verdict = loop.observe_quality(15.0)  # window median 15 < 20: drift
    assert verdict is not None and verdict.drift
    assert started.wait(30)
    assert loop.observe_quality(10.0) is None
    assert loop.observe_quality(10.0).drift  # type: ignore[union-attr]
    assert retrainer.stats().skipped == 1  # the second drift found a retrain running
    assert holder.version == 0 and classifiers.predict(["x"])[Strategy.AC].tolist() == [1]
    finish.set()
    assert retrainer.wait(30)
    deadline = time.monotonic() + 30
    while 5 not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors  # no request reached the half-built model
    assert seen == {1, 5}
    stats = retrainer.stats()
    assert (stats.retrains, stats.failures, stats.version, loop.triggered) == (1, 0, 1, 1)
    assert len(trained) == 1 and len(trained[0]) == 50


def test_too_few_labels_or_a_failing_retrain_keep_the_old_model() -> None:
    holder: HotSwapModel[LevelClassifier] = HotSwapModel(constant_classifier(2))
    few = Retrainer(holder, lambda data: constant_classifier(3), recent(5), min_examples=10)
    assert not few.trigger()
    assert few.stats().skipped == 1

    def broken(data: LabelledPrompts) -> LevelClassifier:
        raise RuntimeError("out of memory")

    failing = Retrainer(holder, broken, recent(20), min_examples=10)
    assert failing.trigger()
    assert failing.wait(30)
    stats = failing.stats()
    assert (stats.retrains, stats.failures, stats.version) == (0, 1, 0)
    assert stats.last_error == "RuntimeError: out of memory"
    wrong = Retrainer(
        holder, lambda data: constant_classifier(0, levels=("x", "y")), recent(20), min_examples=1
    )
    assert wrong.trigger() and wrong.wait(30)
    assert wrong.stats().failures == 1 and holder.current.head.bias.argmax() == 2


def test_recent_labels_keep_the_latest_and_skip_empty_prompts() -> None:
    labels = RecentLabels(Strategy.AC, AC_LEVELS, capacity=3)
    for prompt, level in (("a", 0), ("b", 1), (" ", 2), ("c", 2), ("a", 5), ("d", 3)):
        labels.add(prompt, level)
    data = labels.snapshot()
    assert data.prompts == ("c", "a", "d") and data.labels.tolist() == [2, 5, 3]
    with pytest.raises(ValueError, match="level"):
        labels.add("e", 6)


def test_logistic_retrain_learns_from_recent_labels(tmp_path: Path) -> None:
    encoder = make_tiny_bert(tmp_path / "bert")
    labels = RecentLabels(Strategy.AC, AC_LEVELS)
    rng = np.random.default_rng(0)
    for i in range(160):
        words = rng.choice(HARD if i % 2 else EASY, size=3, replace=False)
        labels.add(" and ".join(words), 0 if i % 2 else 5)
    holder: HotSwapModel[LevelClassifier] = HotSwapModel(constant_classifier(2))
    retrainer = Retrainer(
        holder,
        logistic_retrain(str(encoder), TrainConfig(max_tokens=32, c_grid=(3.0,))),
        labels,
        min_examples=100,
    )
    assert retrainer.trigger() and retrainer.wait(120)
    assert retrainer.stats().retrains == 1, retrainer.stats().last_error
    predicted = holder.current.predict(["cat and dog and sun", "mosaic and origami and crowd"])
    assert predicted.tolist() == [5, 0]
