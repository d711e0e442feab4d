"""Latency per approximation level of the worker's pipelines.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_levels.py            # tiny models on this CPU
    PYTHONPATH=. .venv/bin/python benchmarks/bench_levels.py --worker   # + the full worker path
    PYTHONPATH=. python benchmarks/bench_levels.py --arch sdxl --size 1024 --device cuda \
        --dtype fp16                                                    # random SDXL on a GPU

Two tables:

* **denoise** (``DiffusionModel``): for every AC level the resumed run of N−K steps from a
  latent captured at K, and for every SM level a full run on its model; p50 and p90 of the
  encode + denoise + decode time, the p50 ratio of the denoise time to K = 0, and the
  (N−K)/N the paper predicts (§2.1).
* **worker** (``--worker``): the same levels through ``Worker.generate`` with the approximate
  cache on Qdrant Edge, so a hit pays prompt embedding, search and latent fetch too.

Levels are timed round robin: each repeat runs every level once, in turn, after one warm-up
run of each, so a busy spell of the (shared) machine slows every level alike instead of the
levels that happened to run then. Every model stays loaded for that (the worker holds one SM
variant at a time). CPU time (the process's) is printed beside wall time; the load average
at start and end says how busy the machine was.

``--arch sdxl|sd15`` builds full-size SDXL or SD-1.5 *architectures* with random weights
(``_fullsize.py``; the latency of a UNet does not depend on its weight values), for the GPU
device; ``gpu_profile.py`` measures every model of the profile that way.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _fullsize import build_pipeline
from _machine import load_line, machine_line

from argus.profiles import default_profiles
from argus.types import Strategy
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"


class Samples:
    """Wall and CPU seconds of one level's runs, and what the run itself reported."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.inner: list[float] = []

    def p(self, q: float, which: str = "wall") -> float:
        return float(np.percentile(getattr(self, which), q))


def round_robin(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Samples]:
    """One warm-up run of each, then ``repeats`` rounds that run each once, in turn."""
    for run in runs.values():
        run()
    samples = {name: Samples() for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            inner = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples[name].wall.append(time.perf_counter() - wall)
            samples[name].cpu.append(time.process_time() - cpu)
            samples[name].inner.append(float(inner or 0.0))
    return samples


def denoise_table(args: argparse.Namespace) -> None:
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    profiles = default_profiles()
    spec = GenerationSpec(PROMPT, seed=1, height=args.size, width=args.size, steps=args.steps)
    models: dict[str, DiffusionModel] = {}

    def model(name: str) -> DiffusionModel:
        if name not in models:
            if args.arch == "tiny":
                pipe = build_tiny_pipeline(TINY_PREFIX + name).to(args.device, dtype)
            else:
                full = "sdxl" if args.arch == "sdxl" and name == "sdxl" else "sd-1.5"
                pipe = build_pipeline(full, device=args.device, dtype=dtype)
            models[name] = DiffusionModel(name, pipe, device=args.device, source=args.arch)
        return models[name]

    base = model("sdxl")
    steps = sorted({lv.skip_steps for lv in profiles.levels_for(Strategy.AC)} - {0})
    captured = base.denoise(spec, capture=steps).captured

    def resumed_run(m: DiffusionModel, k: int) -> Callable[[], float]:
        """Denoise from the latent captured at step K (all N steps at K = 0), then decode."""

        def run() -> float:
            start = captured.get(k) if k else None
            result = m.denoise(spec, start_latents=start, start_step=k)
            m.decode(result.latents)
            return result.denoise_s

        return run

    runs: dict[str, Callable[[], Any]] = {}
    for level in profiles.levels:
        if args.arch != "tiny" and level.model not in ("sdxl", "sd-1.5"):
            continue  # full-size architectures: the SDXL base and SD-1.5 only
        if level.skip_steps >= args.steps:
            continue

        runs[level.name] = resumed_run(model(level.model), level.skip_steps)
    samples = round_robin(runs, args.repeats)
    print(f"\ndenoise + decode, {args.arch} models, {args.size}px, N={args.steps}, "
          f"{args.device}/{args.dtype}, {args.repeats} rounds over the levels")  # fmt: skip
    print(f"{'level':<12}{'model':<10}{'steps':>6}{'p50 ms':>9}{'p90 ms':>9}{'CPU p50':>9}"
          f"{'denoise p50':>12}{'ratio':>7}{'(N-K)/N':>9}")  # fmt: skip
    reference = None
    by_name = {level.name: level for level in profiles.levels}
    for name, got in samples.items():
        level = by_name[name]
        denoise = got.p(50, "inner")
        reference = reference or denoise
        k = level.skip_steps
        print(f"{name:<12}{level.model:<10}{args.steps - k:>6}{got.p(50) * 1e3:>9.1f}"
              f"{got.p(90) * 1e3:>9.1f}{got.p(50, 'cpu') * 1e3:>9.1f}{denoise * 1e3:>12.1f}"
              f"{denoise / reference:>7.2f}{(args.steps - k) / args.steps:>9.2f}")  # fmt: skip


def worker_table(args: argparse.Namespace) -> None:
    from argus.worker.app import WorkerSettings, build_worker
    from argus.worker.engine import GenerateCall

    with tempfile.TemporaryDirectory() as cache_dir:
        worker = build_worker(
            WorkerSettings(
                model="tiny",
                device=args.device,
                cache_dir=cache_dir,
                default_size=args.size,
                default_steps=args.steps,
            )
        )
        levels = default_profiles().levels_for(Strategy.AC)
        for i in range(20):  # fill the cache with other prompts
            worker.generate(GenerateCall(f"{PROMPT}, variation {i}", seed=i, level="ac-k0"))
        worker.flush()
        results: dict[str, list[Any]] = {level.name: [] for level in levels}

        def make_run(name: str) -> Callable[[], None]:
            def run() -> None:
                call = GenerateCall(PROMPT + "!", seed=99, level=name)
                results[name].append(worker.generate(call))

            return run

        samples = round_robin({lv.name: make_run(lv.name) for lv in levels}, args.repeats)
        print(f"\nthrough Worker.generate (embed + Qdrant Edge search + fetch + denoise + PNG), "
              f"tiny, {args.size}px, N={args.steps}, {args.repeats} rounds")  # fmt: skip
        print(f"{'level':<10}{'p50 ms':>9}{'p90 ms':>9}{'CPU p50':>9}{'search ms':>11}"
              f"{'fetch ms':>10}{'hit':>6}")  # fmt: skip
        for name, got in samples.items():
            last = results[name][-1]
            print(f"{name:<10}{got.p(50) * 1e3:>9.1f}{got.p(90) * 1e3:>9.1f}"
                  f"{got.p(50, 'cpu') * 1e3:>9.1f}{last.timing_ms.get('search_ms', 0):>11.2f}"
                  f"{last.timing_ms.get('fetch_ms', 0):>10.2f}{last.cache.value:>6}")  # fmt: skip
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="tiny", choices=("tiny", "sdxl", "sd15"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=10, help="rounds over the levels")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16"))
    parser.add_argument("--worker", action="store_true", help="also time the full worker path")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(machine_line())
    denoise_table(args)
    if args.worker:
        worker_table(args)
    print(load_line("end"))


if __name__ == "__main__":
    main()
