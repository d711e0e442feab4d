"""Katz workflows end to end on a worker: 0C/0L, 1C/1L, 2C/2L, 3C/2L requests, Argus vs sequential.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_adapters.py [--variant sdxl] [--steps 20]
        [--size 64] [--rank 64] [--repeats 5] [--threads 1]

For each request shape (C ControlNets, L LoRAs), the p50 latency of one request's
denoising (prompt encoding included, VAE decoding not):

* ``sequential``: the plain diffusers workflow. The LoRAs are read from disk and merged before
  denoising starts (synchronous loading; diffusers' own ``load_lora_weights`` needs ``peft``,
  which this project does not install, so the same read and merge code as Argus's runs here,
  in the request's thread), then diffusers' ``StableDiffusion[XL]ControlNetPipeline`` runs
  the ControlNets one after the other before each UNet call; the weights are restored after.
* ``argus sync`` / ``argus async``: the worker's own path (:class:`WorkerAdapters.attach`):
  LoRAs through bounded asynchronous loading (loader processes, merged at the first step
  boundary after they are ready, waited for at K), ControlNets beside the UNet's down and
  mid blocks in process, synchronous or pipelined.

LoRA files are fresh reads every request (the loader's cache is off), from the page cache.
Both paths start from the same weights and end with them restored. The last column is BAL's
overhead over the same request without LoRAs (the ``argus sync`` row with 0 LoRAs and the
same ControlNets): Katz's target is ≤ 10% when loading fits within K steps.

Figures are from tiny random-weight models on a CPU: Python dispatch is a large share of
each step, and two cores leave the ControlNet and loader work little room to run beside the
UNet. On a GPU (``--device cuda --variant sdxl --size 1024``) the same script measures the
paper's setting.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _machine import load_line, machine_line
from bench_controlnet import control_png, diffusers_run

from argus.worker.adapters.controlnet.executor import ControlUnit
from argus.worker.adapters.lora import (
    LoraConfig,
    LoraLibrary,
    LoraLoader,
    LoraRequest,
    WeightBackup,
    load_now,
    merge,
    write_tiny_lora,
)
from argus.worker.adapters.workflow import AdapterPlan, AdapterSettings, WorkerAdapters
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline

SHAPES = ((0, 0), (1, 1), (2, 2), (3, 2), (0, 1), (0, 2))
CONTROLNETS = ("canny", "depth", "openpose")


def p50(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up: first ControlNet builds, allocator, loader processes
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def sequential(
    model: DiffusionModel, library: LoraLibrary, plan: AdapterPlan, spec: GenerationSpec
) -> Callable[[], None]:
    pipeline = diffusers_run(model, list(plan.controls), spec)
    unet = model.pipeline.unet

    def go() -> None:
        backup = WeightBackup()
        try:
            for request in plan.loras:
                merge(unet, load_now(library, request.name), request.scale, backup)
            pipeline()
        finally:
            backup.restore()

    return go


def argus(
    model: DiffusionModel, adapters: WorkerAdapters, plan: AdapterPlan, spec: GenerationSpec
) -> Callable[[], None]:
    def go() -> None:
        with adapters.attach(model, spec, plan) as extras:
            model.denoise(spec, **extras.kwargs())

    return go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="sdxl", choices=("sdxl", "sd-1.5"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank (attention modules)")
    parser.add_argument("--bound", type=int, default=10, help="BAL bound K at 50 steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    source = TINY_PREFIX + args.variant
    model = DiffusionModel(
        args.variant, build_tiny_pipeline(source, "euler"), device="cpu", source=source
    )
    spec = GenerationSpec(
        "a lighthouse at dusk", seed=1, height=args.size, width=args.size, steps=args.steps
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            write_tiny_lora(
                model.pipeline.unet, Path(tmp) / f"style-{i}.safetensors", rank=args.rank, seed=i
            )
        library = LoraLibrary(tmp)
        size_mib = sum(p.stat().st_size for p in Path(tmp).iterdir()) / 2**21
        modes: dict[str, WorkerAdapters] = {}
        for mode in ("sync", "async"):
            adapters = WorkerAdapters(
                AdapterSettings(controlnet="local", controlnet_mode=mode, lora_bound=args.bound),
                device="cpu",
                dtype=torch.float32,
            )
            adapters.start()
            adapters.loras = LoraLoader(library, LoraConfig(processes=2, cache_items=0))
            adapters.loras.warm()
            modes[mode] = adapters
        bound = modes["sync"].bound(args.steps)
        print(
            f"tiny {args.variant}, {args.size} px, {args.steps} steps, LoRA rank {args.rank} "
            f"({size_mib:.2f} MiB each), BAL bound K={bound}, torch threads "
            f"{torch.get_num_threads()}; p50 of {args.repeats}, ms per request (denoise)"
        )
        print(
            f"{'request':>8} {'sequential':>11} {'argus sync':>11} {'argus async':>12} "
            f"{'speedup':>8} {'LoRA overhead (BAL)':>20}"
        )
        no_lora: dict[int, float] = {}
        try:
            for controls, loras in SHAPES:
                plan = AdapterPlan(
                    tuple(LoraRequest(f"style-{i}", 1.0) for i in range(loras)),
                    tuple(
                        ControlUnit(CONTROLNETS[i], 1.0, control_png(i, args.size))
                        for i in range(controls)
                    ),
                )
                seq = p50(sequential(model, library, plan, spec), args.repeats)
                sync = p50(argus(model, modes["sync"], plan, spec), args.repeats)
                asy = p50(argus(model, modes["async"], plan, spec), args.repeats)
                if loras == 0:
                    no_lora[controls] = sync
                base = no_lora.get(controls)
                overhead = f"{(sync / base - 1) * 100:+.1f}%" if base and loras else "-"
                print(
                    f"{controls}C/{loras}L".rjust(8) + f" {seq * 1e3:11.1f} {sync * 1e3:11.1f} "
                    f"{asy * 1e3:12.1f} {seq / min(sync, asy):7.2f}x {overhead:>20}"
                )
        finally:
            for adapters in modes.values():
                adapters.close()


if __name__ == "__main__":
    main()
    print(load_line("end"))
