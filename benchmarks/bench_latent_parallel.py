"""Latent parallelism (Katz §7): CFG's two branches on two processes vs one batch of two.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_latent_parallel.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_latent_parallel.py --configs mid --repeats 5
    PYTHONPATH=. python benchmarks/bench_latent_parallel.py --device cuda:0 \
        --peer-device cuda:1 --configs mid            # two GPUs, NCCL

For each UNet config it times the denoising loop (``DiffusionModel.denoise``, text encoding
excluded) three ways and prints the median per step:

* **single, T threads**: the default predictor, both branches as one batch of two, with all
  ``--threads`` CPU threads (the fair baseline on a CPU: the same cores as the two processes);
* **single, 1 thread**: the same with one thread (what one of the two processes gets);
* **latent parallel**: :mod:`argus.worker.adapters.latent_parallel`, rank 0 and the peer with
  ``threads / 2`` threads each, gloo between them.

Configs: ``tiny`` is ``tiny:sd-1.5`` at 64 px (8×8 latents, 0.6 M UNet parameters); ``mid``
is an SD-1.5-shaped UNet with widths (64, 128, 256), two layers per block, at 256 px (32×32
latents, 17.6 M parameters), saved as a diffusers directory that both processes load, like a
real model. On a CPU the two processes share the machine's cores, so a speedup is bounded by
how badly one batch of two uses them; Katz's 1.36–1.71× (§9.5) is on two GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _machine import load_line, machine_line

from argus.worker.adapters.latent_parallel import LatentParallelConfig, LatentParallelGroup
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline, load_pipeline_dir

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"


def mid_pipeline_dir(root: Path) -> Path:
    """tiny:sd-1.5 with a wider, deeper UNet, saved as a diffusers directory."""
    from diffusers import UNet2DConditionModel

    pipeline = build_tiny_pipeline(TINY_PREFIX + "sd-1.5")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(64, 128, 256),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=int(pipeline.text_encoder.config.hidden_size),
        attention_head_dim=8,
        norm_num_groups=32,
    ).eval()
    pipeline.register_modules(unet=unet)
    pipeline.save_pretrained(root, safe_serialization=True)
    return root


def load_model(config: str, root: Path, device: str) -> tuple[DiffusionModel, int]:
    """The model of ``config`` and its image size."""
    if config == "tiny":
        source = TINY_PREFIX + "sd-1.5"
        pipeline = build_tiny_pipeline(source)
        size = 64
    elif config == "mid":
        source = str(mid_pipeline_dir(root / "mid"))
        pipeline = load_pipeline_dir(source, torch.float32)
        size = 256
    else:
        raise SystemExit(f"unknown config {config!r}: expected tiny or mid")
    pipeline.to(device)
    return DiffusionModel(config, pipeline, device=device, source=source), size


def interleaved_ms(
    runs: dict[str, tuple[int, Callable[[], Any]]], steps: int, repeats: int
) -> dict[str, float]:
    """Median ms per step of each run (threads, callable), the runs taken in turn each round
    so that a change in the machine's load hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, (threads, run) in runs.items():
            torch.set_num_threads(threads)
            elapsed = run().denoise_s
            if round_:
                times[name].append(elapsed)
    return {name: 1e3 * statistics.median(t) / steps for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,mid")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    parser.add_argument("--device", default="cpu", help="rank 0's device")
    parser.add_argument("--peer-device", default="cpu")
    args = parser.parse_args()
    print(machine_line())
    print(
        f"torch {torch.__version__}; {args.threads} CPU threads in all; "
        f"rank 0 on {args.device}, peer on {args.peer_device}; {args.steps} steps, "
        f"median of {args.repeats}"
    )
    half = max(1, args.threads // 2)
    config = LatentParallelConfig(peer_device=args.peer_device, peer_threads=half)
    header = (
        f"{'config':<6} {'params':>7} {'latent':>7} {'single T':>9} {'single 1':>9} "
        f"{'parallel':>9} {'speedup':>8} {'vs best':>8} {'peer wait':>9}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        group = LatentParallelGroup.start(config, model_device=args.device)
        try:
            for name in args.configs.split(","):
                model, size = load_model(name.strip(), Path(tmp), args.device)
                spec = GenerationSpec(PROMPT, height=size, width=size, steps=args.steps)
                group.prepare(model)
                before = group.stats()

                def single(m: DiffusionModel = model, s: GenerationSpec = spec) -> Any:
                    return m.denoise(s)

                def parallel(m: DiffusionModel = model, s: GenerationSpec = spec) -> Any:
                    return m.denoise(s, predictor=group.predictor(m))

                ms = interleaved_ms(
                    {
                        "single": (args.threads, single),
                        "one": (1, single),
                        "parallel": (half, parallel),
                    },
                    args.steps,
                    args.repeats,
                )
                after = group.stats()
                waited = after.peer_wait_s - before.peer_wait_s
                wait_ms = 1e3 * waited / max(after.steps - before.steps, 1)
                params = sum(p.numel() for p in model.pipeline.unet.parameters()) / 1e6
                latent = f"{size // 8}x{size // 8}"
                best = min(ms["single"], ms["one"])
                print(
                    f"{name:<6} {params:>6.1f}M {latent:>7} {ms['single']:>8.1f}ms "
                    f"{ms['one']:>8.1f}ms {ms['parallel']:>8.1f}ms "
                    f"{ms['single'] / ms['parallel']:>7.2f}x {best / ms['parallel']:>7.2f}x "
                    f"{wait_ms:>7.1f}ms"
                )
        finally:
            group.close()
    print(
        "speedup = single T / parallel; vs best = the faster single run / parallel.\n"
        "peer wait: per step, how long rank 0 waited for the peer after its own branch\n"
        f"(imbalance plus transfer). The two processes share the {args.threads} CPU threads\n"
        "of the single run (and the machine with whatever else runs on it), so a CPU speedup\n"
        "is bounded by what one batch of two leaves unused; Katz measures 1.36-1.71x on two\n"
        "GPUs (§9.5)."
    )


if __name__ == "__main__":
    main()
    print(load_line("end"))
