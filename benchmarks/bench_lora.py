"""LoRA serving latency: no LoRA vs bounded asynchronous loading (BAL) vs synchronous loading.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_lora.py --threads 1       # tiny SDXL, CPU
    PYTHONPATH=. .venv/bin/python benchmarks/bench_lora.py --threads 1 --rank 512 --targets all \
        --bound 10                                                           # a 27 MiB LoRA

Every request loads its LoRA cold (the loader's cache is off) through the real loader
processes and shared memory, on one tiny model with a seeded random LoRA written for it:

* **none**: the denoising run alone (text encoding + N steps);
* **BAL**: the request asks for the LoRA and starts denoising at once; the LoRA is merged at
  the first step boundary after it is loaded, at the latest at step K; the base weights are
  restored after the last step. Katz's target: no visible overhead when loading fits in K
  steps (§6, §9.4);
* **sync**: load, merge, then denoise (then restore), as a serving system without BAL does.

Rounds interleave the three so drift on a shared machine hits them alike; the table shows the
median and the fastest round, each with its overhead over "none". The loader processes start
before the first round (``warm``); their start-up (seconds: each imports torch) is reported
apart. ``--threads 1`` keeps the tiny model's torch on one core (on two shared cores more
threads mostly wait for each other) and leaves the other to the loader: BAL can only hide a
load behind denoising where a core (or, on a GPU host, the CPU as a whole) is free for it.
The merge runs between steps in both BAL and sync, so it is overhead either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from _machine import load_line, machine_line

from argus.worker.adapters.lora import (
    LoadedLora,
    LoraConfig,
    LoraLibrary,
    LoraLoader,
    LoraRequest,
    LoraSession,
    PendingLora,
    write_tiny_lora,
)
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec
from argus.worker.models.sources import TINY_PREFIX, build_tiny_pipeline

PROMPT = "an owl standing on a wire, papercut style"
TARGET_SETS = {
    "attn": ("to_q", "to_k", "to_v", "to_out.0"),
    "all": ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj",
            "ff.net.2", "conv1", "conv2"),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="sdxl", help="tiny variant")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--bound", type=int, help="K (default: 20%% of the steps, as 10 of 50)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--targets", choices=sorted(TARGET_SETS), default="attn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=1, help="loader processes")
    parser.add_argument("--niceness", type=int, default=LoraConfig.niceness, help="of loaders")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, help="torch threads of the serving process (default: torch's)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    return parser.parse_args()


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    out = run()
    return time.perf_counter() - began, out


def main() -> None:
    args = parse_args()
    print(machine_line())
    if args.threads:
        torch.set_num_threads(args.threads)
    bound = args.bound if args.bound is not None else max(1, round(0.2 * args.steps))
    source = TINY_PREFIX + args.variant
    model = DiffusionModel(
        args.variant, build_tiny_pipeline(source).to(args.device), device=args.device, source=source
    )
    unet = model.pipeline.unet
    spec = GenerationSpec(PROMPT, seed=0, height=args.size, width=args.size, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="argus-bench-lora-") as root:
        targets = TARGET_SETS[args.targets]
        file = Path(root) / "style.safetensors"
        path = write_tiny_lora(model, file, rank=args.rank, targets=targets)
        size_mib = path.stat().st_size / 2**20
        config = LoraConfig(
            processes=args.processes, cache_items=0, bound=bound, niceness=args.niceness
        )
        loader = LoraLoader(LoraLibrary(root), config)
        start_s, _ = timed(loader.warm)
        try:
            figures = measure(model, unet, spec, loader, bound, args.rounds)
        finally:
            loader.close()
    report(args, bound, size_mib, start_s, figures)


def measure(
    model: DiffusionModel,
    unet: torch.nn.Module,
    spec: GenerationSpec,
    loader: LoraLoader,
    bound: int,
    rounds: int,
) -> dict[str, Any]:
    requests = [LoraRequest("style", 1.0)]
    lat: dict[str, list[float]] = {"none": [], "bal": [], "sync": []}
    bal_stats = []
    sync_load, sync_merge = [], []

    def none() -> None:
        model.denoise(spec)

    def bal() -> LoraSession:
        with loader.open_session(unet, requests, steps=spec.steps, lock=model.lock) as session:
            model.denoise(spec, before_step=[session.before_step], hooks=[session.after_step])
        return session

    def sync() -> tuple[float, LoraSession]:
        load_s, lora = timed(lambda: loader.load("style").result())
        loaded: Future[LoadedLora] = Future()
        loaded.set_result(lora)
        pending = [PendingLora(requests[0], loaded, 0.0)]
        session = LoraSession(unet, pending, steps=spec.steps, bound=0, lock=model.lock)
        with session:
            session.before_step(0)  # merge before denoising starts
            model.denoise(spec, before_step=[session.before_step], hooks=[session.after_step])
        return load_s, session

    for warmup in (none, bal, sync):  # first calls pay allocator and kernel warm-up
        warmup()
    for _ in range(rounds):
        seconds, _ = timed(none)
        lat["none"].append(seconds)
        seconds, session = timed(bal)
        lat["bal"].append(seconds)
        bal_stats.append(session.stats)
        seconds, (load_s, session) = timed(sync)
        lat["sync"].append(seconds)
        sync_load.append(load_s)
        sync_merge.append(session.stats.loras[0].merge_s)
    loras = [s.loras[0] for s in bal_stats]
    return {
        "latency_s": {k: statistics.median(v) for k, v in lat.items()},
        "latency_min_s": {k: min(v) for k, v in lat.items()},
        "bal_load_s": statistics.median(r.load_s for r in loras),
        "bal_read_s": statistics.median(r.read_s for r in loras),
        "bal_merge_s": statistics.median(r.merge_s for r in loras),
        "bal_wait_s": statistics.median(r.wait_s for r in loras),
        "bal_merge_steps": sorted({r.merge_step for r in loras}),
        "bal_waited": sum(s.waited for s in bal_stats),
        "restore_s": statistics.median(s.restore_s for s in bal_stats),
        "sync_load_s": statistics.median(sync_load),
        "sync_merge_s": statistics.median(sync_merge),
        "rounds": rounds,
    }


def report(
    args: argparse.Namespace, bound: int, size_mib: float, start_s: float, f: dict[str, Any]
) -> None:
    lat, fastest = f["latency_s"], f["latency_min_s"]
    base = lat["none"]
    print(
        f"model tiny:{args.variant} on {args.device}, {args.steps} steps at {args.size} px, "
        f"K = {bound}; LoRA rank {args.rank} on {args.targets} modules, {size_mib:.2f} MiB; "
        f"{args.processes} loader process(es) at nice +{args.niceness}, "
        f"started in {start_s:.2f} s; "
        f"{torch.get_num_threads()} torch threads; {f['rounds']} rounds"
    )
    step_ms = base / args.steps * 1e3
    print(f"{'run':6} {'p50 ms':>9} {'overhead':>9} {'min ms':>9} {'overhead':>9}")
    for name, label in (("none", "none"), ("bal", "BAL"), ("sync", "sync")):
        over = (lat[name] / base - 1) * 100
        over_min = (fastest[name] / fastest["none"] - 1) * 100
        print(
            f"{label:6} {lat[name] * 1e3:9.1f} {over:8.1f}% "
            f"{fastest[name] * 1e3:9.1f} {over_min:8.1f}%"
        )
    print(
        f"BAL: load {f['bal_load_s'] * 1e3:.1f} ms (read in loader {f['bal_read_s'] * 1e3:.1f} ms)"
        f" ≈ {f['bal_load_s'] * 1e3 / step_ms:.1f} steps of {step_ms:.1f} ms; merged at step(s) "
        f"{f['bal_merge_steps']}; waited at the bound in {f['bal_waited']}/{f['rounds']} rounds "
        f"(median wait {f['bal_wait_s'] * 1e3:.1f} ms); merge {f['bal_merge_s'] * 1e3:.1f} ms, "
        f"restore {f['restore_s'] * 1e3:.1f} ms"
    )
    print(
        f"sync: load {f['sync_load_s'] * 1e3:.1f} ms + merge {f['sync_merge_s'] * 1e3:.1f} ms "
        "before the first step"
    )
    bal_over = (lat["bal"] / base - 1) * 100
    sync_over = (lat["sync"] / base - 1) * 100
    verdict = "meets" if bal_over <= 10 else "misses"
    print(
        f"BAL overhead over no LoRA: {bal_over:.1f}% (p50; {verdict} the ≤ 10% target); "
        f"synchronous loading: {sync_over:.1f}%"
    )
    if args.json is not None:
        payload = {"machine": machine_line(), "args": vars(args) | {"json": str(args.json)}, **f}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
    print(load_line("end"))
