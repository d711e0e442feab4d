"""The classifier of the genai-bench quality world, and how well it predicts real ratings.

The genai-bench world (:mod:`argus.profiles.quality_worlds`) scores requests with GenAI-Bench's
human ratings on an SM ladder (SDXL-Base, SD-2.1, SDXL-Turbo), which the committed classifier
was never trained for (its labels are the synthetic model's, on other levels). So
``argus evaluate --quality genai-bench`` trains one as the committed one was trained
(:func:`argus.classifier.train.train_classifier` with the default's recipe: a logistic head
on the first 2 layers of frozen all-MiniLM-L6-v2 in int8), on labels from the
ratings: the optimal level of each prompt under the δ rule, on the mean of its three raters.
It learns only from :func:`~argus.profiles.quality_worlds.genai_training_table`: its weights
from the TRAIN prompts, its temperature, classes and Q(v | c) from the CALIBRATION prompts;
the EVAL prompts, which the simulation serves, are not given to it at all.

:func:`predictability` says how much of a prompt's drop its text predicts, on the EVAL
prompts: the Pearson correlation between the classifier's predicted drop (its expected
optimal level, negated: a prompt it thinks tolerant should lose little) and the drop each
rater gave (rater k's rating of SDXL-Base minus rater k's rating of the cheaper model), for
each cheaper model, averaged over the three raters; beside it the same against the mean of
the raters, and the raters' own agreement (rater k's drop against the mean of the other two
raters' drops, averaged over k), the most any prediction from outside could reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from argus.contracts.quality import DEFAULT_DELTA
from argus.profiles.quality_worlds import (
    GENAI_MODELS,
    RATERS,
    genai_ratings,
    genai_split,
    genai_training_table,
)
from argus.prompt_split import PromptSet
from argus.sim.classifiers import TrainedClassifier

RECIPE_LAYERS = 2
RECIPE_RUNTIME = "onnx-int8"
"""The committed default classifier's recipe (``classifiers/README.md``): the encoder's first
2 layers, vectors of ONNX Runtime in int8."""
NAME = "genai-bench minilm-l2-logistic-int8 (TRAIN split of GenAI-Bench)"


@dataclass(frozen=True)
class Predictability:
    """Correlations on the EVAL prompts, per cheaper model (``GENAI_MODELS[1:]``)."""

    models: tuple[str, ...]
    per_rater: tuple[float, ...]  # r(predicted drop, rater k's drop), mean over k
    with_mean: tuple[float, ...]  # r(predicted drop, the raters' mean drop)
    raters_agree: tuple[float, ...]  # r(rater k's drop, the other raters' mean drop), mean
    prompts: int  # EVAL prompts

    def lines(self) -> list[str]:
        """What ``argus evaluate`` prints for it."""
        out = [
            f"classifier predictability on {self.prompts} held-out EVAL prompts (Pearson r "
            "of its predicted drop against each rater's own drop from SDXL-Base, mean over "
            f"the {RATERS} raters; against the raters' mean; the raters' agreement):"
        ]
        for i, model in enumerate(self.models):
            out.append(
                f"  SDXL_Base -> {model}: r {self.per_rater[i]:+.3f} per rater, "
                f"{self.with_mean[i]:+.3f} with the mean; raters agree r "
                f"{self.raters_agree[i]:+.3f}"
            )
        return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or np.std(x) == 0.0 or np.std(y) == 0.0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def drop_correlations(predicted_drop: np.ndarray, ratings: np.ndarray) -> Predictability:
    """:class:`Predictability` of ``predicted_drop`` (one per prompt) against ``ratings``
    ``[prompt, model, rater]`` (model 0 the best)."""
    per_rater, with_mean, agree = [], [], []
    for m in range(1, ratings.shape[1]):
        drops = ratings[:, 0, :] - ratings[:, m, :]  # [prompt, rater]
        per_rater.append(
            float(np.nanmean([_pearson(predicted_drop, drops[:, k]) for k in range(RATERS)]))
        )
        with_mean.append(_pearson(predicted_drop, drops.mean(axis=1)))
        others = [
            _pearson(drops[:, k], np.delete(drops, k, axis=1).mean(axis=1)) for k in range(RATERS)
        ]
        agree.append(float(np.nanmean(others)))
    return Predictability(
        tuple(GENAI_MODELS[1:]), tuple(per_rater), tuple(with_mean), tuple(agree), len(ratings)
    )


@dataclass(frozen=True)
class GenaiClassifier:
    """The trained genai-bench classifier, the prompts it learned from and its predictability."""

    classifier: TrainedClassifier
    trained_on: frozenset[str]  # every prompt text train_classifier was given
    predictability: Predictability


def train_genai_classifier() -> GenaiClassifier:
    """Train on the TRAIN (weights) and CALIBRATION (calibration) prompts' ratings and
    measure :func:`predictability` on the EVAL prompts."""
    from argus.classifier.embedding_cache import EmbeddingCache
    from argus.classifier.labels import labels_from_table
    from argus.classifier.prompts import max_chars_for, prepare_prompt
    from argus.classifier.serving import ClassifierSet
    from argus.classifier.train import TrainConfig, train_classifier

    config = TrainConfig(layers=RECIPE_LAYERS, runtime=RECIPE_RUNTIME)
    table = genai_training_table()
    data = labels_from_table(table, DEFAULT_DELTA, max_chars=max_chars_for(config.max_tokens))
    result = train_classifier(data, config, cache=EmbeddingCache())
    model = result.classifier
    eval_texts = [p.prompt for p in genai_split()[PromptSet.EVAL]]
    vectors = model.embed(
        [prepare_prompt(t, max_chars=model.config.max_chars) or "" for t in eval_texts]
    )
    predicted_drop = -model.tolerance_of_vectors(vectors)
    served = ClassifierSet({model.strategy: model})
    return GenaiClassifier(
        TrainedClassifier.in_memory(served, NAME),
        frozenset(table.prompts),
        drop_correlations(np.asarray(predicted_drop), genai_ratings(eval_texts)),
    )
