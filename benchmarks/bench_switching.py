"""Model switches on a worker: whole-pipeline loading against component loading.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_switching.py --quick

For every ordered pair of the tiny variants (A → B) two workers' model registries switch
from A to B, in interleaved rounds so that drift on a shared machine hits both alike:

* **whole**: the worker as it was before its component registry: B's load builds every part
  of B's pipeline (a fresh registry, nothing resident), and afterwards holds B alone;
* **parts**: the component registry with A resident: B's load builds only the parts whose
  weights' digest is not resident (within the SD-1.x family, only the UNet), and afterwards
  holds A and B, their shared parts once.

Switch time is the time from ``activate(B)`` until B is ready (median of the rounds); the
whole-pipeline column is B's load into an empty registry, so it leaves out the unloading of A
that a real switch adds (``gc.collect``), which the "back" columns include;
resident bytes are the registry's memory guard's count after the switch. Every part's digest
is computed before the rounds (``ModelRegistry.index``, once per process): a worker does that
once per source, not per switch. The tiny variants' "load" is building their seeded modules
on the CPU, the stand-in for reading weights; their parts keep the real families' sharing.

The last two lines give the issue's figures: the median over the SD-1.x family's pairs of the
parts switch time as a share of the whole-pipeline load, and the bytes of three resident
SD-1.x-family variants (sd-1.5, sd-1.4, small-sd) as a share of three pipelines.

``--full`` measures the same at full size: three SD-1.x pipelines built from the published
configurations with random weights (fp16, seeded), written as diffusers directories in a
temporary folder and loaded from there: one CLIP ViT-L/14 text encoder (123.1 M parameters),
one VAE (83.7 M) and a tokenizer shared by their files, and three SD-1.5-shaped UNets (859.5 M
each) seeded apart, standing for SD-1.5, SD-1.4 and a third fine-tune of the family (the
distilled small and tiny UNets' configurations are not used: their sizes are not published in
the papers here). Pairs are SD-1.5 ↔ SD-1.4. It needs about 6 GB of disk and 7 GB of memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path

import torch
from _machine import load_line, machine_line

from argus.worker.models.registry import ModelRegistry
from argus.worker.models.sources import TINY_PREFIX, TINY_VARIANTS

FAMILY = ("sd-1.5", "sd-1.4", "small-sd", "tiny-sd")  # one text encoder and VAE
THREE = ("sd-1.5", "sd-1.4", "small-sd")
SOURCES = {name: TINY_PREFIX + name for name in TINY_VARIANTS}
FULL_FAMILY = ("sd-1.5", "sd-1.4", "sd-1.x-ft")  # three SD-1.x UNets around one CLIP and VAE
CLIP_L = {  # openai/clip-vit-large-patch14's text tower
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 77,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
SD15_UNET = {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8}
SD_VAE = {
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "latent_channels": 4,
    "layers_per_block": 2,
    "sample_size": 512,
}


@dataclass(frozen=True)
class Models:
    """What the registries load: model name → source, and the dtype."""

    sources: dict[str, str]
    dtype: str = "fp32"

    def registry(self, max_resident: int) -> ModelRegistry:
        return ModelRegistry(
            self.sources, device="cpu", dtype=self.dtype, max_resident=max_resident
        )


def random_fp16(cls: type, seed: int, **config: object) -> torch.nn.Module:
    """A module of ``cls`` built from ``config`` with seeded random fp16 weights, allocated
    once (built on the meta device, never initialised in fp32)."""
    with torch.device("meta"):
        module = cls(**config).to(torch.float16)
    module = module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    return module


def build_full_family(root: Path) -> dict[str, str]:
    """Write :data:`FULL_FAMILY` as diffusers directories under ``root``: the first whole, the
    others with their own UNet and the first's text encoder, VAE and tokenizer files linked."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from argus.worker.models.sources import make_scheduler, tiny_tokenizer

    sources = {name: root / name for name in FULL_FAMILY}
    first = sources[FULL_FAMILY[0]]
    text = CLIPTextModel(CLIPTextConfig(**CLIP_L)).to(torch.float16)  # has position buffers
    vae = random_fp16(AutoencoderKL, 1, **SD_VAE)
    for seed, (name, path) in enumerate(sources.items(), start=10):
        unet = random_fp16(UNet2DConditionModel, seed, **SD15_UNET)
        if path == first:
            StableDiffusionPipeline(
                vae=vae,
                text_encoder=text,
                tokenizer=tiny_tokenizer(),
                unet=unet,
                scheduler=make_scheduler("euler"),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            ).save_pretrained(path, safe_serialization=True)
        else:
            for item in first.iterdir():
                if item.is_dir() and item.name != "unet":
                    shutil.copytree(item, path / item.name, copy_function=os.link)
                elif item.is_file():
                    shutil.copy(item, path / item.name)
            unet.save_pretrained(path / "unet", safe_serialization=True)
        del unet
        print(f"  wrote {name}", flush=True)
    return {name: str(path) for name, path in sources.items()}


@dataclass(frozen=True)
class Switch:
    seconds: float  # activate(B) until B is ready
    bytes: int  # the memory guard's count after it
    loaded: tuple[str, ...]  # the parts B's load loaded
    back_s: float  # then activate(A) until A is ready again (parts: A is still resident)


def switch(models: Models, a: str, b: str, *, parts: bool) -> Switch:
    """Switch from ``a`` to ``b`` and back, whole pipelines or parts."""
    reg = models.registry(max_resident=len(models.sources) if parts else 1)
    try:
        if parts:
            reg.activate(a).result()
        began = time.perf_counter()
        reg.activate(b).result()
        seconds = time.perf_counter() - began
        loaded = next(m.loaded_parts for m in reg.infos() if m.name == b)
        held = reg.used_bytes()
        began = time.perf_counter()
        reg.activate(a).result()
        return Switch(seconds, held, tuple(sorted(loaded)), time.perf_counter() - began)
    finally:
        reg.close()


def resident_bytes(models: Models, names: tuple[str, ...], *, parts: bool) -> int:
    """Bytes held by ``names`` all resident (parts), or by one whole pipeline each."""
    if not parts:
        return sum(resident_bytes(models, (name,), parts=True) for name in names)
    reg = models.registry(max_resident=len(models.sources))
    try:
        for name in names:
            reg.activate(name).result()
        return reg.used_bytes()
    finally:
        reg.close()


def quiet_libraries() -> None:
    """Silence diffusers' and transformers' per-load warnings and progress bars ("kept in
    float32" on every .to(), fp16 on the CPU, no accelerate): the table is the output."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="switches per pair and mode")
    parser.add_argument("--quick", action="store_true", help="3 rounds (a couple of minutes)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="full-size SD-1.x architectures with random fp16 weights from a temporary "
        "directory (about 6 GB of disk, 7 GB of memory)",
    )
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    quiet_libraries()
    if not args.full:
        run(Models(SOURCES), rounds, list(permutations(SOURCES, 2)), FAMILY, THREE)
        return
    with tempfile.TemporaryDirectory(prefix="argus-bench-switching-") as tmp:
        print(machine_line())
        began = time.perf_counter()
        models = Models(build_full_family(Path(tmp)), dtype="fp16")
        print(f"full-size SD-1.x family written in {time.perf_counter() - began:.0f} s\n")
        pairs = [("sd-1.5", "sd-1.4"), ("sd-1.4", "sd-1.5")]
        run(models, rounds, pairs, ("sd-1.5", "sd-1.4"), FULL_FAMILY, header=False)


def run(
    models: Models,
    rounds: int,
    pairs: list[tuple[str, str]],
    family: tuple[str, ...],
    three: tuple[str, ...],
    *,
    header: bool = True,
) -> None:
    """Time every pair's switches, then the three resident models' bytes; prints the table
    and the two figures."""
    if header:
        print(machine_line())
    reg = models.registry(max_resident=1)
    began = time.perf_counter()
    reg.index().result()
    reg.close()
    count = len(models.sources)
    print(f"part digests of {count} sources: {time.perf_counter() - began:.2f} s (once)")
    switch(models, "sd-1.5", "sd-1.4", parts=True)  # warm the builders' first-call costs

    print(f"{len(pairs)} pairs, {rounds} rounds each, whole and parts interleaved\n")
    print(
        f"{'switch':22} {'whole s':>8} {'parts s':>8} {'parts %':>8} "
        f"{'whole MiB':>10} {'parts MiB':>10} {'back: whole s':>14} {'parts s':>8}  parts loaded"
    )
    ratios: dict[tuple[str, str], float] = {}
    for a, b in pairs:
        whole, parts = [], []
        for _ in range(rounds):
            whole.append(switch(models, a, b, parts=False))
            parts.append(switch(models, a, b, parts=True))
        w = statistics.median(s.seconds for s in whole)
        p = statistics.median(s.seconds for s in parts)
        wb = statistics.median(s.back_s for s in whole)
        pb = statistics.median(s.back_s for s in parts)
        ratios[(a, b)] = p / w
        print(
            f"{a + ' -> ' + b:22} {w:8.3f} {p:8.3f} {100 * p / w:7.0f}% "
            f"{whole[-1].bytes / 2**20:10.2f} {parts[-1].bytes / 2**20:10.2f} {wb:14.3f} "
            f"{pb:8.4f}  {', '.join(parts[-1].loaded)}"
        )
    print(
        "\nwhole MiB: the new pipeline alone after the switch (the old one is unloaded; both "
        "are held during it); parts MiB: both models, shared parts once; back: the switch "
        "back to the first model (whole: a full load again, plus unloading the other pipeline "
        "and collecting it, as the worker did before; parts: it is still resident)"
    )
    three_whole = resident_bytes(models, three, parts=False)
    three_parts = resident_bytes(models, three, parts=True)
    print(
        f"three resident ({', '.join(three)}): {three_parts / 2**20:.2f} MiB as parts, "
        f"{three_whole / 2**20:.2f} MiB as three pipelines"
    )
    print(load_line("end"))
    within = [ratios[pair] for pair in permutations(family, 2)]
    print(f"within-family switch: {100 * statistics.median(within):.0f}% of a whole-pipeline load")
    print(f"three resident variants: {100 * three_parts / three_whole:.0f}% of three pipelines")


if __name__ == "__main__":
    main()
