"""The worker's denoising loop with the UNet step replayed from CUDA graphs, against eager.

On a GPU, from the repository root::

    PYTHONPATH=. python benchmarks/bench_cuda_graphs.py --models sdxl,sd-1.5 --steps 30

For each model (full size, random weights, ``benchmarks/_fullsize.py``) it times whole images
through :class:`~argus.worker.models.pipelines.DiffusionModel` (encode, N steps, VAE decode), first
eager and then with :meth:`DiffusionModel.use_cuda_graphs`: the first graphed run pays the
capture. It prints the medians, the speed-up, and the largest difference between the two
runs' final latents for one seed. A replay runs the same kernels on the same inputs, so the
two should agree to the bit or very nearly. CUDA only.

Measured 2026-11-27 on an NVIDIA H200 (torch 2.11.0+cu130, fp16, N = 30, medians of 3, one
warm-up; ``docs/gpu/h200-cuda-graphs.log``):

    sdxl 1024px: eager 2.852 s, graphed 1.439 s, speed-up 1.98x; first graphed run 1.827 s
    sd-1.5 512px: eager 0.813 s, graphed 0.393 s, speed-up 2.07x; first graphed run 0.523 s
    (one graph each, 120 replays; the final latents identical to the bit)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fullsize import build_pipeline, native_size

from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"


def timed_runs(
    model: DiffusionModel, spec: GenerationSpec, repeats: int
) -> tuple[list[float], torch.Tensor]:
    """Seconds of ``repeats`` whole images, and the last run's final latents."""
    seconds = []
    latents = torch.empty(0)
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        result = model.denoise(spec)
        model.decode(result.latents)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
        latents = result.latents.float().cpu()
    return seconds, latents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sdxl,sd-1.5")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-graphs", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, fp16, N = {args.steps}")
    for name in args.models.split(","):
        size = native_size(name, tiny=False)
        pipe = build_pipeline(name, device="cuda", dtype=torch.float16)
        model = DiffusionModel(name, pipe, device="cuda", source=f"full:{name}")
        spec = GenerationSpec(PROMPT, seed=3, height=size, width=size, steps=args.steps)
        timed_runs(model, spec, 1)  # warm-up
        eager, eager_latents = timed_runs(model, spec, args.repeats)
        model.use_cuda_graphs(args.max_graphs)
        first, _ = timed_runs(model, spec, 1)
        graphed, graphed_latents = timed_runs(model, spec, args.repeats)
        assert model.graphs is not None
        diff = (eager_latents - graphed_latents).abs().max().item()
        e, g = statistics.median(eager), statistics.median(graphed)
        print(
            f"{name} {size}px: eager {e:.3f} s, graphed {g:.3f} s, speed-up {e / g:.2f}x; "
            f"first graphed run {first[0]:.3f} s (capture); graphs {len(model.graphs)}, "
            f"replays {model.graphs.replays}; max |latent diff| {diff:.3g}"
        )
        del model, pipe
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
