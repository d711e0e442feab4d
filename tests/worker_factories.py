"""Builders for worker tests: tiny real pipelines, registries and engines (no GPU, no hub)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from argus.profiles import default_profiles
from argus.worker.engine import Worker, WorkerConfig
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.registry import ModelRegistry
from argus.worker.models.sources import TINY_PREFIX, TINY_VARIANTS, build_tiny_pipeline

STEPS = 10  # tiny runs: 10 steps at 64 px


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (on a small CPU that other work
    loads, more threads wait for each other at every operator), then set back."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spec(prompt: str = "a red bus in the snow", **kwargs: Any) -> GenerationSpec:
    kwargs.setdefault("steps", STEPS)
    return GenerationSpec(prompt=prompt, **kwargs)


@functools.cache
def tiny_model(variant: str = "sd-1.5", scheduler: str = "euler") -> DiffusionModel:
    """A shared tiny model; tests must not mutate it."""
    source = TINY_PREFIX + variant
    return DiffusionModel(
        variant, build_tiny_pipeline(source, scheduler), device="cpu", source=source
    )


def tiny_sources() -> dict[str, str]:
    return {name: TINY_PREFIX + name for name in TINY_VARIANTS}


def make_registry(**kwargs: Any) -> ModelRegistry:
    kwargs.setdefault("device", "cpu")
    return ModelRegistry(tiny_sources(), **kwargs)


def make_worker(
    *,
    cache: Any = None,
    encoder: Any = None,
    level: str | None = None,
    load: bool = True,
    warm: bool = False,
    adapters: Any = None,
    edit_cache: Any = None,
    **config: Any,
) -> Worker:
    config.setdefault("default_steps", STEPS)
    worker = Worker(
        default_profiles(),
        make_registry(),
        cache=cache,
        encoder=encoder,
        config=WorkerConfig(**config),
        level=level,
        adapters=adapters,
        edit_cache=edit_cache,
    )
    if load:
        worker.configure(wait=True)
    if warm:  # ready: health SERVING, heartbeats sent
        worker.warm_up()
    return worker


def make_tiny_clip(directory: Any) -> Any:
    """A tiny random CLIP saved as a scorer directory (see ``write_tiny_clip``)."""
    from argus.worker.scoring import write_tiny_clip

    return write_tiny_clip(directory)


def edge_cache(root: Path, dim: int) -> Any:
    """A small approximate cache under ``root``: Qdrant Edge for the index, 100 entries, the
    latent store without fsync, its own metrics registry."""
    from prometheus_client import CollectorRegistry

    from argus.worker.approx_cache.cache import ApproximateCache, EdgeVectorIndex, LatentStore

    return ApproximateCache(
        EdgeVectorIndex(root / "edge", dim, optimize_after=None),
        LatentStore(root / "latents", fsync=False),
        max_entries=100,
        max_bytes=None,
        registry=CollectorRegistry(),
    )
