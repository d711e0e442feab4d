"""diffusers' ``UNet2DConditionModel.forward`` cut in two where ControlNet residuals enter.

Katz §5 splits each denoising step into a *parallel* part (the UNet's time embedding, down
and mid blocks, and the ControlNets) and a *serial* part (the up blocks, which need the
ControlNets' residuals). :meth:`SplitUNet.encode` is the first half and
:meth:`SplitUNet.decode` the second; ``decode(encode(x), residuals)`` computes exactly what
``unet(x, down_block_additional_residuals=…, mid_block_additional_residual=…)`` computes,
operation for operation, so a synchronous run gives the same latents as diffusers' own
ControlNet pipelines (tested with tolerance zero on the CPU).

It reproduces the forward for the features SD-1.x, SD-2.x and SDXL UNets use: the sinusoidal
time embedding, SDXL's added text/time conditioning (``addition_embed_type="text_time"``),
``time_embed_act``, ``center_input_sample``, the down, mid and up blocks with upsample sizes
forwarded for odd latent sizes, the ControlNet residuals, and the output norm. The helpers
diffusers factored out (``get_time_embed``, ``get_aug_embed``,
``process_encoder_hidden_states``) are called, not copied. A UNet with features outside this
set (class labels, timestep conditioning, image or hint embeddings, GLIGEN, attention masks,
T2I-Adapters) is refused at construction with :class:`UnsupportedUNetError` rather than run
differently from diffusers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from argus.worker.adapters.controlnet.errors import InvalidControlNetRequest


class UnsupportedUNetError(ValueError):
    """A UNet configuration :class:`SplitUNet` does not reproduce."""


@dataclass(frozen=True)
class Residuals:
    """ControlNet outputs for one step: already scaled, summed over the request's ControlNets."""

    down: tuple[torch.Tensor, ...]  # one per skip connection, in the UNet's order
    mid: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Residuals:
        return Residuals(tuple(t.to(device, dtype) for t in self.down), self.mid.to(device, dtype))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.down, self.mid))


@dataclass(frozen=True)
class Encoded:
    """The state the up blocks need: the mid block's output, the skips, the embeddings."""

    sample: torch.Tensor  # the mid block's output
    skips: tuple[torch.Tensor, ...]  # conv_in's output, then every down-block resnet/downsampler
    emb: torch.Tensor  # time (+ added) embedding, after time_embed_act
    encoder_hidden_states: torch.Tensor
    forward_upsample_size: bool  # the latent size is not a multiple of the total upsampling


# both cross a CUDA graph's boundary as nested tensors (argus.worker.models.cuda_graphs)
pytree.register_dataclass(Residuals)
pytree.register_dataclass(Encoded)


def sum_residuals(parts: Sequence[Residuals]) -> Residuals:
    """Residuals of several ControlNets added in order, as diffusers' MultiControlNetModel does."""
    if not parts:
        raise ValueError("no residuals to sum")
    down = list(parts[0].down)
    mid = parts[0].mid
    for part in parts[1:]:
        down = [prev + curr for prev, curr in zip(down, part.down, strict=True)]
        mid = mid + part.mid
    return Residuals(tuple(down), mid)


class SplitUNet:
    """A ``UNet2DConditionModel`` run as :meth:`encode` (down + mid) then :meth:`decode` (up)."""

    def __init__(self, unet: Any) -> None:
        check_supported(unet.config)
        self.unet = unet

    # -- the parallel part -----------------------------------------------------------------

    def encode(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    ) -> Encoded:
        """Time embedding, input convolution, down blocks and mid block (``forward`` §1–4)."""
        unet = self.unet
        up_factor = 2**unet.num_upsamplers
        forward_upsample_size = any(dim % up_factor != 0 for dim in sample.shape[-2:])
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        # 1. time
        t_emb = unet.get_time_embed(sample=sample, timestep=timestep)
        emb = unet.time_embedding(t_emb, None)
        aug_emb = unet.get_aug_embed(
            emb=emb,
            encoder_hidden_states=encoder_hidden_states,
            added_cond_kwargs=added_cond_kwargs,
        )
        emb = emb + aug_emb if aug_emb is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        encoder_hidden_states = unet.process_encoder_hidden_states(
            encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added_cond_kwargs
        )
        # 2. pre-process
        sample = unet.conv_in(sample)
        # 3. down
        skips: tuple[torch.Tensor, ...] = (sample,)
        for block in unet.down_blocks:
            if getattr(block, "has_cross_attention", False):
                sample, res = block(
                    hidden_states=sample,
                    temb=emb,
                    encoder_hidden_states=encoder_hidden_states,
                    attention_mask=None,
                    cross_attention_kwargs=None,
                    encoder_attention_mask=None,
                )
            else:
                sample, res = block(hidden_states=sample, temb=emb)
            skips += res
        # 4. mid
        if unet.mid_block is not None:
            if getattr(unet.mid_block, "has_cross_attention", False):
                sample = unet.mid_block(
                    sample,
                    emb,
                    encoder_hidden_states=encoder_hidden_states,
                    attention_mask=None,
                    cross_attention_kwargs=None,
                    encoder_attention_mask=None,
                )
            else:
                sample = unet.mid_block(sample, emb)
        return Encoded(sample, skips, emb, encoder_hidden_states, forward_upsample_size)

    # -- the serial part -------------------------------------------------------------------

    def decode(self, encoded: Encoded, residuals: Residuals | None = None) -> torch.Tensor:
        """Add the residuals to the skips and the mid output, then the up blocks (§5–6)."""
        unet = self.unet
        skips = encoded.skips
        sample = encoded.sample
        if residuals is not None:
            check_residuals(residuals, encoded)
            skips = tuple(s + r for s, r in zip(skips, residuals.down, strict=True))
            sample = sample + residuals.mid
        upsample_size = None
        for i, block in enumerate(unet.up_blocks):
            is_final_block = i == len(unet.up_blocks) - 1
            res = skips[-len(block.resnets) :]
            skips = skips[: -len(block.resnets)]
            if not is_final_block and encoded.forward_upsample_size:
                upsample_size = skips[-1].shape[2:]
            if getattr(block, "has_cross_attention", False):
                sample = block(
                    hidden_states=sample,
                    temb=encoded.emb,
                    res_hidden_states_tuple=res,
                    encoder_hidden_states=encoded.encoder_hidden_states,
                    cross_attention_kwargs=None,
                    upsample_size=upsample_size,
                    attention_mask=None,
                    encoder_attention_mask=None,
                )
            else:
                sample = block(
                    hidden_states=sample,
                    temb=encoded.emb,
                    res_hidden_states_tuple=res,
                    upsample_size=upsample_size,
                )
        if unet.conv_norm_out:
            sample = unet.conv_norm_out(sample)
            sample = unet.conv_act(sample)
        out: torch.Tensor = unet.conv_out(sample)
        return out

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None,
        residuals: Residuals | None = None,
    ) -> torch.Tensor:
        """Both halves back to back: the UNet's forward, residuals included."""
        encoded = self.encode(sample, timestep, encoder_hidden_states, added_cond_kwargs)
        return self.decode(encoded, residuals)


def check_supported(config: Any) -> None:
    """Refuse UNet features whose forward :class:`SplitUNet` does not reproduce."""
    problems = []
    if config.get("class_embed_type") is not None or config.get("num_class_embeds") is not None:
        problems.append("class embeddings")
    if config.get("addition_embed_type") not in (None, "text_time"):
        problems.append(f"addition_embed_type={config.get('addition_embed_type')!r}")
    if config.get("encoder_hid_dim_type") is not None or config.get("encoder_hid_dim") is not None:
        problems.append("an encoder_hid projection")
    if config.get("time_cond_proj_dim") is not None:
        problems.append("timestep conditioning (time_cond_proj_dim)")
    if config.get("attention_type", "default") != "default":
        problems.append(f"attention_type={config.get('attention_type')!r}")
    if problems:
        raise UnsupportedUNetError(f"UNet with {', '.join(problems)} cannot be split")


def check_residuals(residuals: Residuals, encoded: Encoded) -> None:
    """Residuals must match the UNet's skips one for one, or the ControlNet does not fit it."""
    if len(residuals.down) != len(encoded.skips):
        raise InvalidControlNetRequest(
            "controlnets",
            f"the ControlNets return {len(residuals.down)} down residuals, this base UNet has"
            f" {len(encoded.skips)} skip connections (a ControlNet of another base model?)",
        )
    pairs = [*zip(residuals.down, encoded.skips, strict=True), (residuals.mid, encoded.sample)]
    for i, (residual, skip) in enumerate(pairs):
        if residual.shape != skip.shape:
            where = "mid" if i == len(pairs) - 1 else f"down[{i}]"
            raise InvalidControlNetRequest(
                "controlnets",
                f"residual {where} has shape {tuple(residual.shape)}, this base UNet needs"
                f" {tuple(skip.shape)} (a ControlNet of another base model?)",
            )
