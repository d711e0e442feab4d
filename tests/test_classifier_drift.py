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
    Observation,
    Retrainer,
    ScoredPrompts,
    logistic_retrain,
    observed_class_quality,
)
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import LevelClassifier
from argus.classifier.serving import ClassifierSet, HotSwapModel
from argus.classifier.train import TrainConfig
from argus.types import ClassQuality, Strategy
from tests.classifier_factories import (
    AC_LEVELS,
    EASY,
    HARD,
    FakeEncoder,
    constant_classifier,
    make_tiny_bert,
)

pytestmark = pytest.mark.unit


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


class FixedLabels:
    """Labelled prompts the test gives, as a Retrainer's label source."""

    strategy = Strategy.AC

    def __init__(self, pairs: list[tuple[str, int]]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def snapshot(self) -> LabelledPrompts:
        return LabelledPrompts(
            strategy=self.strategy,
            levels=AC_LEVELS,
            prompts=tuple(p for p, _ in self.pairs),
            labels=np.array([label for _, label in self.pairs], dtype=np.int64),
            scores=None,
            source="the test's labels",
            delta=0.9,
        )


def recent(n: int) -> FixedLabels:
    return FixedLabels([(f"prompt {i}", i % 3) for i in range(n)])


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


def test_logistic_retrain_learns_from_recent_labels(tmp_path: Path) -> None:
    encoder = make_tiny_bert(tmp_path / "bert")
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(160):
        words = rng.choice(HARD if i % 2 else EASY, size=3, replace=False)
        pairs.append((" and ".join(words), 0 if i % 2 else 5))
    labels = FixedLabels(pairs)
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


# ------------------------------------------------------------------- labels and Q from scores


def test_scored_prompts_label_by_the_delta_rule_on_observed_levels() -> None:
    scored = ScoredPrompts(Strategy.AC, AC_LEVELS, capacity=3, delta=0.9)
    scored.observe("a", 0, 20.0)
    assert len(scored) == 0  # one level says nothing about the others
    scored.observe("a", 4, 18.5)  # within 0.9 × 20: tolerates level 4
    scored.observe("b", 0, 20.0)
    scored.observe("b", 2, 17.0)  # below 18: level 0 stays its label
    scored.observe("c", 3, 10.0)
    scored.observe(" ", 1, 5.0)  # empty prompts are answered without the model: ignored
    scored.observe("c", 5, float("nan"))  # ignored
    assert len(scored) == 2
    data = scored.snapshot()
    assert data.prompts == ("a", "b") and data.labels.tolist() == [4, 0]
    scored.observe("d", 1, 12.0)  # capacity 3: "a" leaves, and its label with it
    assert len(scored) == 1 and scored.snapshot().prompts == ("b",)
    assert [o.prompt for o in scored.observations()] == ["b", "c", "d"]
    with pytest.raises(ValueError, match="level"):
        scored.observe("e", 6, 1.0)


def test_observed_class_quality_measures_what_was_seen_and_keeps_the_rest() -> None:
    levels = ("l0", "l1", "l2")
    previous = ClassQuality(Strategy.AC, levels, ((0.5, 0.5, 0.5),) * 3, (1 / 3,) * 3, "old")
    observations = [
        Observation("p", {0: 20.0, 1: 18.0}),  # class 0
        Observation("q", {0: 10.0}),  # class 0
        Observation("r", {2: 15.0}),  # class 2
    ]
    quality = observed_class_quality([0, 0, 2], observations, levels, Strategy.AC, previous, "t")
    best = 15.0  # the mean level-0 score over every class
    assert quality.quality[0] == pytest.approx((1.0, 18.0 / best, 0.5))
    assert quality.quality[1] == (0.5, 0.5, 0.5)  # never observed: the previous model's Q
    assert quality.quality[2] == pytest.approx((0.5, 0.5, 1.0))
    assert quality.prior == pytest.approx((2 / 3, 0.0, 1 / 3)) and quality.source == "t"
    alone = observed_class_quality([0, 0, 2], observations, levels, Strategy.AC, None, "t")
    assert alone.quality[1] == pytest.approx((1.0, 18.0 / best, 1.0))  # the level means
    with pytest.raises(ValueError, match="no AC scores"):
        observed_class_quality([], [], levels, Strategy.AC, None, "t")


def test_observed_class_quality_shrinks_what_its_scores_cannot_tell_apart() -> None:
    """A class's mean at a level is shrunk towards the level's mean by how much of the
    difference its scores can tell from noise, as the calibration's Q is: two classes a point
    apart with scores two points apart within them are one; five points apart with a spread
    of a tenth they stay apart."""
    levels = ("l0", "l1", "l2")

    def measured(scores_by_class: dict[int, list[float]]) -> ClassQuality:
        classes = [c for c, scores in scores_by_class.items() for _ in scores]
        observations = [
            Observation(f"p{c}-{i}", {0: 20.0, 1: score})
            for c, scores in scores_by_class.items()
            for i, score in enumerate(scores)
        ]
        return observed_class_quality(classes, observations, levels, Strategy.AC, None, "t")

    noisy = measured({0: [10.0, 12.0], 1: [11.0, 13.0]})
    assert noisy.quality[0][1] == pytest.approx(11.5 / 20.0)  # raw 11 and 12: pooled
    assert noisy.quality[1][1] == pytest.approx(11.5 / 20.0)
    apart = measured({0: [10.0, 10.1, 9.9], 1: [15.0, 15.1, 14.9]})
    assert apart.quality[0][1] == pytest.approx(10.0 / 20.0, abs=0.002)
    assert apart.quality[1][1] == pytest.approx(15.0 / 20.0, abs=0.002)


def test_a_retrain_publishes_the_measured_quality_with_its_version() -> None:
    holder: HotSwapModel[LevelClassifier] = HotSwapModel(constant_classifier(2))
    table = ClassQuality(Strategy.AC, AC_LEVELS, ((1.0,) * 6,) * 6, (1 / 6,) * 6, "measured")
    swaps: list[int] = []
    retrainer = Retrainer(
        holder,
        lambda data: constant_classifier(3),
        recent(20),
        min_examples=10,
        measure=lambda model: table,
        on_swap=swaps.append,
    )
    assert retrainer.published is None
    assert retrainer.trigger() and retrainer.wait(30)
    assert retrainer.published == (1, table) and swaps == [1] and holder.version == 1

    def unmeasurable(model: LevelClassifier) -> ClassQuality:
        raise ValueError("no scores")

    failing = Retrainer(
        holder, lambda data: constant_classifier(4), recent(20), min_examples=10,
        measure=unmeasurable,
    )  # fmt: skip
    assert failing.trigger() and failing.wait(30)
    assert failing.stats().failures == 1 and failing.published is None and holder.version == 1


def test_a_retrain_reads_the_student_layers_of_the_model_it_replaces(tmp_path: Path) -> None:
    """A student's head retrains on the student's layers; a head put on other layers (a full
    encoder: the same weights' SHA-256) is refused and the old model keeps serving."""
    from argus.classifier.train import train_classifier
    from argus.embedding import PromptEmbedder

    encoder = make_tiny_bert(tmp_path / "bert")
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(160):
        words = rng.choice(HARD if i % 2 else EASY, size=3, replace=False)
        pairs.append((" and ".join(words), 0 if i % 2 else 5))
    labels = FixedLabels(pairs)
    fast = TrainConfig(max_tokens=32, c_grid=(3.0,))
    student = train_classifier(
        labels.snapshot(), TrainConfig(max_tokens=32, c_grid=(3.0,), layers=1), encoder_dir=encoder
    ).classifier
    holder: HotSwapModel[LevelClassifier] = HotSwapModel(student)
    retrainer = Retrainer(holder, logistic_retrain(str(encoder), fast), labels, min_examples=100)
    assert retrainer.trigger() and retrainer.wait(120)
    assert retrainer.stats().retrains == 1, retrainer.stats().last_error
    assert holder.current is not student and holder.current.config.layers == 1
    assert getattr(holder.current.encoder, "layers", None) == 1

    full = PromptEmbedder(encoder, max_tokens=32)
    on_full = Retrainer(
        holder,
        logistic_retrain(str(encoder), fast),
        labels,
        min_examples=100,
        prepare=lambda m: LevelClassifier(m.config, full, m.head, m.calibration),
    )
    served = holder.current
    assert on_full.trigger() and on_full.wait(120)
    assert on_full.stats().failures == 1 and holder.current is served
    assert "fitted on encoder layers 1" in (on_full.stats().last_error or "")
