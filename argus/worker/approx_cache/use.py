"""How one request uses the approximate cache: where its run starts, and whether its latents
are stored for later requests.

A request names a *level* of the worker's profile:

* AC level with K > 0: embed the prompt, find the nearest cached prompt of the request's
  :func:`cache_key` (model, scheduler, size, steps and adapters) and resume at the largest
  cached step at most K that the neighbour's similarity allows under the model's rule
  (:func:`look_up`; the level's K is a ceiling). A neighbour below the rule's floor, nothing
  cached, a missing or corrupt latent, an index down or slow: a miss, generated in full and
  counted, never an error.
* AC level with K = 0, or a miss: a full generation. When it ran on the AC base model, its
  latents at the cache's steps (:func:`capture_steps`) are stored under its key
  (:func:`feeds_cache`, :func:`insert`), off the request path: the worker hands them to a
  single writer thread with a bounded backlog, and a full backlog drops the insert, counted.
* SM level: a full generation on that level's model, never a lookup; when the model is the
  AC base model (SM's best level on SDXL), it feeds the cache as a K = 0 run does.

Adapters are part of the key, so a request with LoRAs or ControlNets resumes only from, and
feeds only, latents made under the same LoRAs (names and scales) and the same ControlNets
(names, scales and control images): the control's structure, laid down in the steps a hit
skips, is then the request's own. What stays restricted, and why:

* an edit never uses the cache (:attr:`CacheOutcome.NOT_USED`) nor feeds it: the cache holds
  latents generated from noise, and resuming one would replace the template by another image,
  while an edit's latents carry its template into any prompt that would resume from them;
* a LoRA run's cached latents are what bounded asynchronous loading made of it: the LoRAs may
  join after a few steps, up to the BAL bound, so the steps before are the base model's. That
  is the image BAL serves anyway, and a resumed run merges them as they load (waiting at its
  first step when it starts past the bound). ControlNets' async mode (each step using the
  previous step's residuals) makes nearly the image sync mode makes, and latent parallelism
  the same within rounding; neither is in the key, which a router computes from the request.

These are functions of the worker's cache and prompt encoder, passed at each call: the worker
owns both (and may swap its encoder, as a benchmark that times it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from argus.contracts.generate import (
    Adapter,
    AdapterKind,
    CacheKey,
    CacheOutcome,
    adapters_digest,
)
from argus.request_limits import InvalidRequestError
from argus.types import Level, Strategy
from argus.worker.adapters.workflow import AdapterPlan
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec


class PromptEncoder(Protocol):
    """The worker's prompt encoder (``PromptEmbedder``). One that also has a ``vectors_id``
    (the id of the vectors it makes) can take a router's vector of the same id instead of
    embedding (:func:`router_vector`)."""

    dim: int

    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]: ...


# how far a vector's norm may stray from 1 (float32 rounding over 384 values is ~1e-7)
UNIT_TOLERANCE = 1e-3


def router_vector(
    encoder: PromptEncoder | None, values: tuple[float, ...], encoder_id: str
) -> npt.NDArray[np.float32] | None:
    """The prompt's vector as the router sent it (``GenerateCall.prompt_embedding`` and
    ``prompt_encoder``), checked, when this worker's encoder makes the same vectors; None when
    none was sent, when this worker has no encoder, or when its encoder is another (the worker
    then embeds the prompt itself). Raises :class:`InvalidRequestError` naming the field for a
    vector without its encoder's id, or one of this encoder that is of another width, not
    finite or not of unit norm: such a vector would file the prompt under a wrong direction."""
    if not values:
        return None
    if not encoder_id:
        raise InvalidRequestError("prompt_encoder", "required with prompt_embedding")
    if encoder is None or getattr(encoder, "vectors_id", None) != encoder_id:
        return None
    vector = np.asarray(values, dtype=np.float32)
    if vector.shape != (encoder.dim,):
        raise InvalidRequestError(
            "prompt_embedding", f"{vector.size} values; this encoder's vectors have {encoder.dim}"
        )
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(vector).all() or abs(norm - 1.0) > UNIT_TOLERANCE:
        raise InvalidRequestError(
            "prompt_embedding", f"must be a finite unit vector, got norm {norm:.4g}"
        )
    vector.flags.writeable = False
    return vector


def _embedding(
    cache: Any,
    encoder: PromptEncoder,
    prompt: str,
    given: npt.NDArray[np.float32] | None,
) -> npt.NDArray[np.float32]:
    """``given`` (the router's vector) or the encoder's, counted by where it came from."""
    source = "router" if given is not None else "worker"
    cache.count_vector(source)
    return given if given is not None else encoder.embed_one(prompt)


@dataclass(frozen=True)
class CacheLookup:
    """What the approximate cache gave a request (step 2 of the worker's run): a HIT
    resumes ``latent`` at ``start_step`` (at most the level's K); a MISS (``miss_reason``
    says why) and NOT_USED (by design: SM, K = 0, no cache) start from noise at step 0,
    except an edit (NOT_USED), which starts at its own step from its image
    (:attr:`GenerationSpec.start_step`)."""

    outcome: CacheOutcome
    start_step: int = 0  # the K resumed at, on a hit
    latent: torch.Tensor | None = None  # the cached latent after start_step steps (hit)
    # cosine similarity of the nearest cached prompt found (a hit, or a miss below the floor
    # or with a bad latent); None: no neighbour found, or no lookup made
    similarity: float | None = None
    miss_reason: str = ""  # one of argus.worker.approx_cache.cache.MISS_REASONS, "no-encoder"
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
        similarity: float | None = None,
    ) -> CacheLookup:
        return cls(
            CacheOutcome.MISS,
            miss_reason=reason,
            search_ms=search_ms,
            fetch_ms=fetch_ms,
            embedding=embedding,
            similarity=similarity,
        )


NOT_LOOKED_UP = CacheLookup(CacheOutcome.NOT_USED)


def cache_key(model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan) -> CacheKey:
    """The cache key of ``spec`` run on ``model`` with ``plan``'s adapters: a cached latent
    serves only a run of the same model, scheduler, size, step count and adapters."""
    return CacheKey(
        model=model.name,
        scheduler=model.scheduler_name,
        height=spec.height,
        width=spec.width,
        steps=spec.steps,
        adapters=adapters_digest(plan_adapters(plan)),
    )


def plan_adapters(plan: AdapterPlan) -> list[Adapter]:
    """A checked plan's adapters as the contract's values (scales as run), for the key."""
    loras = [Adapter(AdapterKind.LORA, r.name, r.scale) for r in plan.loras]
    controls = [Adapter(AdapterKind.CONTROLNET, u.name, u.scale, u.image) for u in plan.controls]
    return loras + controls


def look_up(
    cache: Any | None,
    encoder: PromptEncoder | None,
    spec: GenerationSpec,
    level: Level,
    key: CacheKey | None,
    embedding: npt.NDArray[np.float32] | None = None,
) -> CacheLookup:
    """Step 2: where the run starts. An edit starts where its strength says, without the
    cache (see the module's docstring). An AC level with K > 0 embeds the prompt (or takes
    ``embedding``, the router's vector of it) and looks it up under ``key`` with K as the
    ceiling; a worker without an encoder misses without a search; every other request does
    not use the cache."""
    if spec.edit is not None:
        return CacheLookup(CacheOutcome.NOT_USED, start_step=spec.start_step)
    if level.strategy is not Strategy.AC or level.skip_steps == 0 or cache is None:
        return NOT_LOOKED_UP
    if encoder is None or key is None:
        return CacheLookup.miss("no-encoder")
    from argus.worker.approx_cache.cache import CacheHit

    embedding = _embedding(cache, encoder, spec.prompt, embedding)
    found = cache.lookup(embedding, key, level.skip_steps)
    if isinstance(found, CacheHit):
        return CacheLookup(
            CacheOutcome.HIT,
            start_step=found.step,
            latent=found.latent,
            similarity=float(found.similarity),
            search_ms=found.search_s * 1e3,
            fetch_ms=found.fetch_s * 1e3,
            embedding=embedding,
        )
    return CacheLookup.miss(
        str(found.reason), found.search_s * 1e3, found.fetch_s * 1e3, embedding, found.similarity
    )


def feeds_cache(
    cache: Any | None,
    base_model: str | None,
    model: DiffusionModel,
    lookup: CacheLookup,
) -> bool:
    """Step 3: whether the run's latents at the cache's steps are stored: a full run on the
    base model, adapters or not (they are in its key), whatever level asked for it: an AC
    level at K = 0 or a miss, and SM's level on the same model, whose run is the same
    denoising, so a cluster serving SM keeps its caches growing for when it returns to AC."""
    return lookup.start_step == 0 and cache is not None and model.name == base_model


def capture_steps(cache: Any, steps: int) -> tuple[int, ...]:
    """The steps below ``steps`` whose latents ``cache`` keeps: what a feeding run captures."""
    return tuple(k for k in cache.cache_steps if 0 < k < steps)


def insert(
    cache: Any | None,
    encoder: PromptEncoder | None,
    prompt: str,
    embedding: npt.NDArray[np.float32] | None,
    key: CacheKey,
    latents: dict[int, torch.Tensor],
    given: npt.NDArray[np.float32] | None = None,
) -> bool:
    """Step 6, on the writer thread: store a run's captured ``latents`` under ``prompt``'s
    ``embedding`` (the lookup's, already counted); without one, under ``given`` (the router's
    vector) or one made now, counted as the lookup counts its own. Returns False when the
    cache refused or failed the insert (the worker counts it); a worker without a cache or
    encoder stores nothing."""
    if encoder is None or cache is None:
        return True
    try:
        if embedding is None:
            embedding = _embedding(cache, encoder, prompt, given)
        cache.insert(embedding, key, prompt, latents)
    except Exception:
        return False
    return True
