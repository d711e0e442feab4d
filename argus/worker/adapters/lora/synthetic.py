"""Seeded random LoRA files that fit a model's UNet.

Nothing is downloaded, so tests, demos, ``argus profile-lora`` on tiny models and the LoRA
benchmark need LoRA files made on the spot. :func:`write_tiny_lora` writes one in the exact
layout diffusers' ``save_lora_weights`` produces (``unet.<module>.lora_A.weight`` /
``lora_B.weight``, PEFT config in the ``lora_adapter_metadata`` metadata when an alpha is
given, or per-module ``alpha`` tensors), for the modules named by ``targets`` (by default the
attention projections that diffusers' LoRA training scripts adapt).

The random weights are scaled so that each module's delta ``(alpha/r) · B @ A`` has an RMS of
``strength`` × the RMS of the weight it patches: large enough to change the image, small
enough to keep a random model's outputs finite. :func:`write_unfit_lora` writes one with a
wrong key or a wrong shape, for the error paths.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from argus.worker.adapters.lora.fileformat import METADATA_KEY
from argus.worker.adapters.lora.patch import patch_targets, weight_of

DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def unet_of(target: Any) -> torch.nn.Module:
    """The UNet of a DiffusionModel, a diffusers pipeline, or the UNet itself."""
    if hasattr(target, "pipeline"):
        target = target.pipeline
    unet = getattr(target, "unet", target)
    if not isinstance(unet, torch.nn.Module):
        raise TypeError(f"{type(target).__name__} has no UNet")
    return unet


def _matches(module: str, targets: Sequence[str]) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def tiny_lora_tensors(
    target: Any,
    *,
    rank: int = 4,
    seed: int = 0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    strength: float = 0.3,
    alpha: float | None = None,
    dtype: torch.dtype = torch.float16,
) -> dict[str, torch.Tensor]:
    """The tensors of a random LoRA for ``target``'s UNet, keyed as diffusers keys them."""
    if rank < 1:
        raise ValueError(f"rank {rank} must be ≥ 1")
    modules = sorted(
        (name, module)
        for name, module in patch_targets(unet_of(target)).items()
        if _matches(name, targets)
    )
    if not modules:
        raise ValueError(f"no Linear/Conv2d module of the UNet matches {list(targets)}")
    generator = torch.Generator().manual_seed(seed)
    factor = (float(rank) if alpha is None else alpha) / rank
    tensors: dict[str, torch.Tensor] = {}
    for name, module in modules:
        weight = weight_of(module).detach().to("cpu", torch.float32)
        out, kernel = weight.shape[0], tuple(weight.shape[1:])
        down = torch.randn((rank, *kernel), generator=generator)
        up_shape = (out, rank, 1, 1) if len(kernel) == 3 else (out, rank)
        up = torch.randn(up_shape, generator=generator)
        delta = factor * (up.flatten(1) @ down.flatten(1))
        up *= strength * _rms(weight) / max(_rms(delta), 1e-12)
        tensors[f"unet.{name}.lora_A.weight"] = down.to(dtype).contiguous()
        tensors[f"unet.{name}.lora_B.weight"] = up.to(dtype).contiguous()
    return tensors


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.pow(2).mean().sqrt())


def write_tiny_lora(
    target: Any,
    path: str | Path,
    *,
    rank: int = 4,
    seed: int = 0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    strength: float = 0.3,
    alpha: float | None = None,
    alpha_keys: bool = False,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write a seeded random LoRA that fits ``target``'s UNet; returns the path.

    ``alpha`` None writes no alpha (factor 1); otherwise it goes into the PEFT config in the
    metadata, or, with ``alpha_keys``, into a ``unet.<module>.alpha`` tensor per module.
    """
    from safetensors.torch import save_file

    tensors = tiny_lora_tensors(
        target, rank=rank, seed=seed, targets=targets, strength=strength, alpha=alpha, dtype=dtype
    )
    metadata = {"format": "pt"}
    if alpha is not None and alpha_keys:
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            tensors[key.removesuffix(".lora_A.weight") + ".alpha"] = torch.tensor(float(alpha))
    elif alpha is not None:
        config = {
            "unet.r": rank,
            "unet.lora_alpha": alpha,
            "unet.target_modules": sorted(targets),
            "unet.rank_pattern": {},
            "unet.alpha_pattern": {},
            "unet.use_dora": False,
            "unet.use_rslora": False,
        }
        metadata[METADATA_KEY] = json.dumps(config, sort_keys=True)
    out = Path(path)
    save_file(tensors, str(out), metadata=metadata)
    return out
