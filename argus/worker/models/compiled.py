"""``torch.compile`` of a worker's UNet, compiled when a model loads rather than by its first
request.

With ``argus worker --compile MODE`` the registry (:mod:`argus.worker.models.registry`) calls
:func:`compile_and_warm` on every model it loads, before the model is ready: the UNet is
wrapped in ``torch.compile(unet, mode=MODE, backend=BACKEND)``
(:meth:`~argus.worker.models.pipelines.DiffusionModel.use_compile`) and one short plain run at
the worker's serving size (``--default-size``) compiles it there and then (with CUDA graphs,
the same run captures the serving size's graph). The seconds that took are logged, reported
to the registry's ``on_compile`` callback (the ``argus_worker_compile_seconds`` gauge) and
counted in the model's load time.

What it covers: the runs that take the UNet's fast forward
(:meth:`~argus.worker.models.pipelines.DiffusionModel.fast_unet`): plain generations, LoRA
runs (a LoRA is merged into the weights in place, so the compiled forward reads the merged
values without recompiling), and edits without a predictor of their own (img2img, inpainting
without the activation cache, step batches of such edits). What it does not cover: runs with a
custom noise predictor (inpainting with the activation cache, ControlNet, latent parallelism)
do not call the compiled forward; their blocks are patched or split. A shape the warm-up did
not run (another image size, a batch of edits) compiles on its first step, as any new shape
does under ``torch.compile``. The compiled forward does not run the UNet's cancellation
checkpoints: a request is stopped between steps, not inside one (as with CUDA graphs).

Mode ``reduce-overhead`` replays CUDA graphs of its own; the registry then does not take the
worker's own (``--cuda-graphs``) as well.
"""

from __future__ import annotations

import logging
import time

from argus import defaults
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

log = logging.getLogger(__name__)

GRAPHED_MODES = frozenset({"reduce-overhead"})
"""Modes whose compiled forward replays CUDA graphs of its own."""

WARM_UP_PROMPT = "a compile warm-up"


def check_compile_mode(mode: str, option: str = "compile_mode") -> str:
    """``mode`` if it is one of :data:`argus.defaults.COMPILE_MODES`; ValueError naming
    ``option`` otherwise."""
    if mode not in defaults.COMPILE_MODES:
        expected = ", ".join(defaults.COMPILE_MODES)
        raise ValueError(f"{option}: {mode!r} is not a torch.compile mode (expected {expected})")
    return mode


def check_compile_backend(backend: str, option: str = "compile_backend") -> str:
    """``backend`` if ``torch.compile`` knows it (eager and aot_eager included); ValueError
    naming ``option`` otherwise. Imports ``torch._dynamo``."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"{option}: {backend!r} is not a torch.compile backend (known: {', '.join(known)})"
        )
    return backend


def compile_and_warm(
    model: DiffusionModel,
    mode: str,
    backend: str,
    height: int,
    width: int,
    steps: int = 2,
) -> float:
    """Compile ``model``'s UNet and run one plain ``steps``-step generation at ``height`` ×
    ``width`` with the model's default guidance (both CFG branches, as a request that sets no
    scale), which compiles it; returns the seconds the compilation and that run took."""
    check_compile_mode(mode, "mode")
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    began = time.perf_counter()
    model.use_compile(mode=mode, backend=backend)
    warm_up(model, height, width, steps)
    seconds = time.perf_counter() - began
    log.info("compiled %s (%s, %s) in %.1f s", model.name, mode, backend, seconds)
    return seconds


def warm_up(model: DiffusionModel, height: int, width: int, steps: int = 2) -> None:
    """One plain ``steps``-step generation at ``height`` × ``width`` with the model's default
    guidance: what compiles a compiled forward, and what captures the CUDA graph of the
    serving size, before the first request."""
    model.denoise(GenerationSpec(WARM_UP_PROMPT, height=height, width=width, steps=steps))
