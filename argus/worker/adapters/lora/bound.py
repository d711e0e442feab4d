"""Profiling the asynchrony bound K of a (model, LoRA) pair, as Katz §6 does.

Katz runs the same generation twice, with and without the LoRA, computes the cosine
similarity between the two runs' latents at every denoising step, and sets K to "the step at
which the similarity starts to drop below a predefined threshold, e.g. 0.99".

Our reading, made exact:

* the compared tensors are the scheduler's latents *after* each step (the input of the next
  step; after the last step, the final latents that go to the VAE), of two runs with the same
  prompt, seed, scheduler and step count: one of the base model, one with the LoRA merged
  before step 0 (through the same :class:`~argus.worker.adapters.lora.session.LoraSession` the
  worker
  uses, with bound 0);
* the similarity is the cosine of the two latents flattened to one vector each;
* steps are indexed from 0, and step ``i`` produces the latents after ``i + 1`` steps. K is the
  index of the first step whose output falls below the threshold. Steps ``0 … K−1`` thus had
  outputs indistinguishable (≥ threshold) even with the LoRA active from the start, so BAL
  may run them without it, and waits before step K (the ``(K+1)``-th step), which matches the
  session's bound. K = 0 means the LoRA matters from the first step (load synchronously); if
  the similarity never drops, K = N (the session clamps it to N − 1);
* over several prompts K is the smallest per-prompt K: the bound must hold for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from argus.worker.adapters.lora.patch import LoadedLora
from argus.worker.adapters.lora.session import LoraRequest, LoraSession, PendingLora


@dataclass(frozen=True)
class BoundProfile:
    """The similarity curves of a LoRA against its base model, and the K they give."""

    lora: str
    bound: int  # K over all prompts
    threshold: float
    steps: int
    scale: float
    prompts: tuple[str, ...]
    similarity: tuple[tuple[float, ...], ...]  # [prompt][i]: cosine after step i (0-based)
    per_prompt: tuple[int, ...]  # K of each prompt

    def minimum(self) -> tuple[float, ...]:
        """The lowest similarity over prompts at each step."""
        return tuple(min(column) for column in zip(*self.similarity, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "lora": self.lora,
            "bound": self.bound,
            "threshold": self.threshold,
            "steps": self.steps,
            "scale": self.scale,
            "prompts": list(self.prompts),
            "per_prompt_bound": list(self.per_prompt),
            "similarity": [list(curve) for curve in self.similarity],
            "min_similarity": list(self.minimum()),
        }


def latent_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two latents, flattened, in float64."""
    x = a.detach().to("cpu", torch.float64).flatten()
    y = b.detach().to("cpu", torch.float64).flatten()
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def first_below(curve: Sequence[float], threshold: float) -> int:
    """Index of the first step whose similarity is below ``threshold``; ``len(curve)`` if none."""
    for index, value in enumerate(curve):
        if value < threshold:
            return index
    return len(curve)


def _trajectory(model: Any, spec: Any, session: LoraSession | None) -> list[torch.Tensor]:
    """Latents after each step 1 … N of one run (with the session's LoRAs if given)."""
    before = [session.before_step] if session is not None else []
    after = [session.after_step] if session is not None else []
    result = model.denoise(spec, capture=range(1, spec.steps), before_step=before, hooks=after)
    return [result.captured[s] for s in range(1, spec.steps)] + [result.latents]


def profile_bound(
    model: Any,
    lora: LoadedLora,
    prompts: Sequence[str],
    *,
    steps: int = 50,
    threshold: float = 0.99,
    scale: float = 1.0,
    seed: int = 0,
    size: int = 64,
) -> BoundProfile:
    """Profile K for ``lora`` on ``model`` (a :class:`DiffusionModel`) over ``prompts``.

    Two runs per prompt (seed ``seed + i`` for prompt ``i``); the model's weights are the
    base weights again when this returns, also after an error.
    """
    from argus.worker.models.pipelines import GenerationSpec

    if not prompts:
        raise ValueError("profile_bound needs at least one prompt")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold {threshold} outside (0, 1]")
    unet = model.pipeline.unet
    curves: list[tuple[float, ...]] = []
    for index, prompt in enumerate(prompts):
        spec = GenerationSpec(
            prompt=prompt, seed=seed + index, height=size, width=size, steps=steps
        )
        base = _trajectory(model, spec, None)
        loaded: Future[LoadedLora] = Future()
        loaded.set_result(lora)
        pending = [PendingLora(LoraRequest(lora.name, scale), loaded, 0.0, cached=True)]
        with LoraSession(unet, pending, steps=steps, bound=0, lock=model.lock) as session:
            patched = _trajectory(model, spec, session)
        curves.append(tuple(latent_cosine(a, b) for a, b in zip(base, patched, strict=True)))
    per_prompt = tuple(first_below(curve, threshold) for curve in curves)
    return BoundProfile(
        lora=lora.name,
        bound=min(per_prompt),
        threshold=threshold,
        steps=steps,
        scale=scale,
        prompts=tuple(prompts),
        similarity=tuple(curves),
        per_prompt=per_prompt,
    )
