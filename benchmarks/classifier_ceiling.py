"""How predictable the SYNTHETIC labels are from text at all: a reference for the classifier.

The synthetic quality model (argus/profiles/synthetic_quality.py) draws each prompt's latent
difficulty as ``0.7 × text feature + 0.71 × noise``, so no text classifier can recover the
optimal level exactly. This fits a logistic regression on the model's *own* text feature
(``prompt_difficulty``) on the TRAIN prompts of the fixed split (``argus.prompt_split``) that
``argus train-classifier`` uses, and prints its accuracy and downstream quality on the EVAL
prompts beside the committed classifier's ``metrics.json``.

    python benchmarks/classifier_ceiling.py
"""

from __future__ import annotations

import json

import numpy as np
from _machine import load_line, machine_line

from argus.classifier.evaluate import evaluate
from argus.classifier.serving import default_classifier_dir
from argus.profiles import default_profiles
from argus.prompt_split import PromptSet
from argus.sim.classifiers import text_ceiling_head, text_ceiling_labels, text_features
from argus.types import Strategy


def main() -> None:
    print(machine_line())
    profiles = default_profiles()
    for strategy in Strategy:
        levels = tuple(lv.name for lv in profiles.levels_for(strategy))
        data = text_ceiling_labels(strategy, levels)
        test = np.array([s is PromptSet.EVAL for s in data.prompt_sets()])
        head = text_ceiling_head(strategy, levels)
        x = text_features(data.prompts)
        predicted = np.argmax(head.logits(x[test]), axis=1)
        assert data.scores is not None
        result = evaluate(data.labels[test], predicted, len(levels), scores=data.scores[test])
        quality = result.quality
        assert quality is not None
        committed = json.loads(
            (default_classifier_dir() / strategy.value.lower() / "metrics.json").read_text()
        )["eval"]
        print(
            f"{strategy}: text-feature ceiling: accuracy {result.accuracy:.3f}, macro-F1 "
            f"{result.macro_f1:.3f}, quality {quality.classifier:.2f} (random "
            f"{quality.random:.2f}, oracle {quality.oracle:.2f}), mean level "
            f"{quality.mean_level_classifier:.2f} | committed classifier: accuracy "
            f"{committed['accuracy']:.3f}, macro-F1 {committed['macro_f1']:.3f}, quality "
            f"{committed['quality']['classifier']:.2f}"
        )


if __name__ == "__main__":
    main()
    print(load_line("end"))
