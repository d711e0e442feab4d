"""What adapters cost on the device a pipeline runs on: a LoRA's load and patch, a ControlNet's
added latency. ``gpu_profile.py`` calls both on the full-size models of ``_fullsize.py``; the
test runs them on the tiny variants on a CPU.

Both go through the worker's own code, not diffusers' generic adapter paths:

* :func:`lora_cost` writes a seeded random LoRA for the pipeline's UNet with the project's
  writer (:func:`argus.worker.adapters.lora.write_tiny_lora`: rank ``rank`` on the attention
  projections ``to_q``, ``to_k``, ``to_v``, ``to_out.0``, as SDXL LoRAs are trained), reads it
  with the loader processes' reader (:func:`~argus.worker.adapters.lora.fileformat.read_file`), and
  patches it in and out with the session's :func:`~argus.worker.adapters.lora.patch.merge` and
  :class:`~argus.worker.adapters.lora.patch.WeightBackup` (in-place ``addmm_`` into each weight, a
  copy of each weight kept for a bit-exact restore);
* :func:`controlnet_cost` runs the worker's denoising loop (:class:`DiffusionModel.denoise`)
  at batch 1 with classifier-free guidance, plain and with one ControlNet through
  :class:`~argus.worker.adapters.controlnet.predictor.ControlNetPredictor` (the worker's default
  ``sync`` mode) and a :class:`~argus.worker.adapters.controlnet.executor.LocalControlNetExecutor`
  on
  the pipeline's own device, as ``--controlnet local`` runs it. The ControlNet is a random
  one built from the pipeline's UNet (``ControlNetModel.from_unet``, diffusers' default
  conditioning encoder (16, 32, 96, 256), as the released SDXL ControlNets have); the
  executor serves it in place of a catalog load, everything else is the executor's code.

Clocks are read after ``torch.cuda.synchronize()`` on CUDA. Every figure is a median over
the repeats; the functions return flat dicts of floats.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _machine import drop_page_cache
from bench_controlnet import control_png

from argus.contracts.controlnet import ControlUnit
from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
from argus.worker.adapters.controlnet.models import (
    CatalogEntry,
    ControlNetCatalog,
    base_family,
    model_bytes,
)
from argus.worker.adapters.controlnet.predictor import ControlNetMode, ControlNetPredictor
from argus.worker.adapters.lora.fileformat import ReadFailure, SharedRead, read_file
from argus.worker.adapters.lora.patch import (
    WeightBackup,
    loaded_from,
    merge,
    patch_targets,
    weight_of,
)
from argus.worker.adapters.lora.synthetic import DEFAULT_TARGETS, write_tiny_lora
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"
CONTROLNET_NAME = "random"
ZERO_CONVS = (  # diffusers initialises these at zero
    "controlnet_down_blocks",
    "controlnet_mid_block",
    "controlnet_cond_embedding.conv_out",
)


def _clock(device: str) -> float:
    """``time.perf_counter()`` once the device has finished the work queued so far."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


# -- LoRA --------------------------------------------------------------------------------------


def _read(path: Path) -> tuple[float, SharedRead]:
    began = time.perf_counter()
    outcome = read_file(str(path), share=False)
    seconds = time.perf_counter() - began
    if isinstance(outcome, ReadFailure):
        raise RuntimeError(f"{path}: {outcome.message}")
    return seconds, outcome


def lora_cost(
    pipe: Any,
    *,
    device: str,
    dtype: torch.dtype,
    rank: int = 64,
    repeats: int = 5,
    workdir: Path,
) -> dict[str, float]:
    """A rank-``rank`` LoRA on ``pipe``'s UNet: file size, read, host→device copy, patch, unpatch.

    Each repeat (after one untimed warm-up round) times, in milliseconds:

    * ``lora_read_ms``: parse, check and read the file into host memory as a loader process
      does, with the file's pages first dropped from the page cache (a cold read where the
      OS allows it; ``lora_read_cold`` is 1.0 then, 0.0 where it could not drop them);
      ``lora_read_warm_ms``: the same read again, from the page cache;
    * ``lora_h2d_ms``: the file's data section (every tensor) copied to ``device`` in one copy;
    * ``lora_patch_ms``: :func:`merge` of the device-resident LoRA into the UNet (the shape
      check, a copy of each patched weight, one ``addmm_`` per module);
    * ``lora_unpatch_ms``: :meth:`WeightBackup.restore`, the weights copied back bit for bit;
    * ``lora_patch_from_host_ms``: :func:`merge` straight from the host copy, as the worker's
      LoRA session does it (each module's factors go to the device inside the merge).

    Also ``lora_mib`` (the file), ``lora_modules``, ``lora_params_m`` (LoRA parameters,
    millions), ``lora_patched_params_m`` (UNet weights the patch rewrites, millions) and
    ``lora_patch_rel_change`` (RMS of the patch's change over RMS of the patched weights, on
    the first repeat; the writer aims at 0.3). The first repeat checks that the patch changed
    every patched weight and that the unpatch restored each one exactly, and raises if not.
    The LoRA is written in ``dtype`` to ``workdir``; the UNet is left as it was found.
    """
    if repeats < 1:
        raise ValueError(f"repeats {repeats} must be >= 1")
    unet = pipe.unet
    workdir.mkdir(parents=True, exist_ok=True)
    path = write_tiny_lora(
        pipe, workdir / f"lora-r{rank}.safetensors", rank=rank, targets=DEFAULT_TARGETS, dtype=dtype
    )
    with open(path, "rb") as handle:  # written pages must reach the disk before they can go
        os.fsync(handle.fileno())
    name = path.stem
    targets = patch_targets(unet)
    times: dict[str, list[float]] = {
        k: [] for k in ("read", "read_warm", "h2d", "patch", "unpatch", "patch_from_host")
    }
    cold = 1.0
    figures: dict[str, float] = {}
    with torch.no_grad():
        for round_ in range(repeats + 1):  # round 0: warm-up, not timed
            if not drop_page_cache(path):
                cold = 0.0
            read_s, read = _read(path)
            warm_s, read = _read(path)
            host = loaded_from(name, str(path), read)

            began = _clock(device)
            data = torch.empty_like(read.data, device=device).copy_(read.data)
            h2d_s = _clock(device) - began
            on_device = loaded_from(name, str(path), SharedRead(read.layout, data, read.read_s))

            originals: dict[str, torch.Tensor] = {}
            if round_ == 1:
                originals = {
                    m.module: weight_of(targets[m.module]).detach().clone() for m in host.modules
                }
            backup = WeightBackup()
            began = _clock(device)
            merge(unet, on_device, 1.0, backup)
            patch_s = _clock(device) - began
            if originals:
                figures["lora_patch_rel_change"] = _check_patched(targets, originals)
            began = _clock(device)
            backup.restore()
            unpatch_s = _clock(device) - began
            if originals:
                _check_restored(targets, originals)
                del originals

            backup = WeightBackup()
            began = _clock(device)
            merge(unet, host, 1.0, backup)
            from_host_s = _clock(device) - began
            backup.restore()
            del data, on_device
            if round_ == 0:
                continue
            for key, seconds in (
                ("read", read_s),
                ("read_warm", warm_s),
                ("h2d", h2d_s),
                ("patch", patch_s),
                ("unpatch", unpatch_s),
                ("patch_from_host", from_host_s),
            ):
                times[key].append(seconds)
    lora_params = sum(m.down.numel() + m.up.numel() for m in host.modules)
    patched = sum(weight_of(targets[m.module]).numel() for m in host.modules)
    return {
        "lora_rank": float(rank),
        "lora_mib": path.stat().st_size / 2**20,
        "lora_modules": float(len(host.modules)),
        "lora_params_m": lora_params / 1e6,
        "lora_patched_params_m": patched / 1e6,
        **{f"lora_{key}_ms": _median_ms(values) for key, values in times.items()},
        "lora_read_cold": cold,
        **figures,
        "lora_repeats": float(repeats),
    }


def _check_patched(
    targets: dict[str, torch.nn.Module], originals: dict[str, torch.Tensor]
) -> float:
    """RMS change over RMS weight across the patched modules; raises if any did not change."""
    change = base = 0.0
    for module, original in originals.items():
        weight = weight_of(targets[module]).detach()
        diff = (weight.float() - original.float()).pow(2).sum().item()
        if diff == 0.0:
            raise RuntimeError(f"the LoRA patch left {module} unchanged")
        change += diff
        base += original.float().pow(2).sum().item()
    return math.sqrt(change / base)


def _check_restored(
    targets: dict[str, torch.nn.Module], originals: dict[str, torch.Tensor]
) -> None:
    for module, original in originals.items():
        if not torch.equal(weight_of(targets[module]).detach(), original):
            raise RuntimeError(f"the unpatch did not restore {module} bit for bit")


# -- ControlNet --------------------------------------------------------------------------------


class _OneControlNet(LocalControlNetExecutor):
    """The worker's local executor, serving one ControlNet built here instead of a catalog's."""

    def __init__(self, family: str, net: Any, *, device: str, dtype: torch.dtype) -> None:
        entry = CatalogEntry(family, CONTROLNET_NAME, f"built:{family}/{CONTROLNET_NAME}")
        self._net = net
        super().__init__(ControlNetCatalog([entry], "gpu profile"), device=device, dtype=dtype)

    def _load(self, key: str) -> Any:
        return self._net

    def _estimate(self, key: str) -> int:
        return model_bytes(self._net)


def random_controlnet(unet: Any, *, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A ControlNet of ``unet``'s architecture with seeded random weights, built on ``device``.

    diffusers initialises the zero convolutions at zero (the residuals would all be zero);
    here they are drawn small, so the residuals reach the UNet as a trained ControlNet's do.
    """
    from diffusers import ControlNetModel

    kind = torch.device(device)
    forked = [kind.index or 0] if kind.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), torch.device(device):
        torch.manual_seed(seed)
        net = ControlNetModel.from_unet(unet, load_weights_from_unet=False)
        with torch.no_grad():
            for name, param in net.named_parameters():
                if name.startswith(ZERO_CONVS) and param.dim() >= 2:
                    param.normal_(0.0, 0.1 / math.sqrt(param[0].numel()))
    return net.to(device=device, dtype=dtype).eval()


class _StepClock:
    """``before_step`` / ``on_step`` callbacks of :meth:`DiffusionModel.denoise` that time each
    step (UNet or ControlNet + UNet, guidance, scheduler step) between synchronised clocks."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.began: dict[int, float] = {}
        self.ended: dict[int, float] = {}

    def before(self, step: int) -> None:
        self.began[step] = _clock(self.device)

    def after(self, step: int) -> None:
        self.ended[step] = _clock(self.device)

    def steps(self) -> list[float]:
        return [self.ended[s] - self.began[s] for s in sorted(self.ended)]

    def image(self) -> float:
        return self.ended[max(self.ended)] - self.began[min(self.began)]


def controlnet_cost(
    pipe: Any,
    *,
    device: str,
    dtype: torch.dtype,
    size: int,
    steps: int = 10,
    repeats: int = 3,
) -> dict[str, float]:
    """One ControlNet's added latency on ``pipe`` at ``size`` px, batch 1 with CFG.

    Runs the worker's loop ``steps`` steps plain and with one random ControlNet (see the
    module's doc), alternating, after one untimed warm-up run of each; returns, in ms:

    * ``unet_step_ms`` / ``controlnet_step_ms``: median time of one step without / with the
      ControlNet (steps 1…N−1 of every repeat; step 0 also opens the ControlNet session);
    * ``controlnet_added_ms_per_step``: their difference;
    * ``unet_image_ms`` / ``controlnet_image_ms``: median time of the N steps of one image
      (prompt encoding and VAE decoding excluded: they are the same with or without);
      ``controlnet_added_ms_per_image``: their difference;
    * ``controlnet_open_ms``: median time the predictor spent opening its session (control
      image decoded and moved to the device, the ControlNet leased from the executor's cache);
      ``controlnet_wait_ms_per_step``: median time per step the UNet's up blocks waited for
      the residuals (the part of the ControlNet not overlapped with the UNet's encoder).

    Also ``controlnet_params_m`` (millions), ``controlnet_mib`` (its weights on the device),
    ``controlnet_latent_change`` (relative L2 distance between the final latents with and
    without the ControlNet: above 0 shows the residuals reached the UNet), ``controlnet_size_px``
    and ``controlnet_steps``.
    """
    if steps < 2 or repeats < 1:
        raise ValueError(f"steps {steps} must be >= 2 and repeats {repeats} >= 1")
    family = base_family(pipe.unet.config)
    model = DiffusionModel(f"{family}-profile", pipe, device=device, source="gpu-profile")
    net = random_controlnet(pipe.unet, device=device, dtype=dtype)
    executor = _OneControlNet(family, net, device=device, dtype=dtype)
    units = [ControlUnit(CONTROLNET_NAME, 1.0, control_png(0, size))]
    spec = GenerationSpec(PROMPT, seed=0, height=size, width=size, steps=steps)

    def run(with_controlnet: bool) -> tuple[_StepClock, torch.Tensor, ControlNetPredictor | None]:
        clock = _StepClock(device)
        predictor = None
        if with_controlnet:
            predictor = ControlNetPredictor(model, executor, units, mode=ControlNetMode.SYNC)
        try:
            result = model.denoise(
                spec, predictor=predictor, before_step=[clock.before], on_step=clock.after
            )
        finally:
            if predictor is not None:
                predictor.close()
        if predictor is not None and predictor.stats.steps != steps:
            raise RuntimeError(f"the ControlNet ran {predictor.stats.steps} of {steps} steps")
        return clock, result.latents.float().cpu(), predictor

    step_s: dict[bool, list[float]] = {False: [], True: []}
    image_s: dict[bool, list[float]] = {False: [], True: []}
    open_s: list[float] = []
    wait_s: list[float] = []
    latents: dict[bool, torch.Tensor] = {}
    try:
        for round_ in range(repeats + 1):  # round 0: warm-up, not timed
            for with_controlnet in (False, True):
                clock, latents[with_controlnet], predictor = run(with_controlnet)
                if round_ == 0:
                    continue
                step_s[with_controlnet] += clock.steps()[1:]
                image_s[with_controlnet].append(clock.image())
                if predictor is not None:
                    open_s.append(predictor.stats.open_s)
                    wait_s.append(predictor.stats.wait_s / steps)
    finally:
        executor.close()
        model.release()
    plain, controlled = latents[False], latents[True]
    change = float((controlled - plain).norm() / plain.norm().clamp_min(1e-12))
    unet_step = _median_ms(step_s[False])
    cn_step = _median_ms(step_s[True])
    unet_image = _median_ms(image_s[False])
    cn_image = _median_ms(image_s[True])
    return {
        "unet_step_ms": unet_step,
        "controlnet_step_ms": cn_step,
        "controlnet_added_ms_per_step": cn_step - unet_step,
        "unet_image_ms": unet_image,
        "controlnet_image_ms": cn_image,
        "controlnet_added_ms_per_image": cn_image - unet_image,
        "controlnet_open_ms": _median_ms(open_s),
        "controlnet_wait_ms_per_step": _median_ms(wait_s),
        "controlnet_params_m": sum(p.numel() for p in net.parameters()) / 1e6,
        "controlnet_mib": model_bytes(net) / 2**20,
        "controlnet_latent_change": change,
        "controlnet_size_px": float(size),
        "controlnet_steps": float(steps),
        "controlnet_repeats": float(repeats),
    }
