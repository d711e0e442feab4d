"""The worker's denoising loop with its UNet work replayed from CUDA graphs, against eager.

On a GPU, from the repository root::

    PYTHONPATH=. python benchmarks/bench_cuda_graphs.py --models sdxl,sd-1.5 --steps 30 \\
        --cases plain,lora,controlnet,batch

and on a CPU, the same code on a tiny model through the graphs' eager stand-in (what the test
runs; its times mean nothing)::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cuda_graphs.py --tiny --steps 3 --repeats 1

For each model (full size, random weights, ``benchmarks/_fullsize.py``) and each case it times
runs through :class:`~argus.worker.models.pipelines.DiffusionModel`, first eager and then with
:meth:`DiffusionModel.use_cuda_graphs` (the worker's default on CUDA); the first graphed run
pays the captures. Cases:

* ``plain``: a whole image (encode, N steps, VAE decode);
* ``lora``: N steps with a rank-64 LoRA merged in place before step 0 (the worker's merge);
* ``controlnet``: N steps with one random ControlNet in the synchronous mode (the worker's
  predictor and local executor);
* ``batch``: two generations stepped together by the worker's step batcher.

It prints, per case, the medians, the speed-up, the steps' time per step and that over the
*floor*: one guided UNet step replayed from its graph alone (the UNet's work of a step and
nothing else: no guidance, no scheduler step, no Python between steps), and the largest
difference between the eager and graphed final latents for one seed. With ``--json FILE`` it
also writes the figures.

Measured 2026-11-27 on an NVIDIA H200 (torch 2.11.0+cu130, fp16, N = 30, medians of 3, one
warm-up; plain case only, before LoRA, ControlNet and batches were graphed;
``docs/gpu/h200-cuda-graphs.log``):

    sdxl 1024px: eager 2.852 s, graphed 1.439 s, speed-up 1.98x; first graphed run 1.827 s
    sd-1.5 512px: eager 0.813 s, graphed 0.393 s, speed-up 2.07x; first graphed run 0.523 s
    (one graph each, 120 replays; the final latents identical to the bit)
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_profile import Clock, median_ms

from argus.worker.models.pipelines import DiffusionModel, GenerationSpec

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"
CASES = ("plain", "lora", "controlnet", "batch")


def timed(
    device: str, run: Callable[[], torch.Tensor], repeats: int
) -> tuple[list[float], torch.Tensor]:
    """Seconds of ``repeats`` calls of ``run``, and the last call's latents on the CPU."""
    last: list[torch.Tensor] = []
    seconds = Clock(device).time(lambda: last.append(run()), repeats, warmup=0)
    return seconds, last[-1].float().cpu()


def floor_ms(model: DiffusionModel, spec: GenerationSpec, repeats: int = 20) -> float:
    """Median ms of one guided UNet step replayed from its graph alone (the model has graphs;
    the untimed first call captures it if it is not yet)."""
    graphs = model.graphs
    assert graphs is not None
    with torch.inference_mode():
        cond = model.encode(spec)
        scheduler, timesteps, latents, _ = model.start_run(spec, None, 0, ())
        sample = model.unet_input(latents, timesteps[0], cond, scheduler)

        def step() -> torch.Tensor:
            return graphs(sample, timesteps[0], cond.embeds, cond.added)

        return median_ms(Clock(model.device).time(step, repeats, warmup=1))


class Case:
    """One kind of run: ``run()`` returns final latents; ``steps`` of them per call."""

    def __init__(self, run: Callable[[], torch.Tensor], steps: int, close: Callable[[], None]):
        self.run = run
        self.steps = steps
        self.close = close


def make_case(
    name: str, model: DiffusionModel, spec: GenerationSpec, workdir: Path, tiny: bool
) -> Case:
    if name == "plain":

        def plain() -> torch.Tensor:
            result = model.denoise(spec)
            model.decode(result.latents)
            return result.latents

        return Case(plain, spec.steps, lambda: None)
    if name == "lora":
        from argus.worker.adapters.lora import LoraLibrary, WeightBackup, load_now, merge
        from argus.worker.adapters.lora.synthetic import DEFAULT_TARGETS, write_tiny_lora

        rank = 4 if tiny else 64
        write_tiny_lora(
            model.pipeline, workdir / "style.safetensors", rank=rank, targets=DEFAULT_TARGETS
        )
        lora = load_now(LoraLibrary(workdir), "style")

        def with_lora() -> torch.Tensor:
            backup = WeightBackup()

            def before(step: int) -> None:
                if step == 0:
                    merge(model.pipeline.unet, lora, 0.8, backup)

            try:
                return model.denoise(spec, before_step=[before]).latents
            finally:
                with model.lock:
                    backup.restore()

        return Case(with_lora, spec.steps, lambda: None)
    if name == "controlnet":
        from PIL import Image

        from argus.contracts.controlnet import ControlUnit
        from argus.worker.adapters.controlnet.executor import LocalControlNetExecutor
        from argus.worker.adapters.controlnet.models import ControlNetCatalog
        from argus.worker.adapters.controlnet.predictor import ControlNetPredictor

        if tiny:
            executor: Any = LocalControlNetExecutor(ControlNetCatalog.tiny())
            unit_name = "canny"
        else:
            from _gpu_adapters import CONTROLNET_NAME, _OneControlNet, random_controlnet

            from argus.worker.adapters.controlnet.models import base_family

            net = random_controlnet(model.pipeline.unet, device=model.device, dtype=model.dtype)
            family = base_family(model.pipeline.unet.config)
            executor = _OneControlNet(family, net, device=model.device, dtype=model.dtype)
            unit_name = CONTROLNET_NAME
        buffer = io.BytesIO()
        Image.new("RGB", (spec.width, spec.height), (128, 40, 200)).save(buffer, format="PNG")
        units = [ControlUnit(unit_name, 1.0, buffer.getvalue())]

        def controlled() -> torch.Tensor:
            predictor = ControlNetPredictor(model, executor, units)
            with predictor:
                return model.denoise(spec, predictor=predictor).latents

        return Case(controlled, spec.steps, executor.close)
    if name == "batch":
        from dataclasses import replace

        from argus.worker.editing.step_batch import StepBatcher

        def batched() -> torch.Tensor:
            batcher = StepBatcher(model, bound=2)
            futures = [batcher.submit(replace(spec, seed=s), key=str(s)) for s in (1, 2)]
            batcher.run_until_idle()
            return torch.cat([f.result().latents for f in futures])

        return Case(batched, spec.steps, lambda: None)
    raise ValueError(f"case {name!r}: expected one of {', '.join(CASES)}")


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.tiny:
        from argus.worker.models.sources import build_tiny_pipeline

        pipe = build_tiny_pipeline(f"tiny:{name}")
        size, device, capture = 32, "cpu", "eager"
    else:
        from _fullsize import build_pipeline, native_size

        size = native_size(name, tiny=False)
        pipe = build_pipeline(name, device="cuda", dtype=torch.float16)
        device, capture = "cuda", "cuda"
    model = DiffusionModel(name, pipe, device=device, source=f"bench:{name}")
    spec = GenerationSpec(PROMPT, seed=3, height=size, width=size, steps=args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case_name in args.cases.split(","):
            case = make_case(case_name, model, spec, Path(workdir), args.tiny)
            try:
                model.graphs = None
                timed(device, case.run, 1)  # warm-up
                eager, eager_latents = timed(device, case.run, args.repeats)
                model.use_cuda_graphs(args.max_graphs, capture=capture)
                assert model.graphs is not None
                first, _ = timed(device, case.run, 1)
                replays = model.graphs.replays
                graphed, graphed_latents = timed(device, case.run, args.repeats)
                replayed = model.graphs.replays - replays
                floor = floor_ms(model, spec)
            finally:
                case.close()
                model.graphs = None
            e, g = statistics.median(eager), statistics.median(graphed)
            per_step = g / case.steps * 1e3
            row = {
                "model": name,
                "size_px": size,
                "case": case_name,
                "steps": case.steps,
                "eager_s": e,
                "graphed_s": g,
                "speedup": e / g,
                "first_graphed_s": first[0],
                "graphed_ms_per_step": per_step,
                "floor_ms_per_step": floor,
                "over_floor": per_step / floor,
                "replays_per_run": replayed / max(args.repeats, 1),
                "max_latent_diff": float((eager_latents - graphed_latents).abs().max()),
            }
            rows.append(row)
            print(
                f"{name} {size}px {case_name}: eager {e:.3f} s, graphed {g:.3f} s, speed-up "
                f"{e / g:.2f}x; first graphed run {first[0]:.3f} s (capture); "
                f"{per_step:.1f} ms a step = {per_step / floor:.2f}x the floor ({floor:.1f} ms); "
                f"{row['replays_per_run']:.0f} replays a run; max |latent diff| "
                f"{row['max_latent_diff']:.3g}",
                flush=True,
            )
    del model, pipe
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="default: sdxl,sd-1.5 (tiny: sd-1.5)")
    parser.add_argument("--cases", default="plain")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-graphs", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU, eager stand-in")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"--cases: {case!r} is not one of {', '.join(CASES)}")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device (--tiny runs the CPU stand-in)")
    models = args.models or ("sd-1.5" if args.tiny else "sdxl,sd-1.5")
    where = "CPU, eager stand-in" if args.tiny else torch.cuda.get_device_name(0)
    print(f"{where}, torch {torch.__version__}, N = {args.steps}", flush=True)
    rows = [row for name in models.split(",") for row in bench_model(name, args)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
