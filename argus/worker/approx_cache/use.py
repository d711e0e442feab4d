"""How one request uses the approximate cache: where its run starts, and whether its latents
are stored for later requests.

A request names a *level* of the worker's profile:

* AC level with K > 0: embed the prompt, find the nearest cached prompt with the same model,
  scheduler, resolution and steps (:func:`cache_key`), fetch its latent at step K and denoise
  the remaining N−K steps (:func:`look_up`). A miss, or a missing or corrupt latent, falls back
  to a full generation, counted; it is never an error.
* AC level with K = 0, or a miss: a full generation. When it ran on the AC base model without
  adapters, its latents at the cache's steps (:func:`capture_steps`) are stored
  (:func:`feeds_cache`, :func:`insert`), off the request path: the worker hands them to a
  single writer thread with a bounded backlog, and a full backlog drops the insert, counted.
* SM level: a full generation on that level's model; the cache is not used.

An edit never uses the approximate cache (:attr:`CacheOutcome.NOT_USED`): the cache holds
latents of other prompts generated from noise, and resuming one at step K would replace the
template by another image, while the template's own steps are what an edit keeps; nor does an
edit feed it, since its latents carry its template into any prompt that would resume from
them. A request with ControlNets never resumes from a cached latent (the control's structure
is set in the steps a hit would skip), and no adapter request feeds the cache (it holds the
base model's latents alone).

These are functions of the worker's cache and prompt encoder, passed at each call: the worker
owns both (and may swap its encoder, as a benchmark that times it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from argus.contracts.generate import CacheOutcome
from argus.types import Level, Strategy
from argus.worker.adapters.workflow import AdapterPlan
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec


class PromptEncoder(Protocol):
    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]: ...


@dataclass(frozen=True)
class CacheLookup:
    """What the approximate cache gave a request (step 2 of the worker's run): a HIT
    resumes ``latent`` at ``start_step`` (the level's K); a MISS (``miss_reason`` says why)
    and NOT_USED (by design: SM, K = 0, no cache) start from noise at step 0, except an edit
    (NOT_USED), which starts at its own step from its image (:attr:`GenerationSpec.start_step`)."""

    outcome: CacheOutcome
    start_step: int = 0  # K on a hit
    latent: torch.Tensor | None = None  # the cached latent after K steps (hit)
    similarity: float = 0.0  # cosine similarity of the cached prompt (hit)
    miss_reason: str = (
        ""  # one of argus.worker.approx_cache.cache.MISS_REASONS, "controlnet", "no-encoder"
    )
    search_ms: float = 0.0  # in the vector index (0 when no search ran)
    fetch_ms: float = 0.0  # reading the latent (0 when none was read)
    # the prompt's embedding when the lookup made one; a run that feeds the cache reuses it
    embedding: npt.NDArray[np.float32] | None = None

    @classmethod
    def miss(
        cls,
        reason: str,
        search_ms: float = 0.0,
        fetch_ms: float = 0.0,
        embedding: npt.NDArray[np.float32] | None = None,
    ) -> CacheLookup:
        return cls(
            CacheOutcome.MISS,
            miss_reason=reason,
            search_ms=search_ms,
            fetch_ms=fetch_ms,
            embedding=embedding,
        )


NOT_LOOKED_UP = CacheLookup(CacheOutcome.NOT_USED)


def cache_key(model: DiffusionModel, spec: GenerationSpec) -> Any:
    """The :class:`~argus.worker.approx_cache.cache.CacheKey` of ``spec`` run on ``model``:
    a cached latent serves only a run of the same model, scheduler, size and step count."""
    from argus.worker.approx_cache.cache import CacheKey

    return CacheKey(
        model=model.name,
        scheduler=model.scheduler_name,
        height=spec.height,
        width=spec.width,
        steps=spec.steps,
    )


def look_up(
    cache: Any | None,
    encoder: PromptEncoder | None,
    spec: GenerationSpec,
    level: Level,
    plan: AdapterPlan,
    key: Any,
) -> CacheLookup:
    """Step 2: where the run starts. An edit starts where its strength says, without the
    cache (see the module's docstring). An AC level with K > 0 looks the prompt up in the
    cache (embedding it); a request with ControlNets, or a worker without an encoder,
    misses without a search; every other request does not use the cache."""
    if spec.edit is not None:
        return CacheLookup(CacheOutcome.NOT_USED, start_step=spec.start_step)
    if level.strategy is not Strategy.AC or level.skip_steps == 0 or cache is None:
        return NOT_LOOKED_UP
    if plan.controls:  # the control's structure is set in the steps a hit would skip
        return CacheLookup.miss("controlnet")
    if encoder is None:
        return CacheLookup.miss("no-encoder")
    from argus.worker.approx_cache.cache import CacheHit

    embedding = encoder.embed_one(spec.prompt)
    found = cache.lookup(embedding, key, level.skip_steps)
    if isinstance(found, CacheHit):
        return CacheLookup(
            CacheOutcome.HIT,
            start_step=level.skip_steps,
            latent=found.latent,
            similarity=float(found.similarity),
            search_ms=found.search_s * 1e3,
            fetch_ms=found.fetch_s * 1e3,
            embedding=embedding,
        )
    return CacheLookup.miss(str(found.reason), found.search_s * 1e3, found.fetch_s * 1e3, embedding)


def feeds_cache(
    cache: Any | None,
    base_model: str | None,
    model: DiffusionModel,
    level: Level,
    plan: AdapterPlan,
    lookup: CacheLookup,
) -> bool:
    """Step 3: whether the run's latents at the cache's steps are stored: a full run of
    an AC level on the base model, without adapters (the cache holds the base model's
    latents alone)."""
    return (
        lookup.start_step == 0
        and cache is not None
        and model.name == base_model
        and level.strategy is Strategy.AC
        and not plan
    )


def capture_steps(cache: Any, steps: int) -> tuple[int, ...]:
    """The steps below ``steps`` whose latents ``cache`` keeps: what a feeding run captures."""
    return tuple(k for k in cache.cache_steps if 0 < k < steps)


def insert(
    cache: Any | None,
    encoder: PromptEncoder | None,
    prompt: str,
    embedding: npt.NDArray[np.float32] | None,
    key: Any,
    latents: dict[int, torch.Tensor],
) -> bool:
    """Step 6, on the writer thread: store a run's captured ``latents`` under ``prompt``'s
    embedding (made now when the lookup made none). Returns False when the cache refused or
    failed the insert (the worker counts it); a worker without a cache or encoder stores
    nothing."""
    if encoder is None or cache is None:
        return True
    vector = encoder.embed_one(prompt) if embedding is None else embedding
    try:
        cache.insert(vector, key, prompt, latents)
    except Exception:
        return False
    return True
