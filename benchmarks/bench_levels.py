"""Latency per approximation level of the worker's pipelines.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_levels.py            # tiny models on this CPU
    PYTHONPATH=. .venv/bin/python benchmarks/bench_levels.py --worker   # + the full worker path
    PYTHONPATH=. python benchmarks/bench_levels.py --arch sdxl --size 1024 --device cuda \
        --dtype fp16                                                    # random SDXL on a GPU

Two tables:

* **denoise** (``DiffusionModel``): for every AC level the resumed run of N−K steps from a
  latent captured at K, and for every SM level a full run on its model; p50 of the encode +
  denoise + decode time, its ratio to K = 0, and the (N−K)/N the paper predicts (§2.1).
* **worker** (``--worker``): the same levels through ``Worker.generate`` with the approximate
  cache on Qdrant Edge, so a hit pays prompt embedding, search and latent fetch too.

``--arch sdxl|sd15`` builds full-size SDXL or SD-1.5 *architectures* with random weights (no
weights to download; the latency of a UNet does not depend on its weight values), for the GPU
device.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from _machine import machine_line

from argus.profiles import default_profiles
from argus.types import Strategy
from argus.worker.models import TINY_PREFIX, build_tiny_pipeline
from argus.worker.pipelines import DiffusionModel, GenerationSpec

PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk, seagulls"


def full_size_pipeline(arch: str, dtype: torch.dtype, device: str) -> Any:
    """SDXL or SD-1.5 with their published configs and random weights (diffusers defaults)."""
    from diffusers import (
        AutoencoderKL,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from argus.worker.models import _tokenizer, make_scheduler

    torch.manual_seed(0)
    tok = _tokenizer()
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        latent_channels=4,
        sample_size=1024 if arch == "sdxl" else 512,
        scaling_factor=0.13025 if arch == "sdxl" else 0.18215,
    )

    def text(hidden: int, layers: int, heads: int, proj: int) -> Any:
        return CLIPTextConfig(
            vocab_size=tok.vocab_size,
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=77,
            projection_dim=proj,
            eos_token_id=tok.sep_token_id,
            pad_token_id=tok.pad_token_id,
        )

    if arch == "sdxl":
        unet = UNet2DConditionModel(
            sample_size=128,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
            use_linear_projection=True,
        )
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=CLIPTextModel(text(768, 12, 12, 768)),
            text_encoder_2=CLIPTextModelWithProjection(text(1280, 32, 20, 1280)),
            tokenizer=tok,
            tokenizer_2=tok,
            unet=unet,
            scheduler=make_scheduler("euler"),
            force_zeros_for_empty_prompt=False,
        )
    else:
        unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768)
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=CLIPTextModel(text(768, 12, 12, 768)),
            tokenizer=tok,
            unet=unet,
            scheduler=make_scheduler("euler"),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    return pipe.to(device, dtype)


def timed(fn: Any, repeats: int) -> tuple[float, float]:
    """p50 of the wall time of ``fn()`` and of the number it returns (e.g. denoise seconds)."""
    times, inner = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        inner.append(float(fn() or 0.0))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times), statistics.median(inner)


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
                arch = args.arch if name == "sdxl" else "sd15"
                pipe = full_size_pipeline(arch, dtype, args.device)
            models[name] = DiffusionModel(name, pipe, device=args.device, source=args.arch)
        return models[name]

    base = model("sdxl")
    steps = sorted({lv.skip_steps for lv in profiles.levels_for(Strategy.AC)} - {0})
    captured = base.denoise(spec, capture=steps).captured
    print(f"\ndenoise + decode, {args.arch} models, {args.size}px, N={args.steps}, "
          f"{args.device}/{args.dtype}, p50 of {args.repeats}")  # fmt: skip
    print(f"{'level':<12}{'model':<10}{'steps':>6}{'total ms':>10}{'denoise ms':>12}"
          f"{'ratio':>8}{'(N-K)/N':>9}")  # fmt: skip
    reference = None
    for level in profiles.levels:
        if args.arch != "tiny" and level.model not in ("sdxl", "sd-1.5"):
            continue  # full-size architectures: the SDXL base and SD-1.5 only
        k = level.skip_steps
        if k >= args.steps:
            continue
        m = model(level.model)

        def run(m: DiffusionModel = m, k: int = k) -> float:
            start = captured.get(k) if k else None
            result = m.denoise(spec, start_latents=start, start_step=k)
            m.decode(result.latents)
            return result.denoise_s

        run()  # warm-up
        total, denoise = timed(run, args.repeats)
        reference = reference or denoise
        expected = (args.steps - k) / args.steps
        print(f"{level.name:<12}{level.model:<10}{args.steps - k:>6}{total * 1e3:>10.1f}"
              f"{denoise * 1e3:>12.1f}{denoise / reference:>8.2f}{expected:>9.2f}")  # fmt: skip
        if level.strategy is Strategy.SM and level.model != "sdxl":
            models.pop(level.model, None)  # one variant resident at a time, as on a worker


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
        print(f"\nthrough Worker.generate (embed + Qdrant Edge search + fetch + denoise + PNG), "
              f"tiny, {args.size}px, N={args.steps}, p50 of {args.repeats}")  # fmt: skip
        print(f"{'level':<10}{'p50 ms':>10}{'search ms':>11}{'fetch ms':>10}{'hit':>6}")
        for level in levels:
            results: list[Any] = []

            def run(name: str = level.name, out: list[Any] = results) -> None:
                out.append(worker.generate(GenerateCall(PROMPT + "!", seed=99, level=name)))

            run()
            p50, _ = timed(run, args.repeats)
            last = results[-1]
            print(f"{level.name:<10}{p50 * 1e3:>10.1f}{last.timing_ms.get('search_ms', 0):>11.2f}"
                  f"{last.timing_ms.get('fetch_ms', 0):>10.2f}{last.cache.value:>6}")  # fmt: skip
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="tiny", choices=("tiny", "sdxl", "sd15"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16"))
    parser.add_argument("--worker", action="store_true", help="also time the full worker path")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(machine_line())
    denoise_table(args)
    if args.worker:
        worker_table(args)


if __name__ == "__main__":
    main()
