"""The classifiers a simulated router can use, by name (:func:`make_classifier`).

Each gives, per request and strategy, two outputs of the router's classifier:

* ``predict_level``: the predicted optimal level (what the paper's planner and NIRVANA use);
* ``predict_class``: the class the joint planner routes by (a calibrated tolerance bin for a
  trained classifier; the optimal level itself for the oracles),

and ``class_quality``: Q(v | c) per strategy, the mean quality at each level of the prompts
in each class. A trained classifier brings the Q it measured on its calibration prompts (the
only honest source: those prompts are neither trained on nor replayed); the oracles measure
it on the replay's own table, which is what makes them upper bounds.

* :class:`TrainedClassifier`: the router's own trained model, loaded from a ``classifiers/``
  artifact (``argus replay``'s default) or held in memory by a benchmark that trains it;
* :class:`OracleClassifier`: the quality table's optimal level (the library default);
* :class:`NoisyOracleClassifier`: right with a stated accuracy (``noisy-oracle@0.85``);
* :class:`TextCeilingClassifier`: the synthetic world's own difficulty feature, about the most
  a text classifier can know there (``text-ceiling``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from argus.classifier.calibration import shrunk_class_means
from argus.contracts.quality import QualityTable
from argus.sim.cluster import SimContext
from argus.types import ClassQuality, Strategy

if TYPE_CHECKING:
    from argus.classifier.labels import LabelledPrompts
    from argus.classifier.model import ClassifierConfig, LinearHead
    from argus.classifier.serving import ClassifierSet
    from argus.traces import PromptRecord

IntArray = npt.NDArray[np.int64]


class Classifier(Protocol):
    """The router's classifier as the simulator runs it (see the module docstring)."""

    label: str

    def reset(self, ctx: SimContext) -> None:
        """Prepare for a run over ``ctx``'s requests (predict every unique prompt now)."""

    def predict_level(self, strategy: Strategy, request: int) -> int:
        """The predicted optimal level index of ``request``."""

    def predict_class(self, strategy: Strategy, request: int) -> int:
        """The class of ``request`` that the joint planner's PASM rows are indexed by."""

    def class_quality(self) -> Mapping[Strategy, ClassQuality]:
        """Q(v | c) per strategy, for the joint planner (after :meth:`reset`)."""


class _TableClassifier:
    """A classifier whose outputs are per-row arrays over the replay's quality tables."""

    label: str

    def reset(self, ctx: SimContext) -> None:
        self._ctx = ctx
        self._levels = {s: self._row_levels(ctx, s, t) for s, t in ctx.quality.items()}
        self._quality = {
            s: measured_class_quality(t, self._levels[s], f"{self.label}, measured on the replay")
            for s, t in ctx.quality.items()
        }
        self._by_request = _per_request(ctx, self._levels)

    def _row_levels(self, ctx: SimContext, strategy: Strategy, table: QualityTable) -> IntArray:
        raise NotImplementedError

    def predict_level(self, strategy: Strategy, request: int) -> int:
        return self._by_request[strategy][request]

    predict_class = predict_level  # its classes are its levels

    def class_quality(self) -> Mapping[Strategy, ClassQuality]:
        return self._quality


class OracleClassifier(_TableClassifier):
    """The quality table's own optimal level: an upper bound for a trained classifier."""

    label = "oracle"

    def _row_levels(self, ctx: SimContext, strategy: Strategy, table: QualityTable) -> IntArray:
        return table.optimal_levels()


class NoisyOracleClassifier(_TableClassifier):
    """Right with probability ``accuracy``, otherwise a uniformly random other level; the
    same prompt always gets the same answer."""

    def __init__(self, accuracy: float, seed: int = 0) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy: must be in [0, 1], got {accuracy}")
        self.accuracy = accuracy
        self.label = f"noisy-oracle@{accuracy:g}"
        self._seed = seed

    def _row_levels(self, ctx: SimContext, strategy: Strategy, table: QualityTable) -> IntArray:
        true = table.optimal_levels()
        count = len(table.levels)
        if count < 2:
            return true
        rng = np.random.default_rng([self._seed, 1 if strategy is Strategy.AC else 2])
        wrong = rng.random(len(true)) >= self.accuracy
        other = rng.integers(0, count - 1, len(true))
        other = np.where(other >= true, other + 1, other)
        result: IntArray = np.where(wrong, other, true).astype(np.int64)
        return result


class TextCeilingClassifier(_TableClassifier):
    """A logistic regression on the synthetic model's own text feature
    (:func:`~argus.profiles.synthetic_quality.prompt_difficulty`), fitted on the TRAIN prompts'
    optimal levels of the seed-0 tables, as ``argus train-classifier`` fits on them. The
    feature is computed from the prompt's words and its PartiPrompts category, so this knows
    what a classifier of the text could know at best (and the category besides); the rest of
    a prompt's difficulty is noise drawn per seed. Q(v | c) is measured on the replay, as the
    oracles' is, so it bounds a trained classifier from above. Only PartiPrompts prompts (the
    synthetic and uniform worlds') have the feature; another prompt raises ValueError."""

    label = "text-ceiling"

    def _row_levels(self, ctx: SimContext, strategy: Strategy, table: QualityTable) -> IntArray:
        head = text_ceiling_head(strategy, table.levels)
        levels: IntArray = np.argmax(head.logits(text_features(table.prompts)), axis=1)
        return levels.astype(np.int64)


def text_features(prompts: Sequence[str]) -> npt.NDArray[np.float32]:
    """The synthetic model's text feature of each PartiPrompts prompt, one column."""
    from argus.profiles.synthetic_quality import prompt_difficulty

    records = _partiprompts()
    missing = [p for p in prompts if p not in records]
    if missing:
        raise ValueError(
            f"text-ceiling: {len(missing)} prompt(s) are not PartiPrompts prompts, which alone "
            f"have the synthetic model's text feature (first: {missing[0][:60]!r})"
        )
    return np.array([[prompt_difficulty(records[p])] for p in prompts], dtype=np.float32)


@functools.cache
def _partiprompts() -> dict[str, PromptRecord]:
    from argus.traces import default_prompt_trace, load_prompts

    return {r.prompt: r for r in load_prompts(default_prompt_trace())}


@functools.cache
def text_ceiling_labels(strategy: Strategy, levels: tuple[str, ...]) -> LabelledPrompts:
    """Every PartiPrompts prompt with its δ-rule optimal level in the seed-0 synthetic table of
    ``strategy``'s ``levels``: what ``argus train-classifier`` trains on."""
    from argus.classifier.labels import labels_from_table
    from argus.profiles.synthetic_quality import synthetic_quality_table

    records = list(_partiprompts().values())
    return labels_from_table(synthetic_quality_table(records, strategy, levels, seed=0))


@functools.cache
def text_ceiling_head(strategy: Strategy, levels: tuple[str, ...]) -> LinearHead:
    """The :class:`TextCeilingClassifier`'s model for ``strategy``'s ``levels``: multinomial
    logistic regression (C = 10) from the text feature to the optimal level of the TRAIN
    prompts of :func:`text_ceiling_labels`."""
    from argus.classifier.train import fit_logistic_head
    from argus.prompt_split import PromptSet

    data = text_ceiling_labels(strategy, levels)
    train = np.array([s is PromptSet.TRAIN for s in data.prompt_sets()])
    x = text_features(data.prompts)
    return fit_logistic_head(x[train], data.labels[train], len(levels), 10.0, 5000)


def _per_request(ctx: SimContext, by_row: Mapping[Strategy, IntArray]) -> dict[Strategy, list[int]]:
    """Each request's answer, looked up once per run: per request it is a list index."""
    return {s: values[ctx.prompt_rows].tolist() for s, values in by_row.items()}


def measured_class_quality(table: QualityTable, classes: IntArray, source: str) -> ClassQuality:
    """Q(v | c) of ``table``'s prompts grouped by ``classes`` (one per row): each class's
    mean score per level, shrunk as the calibration shrinks it
    (:func:`argus.classifier.calibration.shrunk_class_means`), over the mean at the best level
    of all rows. A class with no rows gets the level averages."""
    n = len(table.levels)
    scores = table.scores
    best = float(scores[:, 0].mean())
    means = shrunk_class_means(classes, scores, n)
    rows = tuple(tuple(float(value) / best for value in row) for row in means)
    prior = tuple(float(x) for x in np.bincount(classes, minlength=n)[:n] / len(classes))
    return ClassQuality(table.strategy, table.levels, rows, prior, source)


class TrainedClassifier:
    """A trained classifier, one model per strategy: an artifact (``classifiers/<name>``),
    or models trained in this process and never saved (:meth:`in_memory`).

    Predicts once per unique prompt text and caches across runs: a replay of 500k requests
    over 1,600 prompts runs the encoder 1,600 times. Construction from a directory reads only
    the configs (a bad path fails at once, naming it); the weights and the encoder load at the
    first :meth:`reset`. Each table's levels must be the classifier's labels.
    """

    def __init__(self, directory: str | Path) -> None:
        from argus.classifier.model import artifact_key
        from argus.classifier.serving import load_classifier_set, read_configs, strategy_dirs

        path = Path(directory)
        self._start(
            str(path),
            path.name,
            read_configs(path),
            lambda: load_classifier_set(path),
            {
                s: _PREDICTIONS.setdefault(artifact_key(p), {})
                for s, p in strategy_dirs(path).items()
            },
        )

    @classmethod
    def in_memory(cls, models: ClassifierSet, name: str) -> TrainedClassifier:
        """``models`` as they are, under ``name``: what a benchmark that trains classifiers
        on the fly replays with. Its predictions are cached for this object only (the same
        text may be classified differently by the next model trained)."""
        classifier = cls.__new__(cls)
        classifier._start(
            name,
            name,
            {s: models.current(s).config for s in models.strategies},
            lambda: models,
            {s: {} for s in models.strategies},
        )
        return classifier

    def _start(
        self,
        name: str,
        short_name: str,
        configs: Mapping[Strategy, ClassifierConfig],
        load: Callable[[], ClassifierSet],
        predictions: dict[Strategy, dict[str, tuple[int, int]]],
    ) -> None:
        """What both constructors set: ``name`` in errors, ``short_name`` in the label,
        ``load`` called once, when the models are first needed, ``predictions`` by prompt text."""
        self.name = name
        self.configs = dict(configs)
        details = "; ".join(f"{s}: {c.describe()}" for s, c in self.configs.items())
        self.label = f"trained {short_name} ({details})"
        self._loader = load
        self._models: ClassifierSet | None = None
        self.progress: Callable[[int, int], None] | None = None  # (done, total) embedding
        self._cache = predictions
        self._calibration: Mapping[Strategy, QualityTable] | None = None
        self._calibration_source = ""

    def calibrated_on(
        self, tables: Mapping[Strategy, QualityTable], source: str
    ) -> TrainedClassifier:
        """This classifier with Q(v | c) measured on ``tables`` (calibration prompts scored in
        another quality world) instead of the artifact's own: the same models and predictions,
        a planner that believes what that world says of each class. ``source`` names the
        tables in the label."""
        twin = copy.copy(self)
        twin._calibration = dict(tables)
        twin._calibration_source = source
        twin.label = f"{self.label}; Q(v | c) measured on {source}"
        return twin

    def _predict(self, strategy: Strategy, texts: Sequence[str]) -> list[tuple[int, int]]:
        """(level, class) of each text for ``strategy``, running the encoder once for the texts
        not predicted before in this process."""
        from argus.classifier.embedding_cache import EmbeddingCache
        from argus.classifier.prompts import clean_prompt

        todo = sorted({t for t in texts if t not in self._cache[strategy]})
        if todo:
            inferred = self._load().infer_cleaned(
                [clean_prompt(t) for t in todo], cache=EmbeddingCache(), progress=self.progress
            )
            for s, result in inferred.items():
                pairs = zip(result.levels.tolist(), result.classes.tolist(), strict=True)
                self._cache[s].update(zip(todo, pairs, strict=True))
        return [self._cache[strategy][t] for t in texts]

    def prepare(self, quality: Mapping[Strategy, QualityTable]) -> None:
        """Check the labels against the tables and load the models; ValueError names why."""
        from argus.classifier.model import ArtifactError

        missing = [s for s in quality if s not in self.configs]
        if missing:
            raise ValueError(f"classifier {self.name} has no model for {missing[0]}")
        for strategy, table in quality.items():
            if table.levels != self.configs[strategy].levels:
                raise ValueError(
                    f"classifier {self.name}: {strategy} labels "
                    f"{', '.join(self.configs[strategy].levels)} differ from the quality "
                    f"table's levels {', '.join(table.levels)}"
                )
        try:
            self._load()
        except ArtifactError as exc:
            raise ValueError(str(exc)) from None

    def reset(self, ctx: SimContext) -> None:
        """Predict levels and classes of every unique prompt of the replay not seen before
        in this process, embedding through the on-disk cache (a prompt is embedded once per
        machine, not once per replay); ``progress`` reports the embedding."""
        self.prepare(ctx.quality)
        self._ctx = ctx
        rows = np.unique(ctx.prompt_rows).tolist()
        texts = {s: [table.prompts[r] for r in rows] for s, table in ctx.quality.items()}
        self._levels: dict[Strategy, IntArray] = {}
        self._classes: dict[Strategy, IntArray] = {}
        for strategy, table in ctx.quality.items():
            levels = np.zeros(len(table.prompts), dtype=np.int64)
            classes = np.zeros(len(table.prompts), dtype=np.int64)
            predicted = self._predict(strategy, texts[strategy])
            levels[rows] = [level for level, _ in predicted]
            classes[rows] = [klass for _, klass in predicted]
            self._levels[strategy] = levels
            self._classes[strategy] = classes
        self._level_of_request = _per_request(ctx, self._levels)
        self._class_of_request = _per_request(ctx, self._classes)

    def _load(self) -> ClassifierSet:
        if self._models is None:
            self._models = self._loader()
        return self._models

    def predict_level(self, strategy: Strategy, request: int) -> int:
        return self._level_of_request[strategy][request]

    def predict_class(self, strategy: Strategy, request: int) -> int:
        return self._class_of_request[strategy][request]

    def class_quality(self) -> Mapping[Strategy, ClassQuality]:
        """Q(v | c) from the artifact's calibration prompts (or the tables of
        :meth:`calibrated_on`); an artifact without a calibration has classes = levels,
        measured on the replay (labelled so)."""
        models = self._load()
        if self._calibration is not None:
            measured = {}
            for s, table in self._calibration.items():
                predicted = self._predict(s, table.prompts)
                classes = np.array([klass for _, klass in predicted], dtype=np.int64)
                measured[s] = measured_class_quality(
                    table, classes, f"{self.label}, measured on {self._calibration_source}"
                )
            return measured
        return {
            s: models.class_quality(s)
            if models.has_classes(s)
            else measured_class_quality(t, self._classes[s], f"{self.label}, on the replay")
            for s, t in self._ctx.quality.items()
        }


# Predictions of trained classifiers in this process, by artifact_key and prompt text: a
# second replay (or test) with the same artifact does not run the encoder again.
_PREDICTIONS: dict[str, dict[str, tuple[int, int]]] = {}  # text → (level, class)


def make_classifier(spec: str) -> Classifier:
    """A classifier by name: ``default`` (the committed ``classifiers/minilm-l2-logistic-int8``),
    ``oracle``, ``noisy-oracle@ACCURACY`` (a bare accuracy such as ``0.85`` works too),
    ``text-ceiling``, or a classifier directory. Bad specs raise ValueError quoting them."""
    text = spec.strip()
    if text == "oracle":
        return OracleClassifier()
    if text == "text-ceiling":
        return TextCeilingClassifier()
    accuracy = text.removeprefix("noisy-oracle@")
    try:
        value = float(accuracy)
    except ValueError:
        if text.startswith("noisy-oracle@"):
            raise ValueError(f"classifier {spec!r}: {accuracy!r} is not an accuracy") from None
    else:
        return NoisyOracleClassifier(value)
    from argus.classifier.model import ArtifactError
    from argus.classifier.serving import default_classifier_dir

    directory = default_classifier_dir() if text == "default" else Path(text)
    try:
        return TrainedClassifier(directory)
    except ArtifactError as exc:
        raise ValueError(
            f"classifier {spec!r}: {exc} (expected default, oracle, noisy-oracle@ACCURACY, "
            "text-ceiling or a classifier directory)"
        ) from None
