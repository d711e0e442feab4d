"""Measure the profile on the GPU at hand: every level's latency, the cache path, the adapters.

Run from the repository root on a machine with an NVIDIA GPU::

    PYTHONPATH=. python benchmarks/gpu_profile.py --device cuda --out gpu-out

and on a CPU, the same code on the worker's tiny variants (what the test runs)::

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_profile.py --tiny --out /tmp/gpu-out

It builds the profile's models at full size with random weights (``benchmarks/_fullsize.py``:
SDXL base at 1024 px, SD-2.x, SD-1.5, Small-SD and Tiny-SD at 512 px; a model's latency does
not depend on its weights' values) and measures, in order of importance, as long as
``--budget-s`` lasts:

1. per model: weights and peak memory, the text encoders, one UNet step and one VAE decode at
   batch 1, 2, 4 and 8 (classifier-free guidance doubles the UNet's batch), a whole image at
   batch 1 through the worker's own ``DiffusionModel`` (N = 50 steps), and on SDXL and SD-1.5
   the UNet step replayed from a CUDA graph;
2. on SDXL: the approximate cache, the run resumed at every K of the profile from a latent
   captured at K, against (N - K) / N (Argus §2.1), and the latent's fetch to the device; a
   rank-64 LoRA's read, copy and patch and an SDXL ControlNet's added time per step
   (``_gpu_adapters.py``, the worker's own LoRA and ControlNet code);
3. with ``--worker``, the worker's whole path: in process (``_gpu_worker.py``: cache miss,
   hit at K, an SM level, a LoRA, a ControlNet, timed per stage), or with ``--worker-via cli``
   through ``python -m argus worker`` processes and gRPC with their defaults
   (``_gpu_cli_worker.py``: SDXL plain, with a LoRA, with a ControlNet, an inpainting edit
   recorded, replayed and with the cache off, hits at K, the SM variants; ``--worker-args``
   passes flags on to the workers), under the key ``worker_cli``;
4. each model's load from a local diffusers directory (the worker's loader);
5. ``torch.compile`` on the UNets named by ``--compile`` (the first call takes minutes).

``--floor-only`` measures only the first item's floors: the guided UNet step replayed from a
CUDA graph (on a CPU, the eager step at batch 1), and for SDXL the same step with one
ControlNet captured with it, which the summary divides the plain and LoRA steps and the
ControlNet step by.

Everything lands in ``OUT/gpu_profile.json`` as it is measured (a run cut short keeps what
it had; SIGTERM stops the worker processes first); ``--write-profile FILE`` and
``--write-markdown FILE`` turn that JSON into the profile ``argus plan --profiles FILE`` reads
and the tables of ``docs/gpu.md``, here or later (``--from-json``, given again to merge the
JSONs of several runs). The profile takes its figures from the CLI path where it measured
them (:func:`cli_figures`), else from the in-process runs. The markdown opens with the
summary of :func:`summary_lines` (:func:`read_summary` reads it back); ``--edit-share-json``
names a ``bench_editing.py`` JSON whose ``s`` (the transformer blocks' share of a step) gives
the edit's bound. ``benchmarks/gpu_device_check.sh`` runs it all on a GPU in one go.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fullsize import ARCHS, build_pipeline, modules, native_size, param_counts
from _machine import drop_page_cache

from argus.profiles import default_profiles
from argus.types import Strategy
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"
# the SM models in the profile's order; sd-1.4 has SD-1.5's architecture and takes its figures
MODELS = ("sdxl", "sd-2.0", "sd-1.5", "small-sd", "tiny-sd")
GIB = 1024**3

# the papers' figures, for the table beside ours
# Argus Table 2 (A100): latency s, load s (Accelerate), memory GB; §5.1: SDXL 4.2 s at N = 50
PAPER_T2 = {
    "sdxl": (4.20, 9.42, 5.14),
    "sd-1.5": (3.84, 5.56, 3.44),
    "small-sd": (2.75, 4.86, 2.32),
    "tiny-sd": (2.18, 2.91, 0.63),
}
# KATZ (H800, SDXL 1024 px, 50 steps): base 2.9 s; +1 ControlNet 4.5 s (§3.3); LoRA load and
# patch > 1 s in Diffusers, 230 ms in KATZ with BAL (§7), a 341 MiB LoRA
KATZ = {"base_s": 2.9, "controlnet_s": 4.5, "lora_diffusers_s": 1.0, "lora_katz_s": 0.23}


class Clock:
    """Wall time of GPU work: synchronises the device before reading the clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
        """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - start)
        return out


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class Run:
    """The measurements so far, written to ``OUT/gpu_profile.json`` after each step, and the
    time budget the sections draw on."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.data: dict[str, Any] = {"models": {}, "skipped": []}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "gpu_profile.json").write_text(json.dumps(self.data, indent=1, default=str))

    def section(self, name: str, need_s: float, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` if at least ``need_s`` seconds are left; record a failure, don't die."""
        if self.left() < need_s:
            self.data["skipped"].append(f"{name}: {self.left():.0f} s left, needs {need_s:.0f}")
            print(f"[skip] {name}", flush=True)
            return None
        began = time.monotonic()
        try:
            result = fn()
        except Exception as exc:  # a section that breaks on this GPU must not lose the others
            self.data["skipped"].append(f"{name}: {type(exc).__name__}: {exc}"[:500])
            print(f"[fail] {name}: {type(exc).__name__}: {exc}", flush=True)
            result = None
        finally:
            free_memory()
        print(f"[done] {name} in {time.monotonic() - began:.1f} s", flush=True)
        self.save()
        return result


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: str) -> dict[str, Any]:
    import diffusers

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            multiprocessors=props.multi_processor_count,
        )
    else:
        env["gpu"] = f"none (CPU: {platform.machine()})"
    return env


def worker_class(env: dict[str, Any]) -> str:
    """``h100`` for an "NVIDIA H100 80GB HBM3", ``cpu`` without a GPU."""
    gpu = str(env.get("gpu", ""))
    for word in gpu.replace("-", " ").split():
        if word[:1].upper() in "HABLV" and any(c.isdigit() for c in word):
            return word.lower()
    return "cpu"


# -- the UNet and VAE alone, at batch b --------------------------------------------------------


def unet_inputs(pipe: Any, batch: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random inputs of one guided UNet step at ``batch`` images (2 × batch rows: CFG)."""
    unet = pipe.unet
    device, dtype = unet.device, unet.dtype
    rows = 2 * batch
    side = size // int(pipe.vae_scale_factor)
    sample = torch.randn(rows, unet.config.in_channels, side, side, device=device, dtype=dtype)
    timestep = torch.tensor(500, device=device)
    context = torch.randn(rows, 77, unet.config.cross_attention_dim, device=device, dtype=dtype)
    kwargs: dict[str, Any] = {"return_dict": False}
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.config.projection_class_embeddings_input_dim - (
            6 * unet.config.addition_time_embed_dim
        )
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(rows, pooled, device=device, dtype=dtype),
            "time_ids": torch.randn(rows, 6, device=device, dtype=dtype),
        }
    return (sample, timestep, context), kwargs


def batch_table(
    pipe: Any, clock: Clock, size: int, batches: tuple[int, ...], repeats: int
) -> dict[str, dict[str, float]]:
    """ms of one UNet step and of one VAE decode per batch size (None where memory ran out)."""
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for batch in batches:
            out[str(batch)] = _batch_row(pipe, clock, size, batch, repeats)
            free_memory()
    return out


def _batch_row(pipe: Any, clock: Clock, size: int, batch: int, repeats: int) -> dict[str, float]:
    args, kwargs = unet_inputs(pipe, batch, size)
    latents = torch.randn_like(args[0][:batch])
    row: dict[str, float] = {}
    try:
        row["unet_step_ms"] = median_ms(clock.time(lambda: pipe.unet(*args, **kwargs), repeats))
        row["vae_decode_ms"] = median_ms(
            clock.time(lambda: pipe.vae.decode(latents, return_dict=False), repeats)
        )
    except torch.OutOfMemoryError:
        row["oom"] = 1.0
    return row


def eager_and_graphed(step: Callable[[], Any], clock: Clock, repeats: int) -> dict[str, float]:
    """``step``'s median time eager and, on CUDA, replayed from a graph captured after three
    warm-up calls on a side stream (PyTorch's recipe): ``eager_ms``, ``cuda_graph_ms`` and
    ``speedup``."""
    out: dict[str, float] = {}
    with torch.inference_mode():
        out["eager_ms"] = median_ms(clock.time(step, repeats, warmup=3))
        if clock.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out["cuda_graph_ms"] = median_ms(clock.time(graph.replay, repeats, warmup=3))
            out["speedup"] = out["eager_ms"] / out["cuda_graph_ms"]
    return out


def graphed_step(pipe: Any, clock: Clock, size: int, repeats: int) -> dict[str, float]:
    """The guided UNet step at batch 1, eager against a captured CUDA graph replayed."""
    args, kwargs = unet_inputs(pipe, 1, size)
    return eager_and_graphed(lambda: pipe.unet(*args, **kwargs), clock, repeats)


def controlnet_step(pipe: Any, clock: Clock, size: int, repeats: int) -> dict[str, float]:
    """The guided UNet step at batch 1 with one ControlNet (random weights, the worker's call:
    the control image repeated over both CFG rows, its residuals into the UNet), eager and,
    on CUDA, as one captured graph: the floor a ControlNet step is compared with."""
    from _gpu_adapters import random_controlnet

    args, kwargs = unet_inputs(pipe, 1, size)
    sample, timestep, context = args
    unet = pipe.unet
    net = random_controlnet(unet, device=str(unet.device), dtype=unet.dtype)
    image = torch.rand(sample.shape[0], 3, size, size, device=unet.device, dtype=unet.dtype)
    added = kwargs.get("added_cond_kwargs")

    def step() -> Any:
        down, mid = net(
            sample, timestep, encoder_hidden_states=context, controlnet_cond=image,
            conditioning_scale=1.0, added_cond_kwargs=added, return_dict=False,
        )  # fmt: skip
        return unet(
            sample, timestep, encoder_hidden_states=context, added_cond_kwargs=added,
            down_block_additional_residuals=down, mid_block_additional_residual=mid,
            return_dict=False,
        )  # fmt: skip

    return eager_and_graphed(step, clock, repeats)


def compiled_step(pipe: Any, clock: Clock, size: int, repeats: int) -> dict[str, float]:
    """The guided UNet step at batch 1, eager against ``torch.compile`` (inductor, default
    mode), and what the first compiled call cost."""
    args, kwargs = unet_inputs(pipe, 1, size)
    with torch.inference_mode():
        eager = median_ms(clock.time(lambda: pipe.unet(*args, **kwargs), repeats, warmup=2))
        compiled = torch.compile(pipe.unet)
        start = time.perf_counter()
        compiled(*args, **kwargs)
        clock.sync()
        first = time.perf_counter() - start
        steady = median_ms(clock.time(lambda: compiled(*args, **kwargs), repeats, warmup=2))
    return {"eager_ms": eager, "compiled_ms": steady, "speedup": eager / steady, "compile_s": first}


# -- the worker's own model path ---------------------------------------------------------------


def image_latency(
    model: DiffusionModel, clock: Clock, spec: GenerationSpec, repeats: int
) -> dict[str, float]:
    """One image at batch 1 through ``DiffusionModel``: text encode, N steps, decode."""

    def whole() -> None:
        model.decode(model.denoise(spec).latents)

    def encode() -> None:
        with torch.inference_mode():
            model.encode(spec)

    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    whole_s = clock.time(whole, repeats)
    peak = torch.cuda.max_memory_allocated() / GIB if clock.cuda else 0.0
    return {
        "latency_s": statistics.median(whole_s),
        "latency_min_s": min(whole_s),
        "encode_ms": median_ms(clock.time(encode, max(3, repeats))),
        "peak_gib": peak,
        "runs": len(whole_s),
    }


def cache_levels(
    model: DiffusionModel, clock: Clock, spec: GenerationSpec, repeats: int
) -> dict[str, dict[str, float]]:
    """The AC levels: the run resumed at K from a latent captured at K (denoise + decode),
    its ratio to K = 0 and the paper's (N - K) / N; and the latent's copy to the device."""
    ks = sorted({lv.skip_steps for lv in default_profiles().levels_for(Strategy.AC)})
    ks = [k for k in ks if k < spec.steps]
    captured = model.denoise(spec, capture=[k for k in ks if k]).captured
    out: dict[str, dict[str, float]] = {}
    for k in ks:
        start = captured.get(k) if k else None

        steps_run: list[int] = []

        def run(start: Any = start, k: int = k, steps_run: list[int] = steps_run) -> None:
            result = model.denoise(spec, start_latents=start, start_step=k)
            steps_run.append(result.steps_run)
            model.decode(result.latents)

        seconds = statistics.median(clock.time(run, repeats))
        out[str(k)] = {"latency_s": seconds, "steps_run": steps_run[-1]}
    base = out[str(ks[0])]["latency_s"]
    for k in ks:
        row = out[str(k)]
        row["ratio"] = row["latency_s"] / base
        row["paper_ratio"] = (spec.steps - k) / spec.steps
    if captured:
        latent = next(iter(captured.values())).pin_memory() if clock.cuda else captured[ks[1]]
        fetch = clock.time(lambda: latent.to(model.device, model.dtype), 20, warmup=3)
        out["fetch"] = {
            "latent_kib": latent.numel() * latent.element_size() / 1024,
            "to_device_ms": median_ms(fetch),
        }
    return out


def load_time(name: str, pipe: Any, clock: Clock, dtype: torch.dtype, device: str) -> float:
    """Seconds the worker's loader takes from a local diffusers directory to the device (the
    directory written just before, its files dropped from the page cache)."""
    from argus.worker.models.sources import load_pipeline_dir

    with tempfile.TemporaryDirectory(prefix=f"argus-{name}-") as folder:
        pipe.save_pretrained(folder, safe_serialization=True)
        drop_page_cache(Path(folder))
        start = time.perf_counter()
        loaded = load_pipeline_dir(folder, dtype).to(device)
        clock.sync()
        seconds = time.perf_counter() - start
        del loaded
    return seconds


# -- the whole run -----------------------------------------------------------------------------


def profile_model(name: str, args: argparse.Namespace, run: Run, clock: Clock) -> None:
    dtype = DTYPES[args.dtype]
    size = native_size(name, args.tiny)
    before = torch.cuda.memory_allocated() if clock.cuda else 0
    start = time.perf_counter()
    pipe = build_pipeline(name, device=args.device, dtype=dtype, tiny=args.tiny)
    clock.sync()
    entry: dict[str, Any] = {
        "size": size,
        "steps": args.steps,
        "build_s": time.perf_counter() - start,
        "params_m": {k: v / 1e6 for k, v in param_counts(pipe).items()},
    }
    if clock.cuda:
        entry["weights_gib"] = (torch.cuda.memory_allocated() - before) / GIB
    else:
        weights = (p for m in modules(pipe).values() for p in m.parameters())
        entry["weights_gib"] = sum(p.numel() * p.element_size() for p in weights) / GIB
    run.data["models"][name] = entry
    if args.floor_only:
        if clock.cuda:
            entry["cuda_graph"] = run.section(
                f"cuda graph {name}", 15, lambda: graphed_step(pipe, clock, size, 10)
            )
        else:  # no CUDA graph on a CPU: the eager step stands in for the floor, measured
            # twice since the first round also pays the CPU kernels' first calls
            batch_table(pipe, clock, size, (1,), 1)
            entry["batches"] = batch_table(pipe, clock, size, (1,), max(5, args.repeats))
        if name == "sdxl":
            repeats = 10 if clock.cuda else max(5, args.repeats)
            entry["controlnet_graph"] = run.section(
                f"controlnet graph {name}", 25, lambda: controlnet_step(pipe, clock, size, repeats)
            )
        return
    model = DiffusionModel(name, pipe, device=args.device, source=f"full:{name}")
    spec = GenerationSpec(PROMPT, seed=1, height=size, width=size, steps=args.steps)
    entry["image"] = image_latency(model, clock, spec, args.repeats)
    run.save()
    entry["batches"] = batch_table(pipe, clock, size, args.batches, args.repeats)
    run.save()
    if name == "sdxl":
        run.data["cache"] = run.section(
            "ac levels", 20, lambda: cache_levels(model, clock, spec, max(2, args.repeats - 1))
        )
        run.data["adapters"] = run.section(
            "adapters", 40, lambda: adapters(pipe, args, size, Path(args.out))
        )
    if clock.cuda and name in ("sdxl", "sd-1.5"):
        entry["cuda_graph"] = run.section(
            f"cuda graph {name}", 15, lambda: graphed_step(pipe, clock, size, 10)
        )


def later_pass(name: str, args: argparse.Namespace, run: Run, clock: Clock, what: str) -> None:
    """The costly sections, once every model has its basic figures: the load from a
    directory (``load``) or ``torch.compile`` (``compile``), on a freshly built model."""
    dtype = DTYPES[args.dtype]
    entry = run.data["models"].get(name)
    if entry is None:
        return
    pipe = build_pipeline(name, device=args.device, dtype=dtype, tiny=args.tiny)
    if what == "load":
        entry["load_s"] = load_time(name, pipe, clock, dtype, args.device)
    else:
        entry["compile"] = compiled_step(pipe, clock, entry["size"], 10)
    del pipe


def adapters(pipe: Any, args: argparse.Namespace, size: int, out: Path) -> dict[str, Any]:
    from _gpu_adapters import controlnet_cost, lora_cost

    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="argus-lora-") as folder:
        lora = lora_cost(pipe, device=args.device, dtype=dtype, rank=64, workdir=Path(folder))
    free_memory()
    control = controlnet_cost(pipe, device=args.device, dtype=dtype, size=size)
    return {"lora": lora, "controlnet": control}


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def worker_cli(args: argparse.Namespace, run: Run) -> None:
    """The worker's default path through ``argus worker`` processes and gRPC; its report
    lands in ``run.data["worker_cli"]`` after every case (:mod:`_gpu_cli_worker`)."""
    import shlex

    from _gpu_cli_worker import CliPlan, cli_path

    def save(report: dict[str, Any]) -> None:
        run.data["worker_cli"] = report
        run.save()

    with tempfile.TemporaryDirectory(prefix="argus-cli-") as folder:
        plan = CliPlan(
            device=args.device,
            dtype_name=args.dtype,
            tiny=args.tiny,
            workdir=Path(folder),
            steps=args.worker_steps or args.steps,
            sm_steps=args.steps,
            repeats=args.worker_repeats,
            sm_models=args.worker_sm_models,
            edit_ratio=args.edit_ratio,
            worker_args=tuple(shlex.split(args.worker_args)),
        )
        cli_path(plan, time_left=run.left, save=save)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from _gpu_worker import install_minilm_stub

    install_minilm_stub()  # the tokenizer's files where the MiniLM package is not installed
    run = Run(Path(args.out), args.budget_s)
    clock = Clock(args.device)
    run.data["env"] = environment(args.device)
    run.data["settings"] = {
        "dtype": args.dtype,
        "steps": args.steps,
        "batches": list(args.batches),
        "repeats": args.repeats,
        "tiny": args.tiny,
    }
    print(json.dumps(run.data["env"]), flush=True)
    run.save()
    for name in args.models:
        run.section(f"model {name}", 30 if name == "sdxl" else 12,
                    lambda name=name: profile_model(name, args, run, clock))  # fmt: skip
    if args.worker and args.worker_via == "cli":
        run.section("worker cli", 60, lambda: worker_cli(args, run))
    elif args.worker:

        def worker() -> Any:
            from _gpu_worker import worker_path

            with tempfile.TemporaryDirectory(prefix="argus-worker-") as folder:
                return worker_path(
                    device=args.device,
                    dtype_name=args.dtype,
                    tiny=args.tiny,
                    workdir=Path(folder),
                    steps=args.worker_steps or args.steps,
                    repeats=args.worker_repeats,
                )

        run.data["worker"] = run.section("worker path", 60, worker)
    if not args.no_load:
        for name in args.models:
            run.section(f"load {name}", 60 if name == "sdxl" else 25,
                        lambda name=name: later_pass(name, args, run, clock, "load"))  # fmt: skip
    for name in args.compile:
        run.section(f"compile {name}", 150,
                    lambda name=name: later_pass(name, args, run, clock, "compile"))  # fmt: skip
    run.save()
    return run.data


# -- what the measurements become --------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (format(value, spec))
    )


def ac_fit(cache: dict[str, Any], steps: int) -> tuple[float, float] | None:
    """Least squares of the resumed runs' latency on the steps they run: ``fixed`` seconds
    (encode, decode, image) plus ``per_step`` × (N − K), Argus §2.1's model with the fixed
    part it leaves out; neither part below zero (noisy points can tilt a free line below the
    origin: then the line through it). None with fewer than two K."""
    points = [(steps - int(k), row["latency_s"]) for k, row in cache.items() if k != "fetch"]
    return line_fit(points)


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """:func:`ac_fit`'s line through (steps run, seconds) points: ``(fixed, per_step)``, both
    non-negative; None with fewer than two distinct step counts."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    per_step = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    fixed = mean_y - per_step * mean_x
    if fixed < 0.0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return fixed, max(per_step, 0.0)


def level_figures(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Latency, load seconds and memory of every level of the default profile: the CLI
    path's figures where it measured them (:func:`cli_figures`), else the in-process ones
    (:func:`process_figures`); a figure neither measured is absent."""
    out = process_figures(data)
    for name, got in cli_figures(data).items():
        out[name] = {**out.get(name, {}), **got}
    return out


def process_figures(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The in-process measurements' figures: AC at K from the line fitted to the resumed runs
    (:func:`ac_fit`: one run per K is too noisy to order the levels on a host-bound GPU) plus
    the measured latent fetch, SM from each model's whole image; SD-1.4 takes SD-1.5's
    figures (same architecture)."""
    models = data["models"]
    cache = data.get("cache") or {}
    fetch_s = (cache.get("fetch") or {}).get("to_device_ms", 0.0) / 1e3
    fit = ac_fit(cache, data["settings"]["steps"])
    out: dict[str, dict[str, float]] = {}
    for level in default_profiles().levels:
        model = "sd-1.5" if level.model == "sd-1.4" else level.model
        entry = models.get(model)
        if not entry or "image" not in entry:
            continue
        latency = entry["image"]["latency_s"]
        if level.strategy is Strategy.AC:
            if fit is None or level.skip_steps >= data["settings"]["steps"]:
                continue
            fixed, per_step = fit
            remaining = data["settings"]["steps"] - level.skip_steps
            latency = fixed + per_step * remaining + (fetch_s if level.skip_steps else 0.0)
        out[level.name] = {
            "latency_s": latency,
            "load_time_s": entry.get("load_s") or float("nan"),
            "gpu_memory_gib": entry.get("weights_gib", float("nan")),
        }
    return out


def _sdxl_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The CLI path's plain SDXL cases: at K = 0 (``plain``, ``plain-short``) and resumed."""
    cases = (data.get("worker_cli") or {}).get("cases") or {}
    return [
        row
        for case, row in cases.items()
        if (case in ("plain", "plain-short") or case.startswith("hit-k")) and not row["substituted"]
    ]


def cli_line(data: dict[str, Any]) -> tuple[float, float] | None:
    """``(fixed s, per step s)`` of an SDXL request through the CLI path: the line through
    its SDXL requests at K = 0 and resumed at K (wall time on steps run, :func:`line_fit`);
    with one step count, that case's own fixed time and reply step time. None without any."""
    rows = _sdxl_rows(data)
    fit = line_fit([(row["steps_run"], row["wall_ms"] / 1e3) for row in rows])
    if fit is not None or not rows:
        return fit
    return rows[0]["fixed_ms"] / 1e3, rows[0]["step_ms"] / 1e3


def cli_figures(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The levels' figures from the CLI path (``data["worker_cli"]``) at the profile's N:
    AC at K < N and SDXL's SM level from :func:`cli_line`, fixed + per step × (N − K) (the
    hits' lookup and fetch are inside their wall time); each SM variant's from its case, fixed +
    step × N (its own wall time where it ran N steps); load seconds and bytes from the
    worker's ``Stats`` (its loader from a local directory whose pages were dropped). SD-1.4
    takes SD-1.5's figures."""
    cli = data.get("worker_cli") or {}
    cases = cli.get("cases") or {}
    states = cli.get("models") or {}
    steps = data["settings"]["steps"]
    line = cli_line(data)
    out: dict[str, dict[str, float]] = {}
    for level in default_profiles().levels:
        model = "sd-1.5" if level.model == "sd-1.4" else level.model
        got: dict[str, float] = {}
        state = states.get(model) or {}
        if state.get("load_s"):
            got["load_time_s"] = state["load_s"]
        if state.get("bytes"):
            got["gpu_memory_gib"] = state["bytes"] / GIB
        row = cases.get(f"sm-{model}")
        if model == "sdxl" and line is not None:
            if level.skip_steps >= steps:
                continue
            fixed, per_step = line
            got["latency_s"] = fixed + per_step * (steps - level.skip_steps)
        elif row is not None and not row["substituted"]:
            whole = row["steps_run"] == steps and row["start_step"] == 0
            got["latency_s"] = (
                row["wall_ms"] / 1e3 if whole else (row["fixed_ms"] + row["step_ms"] * steps) / 1e3
            )
        if got:
            out[level.name] = got
    return out


def profile_toml(data: dict[str, Any]) -> str:
    """The measured profile: the default profile's levels, qualities and parts, with this
    GPU's class and figures. Levels keep the default's order (the classifiers' labels follow
    it); SM levels measured out of that order are re-ordered slowest first and say so."""
    env = data["env"]
    cls = worker_class(env)
    figures = level_figures(data)
    defaults = default_profiles()
    paper = {(lv.name): defaults.profile("a100", lv.name) for lv in defaults.levels}
    lines = [
        f"# Measured by benchmarks/gpu_profile.py on {env.get('gpu')} ({env['date']}; torch "
        f"{env['torch']}, CUDA {env.get('cuda')}, diffusers {env['diffusers']}, "
        f"{data['settings']['dtype']}).",
        "# Full-size architectures with random weights (benchmarks/_fullsize.py), batch 1, "
        f"N = {data['settings']['steps']} steps; SDXL at 1024 px, the SM models at 512 px.",
        *_source_note(data),
        "# sd-1.4 takes sd-1.5's figures (same architecture). quality",
        "# and parts are the default profile's. Where a figure could not be measured, the",
        "# A100 figure of argus/profiles/default.toml stands, marked [paper].",
        f'worker_classes = ["{cls}"]',
        "reference = { width = 1024, height = 1024, steps = 50 }",
        "",
    ]
    for strategy in (Strategy.AC, Strategy.SM):
        rows = []
        for level in defaults.levels_for(strategy):
            got = figures.get(level.name, {})
            fallback = paper[level.name]
            values, marks = {}, []
            for key in ("latency_s", "load_time_s", "gpu_memory_gib"):
                value = got.get(key, math.nan)
                if value is None or math.isnan(value):
                    value = getattr(fallback, key)
                    marks.append(key)
                values[key] = value
            rows.append((level, values, marks))
        ordered = sorted(rows, key=lambda row: -row[1]["latency_s"])
        if ordered != rows:
            lines.append(f"# {strategy.value} levels re-ordered slowest first, as measured")
            rows = ordered
        for level, values, marks in rows:
            note = f"  # [paper] {', '.join(marks)}" if marks else ""
            lines += [
                "[[levels]]",
                f'name = "{level.name}"',
                f'strategy = "{strategy.value}"',
                f'model = "{level.model}"',
                *([f"skip_steps = {level.skip_steps}"] if strategy is Strategy.AC else []),
                f"quality = {level.quality}",
                f"profiles.{cls} = {{ latency_s = {values['latency_s']:.3f}, load_time_s = "
                f"{values['load_time_s']:.2f}, gpu_memory_gib = {values['gpu_memory_gib']:.2f} }}"
                + note,
                "",
            ]
    for model, parts in defaults.parts.items():
        lines.append(f'[models."{model}".parts]')
        for part in parts:
            lines.append(f'{part.name} = {{ id = "{part.id}", share = {part.share} }}')
        lines.append("")
    return "\n".join(lines)


def _source_note(data: dict[str, Any]) -> list[str]:
    """The profile's comment lines on where its figures come from."""
    if not cli_figures(data):
        return [
            "# latency_s: a whole image through the worker's DiffusionModel (AC: the line fitted",
            "# to the runs resumed at each K, fixed + per step x (N - K), plus the measured latent",
            f"# copy to the GPU: {_fit_note(data)}); load_time_s: the worker's loader from a",
            "# local directory; gpu_memory_gib: the weights on the GPU.",
        ]
    cli = data["worker_cli"]
    line = cli_line(data)
    fit = (
        "not measured" if line is None else f"fixed {line[0]:.3f} s, {line[1] * 1e3:.1f} ms a step"
    )
    flags = " ".join(cli.get("worker_args") or []) or "none"
    return [
        "# latency_s: a whole request through `python -m argus worker` and gRPC (mutual TLS, the",
        f"# router's client; the worker's defaults, extra flags: {flags}; commit",
        f"# {cli.get('commit') or '?'}). AC levels and sm-sd-xl: the line through its SDXL",
        f"# requests at K = 0 (N = {cli['steps']} and a third of it) and resumed at K, fixed +",
        f"# per step x (N - K): {fit}; SM variants: their own requests at N = {cli['sm_steps']}.",
        "# load_time_s and gpu_memory_gib: the worker's Stats (its loader from a local directory",
        "# whose pages were dropped; the model's bytes). Levels the CLI run did not reach: the",
        "# in-process figures of benchmarks/gpu_profile.py where measured.",
    ]


def _fit_note(data: dict[str, Any]) -> str:
    fit = ac_fit(data.get("cache") or {}, data["settings"]["steps"])
    if fit is None:
        return "not measured"
    return f"fixed {fit[0]:.3f} s, {fit[1] * 1e3:.1f} ms a step"


# -- the summary that opens docs/gpu.md -------------------------------------------------------

STEP_LINE = "default path, SDXL step{what}: {x:.2f} x the CUDA-graph floor"
EDIT_LINE = "SDXL edit at m = {m:g}: {x:.2f} x faster than in full"
ADAPTER_CASES = {"lora": " with a rank-64 LoRA", "controlnet": " with one ControlNet"}
_STEP_RE = re.compile(
    r"^default path, SDXL step(?P<what>| with a rank-64 LoRA| with one ControlNet): "
    r"(?P<x>\d+(?:\.\d+)?) x the CUDA-graph floor$"
)
_EDIT_RE = re.compile(
    r"^SDXL edit at m = (?P<m>\d+(?:\.\d+)?): (?P<x>\d+(?:\.\d+)?) x faster than in full$"
)


def cuda_graph_floor(data: dict[str, Any], case: str = "plain") -> tuple[float | None, str]:
    """The floor an SDXL step of ``case`` is compared with, in ms, and what it is: the guided
    UNet step at batch 1 (two rows, CFG) replayed from a CUDA graph (``models.sdxl.cuda_graph``;
    a LoRA merged into the weights costs the same); for ``controlnet``, that step with one
    ControlNet, captured together (``models.sdxl.controlnet_graph``). Where no graph was
    measured (a CPU), the eager step at batch 1, named so. The networks' forwards only: no
    scheduler step, no guidance arithmetic, no Python between steps."""
    entry = (data.get("models") or {}).get("sdxl") or {}
    if case == "controlnet":
        what, graph = "the guided UNet step with one ControlNet", entry.get("controlnet_graph")
        eager = (graph or {}).get("eager_ms")
    else:
        what, graph = "the guided UNet step", entry.get("cuda_graph")
        eager = ((entry.get("batches") or {}).get("1") or {}).get("unet_step_ms")
    if (graph or {}).get("cuda_graph_ms"):
        return graph["cuda_graph_ms"], f"{what} replayed from a CUDA graph"
    if eager:
        return eager, f"{what}, eager (no CUDA graph on this device)"
    return None, "not measured"


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of the summary, from the CLI path (``worker_cli``) and the floor; None
    where a figure is missing. ``<case>_x_floor``: the case's reply step time (``denoise_ms /
    steps_run``, median) over the floor, for ``plain``, ``lora`` and ``controlnet``;
    ``wall_x_floor``: the slope of the line through the SDXL requests' wall times at their
    step counts (:func:`cli_line`'s fit: what a step adds to a request, whatever the reply's
    clock leaves out) over it;
    ``edit_speedup``: the edit's step time with the cache off over its step time replayed
    (``edit_wall_speedup``: the same of whole requests); ``edit_bound``: 1 / (1 − s(1 − m))
    at the mask's own ratio m, with ``s`` from ``data["edit_share"]``, and ``edit_of_bound``
    the speed-up's share of it."""
    floor_ms, floor_what = cuda_graph_floor(data)
    cli = data.get("worker_cli") or {}
    cases = cli.get("cases") or {}
    floor_px = ((data.get("models") or {}).get("sdxl") or {}).get("size")
    out: dict[str, Any] = {"floor_ms": floor_ms, "floor": floor_what, "floor_px": floor_px}
    out["controlnet_floor_ms"], out["controlnet_floor"] = cuda_graph_floor(data, "controlnet")
    for case in ("plain", *ADAPTER_CASES):
        step = (cases.get(case) or {}).get("step_ms")
        under = out["controlnet_floor_ms"] if case == "controlnet" else floor_ms
        out[f"{case}_step_ms"] = step
        out[f"{case}_x_floor"] = step / under if step and under else None
    line = line_fit([(row["steps_run"], row["wall_ms"] / 1e3) for row in _sdxl_rows(data)])
    out["wall_step_ms"] = line[1] * 1e3 if line is not None else None
    out["wall_x_floor"] = out["wall_step_ms"] / floor_ms if line and floor_ms else None
    out["edit_m"] = cli.get("edit_ratio")
    out["edit_mask_ratio"] = cli.get("edit_mask_ratio")
    replay, full = cases.get("edit-replay"), cases.get("edit-full")
    out["edit_speedup"] = out["edit_wall_speedup"] = out["edit_bound"] = None
    out["edit_of_bound"] = None
    if replay and full:
        out["edit_speedup"] = full["step_ms"] / replay["step_ms"]
        out["edit_wall_speedup"] = full["wall_ms"] / replay["wall_ms"]
    share = (data.get("edit_share") or {}).get("s")
    m = out["edit_mask_ratio"]
    if share is not None and m is not None:
        out["edit_bound"] = 1.0 / (1.0 - share * (1.0 - m))
        if out["edit_speedup"] is not None:
            out["edit_of_bound"] = out["edit_speedup"] / out["edit_bound"]
    return out


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The summary's lines: first ``default path, SDXL step: N.NN x the CUDA-graph floor``
    and ``SDXL edit at m = 0.2: N.NN x faster than in full`` (``not measured`` in place of the
    sentence's figure where one is missing), then the adapters' step lines, the bound and what
    the floor is."""
    got = summary(data)
    m = got["edit_m"] if got["edit_m"] is not None else 0.2
    lines = [
        STEP_LINE.format(what="", x=got["plain_x_floor"])
        if got["plain_x_floor"] is not None
        else "default path, SDXL step: not measured",
        EDIT_LINE.format(m=m, x=got["edit_speedup"])
        if got["edit_speedup"] is not None
        else f"SDXL edit at m = {m:g}: not measured",
    ]
    for case, what in ADAPTER_CASES.items():
        if got[f"{case}_x_floor"] is not None:
            lines.append(STEP_LINE.format(what=what, x=got[f"{case}_x_floor"]))
    if got["wall_x_floor"] is not None:
        lines.append(
            f"default path, SDXL step from the requests' wall times (the line through their "
            f"step counts): {got['wall_step_ms']:.1f} ms, {got['wall_x_floor']:.2f} x the floor"
        )
    if got["edit_bound"] is not None and got["edit_of_bound"] is not None:
        share = data["edit_share"]
        lines.append(
            f"edit bound at the mask's m = {got['edit_mask_ratio']:.3f}: 1/(1 - s(1 - m)) = "
            f"{got['edit_bound']:.2f} x with s = {share['s']:.3f} ({share.get('source', '?')}); "
            f"the edit reaches {got['edit_of_bound']:.2f} of it"
        )
    if got["floor_ms"] is not None:
        lines.append(
            f"floor: {got['floor']}, SDXL {got['floor_px']} px, batch 1: "
            f"{got['floor_ms']:.1f} ms; a step time is the reply's denoise_ms / steps_run (the "
            "UNet, the scheduler's step, guidance and the loop); an edit's speed-up compares "
            "those step times"
        )
    if got["controlnet_floor_ms"] is not None:
        lines.append(
            f"the ControlNet step's floor: {got['controlnet_floor']}, "
            f"{got['controlnet_floor_ms']:.1f} ms"
        )
    return lines


def read_summary(path: str | Path) -> dict[str, float | None]:
    """The figures of the summary lines in a Markdown file (:func:`summary_lines`), wherever
    they stand in it: ``sdxl_step_x_floor``, ``lora_step_x_floor``,
    ``controlnet_step_x_floor``, ``edit_m`` and ``edit_x_full``; None for a line not there or
    not measured."""
    names = {"": "sdxl", " with a rank-64 LoRA": "lora", " with one ControlNet": "controlnet"}
    out: dict[str, float | None] = {f"{n}_step_x_floor": None for n in names.values()}
    out.update(edit_m=None, edit_x_full=None)
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        found = _STEP_RE.match(line)
        if found:
            out[f"{names[found['what']]}_step_x_floor"] = float(found["x"])
        found = _EDIT_RE.match(line)
        if found:
            out["edit_m"], out["edit_x_full"] = float(found["m"]), float(found["x"])
    return out


def markdown(data: dict[str, Any]) -> str:
    """The summary (:func:`summary_lines`, one paragraph a line), then the tables of
    ``docs/gpu.md``: this GPU's figures beside the papers'."""
    env = data["env"]
    steps = data["settings"]["steps"]
    lines = [
        *(part for line in summary_lines(data) for part in (line, "")),
        f"Measured {env['date']} on **{env.get('gpu')}** (torch {env['torch']}, CUDA "
        f"{env.get('cuda')}, diffusers {env['diffusers']}), {data['settings']['dtype']}, "
        "random weights, by `benchmarks/gpu_profile.py`. Medians of "
        f"{data['settings']['repeats']} runs after a warm-up.",
        "",
        f"### Levels: a whole image at batch 1, N = {steps}",
        "",
        "| model | size | UNet params (M) | weights GiB | peak GiB | latency s | text enc ms "
        "| load s | paper A100 latency s | paper load s | paper GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in data["models"].items():
        image = entry.get("image", {})
        paper = PAPER_T2.get(name, (None, None, None))
        lines.append(
            f"| {name} | {entry['size']} | {_fmt(entry['params_m'].get('unet'), '.0f')} | "
            f"{_fmt(entry.get('weights_gib'))} | {_fmt(image.get('peak_gib'))} | "
            f"{_fmt(image.get('latency_s'), '.3f')} | {_fmt(image.get('encode_ms'), '.1f')} | "
            f"{_fmt(entry.get('load_s'))} | {_fmt(paper[0])} | {_fmt(paper[1])} | "
            f"{_fmt(paper[2])} |"
        )
    lines += [
        "",
        "### Batching: one guided UNet step and one VAE decode (ms)",
        "",
        "| model | " + " | ".join(f"b={b} step" for b in data["settings"]["batches"])
        + " | " + " | ".join(f"b={b} decode" for b in data["settings"]["batches"]) + " |",
        "|---|" + "---|" * (2 * len(data["settings"]["batches"])),
    ]  # fmt: skip
    for name, entry in data["models"].items():
        rows = entry.get("batches", {})
        cells = [_fmt(rows.get(str(b), {}).get("unet_step_ms"), ".1f")
                 for b in data["settings"]["batches"]]  # fmt: skip
        cells += [_fmt(rows.get(str(b), {}).get("vae_decode_ms"), ".1f")
                  for b in data["settings"]["batches"]]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cache = data.get("cache")
    if cache:
        lines += [
            "",
            f"### Approximate caching on SDXL: resumed at K (N = {steps})",
            "",
            "| K | latency s | ratio to K=0 | (N-K)/N (§2.1) | paper A100 s (§5.1) |",
            "|---|---|---|---|---|",
        ]
        for k, row in cache.items():
            if k == "fetch":
                continue
            paper_s = 4.2 * (steps - int(k)) / steps
            lines.append(
                f"| {k} | {row['latency_s']:.3f} | {row['ratio']:.3f} | "
                f"{row['paper_ratio']:.2f} | {paper_s:.2f} |"
            )
        if "fetch" in cache:
            fetch = cache["fetch"]
            lines.append(
                f"\nThe latent captured at K ({fetch['latent_kib']:.0f} KiB, float32) reaches "
                f"the GPU in {fetch['to_device_ms']:.3f} ms (pinned host memory)."
            )
    for name, entry in data["models"].items():
        for key, label in (("cuda_graph", "CUDA graph"), ("compile", "torch.compile")):
            got = entry.get(key)
            if got:
                fast = got.get("cuda_graph_ms", got.get("compiled_ms"))
                extra = f", first call {got['compile_s']:.0f} s" if "compile_s" in got else ""
                lines.append(
                    f"\n{label} on the {name} UNet step (batch 1, guided): eager "
                    f"{got['eager_ms']:.1f} ms, {fast:.1f} ms, {got['speedup']:.2f}×{extra}."
                )
    adapters_data = data.get("adapters")
    if adapters_data:
        lines += ["", "### Adapters on SDXL", "", "| figure | measured | paper |", "|---|---|---|"]
        for key, value in adapters_data.get("lora", {}).items():
            lines.append(f"| LoRA {key} | {value:.2f} | |")
        for key, value in adapters_data.get("controlnet", {}).items():
            lines.append(f"| ControlNet {key} | {value:.2f} | |")
        lines.append(
            f"\nKATZ (H800, SDXL 1024 px, 50 steps): base {KATZ['base_s']} s, one ControlNet "
            f"{KATZ['controlnet_s']} s (§3.3); LoRA load and patch over "
            f"{KATZ['lora_diffusers_s']:.0f} s in Diffusers, {KATZ['lora_katz_s'] * 1e3:.0f} ms "
            "with BAL and in-place patching (§7)."
        )
    if data.get("worker"):
        from _gpu_worker import table

        lines += ["", "### The worker's own path, per stage (ms)", "", table(data["worker"])]
    if (data.get("worker_cli") or {}).get("cases"):
        from _gpu_cli_worker import table as cli_table

        cli = data["worker_cli"]
        flags = " ".join(cli.get("worker_args") or []) or "none"
        lines += [
            "",
            "### The worker's default path: `argus worker` and gRPC (ms)",
            "",
            f"`python -m argus worker` with its defaults (extra flags: {flags}), the router's "
            f"client over mutual TLS; N = {cli['steps']} (SM: {cli['sm_steps']}), medians of "
            f"{cli['repeats']} after a warm-up; edits at mask ratio "
            f"{cli.get('edit_mask_ratio') or 0:.3f}. Per step: the reply's denoise_ms / "
            "steps_run; fixed: the wall time less denoise_ms.",
            "",
            cli_table(cli),
        ]
        if cli.get("skipped"):
            lines += ["", "Not measured there: " + "; ".join(
                f"{case}: {why}" for case, why in cli["skipped"].items()) + "."]  # fmt: skip
    if data.get("skipped"):
        lines += ["", "Not measured in this run: " + "; ".join(data["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="the tiny variants (CPU test)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=None, help="N (default 50; tiny: 4)")
    parser.add_argument("--batches", type=_ints, default=(1, 2, 4, 8))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", default="", help="models whose UNet to torch.compile")
    parser.add_argument("--no-load", action="store_true", help="skip the load-time section")
    parser.add_argument("--worker", action="store_true", help="also the worker's whole path")
    parser.add_argument(
        "--worker-via",
        default="process",
        choices=("process", "cli"),
        help="the worker in this process, or `argus worker` processes over gRPC",
    )
    parser.add_argument(
        "--worker-args", default="", help="flags passed on to `argus worker` (--worker-via cli)"
    )
    parser.add_argument(
        "--worker-sm-models",
        default="sd-2.0,sd-1.5,small-sd,tiny-sd",
        help="the SM variants the CLI worker serves (--worker-via cli)",
    )
    parser.add_argument("--edit-ratio", type=float, default=0.2, help="an edit's mask ratio m")
    parser.add_argument(
        "--edit-share-json",
        default=None,
        help="a bench_editing.py JSON whose s (the blocks' share of a step) gives the edit bound",
    )
    parser.add_argument(
        "--floor-only", action="store_true", help="per model, only the CUDA-graph UNet step"
    )
    parser.add_argument("--worker-steps", type=int, default=None, help="N there (--steps)")
    parser.add_argument("--worker-repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument(
        "--from-json",
        action="append",
        default=[],
        help="only turn this JSON into files (again: merge several runs' JSONs, later ones win)",
    )
    parser.add_argument("--write-json", default=None, help="the (merged) measurements")
    parser.add_argument("--write-profile", default=None)
    parser.add_argument("--write-markdown", default=None)
    args = parser.parse_args(argv)
    args.models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in args.models if m not in ARCHS]
    if unknown:
        parser.error(f"--models: unknown {unknown} (known: {', '.join(ARCHS)})")
    args.compile = tuple(m for m in args.compile.split(",") if m)
    args.worker_sm_models = tuple(m for m in args.worker_sm_models.split(",") if m)
    bad = [m for m in args.worker_sm_models if m not in ARCHS or m == "sdxl"]
    if bad:
        parser.error(
            f"--worker-sm-models: unknown {bad} (known: sd-2.0, sd-1.5, small-sd, tiny-sd)"
        )
    if not 0.0 < args.edit_ratio < 1.0:
        parser.error(f"--edit-ratio: must be in (0, 1), got {args.edit_ratio}")
    args.dtype = args.dtype or ("fp16" if args.device.startswith("cuda") else "fp32")
    args.steps = args.steps or (4 if args.tiny else 50)
    return args


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' JSONs as one: each model's entries and the skip lists joined, any other
    key from the last run that has it."""
    out: dict[str, Any] = {"models": {}, "skipped": []}
    for data in runs:
        for key, value in data.items():
            if key == "models":
                for name, entry in value.items():
                    out["models"].setdefault(name, {}).update(entry)
            elif key == "skipped":
                out["skipped"] += value
            elif value is not None or key not in out:
                out[key] = value
    return out


def edit_share(path: str) -> dict[str, Any]:
    """``s`` of a ``bench_editing.py`` JSON, with where and on what it was measured."""
    got = json.loads(Path(path).read_text())
    source = f"{Path(path).name}: {got.get('arch')} {got.get('size')} px on {got.get('device')}"
    return {"s": float(got["s"]), "source": source, "dtype": got.get("dtype")}


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """For the block, SIGTERM (``timeout``) unwinds the run as an exception does, so the
    worker processes it started are stopped and what was measured stays saved."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json:
        data = merge([json.loads(Path(path).read_text()) for path in args.from_json])
    else:
        with stop_on_sigterm():
            data = measure(args)
    if args.edit_share_json:
        data["edit_share"] = edit_share(args.edit_share_json)
    if args.write_json:
        Path(args.write_json).write_text(json.dumps(data, indent=1, default=str))
    if args.write_profile:
        Path(args.write_profile).write_text(profile_toml(data))
    if args.write_markdown:
        Path(args.write_markdown).write_text(markdown(data))
    print(markdown(data))
    return data


if __name__ == "__main__":
    main()
