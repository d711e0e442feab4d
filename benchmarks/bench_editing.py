"""Latency of one denoising step of a masked edit with the mask-aware activation cache
(argus/worker/editing/masked_blocks.py) against the full step, on SD-1.5's UNet (issue 32, item 3).

The UNet is ``UNet2DConditionModel`` built from SD-1.5's configuration written below
(block_out_channels 320/640/1280/1280, 2 layers per block, cross-attention 768, 8 heads,
sample size 64): full width, random seeded weights, float32, nothing downloaded. One step is
one UNet call on the CFG batch of 2 at ``--size`` pixels (512: a 64×64 latent), with a random
77×768 text embedding. For each mask ratio m (a centred rectangle covering m of the latent)
the full step and the cached step run alternately, ``--repeats`` times each, and the medians
are compared:

* s, the BasicTransformerBlocks' share of the full step, timed with forward hooks;
* the speed-up against the bound 1 / (1 − s(1 − m)) (everything outside the blocks runs in
  full, the blocks' work shrinks to m);
* the Y record (InstGenIE's) against the Y + K/V record (§3.1's alternative);
* cache bytes per template (float16), per step and for a whole ``--steps``-step run;
* load time of a template's record from the activation store's host tier and disk tier.

    .venv/bin/python benchmarks/bench_editing.py --threads 1             # 512×512, 5 repeats
    .venv/bin/python benchmarks/bench_editing.py --threads 1 --quick     # 256×256, 3 repeats, 4 min

Two torch threads on a machine that other work loads wait at every operator's barrier for a
descheduled thread (one masked SD-1.5 block at 32×32 tokens: 280 ms on two threads, 39 ms on
one; a full 512×512 step: 40-60 s on two, 19 s on one), and that overhead counts per operator,
so it hides what the cache saves: on a shared machine run with ``--threads 1``.

Figures, 2 vCPU x86_64 shared with other agents, ``--threads 1 --repeats 3`` at 512×512 (load
average 0.8-1.3 while it ran): full step 18.9 s, s = 0.503;

    m     full    Y (cached)  speed-up  bound
    0.05  18.6 s  10.6 s      1.76x     1.91x
    0.10  18.3 s  11.0 s      1.67x     1.83x
    0.20  18.5 s  12.0 s      1.54x     1.67x   (92% of the bound; K/V: 11.4 s, 1.63x)
    0.40  18.8 s  13.8 s      1.37x     1.43x
    0.80  18.1 s  17.1 s      1.06x     1.11x
    1.00  17.9 s  18.1 s      0.99x     1.00x

An earlier run on two threads under a load average of 5-6 gave 1.59x at m = 0.2 (bound 1.69x)
with single full steps from 40 to 60 s; ``--quick --threads 1`` (256×256, s = 0.37) gave 1.28x
at m = 0.2 against a bound of 1.42x (90%): at 256 px the blocks are too small a share of the
step for 1.5x to be possible. Record bytes per template (fp16, every token covered) at 512:
Y 44.1 MiB a step, 2.15 GiB for 50 steps; Y + K/V 132.2 MiB a step, 6.45 GiB. A 10-step Y
record (441 MiB) loads from the activation store's host tier in 2 µs (a lookup) and from its
disk tier in 0.38 s (page cache dropped, CRC checked: 1.12 GiB/s; 1.21 s under the heavier
load of the earlier run), so a whole 50-step record takes about 2 s from disk.

**SDXL and accelerators.** ``--arch sdxl`` builds SDXL base 1.0's UNet instead (the config of
``benchmarks/_fullsize.py``'s ``ARCHS["sdxl"]``: 2.57 B parameters, cross-attention 2048,
the text-time added conditioning, here a random (2, 1280) pooled embedding and (2, 6) time
ids; ``--size`` defaults to 1024). ``--device cuda`` puts the model, its inputs and the
replayed record on the GPU: the record is recorded to the host in float16 as the worker keeps
it and copied to the device before the timed steps (InstGenIE prefetches a step's cache while
the step before it runs; ``--record-on host`` leaves it on the host, so every replayed block
copies its rows in the timed step). On CUDA every timing synchronises the device before it
reads the clock, each case runs once untimed first, and s is timed with CUDA events around
the blocks. ``--dtype`` is fp32 by default on the CPU and fp16 on CUDA; ``--threads`` applies
to the CPU only. ``--json PATH`` writes the figures (per m: full and cached ms, speed-up,
bound; s; record bytes a step; the store's load times). ``--load-steps`` defaults to 2 for
SDXL, whose Y record at 1024 is about 0.4 GiB a step.

    .venv/bin/python benchmarks/bench_editing.py --arch sdxl --device cuda --repeats 5 \
        --json sdxl.json                                       # 1024×1024, fp16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import drop_page_cache, load_line, machine_line

from argus.worker.editing.masked_blocks import (
    ActivationRecord,
    Replay,
    plan_tokens,
    recording,
    transformer_blocks,
)

# Stable Diffusion 1.5's UNet (runwayml/stable-diffusion-v1-5, unet/config.json), in code
SD15_UNET: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    "up_block_types": (
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "act_fn": "silu",
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "mid_block_scale_factor": 1,
}
RATIOS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)
HEADLINE = 0.2  # the goal: at m = 0.2, ≥ 80% of the bound and ≥ 1.5× faster


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_unet(
    seed: int,
    arch: str = "sd15",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The UNet of ``arch`` (sd15: :data:`SD15_UNET`; sdxl: ``_fullsize.ARCHS["sdxl"]``) with
    seeded random weights, initialised on ``device`` itself (SDXL's 2.57 B parameters are drawn
    by a GPU in a second, by a CPU in a minute), as ``dtype``."""
    from diffusers import UNet2DConditionModel

    if arch == "sdxl":
        from _fullsize import ARCHS

        config = ARCHS["sdxl"].unet
    else:
        config = SD15_UNET
    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**config).eval()
    return unet if dtype == torch.float32 else unet.to(dtype)


def record_on(record: ActivationRecord, device: str) -> ActivationRecord:
    """A copy of ``record`` whose rows live on ``device`` (coverage stays on the CPU)."""

    def moved(tensors: dict[tuple[int, int], torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
        return {key: tensor.to(device) for key, tensor in tensors.items()}

    return ActivationRecord(
        record.latent_size,
        dict(record.coverage),
        moved(record.outputs),
        moved(record.keys),
        moved(record.values),
    )


def centred_region(height: int, width: int, ratio: float) -> torch.Tensor:
    """1×1×height×width, 1 on a centred rectangle of the latent's aspect covering ``ratio``."""
    region = torch.zeros(1, 1, height, width)
    rows = min(height, max(1, round(height * math.sqrt(ratio))))
    cols = min(width, max(1, round(height * width * ratio / rows)))
    top, left = (height - rows) // 2, (width - cols) // 2
    region[..., top : top + rows, left : left + cols] = 1
    return region


def computed_share(unet: Any, record: ActivationRecord, region: torch.Tensor) -> float:
    """The share of the blocks' tokens a replay computes (over m: ceil pooling at the coarse
    resolutions widens the region by up to a token a side)."""
    plans = plan_tokens(region, record)
    counts = [record.outputs[(0, i)].shape[1] for i in range(len(transformer_blocks(unet)))]
    computed = total = 0
    for covered in counts:  # every token is covered in this record: its rows give L
        plan = plans[covered]
        computed += int(plan.computed.numel())
        total += plan.tokens
    return computed / total


_SYNC: list[Callable[[], None]] = []  # torch.cuda.synchronize when the run is on CUDA


def timed(call: Callable[[], Any]) -> float:
    for sync in _SYNC:  # the device idle before the clock starts and done before it stops
        sync()
    start = time.perf_counter()
    call()
    for sync in _SYNC:
        sync()
    return time.perf_counter() - start


def block_share_cuda(unet: Any, call: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """:func:`block_share` on CUDA: the blocks' time from CUDA events around each (the host's
    clock at a hook says when a kernel was queued, not when it ran)."""
    pairs: list[tuple[Any, Any]] = []

    def pre(module: Any, args: Any) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        pairs.append((start, None))

    def post(module: Any, args: Any, output: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        pairs[-1] = (pairs[-1][0], end)

    steps, shares = [], []
    with hooks_on_blocks(unet, pre, post):
        for _ in range(repeats):
            pairs.clear()
            seconds = timed(call)  # synchronises: every event has completed
            inside = sum(start.elapsed_time(end) for start, end in pairs) / 1e3
            steps.append(seconds)
            shares.append(inside / seconds)
    return statistics.median(steps), statistics.median(shares)


@contextlib.contextmanager
def hooks_on_blocks(unet: Any, pre: Callable[..., Any], post: Callable[..., Any]) -> Iterator[None]:
    """``pre`` and ``post`` as forward hooks on every BasicTransformerBlock, for the block."""
    handles = []
    for block in transformer_blocks(unet):
        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def block_share(unet: Any, call: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median full step seconds, median share of it inside the BasicTransformerBlocks)."""
    if _SYNC:
        return block_share_cuda(unet, call, repeats)
    inside = [0.0]
    began: list[float] = []

    def pre(module: Any, args: Any) -> None:
        began.append(time.perf_counter())

    def post(module: Any, args: Any, output: Any) -> None:
        inside[0] += time.perf_counter() - began.pop()

    steps, shares = [], []
    with hooks_on_blocks(unet, pre, post):
        for _ in range(repeats):
            inside[0] = 0.0
            seconds = timed(call)
            steps.append(seconds)
            shares.append(inside[0] / seconds)
    return statistics.median(steps), statistics.median(shares)


def record_bytes(record: ActivationRecord, keys_values: bool) -> int:
    """Bytes of one step's record in one mode (keys and values dropped for the Y mode)."""
    if keys_values:
        return record.nbytes
    return ActivationRecord(record.latent_size, record.coverage, record.outputs).nbytes


def store_load(record: ActivationRecord, steps: int, repeats: int) -> dict[str, float]:
    """Load a template's record of ``steps`` steps (the one recorded step copied under each
    step's names) from the activation store's host tier and disk tier."""
    try:
        from argus.worker.editing.activation_store import ActivationStore
    except ImportError:
        print("activation store: argus/worker/editing/activation_store.py not present; not timed")
        return {}
    one = {k: v for k, v in record.to_tensors().items() if not k.endswith((".k", ".v"))}
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in one.items():
        if name.startswith("s0."):
            for step in range(steps):
                flat[f"s{step}.{name[3:]}"] = tensor
        else:
            flat[name] = tensor
    nbytes = sum(t.nbytes for t in flat.values())
    print(f"activation store: a {steps}-step Y record of {nbytes / 2**20:.0f} MiB", flush=True)
    figures: dict[str, float] = {"steps": steps, "bytes": nbytes}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        host = ActivationStore(2 * nbytes)
        host.put("template", flat)
        seconds = [timed(lambda: host.get("template")) for _ in range(repeats)]
        figures["host_ms"] = statistics.median(seconds) * 1e3
        print(f"  host tier: median {figures['host_ms']:.3f} ms (a lookup)")
        host.close()
        disk = ActivationStore(1, Path(tmp), 4 * nbytes)
        disk.put("template", flat)
        seconds = []
        for _ in range(repeats):
            drop_page_cache(Path(tmp))  # cold: the files' pages out of the page cache
            seconds.append(timed(lambda: disk.get("template")))
        median = statistics.median(seconds)
        print(
            f"  disk tier (page cache dropped, CRC checked): median {median:.2f} s, "
            f"{nbytes / median / 2**30:.2f} GiB/s"
        )
        disk.close()
        figures["disk_s"] = median
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=("sd15", "sdxl"), default="sd15", help="the UNet")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="fp32 on cpu, fp16 on cuda"
    )
    parser.add_argument(
        "--record-on",
        choices=("device", "host"),
        default="device",
        help="where the replayed record lives (a GPU run; see above)",
    )
    parser.add_argument("--quick", action="store_true", help="256 px, 3 repeats")
    parser.add_argument(
        "--size", type=int, default=None, help="image side (default 512; sdxl 1024)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timings per case (5)")
    parser.add_argument("--steps", type=int, default=50, help="steps of a whole run (bytes)")
    parser.add_argument(
        "--load-steps", type=int, default=None, help="steps of the loaded record (10; sdxl 2)"
    )
    parser.add_argument(
        "--kv-ratios", default="0.2", help="mask ratios also timed in K/V mode (comma-separated)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads on the CPU (default torch's); 1 on a machine other work loads",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    xl = args.arch == "sdxl"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]
    size = args.size or (256 if args.quick else 1024 if xl else 512)
    repeats = args.repeats or (3 if args.quick else 5)
    load_steps = args.load_steps or (2 if xl else 10)
    kv_ratios = {float(r) for r in args.kv_ratios.split(",") if r}
    if cuda:
        if device.index is not None:
            torch.cuda.set_device(device)
        _SYNC.append(torch.cuda.synchronize)
    elif args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    where = (
        f"{torch.cuda.get_device_name(device)}" if cuda else f"{torch.get_num_threads()} threads"
    )
    print(
        f"torch {torch.__version__}, {where}; {args.arch}, {str(dtype)[6:]}, {size}×{size}, CFG 2",
        flush=True,
    )

    def show(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms" if cuda else f"{seconds:.2f} s"

    built = time.perf_counter()
    unet = build_unet(args.seed, args.arch, args.device, dtype)
    params = sum(p.numel() for p in unet.parameters())
    print(
        f"UNet: {params / 1e9:.3f} B parameters, built in {time.perf_counter() - built:.1f} s",
        flush=True,
    )
    side = size // 8
    generator = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(2, 4, side, side, generator=generator).to(device, dtype)
    cross = 2048 if xl else 768
    embeds = torch.randn(2, 77, cross, generator=generator).to(device, dtype)
    t = torch.tensor(500, device=device)
    extra: dict[str, Any] = {}
    if xl:  # SDXL's text-time conditioning: pooled OpenCLIP embedding, size/crop/target ids
        time_ids = torch.tensor([size, size, 0, 0, size, size], dtype=torch.float32)
        extra["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, 1280, generator=generator).to(device, dtype),
            "time_ids": time_ids.repeat(2, 1).to(device, dtype),
        }

    def step() -> None:
        unet(latents, t, encoder_hidden_states=embeds, return_dict=False, **extra)

    figures: dict[str, Any] = {
        "arch": args.arch,
        "size": size,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype)[6:],
        "torch": torch.__version__,
        "threads": None if cuda else torch.get_num_threads(),
        "repeats": repeats,
        "record_on": args.record_on if cuda else "host",
        "unet_params": params,
    }
    with torch.inference_mode():
        step()  # warm-up
        if cuda:
            step()
        full_s, share = block_share(unet, step, repeats)
        print(
            f"full step: median {show(full_s)}; s (BasicTransformerBlocks' share) = {share:.3f}",
            flush=True,
        )
        figures.update(full_ms=full_s * 1e3, s=share)
        record = ActivationRecord((side, side))
        with recording(unet, record, 0, None, keys_values=True):
            step()  # the template's run: every token covered
        y_bytes, kv_bytes = record_bytes(record, False), record_bytes(record, True)
        figures.update(y_bytes_per_step=y_bytes, kv_bytes_per_step=kv_bytes)
        print(
            f"record a step (fp16): Y {y_bytes / 2**20:.1f} MiB, "
            f"Y + K/V {kv_bytes / 2**20:.1f} MiB",
            flush=True,
        )
        replayed = record_on(record, args.device) if cuda and args.record_on == "device" else record

        rows = []
        for ratio in RATIOS:
            region = centred_region(side, side, ratio)
            replays = {"y": Replay(unet, replayed, region, keys_values=False)}
            if ratio in kv_ratios:
                replays["kv"] = Replay(unet, replayed, region, keys_values=True)
            if cuda:  # first calls of new shapes (index kernels, cuDNN plans) untimed
                for replay in replays.values():
                    with replay.step(0):
                        step()
            times: dict[str, list[float]] = {"full": [], **{mode: [] for mode in replays}}
            for _ in range(repeats):  # alternate, so a load change hits every case alike
                times["full"].append(timed(step))
                for mode, replay in replays.items():
                    with replay.step(0):
                        times[mode].append(timed(step))
            medians = {mode: statistics.median(seconds) for mode, seconds in times.items()}
            bound = 1 / (1 - share * (1 - ratio))
            speedup = medians["full"] / medians["y"]
            rows.append((ratio, medians, bound, speedup))
            kv = (
                f"; K/V {show(medians['kv'])}, {medians['full'] / medians['kv']:.2f}x"
                if "kv" in medians
                else ""
            )
            computed = computed_share(unet, record, region)
            print(
                f"m={ratio:.2f} (tokens computed {computed:.3f}): "
                f"full {show(medians['full'])}, Y {show(medians['y'])}, "
                f"speed-up {speedup:.2f}x, bound {bound:.2f}x{kv}",
                flush=True,
            )
            figures.setdefault("ratios", []).append(
                {
                    "m": ratio,
                    "tokens_computed": computed,
                    "full_ms": medians["full"] * 1e3,
                    "cached_ms": medians["y"] * 1e3,
                    "speedup": speedup,
                    "bound": bound,
                    "of_bound": speedup / bound,
                    **(
                        {
                            "kv_ms": medians["kv"] * 1e3,
                            "kv_speedup": medians["full"] / medians["kv"],
                        }
                        if "kv" in medians
                        else {}
                    ),
                }
            )
        del replayed, replays

    print()
    for ratio, medians, bound, speedup in rows:
        if ratio == HEADLINE:
            print(
                f"m={ratio}: speed-up {speedup:.2f}x, bound {bound:.2f}x, "
                f"{100 * speedup / bound:.0f}% of bound"
            )
            if "kv" not in medians:
                continue
            kv_gain = 100 * (1 - medians["kv"] / medians["y"])
            print(
                f"K/V mode vs Y mode at m={ratio}: {show(medians['kv'])} vs {show(medians['y'])} "
                f"({kv_gain:+.1f}% time saved by K/V) for {kv_bytes / y_bytes:.1f}x the bytes"
            )
    print(
        f"cache bytes per template (fp16, every token covered): Y {y_bytes / 2**20:.1f} MiB a "
        f"step, {args.steps * y_bytes / 2**30:.2f} GiB for {args.steps} steps; Y + K/V "
        f"{kv_bytes / 2**20:.1f} MiB a step, {args.steps * kv_bytes / 2**30:.2f} GiB",
        flush=True,
    )
    if args.json:  # written before the store's load, so a slow disk costs no figures
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    figures["store_load"] = store_load(record, load_steps, repeats)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures: {args.json}")
    print(load_line("end"))


if __name__ == "__main__":
    main()
