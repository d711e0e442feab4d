"""How long a drift retrain takes in the router, and what Q(v | c) it reports.

Builds the live router's :class:`~argus.router.drift.RouterDrift` on the committed artifacts
(``classifiers/minilm-logistic``) with its default ``train`` (the logistic backbone on
all-MiniLM-L6-v2, ``argus.router.app.build_drift``), then feeds it a made-up drifting stream:
``--prompts`` distinct prompts, each scored at the best level and at one other level (so every
prompt is labelled), scores about 20 for the first half and about 15 after. Windows of 50
scores, 2 earlier windows needed. Prints the drift counters, the wall time from the first
drifting window to the last swap (both strategies retrain in turn, one thread each), and the
reported Q(v | c) of class 0, and whether each retrained head serves on the router's serving
encoder (ONNX Runtime) rather than the torch encoder it was trained with. The scores are
SYNTHETIC; only the timing and the path are real.
The machine is shared: the load average is printed at the start and the end.

    python benchmarks/bench_drift_retrain.py [--prompts 400]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from argus.classifier.drift import DriftConfig
from argus.classifier.serving import load_classifier_set
from argus.profiles import default_profiles
from argus.router.app import build_drift
from argus.router.drift import DriftSettings
from argus.router.metrics import RouterMetrics

WORDS = [
    "cat",
    "dog",
    "bus",
    "tree",
    "red",
    "blue",
    "city",
    "night",
    "mosaic",
    "origami",
    "crowd",
    "portrait",
    "sunset",
    "river",
    "lighthouse",
    "robot",
    "violin",
    "forest",
]


@dataclass(frozen=True)
class Score:
    prompt: str
    level: str
    score: float


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    from prometheus_client import CollectorRegistry

    profiles = default_profiles()
    classifiers = load_classifier_set()
    metrics = RouterMetrics(profiles, registry=CollectorRegistry())
    settings = DriftSettings(DriftConfig(window=50, history=2, min_history=2), min_examples=100)
    drift = build_drift(settings, classifiers, profiles, metrics)
    assert drift is not None
    before = {s: classifiers.current(s).encoder for s in classifiers.strategies}
    rng = random.Random(0)
    began: float | None = None
    for i in range(args.prompts):
        prompt = " ".join(rng.sample(WORDS, 4)) + f", study {i}"
        level = 20.0 if i < args.prompts // 2 else 15.0
        for strategy in classifiers.strategies:
            names = classifiers.current(strategy).levels
            other = rng.randrange(1, len(names))
            loss = other * 0.5 if i % 2 else 0.1
            drift.observe(
                [
                    Score(prompt, names[0], level + rng.random()),
                    Score(prompt, names[other], level - loss + rng.random()),
                ]
            )
        if began is None and drift.stats().drifts:
            began = time.perf_counter()
    drift.wait(600)
    took = time.perf_counter() - began if began is not None else float("nan")
    print(drift.stats())
    print(f"first drift to last swap: {took:.1f} s; errors: {dict(drift.last_errors())}")
    for strategy, encoder in before.items():
        same = classifiers.current(strategy).encoder is encoder
        print(f"{strategy.value}: the retrained head serves on the serving encoder: {same}")
    key, qualities = drift.report("committed")
    print(f"reported key: {key}")
    for quality in qualities:
        row = ", ".join(f"{q:.3f}" for q in quality.quality[0])
        print(f"{quality.strategy.value} Q(v | class 0): {row}  ({quality.source})")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
