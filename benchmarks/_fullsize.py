"""The profile's models at full size, from their published configs, with random weights.

A UNet's, a text encoder's or a VAE's latency does not depend on its weights' values, so the
architectures built here cost on a GPU what the released checkpoints cost, with nothing to
download. :data:`ARCHS` maps each model of the profile (``argus/profiles/default.toml``) to
its architecture and native size:

* ``sdxl``: SDXL base 1.0 (UNet 2.57 B parameters, CLIP ViT-L/14 + OpenCLIP ViT-bigG/14 text
  encoders, kl-f8 VAE), 1024 px;
* ``sd-2.0``: SD-2.x base (linear-projection UNet, 1024-d cross-attention, OpenCLIP ViT-H/14
  text encoder, 23 layers as SD-2 uses them), 512 px;
* ``sd-1.5`` and ``sd-1.4``: the SD-1.x UNet (diffusers' default config), CLIP ViT-L/14, 512 px;
* ``small-sd`` and ``tiny-sd``: the block-removal distillations of SD-1.x that Segmind's
  Small-SD and Tiny-SD follow (BK-SDM): one ResNet/attention pair per down stage and no
  mid-block; Tiny also without the innermost stage. Their text encoder and VAE are SD-1.5's.

:func:`build_pipeline` with ``tiny=True`` gives the worker's tiny variant of the same model
instead (:mod:`argus.worker.models.sources`), so the benchmarks that use this module run on a CPU
too.
The tokenizer is MiniLM's WordPiece cut to 77 tokens (the tiny variants' own): a tokenizer's
vocabulary changes only the size of the embedding table, not the cost of a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from argus.worker.models.sources import (
    TINY_PREFIX,
    build_tiny_pipeline,
    make_scheduler,
    tiny_tokenizer,
)

# CLIP text towers: (hidden, layers, heads, projection, activation)
CLIP_L = (768, 12, 12, 768, "quick_gelu")  # OpenAI CLIP ViT-L/14
OPENCLIP_H = (1024, 23, 16, 512, "gelu")  # SD-2.x: ViT-H/14 without its last layer
OPENCLIP_BIGG = (1280, 32, 20, 1280, "gelu")  # SDXL's second encoder


@dataclass(frozen=True)
class Arch:
    """One model's architecture: its UNet's config, its text towers, its native size."""

    unet: dict[str, Any]
    text: tuple[tuple[int, int, int, int, str], ...]
    size: int
    vae_scale: float = 0.18215
    xl: bool = False
    published_unet_params: float | None = None  # billions, where a source gives it
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


SD1_UNET: dict[str, Any] = {"sample_size": 64, "cross_attention_dim": 768}

ARCHS: dict[str, Arch] = {
    "sdxl": Arch(
        unet={
            "sample_size": 128,
            "block_out_channels": (320, 640, 1280),
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "transformer_layers_per_block": (1, 2, 10),
            "attention_head_dim": (5, 10, 20),
            "cross_attention_dim": 2048,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
            "use_linear_projection": True,
        },
        text=(CLIP_L, OPENCLIP_BIGG),
        size=1024,
        vae_scale=0.13025,
        xl=True,
        published_unet_params=2.567,
    ),
    "sd-2.0": Arch(
        unet={
            "sample_size": 64,
            "attention_head_dim": (5, 10, 20, 20),
            "cross_attention_dim": 1024,
            "use_linear_projection": True,
        },
        text=(OPENCLIP_H,),
        size=512,
        published_unet_params=0.866,
    ),
    "sd-1.5": Arch(unet=SD1_UNET, text=(CLIP_L,), size=512, published_unet_params=0.860),
    "sd-1.4": Arch(unet=SD1_UNET, text=(CLIP_L,), size=512, published_unet_params=0.860),
    "small-sd": Arch(
        unet={**SD1_UNET, "layers_per_block": 1, "mid_block_type": None},
        text=(CLIP_L,),
        size=512,
        notes="BK-SDM-Small layout: one pair per down stage, no mid-block",
    ),
    "tiny-sd": Arch(
        unet={
            **SD1_UNET,
            "layers_per_block": 1,
            "mid_block_type": None,
            "block_out_channels": (320, 640, 1280),
            "down_block_types": ("CrossAttnDownBlock2D",) * 3,
            "up_block_types": ("CrossAttnUpBlock2D",) * 3,
        },
        text=(CLIP_L,),
        size=512,
        notes="BK-SDM-Tiny layout: Small without the innermost stage",
    ),
}


def _text_model(tower: tuple[int, int, int, int, str], tok: Any, projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    hidden, layers, heads, proj, act = tower
    config = CLIPTextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=77,
        projection_dim=proj,
        hidden_act=act,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def build_pipeline(
    name: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tiny: bool = False,
    scheduler: str = "euler",
) -> Any:
    """Model ``name`` of the profile as a diffusers pipeline on ``device``: full size with
    seeded random weights, or the worker's tiny variant of it (``tiny=True``).

    Full-size modules are initialised on ``device`` itself, so SDXL's 3.5 B parameters are
    drawn by the GPU in a second rather than by the CPU in a minute."""
    if tiny:
        return build_tiny_pipeline(TINY_PREFIX + name, scheduler).to(device, dtype)
    from diffusers import (
        AutoencoderKL,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    arch = ARCHS[name]
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    sched = make_scheduler(scheduler)  # its tables stay on the CPU, as diffusers keeps them
    with torch.device(device):
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2,
            latent_channels=4,
            sample_size=arch.size,
            scaling_factor=arch.vae_scale,
            force_upcast=False,
        )
        unet = UNet2DConditionModel(**arch.unet)
        if arch.xl:
            pipe = StableDiffusionXLPipeline(
                vae=vae,
                text_encoder=_text_model(arch.text[0], tok, projection=False),
                text_encoder_2=_text_model(arch.text[1], tok, projection=True),
                tokenizer=tok,
                tokenizer_2=tok,
                unet=unet,
                scheduler=sched,
                force_zeros_for_empty_prompt=False,
            )
        else:
            pipe = StableDiffusionPipeline(
                vae=vae,
                text_encoder=_text_model(arch.text[0], tok, projection=False),
                tokenizer=tok,
                unet=unet,
                scheduler=sched,
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
    return pipe.to(device, dtype)


def native_size(name: str, tiny: bool) -> int:
    """The model's native side in pixels (tiny variants: 64)."""
    return 64 if tiny else ARCHS[name].size


def modules(pipe: Any) -> dict[str, torch.nn.Module]:
    """A pipeline's parts that carry weights, by name."""
    parts = ("unet", "text_encoder", "text_encoder_2", "vae")
    found = {part: getattr(pipe, part, None) for part in parts}
    return {part: m for part, m in found.items() if isinstance(m, torch.nn.Module)}


def param_counts(pipe: Any) -> dict[str, int]:
    """Parameters per part of a pipeline."""
    return {part: sum(p.numel() for p in m.parameters()) for part, m in modules(pipe).items()}
