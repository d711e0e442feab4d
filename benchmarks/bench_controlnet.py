"""ControlNet-as-a-Service latency: sequential diffusers vs Argus's parallel ControlNets.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_controlnet.py                 # tiny SD-1.5
    PYTHONPATH=. .venv/bin/python benchmarks/bench_controlnet.py --variant sdxl --steps 8

For 0, 1, 2 and 3 ControlNets, the p50 latency of one request's denoising loop (prompt
encoding included, VAE decoding not) and its per-step share, for:

* ``diffusers``: diffusers' own ``StableDiffusion[XL]ControlNetPipeline`` (``output_type=
  "latent"``), which runs the ControlNets one after the other before each UNet call (0
  ControlNets: the plain pipeline);
* ``local sync`` / ``local async``: :class:`ControlNetPredictor` with the ControlNets in
  this process on a thread of their own, synchronous (each step waits for its residuals) and
  pipelined asynchronous (step t uses step t−1's);
* ``service sync`` / ``service async``: the same against an ``argus controlnet`` process on
  this machine, over gRPC on loopback with the internal plane's mutual TLS, as deployed
  (``--insecure-internal``: plaintext, to see what TLS costs; ``--no-service``: skipped).

``sequential`` is diffusers' schedule (ControlNets, then the UNet, one thread) run in
Argus's own loop: the fair baseline for the parallel modes, since they share every other
line of code. ``diffusers`` itself can be slower on a CPU for a reason unrelated to
scheduling: its control image is a channels-last view, which its ControlNets and, through
the residuals, its UNet's up blocks inherit, and small channels-last convolutions are slow
on a CPU.

``--threads 1`` gives each of torch's compute threads a core of its own, the cleanest view
of the overlap on a small CPU; torch's default lets one operator use every core, so the
ControlNet thread and the UNet thread then compete for them.

Read the numbers with the machine in mind: the tiny models take milliseconds per call, so
Python dispatch, thread hand-offs and (for the service) protobuf copies are a large part of
them, and a CPU with few cores has little left to run the ControlNets *beside* the UNet: the
intra-op thread pool already spreads each operator over the cores. Katz's speedups come from
ControlNets on GPUs of their own; this benchmark measures the mechanism's overhead and
whatever overlap the cores allow, not those speedups.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _machine import load_line, machine_line
from PIL import Image

from argus.worker.adapters.controlnet.executor import (
    ControlNetExecutor,
    ControlUnit,
    LocalControlNetExecutor,
    SessionSpec,
)
from argus.worker.adapters.controlnet.models import TINY_NAMES, ControlNetCatalog, build_controlnet
from argus.worker.adapters.controlnet.predictor import ControlNetMode, ControlNetPredictor
from argus.worker.models.pipelines import Conditioning, DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline, make_scheduler

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"
FAMILY = {"sd-1.5": "sd15", "sdxl": "sdxl"}


def control_png(seed: int, size: int) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def p50_seconds(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """p50 wall time of each run; the runs take turns, so load that comes and goes on a
    shared machine hits them all alike instead of whichever happened to run then."""
    for fn in runs.values():
        fn()  # warm-up: loads, allocator, first-call dispatch
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def diffusers_run(model: DiffusionModel, units: list[ControlUnit], spec: GenerationSpec) -> Any:
    """A callable running diffusers' sequential ControlNet pipeline on ``model``'s parts."""
    from diffusers import StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    if not units:
        pipe = model.pipeline
        kwargs: dict[str, Any] = {}
    else:
        family = "sdxl" if model.xl else "sd15"
        nets = [build_controlnet(u.name, base=family) for u in units]
        parts = {
            k: v
            for k, v in model.pipeline.components.items()
            if k not in ("image_encoder", "feature_extractor", "safety_checker")
        }
        parts["scheduler"] = make_scheduler("euler", model.scheduler_config)
        net = nets[0] if len(nets) == 1 else MultiControlNetModel(nets)
        if model.xl:
            pipe = StableDiffusionXLControlNetPipeline(
                **parts, controlnet=net, force_zeros_for_empty_prompt=False
            )
        else:
            pipe = StableDiffusionControlNetPipeline(
                **parts,
                controlnet=net,
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        pipe.set_progress_bar_config(disable=True)
        images = [Image.open(io.BytesIO(u.image)) for u in units]
        kwargs = {
            "image": images[0] if len(images) == 1 else images,
            "controlnet_conditioning_scale": 1.0 if len(units) == 1 else [1.0] * len(units),
        }

    def go() -> None:
        with torch.inference_mode():
            pipe(
                prompt=spec.prompt,
                height=spec.height,
                width=spec.width,
                num_inference_steps=spec.steps,
                guidance_scale=model.default_guidance,
                generator=torch.Generator().manual_seed(spec.seed),
                output_type="latent",
                **kwargs,
            )

    return go


class SequentialPredictor:
    """diffusers' schedule in Argus's loop: each step runs the ControlNets, then the whole
    UNet with their residuals, on one thread (the same code as ``local sync`` otherwise)."""

    def __init__(
        self, model: DiffusionModel, executor: LocalControlNetExecutor, units: list[ControlUnit]
    ) -> None:
        self.model = model
        self.executor = executor
        self.units = tuple(units)
        self.session: Any = None

    def __call__(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scheduler: Any, step: int
    ) -> torch.Tensor:
        x = DiffusionModel.unet_input(latents, t, cond, scheduler)
        if self.session is None:
            added = cond.added or {}
            factor = self.model.vae_scale_factor
            self.session = self.executor.open(
                SessionSpec(
                    family="sdxl" if self.model.xl else "sd15",
                    height=int(x.shape[-2]) * factor,
                    width=int(x.shape[-1]) * factor,
                    units=self.units,
                    encoder_hidden_states=cond.embeds,
                    text_embeds=added.get("text_embeds"),
                    time_ids=added.get("time_ids"),
                )
            )
        residuals = self.session.compute(x, t)
        noise: torch.Tensor = self.model.pipeline.unet(
            x,
            t,
            encoder_hidden_states=cond.embeds,
            added_cond_kwargs=cond.added,
            down_block_additional_residuals=residuals.down,
            mid_block_additional_residual=residuals.mid,
            return_dict=False,
        )[0]
        return DiffusionModel.guide(noise, cond)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def sequential_run(
    model: DiffusionModel,
    executor: LocalControlNetExecutor,
    units: list[ControlUnit],
    spec: GenerationSpec,
) -> Callable[[], None]:
    def go() -> None:
        if not units:
            model.denoise(spec)
            return
        predictor = SequentialPredictor(model, executor, units)
        try:
            model.denoise(spec, predictor=predictor)
        finally:
            predictor.close()

    return go


def argus_run(
    model: DiffusionModel,
    executor: ControlNetExecutor | None,
    units: list[ControlUnit],
    spec: GenerationSpec,
    mode: ControlNetMode,
) -> Callable[[], None]:
    def go() -> None:
        if executor is None or not units:
            model.denoise(spec)
            return
        with ControlNetPredictor(model, executor, units, mode=mode) as predictor:
            model.denoise(spec, predictor=predictor)

    return go


def start_service(
    family: str, threads: int | None, tls_dir: str | None
) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "argus", "controlnet", "--port", "0", "--device", "cpu"]
    command += ["--base-family", family, "--cache-size", "8"]
    if tls_dir is None:
        command += ["--insecure-internal"]
    else:
        command += ["--internal-tls-dir", tls_dir]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:  # torch reads it at start for its intra-op pool
        env["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        found = re.search(r"listening on (\S+)", line)
        if found:
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError("argus controlnet did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="sd-1.5", choices=sorted(FAMILY))
    parser.add_argument("--size", type=int, default=64, help="pixels")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--counts", default="0,1,2,3", help="numbers of ControlNets")
    parser.add_argument("--no-service", action="store_true", help="skip the gRPC service")
    parser.add_argument(
        "--insecure-internal", action="store_true", help="the service in plaintext, not mTLS"
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--service-threads", type=int, help="intra-op threads of the service (default: --threads)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    service_threads = args.service_threads or args.threads

    print(machine_line())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
        f" (service: {service_threads or 'default'}),"
        f" load average {os.getloadavg()[0]:.2f}"
    )
    family = FAMILY[args.variant]
    source = TINY_PREFIX + args.variant
    model = DiffusionModel(args.variant, build_tiny_pipeline(source), device="cpu", source=source)
    spec = GenerationSpec(PROMPT, seed=1, height=args.size, width=args.size, steps=args.steps)
    names = TINY_NAMES[family]
    counts = [int(c) for c in args.counts.split(",")]
    local = LocalControlNetExecutor(ControlNetCatalog.tiny().restrict(family))
    executors: dict[str, ControlNetExecutor] = {"local": local}
    process = None
    if not args.no_service:
        from argus.plumbing.internal_tls import Identity, InternalTLS, generate_ca, issue
        from argus.worker.adapters.controlnet.client import RemoteControlNetExecutor

        tls, tls_dir = None, None
        if not args.insecure_internal:  # a CA of the run's own, as argus up makes one
            root = Path(tempfile.mkdtemp(prefix="bench-controlnet-tls-"))
            generate_ca(root / "ca")
            tls_dir = str(issue(root / "ca", Identity("controlnet", "bench"), root / "service"))
            issue(root / "ca", Identity("worker", "bench"), root / "worker")
            tls = InternalTLS.load(root / "worker", "worker")
        process, address = start_service(family, service_threads, tls_dir)
        remote = RemoteControlNetExecutor(address, timeout_s=300, tls=tls)
        remote.wait_ready(60)
        executors["service"] = remote

    modes = ["diffusers", "sequential"] + [
        f"{where} {mode.value}" for where in executors for mode in ControlNetMode
    ]
    print(
        f"\n{args.variant} tiny, {args.size}x{args.size} px, {args.steps} steps, CFG on;"
        f" p50 of {args.repeats} runs; ms per request (ms per step), speedup vs sequential"
    )
    print(f"{'ControlNets':>11}  " + "  ".join(f"{m:>22}" for m in modes))
    results: list[dict[str, Any]] = []
    try:
        for count in counts:
            units = [ControlUnit(names[i], 1.0, control_png(i, args.size)) for i in range(count)]
            runs = {
                "diffusers": diffusers_run(model, units, spec),
                "sequential": sequential_run(model, local, units, spec),
            }
            for where, executor in executors.items():
                for mode in ControlNetMode:
                    runs[f"{where} {mode.value}"] = argus_run(model, executor, units, spec, mode)
            row = p50_seconds(runs, args.repeats)
            base = row["sequential"]
            cells = [
                f"{row[m] * 1e3:7.1f} ({row[m] * 1e3 / args.steps:5.1f}) {base / row[m]:4.2f}x"
                for m in modes
            ]
            print(f"{count:>11}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
            results.append({"controlnets": count, **{m: row[m] for m in modes}})
    finally:
        for executor in executors.values():
            executor.close()
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"variant": args.variant, "size": args.size, "steps": args.steps, "rows": results},
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()
    print(load_line("end"))
