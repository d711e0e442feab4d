"""Real quality tables: every prompt generated at every level through the worker, each image
scored with PickScore (``argus profile``).

PickScore is a CLIP model fine-tuned on human preferences; its score of an image for a prompt
is CLIP's logit, ``exp(logit_scale) · cos(text embedding, image embedding)``. It loads through
transformers' CLIP classes from a local directory (``CLIPModel`` plus its tokenizer and image
processor), so any CLIP checkpoint directory works, and tests use a tiny random one.

Generation goes through the worker's own engine (:class:`argus.worker.engine.Worker`), so the
scores measure exactly what serving produces:

* **AC**: for each prompt, the levels with K > 0 run first and resume from the nearest cached
  prompt's latent; the K = 0 level runs last and its full generation is what enters the cache.
  A prompt therefore never retrieves its own latents, as in production where a prompt meets
  the cache of the prompts before it. ``warmup`` prompts fill the cache before the first one.
  A cache miss is a full generation, as the worker serves it; the count is reported.
* **SM**: each model variant is loaded once (a switch in the worker's registry) and generates
  every prompt from noise.

The output is the quality-table format of :mod:`argus.contracts.quality` (``source: pickscore:
DIR``).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from argus.contracts.generate import CacheOutcome, GenerateCall
from argus.contracts.quality import QualityTable
from argus.types import Level, Strategy
from argus.worker.engine import Worker
from argus.worker.scoring import PickScorer


@dataclass
class ProfileReport:
    tables: dict[Strategy, QualityTable]
    images: int = 0
    cache: Counter[str] = field(default_factory=Counter)  # AC outcomes by level K > 0


@dataclass(frozen=True)
class ProfileSettings:
    steps: int = 50
    size: int = 64
    seed: int = 0
    scorer: str = ""  # recorded in the table's source


def _generate(worker: Worker, prompt: str, level: Level, settings: ProfileSettings) -> Any:
    call = GenerateCall(
        prompt=prompt,
        seed=settings.seed,
        width=settings.size,
        height=settings.size,
        steps=settings.steps,
        level=level.name,
    )
    return worker.generate(call)


def _image(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def profile_ac(
    worker: Worker,
    scorer: PickScorer,
    prompts: Sequence[str],
    settings: ProfileSettings,
    *,
    warmup: Sequence[str] = (),
    report: ProfileReport,
    progress: Callable[[str], None] | None = None,
) -> QualityTable:
    levels = worker.profiles.levels_for(Strategy.AC)
    if not levels:
        raise ValueError("the worker's profile has no AC levels")
    full = [lv for lv in levels if lv.skip_steps == 0]
    if not full:
        raise ValueError("AC profiling needs a K = 0 level to fill the cache")
    worker.configure(level=full[0].name, wait=True)
    for prompt in warmup:
        _generate(worker, prompt, full[0], settings)
    worker.flush()
    scores = np.zeros((len(prompts), len(levels)))
    # K > 0 first, K = 0 last: a prompt never meets its own cached latents
    order = sorted(range(len(levels)), key=lambda j: -levels[j].skip_steps)
    for i, prompt in enumerate(prompts):
        images: list[Image.Image] = []
        for j in order:
            result = _generate(worker, prompt, levels[j], settings)
            if levels[j].skip_steps > 0:
                outcome = result.cache_miss_reason if result.cache is CacheOutcome.MISS else "hit"
                report.cache[outcome] += 1
            images.append(_image(result.png))
        worker.flush()
        for j, value in zip(order, scorer.score(prompt, images), strict=True):
            scores[i, j] = value
        report.images += len(images)
        if progress is not None:
            progress(f"AC {i + 1}/{len(prompts)}")
    return QualityTable(
        strategy=Strategy.AC,
        levels=tuple(lv.name for lv in levels),
        prompts=tuple(prompts),
        scores=_positive(scores),
        source=f"pickscore: {settings.scorer}",
    )


def profile_sm(
    worker: Worker,
    scorer: PickScorer,
    prompts: Sequence[str],
    settings: ProfileSettings,
    *,
    report: ProfileReport,
    progress: Callable[[str], None] | None = None,
) -> QualityTable:
    levels = worker.profiles.levels_for(Strategy.SM)
    if not levels:
        raise ValueError("the worker's profile has no SM levels")
    scores = np.zeros((len(prompts), len(levels)))
    for j, level in enumerate(levels):
        worker.configure(level=level.name, wait=True)  # loads the variant, unloads the last
        for i, prompt in enumerate(prompts):
            result = _generate(worker, prompt, level, settings)
            scores[i, j] = scorer.score(prompt, [_image(result.png)])[0]
            report.images += 1
        if progress is not None:
            progress(f"SM {level.name} done")
    return QualityTable(
        strategy=Strategy.SM,
        levels=tuple(lv.name for lv in levels),
        prompts=tuple(prompts),
        scores=_positive(scores),
        source=f"pickscore: {settings.scorer}",
    )


def _positive(scores: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Quality tables hold positive scores; CLIP logits of random models can be ≤ 0."""
    if scores.size and (scores <= 0).any():
        raise ValueError(
            f"scores must be positive for a quality table; the scorer gave min {scores.min():.3f}"
            " (is it a PickScore/CLIP checkpoint?)"
        )
    return scores
