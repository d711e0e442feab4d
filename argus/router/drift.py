"""Drift retraining in the live router: scores in, a retrained classifier and its Q out.

Workers score a sample of their images (:mod:`argus.worker.scoring`) and send each score on a
later ``GenerateResponse``; :class:`RouterDrift` takes them from the replies
(:meth:`RouterDrift.observe`, called by :class:`~argus.router.core.RouterCore` on the
request thread: a few dictionary updates, no model). Per strategy it keeps

* a :class:`~argus.classifier.drift.DriftMonitor` over the scores of images served at that
  strategy's levels (the paper's trigger, §5.5, with the margin its module documents),
* the recent prompts' scores by level (:class:`~argus.classifier.drift.ScoredPrompts`), whose
  δ-rule labels train the new model, and
* a :class:`~argus.classifier.drift.Retrainer` on the strategy's
  :class:`~argus.classifier.serving.HotSwapModel` in the router's classifier.

A drifting window starts a retrain in the background (``argus_router_classifier_retrains``
counts the swaps). Before the swap the new model's Q(v | c) is measured on the observed scores
(:func:`~argus.classifier.drift.observed_class_quality`); :meth:`RouterDrift.report` gives it,
with a classifier identity that names the retrain, to the router's report to the allocator,
which plans that strategy's classes with it from then on. Requests keep being classified by the
old model until the swap, which is one reference assignment, so none waits or fails for it.
The retrain does take CPU from the router's process while it runs (the MiniLM encoder in
torch, beside the serving encoder); ``benchmarks/bench_drift_retrain.py`` measures how long
(figures in ``docs/router-internals.md``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from argus import defaults
from argus.classifier.drift import (
    DriftConfig,
    DriftMonitor,
    DriftRetraining,
    Retrainer,
    ScoredPrompts,
    observed_class_quality,
)
from argus.classifier.labels import LabelledPrompts
from argus.classifier.model import LevelClassifier
from argus.classifier.prompts import clean_prompt
from argus.classifier.serving import ClassifierSet
from argus.types import ClassQuality, ProfileSet, Strategy

log = logging.getLogger(__name__)

MAX_KEY_CHARS = defaults.MAX_WIRE_ID_CHARS  # RouterReport.classifier's bound


class Scored(Protocol):
    """One score as workers send it (``argus.v1.QualityScore``)."""

    @property
    def prompt(self) -> str: ...

    @property
    def level(self) -> str: ...  # the level that served the image

    @property
    def score(self) -> float: ...


@dataclass(frozen=True)
class DriftSettings:
    """Drift monitoring and retraining in one router (``argus router --drift-*``)."""

    monitor: DriftConfig = field(default_factory=DriftConfig)
    """The trigger: window, history and margin."""

    retrain: bool = True
    """Retrain and swap on drift; False: monitor only (the windows are still counted)."""

    min_examples: int = 100
    """Labelled prompts (scored at two levels or more) a retrain needs; fewer: skipped."""

    capacity: int = 5000
    """Recent prompts whose scores are kept, per strategy."""

    delta: float = defaults.DELTA
    """δ of the labelling rule (Argus §3)."""

    def __post_init__(self) -> None:
        if self.min_examples < 1:
            raise ValueError(f"min_examples: must be >= 1, got {self.min_examples}")
        if self.capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {self.capacity}")
        if not 0.0 < self.delta <= 1.0:
            raise ValueError(f"delta: must be in (0, 1], got {self.delta}")


@dataclass(frozen=True)
class DriftStats:
    """Counters of a :class:`RouterDrift` since it started."""

    scores: int  # scores taken from workers' replies
    ignored: int  # scores of levels not in the profile, or not finite
    windows: int  # windows closed, all strategies
    drifts: int  # windows that drifted
    retrains: int  # models swapped in
    failures: int  # retrains that raised (the old model stays)
    skipped: int  # triggers dropped: a retrain was running, or too few labels


class RouterDrift:
    """Feeds workers' scores to one drift monitor and retrainer per classified strategy.

    ``train`` builds a new model from labelled prompts (it runs on the retrain thread);
    ``on_retrain`` is called after each swap (the metrics counter). Thread-safe.
    """

    def __init__(
        self,
        classifiers: ClassifierSet,
        profiles: ProfileSet,
        train: Callable[[LabelledPrompts], LevelClassifier],
        settings: DriftSettings | None = None,
        *,
        on_retrain: Callable[[Strategy, int], None] | None = None,
    ) -> None:
        self.settings = settings or DriftSettings()
        self.classifiers = classifiers
        self._on_retrain = on_retrain
        self._lock = threading.Lock()  # the monitors are single-feeder
        self._level_of: dict[str, tuple[Strategy, int]] = {}
        self._scored: dict[Strategy, ScoredPrompts] = {}
        self._loops: dict[Strategy, DriftRetraining] = {}
        self._scores = self._ignored = 0
        for strategy in classifiers.strategies:
            levels = classifiers.current(strategy).levels
            for index, name in enumerate(levels):
                self._level_of[name] = (strategy, index)
            scored = ScoredPrompts(strategy, levels, self.settings.capacity, self.settings.delta)
            retrainer = Retrainer(
                classifiers.holders[strategy],
                train,
                scored,
                min_examples=self.settings.min_examples,
                measure=self._measurer(strategy, scored),
                prepare=self._on_serving_encoder(strategy),
                on_swap=self._swapped(strategy),
            )
            self._scored[strategy] = scored
            self._loops[strategy] = DriftRetraining(DriftMonitor(self.settings.monitor), retrainer)
        profile_levels = {level.name for level in profiles.levels}
        unknown = sorted(set(self._level_of) - profile_levels)
        if unknown:
            raise ValueError(f"classifier levels {', '.join(unknown)} are not in the profile")

    # scores in -------------------------------------------------------------------------

    def observe(self, scores: Iterable[Scored]) -> None:
        """Scores from one worker reply. Never raises: a bad score is counted and skipped."""
        with self._lock:
            for item in scores:
                found = self._level_of.get(item.level)
                value = float(item.score)
                if found is None or not math.isfinite(value):
                    self._ignored += 1
                    continue
                strategy, index = found
                self._scores += 1
                self._scored[strategy].observe(item.prompt, index, value)
                verdict = self._loops[strategy].observe_quality(
                    value, retrain=self.settings.retrain
                )
                if verdict is not None and verdict.drift:
                    log.info(
                        "%s quality drifted: window %d median %.3f below the moving average %.3f",
                        strategy.value,
                        verdict.index,
                        verdict.median,
                        verdict.baseline or 0.0,
                    )

    # the allocator's view ------------------------------------------------------------------

    def report(self, base_key: str) -> tuple[str, list[ClassQuality]]:
        """The classifier identity to report and the Q(v | c) of every strategy swapped since
        start. The identity is ``base_key`` (the artifacts') while nothing was swapped, else
        ``base_key`` followed by each swapped strategy's model version, so the allocator (and
        its logs) tell the retrained classifier from the artifact."""
        versions: list[str] = []
        qualities: list[ClassQuality] = []
        for strategy, loop in self._loops.items():
            published = loop.retrainer.published
            if published is None:
                continue
            version, quality = published
            versions.append(f"{strategy.value.lower()}{version}")
            if quality is not None:
                qualities.append(quality)
        if not versions:
            return base_key, []
        suffix = "+retrained:" + ",".join(versions)
        return base_key[: MAX_KEY_CHARS - len(suffix)] + suffix, qualities

    def stats(self) -> DriftStats:
        with self._lock:
            monitors = [loop.monitor for loop in self._loops.values()]
            retrains = [loop.retrainer.stats() for loop in self._loops.values()]
            return DriftStats(
                scores=self._scores,
                ignored=self._ignored,
                windows=sum(m.windows for m in monitors),
                drifts=sum(m.drifts for m in monitors),
                retrains=sum(r.retrains for r in retrains),
                failures=sum(r.failures for r in retrains),
                skipped=sum(r.skipped for r in retrains),
            )

    def last_errors(self) -> Mapping[Strategy, str | None]:
        """The last retrain failure of each strategy (None: none)."""
        return {s: loop.retrainer.stats().last_error for s, loop in self._loops.items()}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for running retrains (tests, shutdown); True when none runs afterwards."""
        return all(loop.retrainer.wait(timeout) for loop in self._loops.values())

    # helpers -------------------------------------------------------------------------------

    def _measurer(
        self, strategy: Strategy, scored: ScoredPrompts
    ) -> Callable[[LevelClassifier], ClassQuality]:
        """Q(v | c) of a retrained model on the observed scores (runs on the retrain thread);
        cells without a score keep the model's predecessor's value."""

        def measure(model: LevelClassifier) -> ClassQuality:
            observations = scored.observations()
            if not observations:
                raise ValueError(f"no {strategy} scores to measure Q(v | c) with")
            cut = model.config.max_chars  # as the serving path cuts them
            vectors = model.embed(
                [clean_prompt(o.prompt, max_chars=cut) or "" for o in observations]
            )
            classes = model.classes_of_vectors(vectors).tolist()
            return observed_class_quality(
                classes,
                observations,
                model.levels,
                strategy,
                self._previous_quality(strategy),
                f"drift retrain: scores of {len(observations)} recent prompts",
            )

        return measure

    def _previous_quality(self, strategy: Strategy) -> ClassQuality | None:
        """The Q(v | c) the allocator plans the current model with: the last retrain's, else
        the artifact's calibration (None without one)."""
        published = self._loops[strategy].retrainer.published
        if published is not None and published[1] is not None:
            return published[1]
        try:
            return self.classifiers.class_quality(strategy)
        except ValueError:
            return None

    def _on_serving_encoder(
        self, strategy: Strategy
    ) -> Callable[[LevelClassifier], LevelClassifier]:
        """The retrained head on the encoder the router serves with, when both are the same
        weights (same ``encoder_sha256`` and token limit): training embeds with torch, serving
        with ONNX Runtime, and the prompt-vector cache stays valid for an unchanged encoder.
        A retrained model on other weights is served as it is."""

        def prepare(model: LevelClassifier) -> LevelClassifier:
            serving = self.classifiers.current(strategy)
            same = (
                bool(model.config.encoder_sha256)
                and model.config.encoder_sha256 == serving.config.encoder_sha256
                and model.config.max_tokens == serving.config.max_tokens
                and model.encoder.dim == serving.encoder.dim
            )
            if not same:
                return model
            return LevelClassifier(model.config, serving.encoder, model.head, model.calibration)

        return prepare

    def _swapped(self, strategy: Strategy) -> Callable[[int], None]:
        def swapped(version: int) -> None:
            log.info("%s classifier retrained: version %d swapped in", strategy.value, version)
            if self._on_retrain is not None:
                self._on_retrain(strategy, version)

        return swapped
