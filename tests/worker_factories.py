"""Builders for worker tests: tiny real pipelines, registries and engines (no GPU, no hub)."""

from __future__ import annotations

import functools
from typing import Any

from argus.profiles import default_profiles
from argus.worker.engine import Worker, WorkerConfig
from argus.worker.models import TINY_PREFIX, TINY_VARIANTS, build_tiny_pipeline
from argus.worker.pipelines import DiffusionModel, GenerationSpec
from argus.worker.registry import ModelRegistry

STEPS = 10  # tiny runs: 10 steps at 64 px


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
    )
    if load:
        worker.configure(wait=True)
    if warm:  # ready: health SERVING, heartbeats sent
        worker.warm_up()
    return worker


def make_tiny_clip(directory: Any) -> Any:
    """A tiny random CLIP saved as a scorer directory (model, BERT tokenizer, image processor).

    Its final norms are biased towards one shared direction so that every image-text cosine,
    and so every score, is positive, as PickScore's are; the scores still depend on the image.
    """
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    from argus.embedding import default_encoder_dir

    tokenizer = AutoTokenizer.from_pretrained(default_encoder_dir(), model_max_length=77)
    common = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    config = CLIPConfig(
        text_config={
            **common,
            "vocab_size": tokenizer.vocab_size,
            "num_hidden_layers": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.cls_token_id,
            "eos_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**common, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        for norm in (model.text_model.final_layer_norm, model.vision_model.post_layernorm):
            norm.weight.mul_(0.1)
            norm.bias.fill_(1.0)
        model.visual_projection.weight.copy_(model.text_projection.weight)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(directory)
    return directory
