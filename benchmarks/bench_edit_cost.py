"""Step time of a batch of masked edits against batch size and mask ratio: the measured points
that argus/sim/edits.py fits its edit cost model on (issue 33, item 3).

SD-1.5's full-width UNet (the configuration in benchmarks/bench_editing.py, random seeded
weights, float32, CPU, nothing downloaded) at ``--size`` pixels. A batch of b edits is one UNet
call on 2b rows (each edit's CFG pair). For each b and mask ratio m a template record of that
batch is taken once, then the replay step (the mask-aware activation cache: every block computes
the region's tokens only) is timed ``--repeats`` times and the median printed; m = 1 is the full
step (a miss). Every edit in a batch has the same m here, so the batch's mask sum is b·m.

    .venv/bin/python benchmarks/bench_edit_cost.py            # 256 px, b 1/2/4, 3 repeats

``--batcher MODELS`` measures instead through the worker's own step batcher
(``argus/worker/editing/step_batch.py``, the path ``argus worker --edit-batch`` serves edits on):
for
each model (a tiny variant's name, as a CPU worker serves it, or ``sd15-arch``), b inpainting
edits of one recorded template at ratio m join one batch, each replaying the record on its own
rows (m = 1: full steps, no record), and the median of ``--repeats`` whole steps (the batched
UNet call, guidance, the schedulers, the blends) is one point. A ``full:NAME`` model is the
profile's full-size architecture of NAME (``benchmarks/_fullsize.py``, random seeded weights)
at its native size unless ``--size`` is given; with ``--device cuda`` it is built on the GPU in
float16 and every timed step ends in a synchronize. ``--write-table FILE`` writes the curves as
the table workers read with ``--edit-batch-table``
(``argus/profiles/batch_curve.py``), and each curve's bound and fitted cost model are printed:

    .venv/bin/python benchmarks/bench_edit_cost.py --batcher sdxl,sd-2.0,sd-1.5,tiny-sd \
        --size 64 --batches 1,2,4,8 --ratios 0.1,0.2,1.0 --repeats 7 \
        --write-table argus/profiles/edit-batching-cpu.toml
    python benchmarks/bench_edit_cost.py --batcher full:sd-1.5,full:sdxl --device cuda \
        --batches 1,2,3,4,5,6,7,8 --ratios 0.1,0.2,1.0 --repeats 5 \
        --write-table argus/profiles/edit-batching-h200.toml           # on a GPU

``--mixed ROUNDS`` times batches that mix mask ratios, or full runs with replays, on
``sd15-arch`` at 64 px through the step batcher, against batches of copies of one edit and the
CPU table's price for the same size and mask sum (:func:`measure_mixed`; about 1 minute a
round on 2 vCPUs):

    .venv/bin/python benchmarks/bench_edit_cost.py --mixed 6 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line
from bench_editing import build_unet, centred_region

from argus.profiles.batch_curve import BatchCurve, CurvePoint, dump_batch_table, load_batch_table
from argus.profiles.edit_cost import fit_cost_model
from argus.request_limits import EditInput
from argus.worker.editing.activation_cache import EditCache
from argus.worker.editing.activation_store import ActivationStore
from argus.worker.editing.masked_blocks import ActivationRecord, Replay, recording
from argus.worker.editing.step_batch import StepBatcher
from argus.worker.models.pipelines import DiffusionModel, GenerationSpec


def batcher_model(name: str, device: str) -> DiffusionModel:
    """A tiny variant as a CPU worker serves it, ``sd15-arch`` (bench_edit_serving's), or
    ``full:NAME``: the full-size architecture on ``device`` (float16 on a GPU)."""
    if name.startswith("full:"):
        from _fullsize import build_pipeline
        from _gpu_worker import install_minilm_stub

        install_minilm_stub()  # the tokenizer's files, where the MiniLM package is not installed

        arch = name.partition(":")[2]
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        pipeline = build_pipeline(arch, device=device, dtype=dtype)
        return DiffusionModel(arch, pipeline, device=device, source=arch)
    from bench_edit_serving import build_model

    return build_model("sd15" if name == "sd15-arch" else f"tiny:{name}")


def model_size(name: str, size: int | None) -> int:
    """``--size``, else a full-size model's native side, else 64 (the tiny variants')."""
    if size:
        return size
    if name.startswith("full:"):
        from _fullsize import native_size

        return native_size(name.partition(":")[2], tiny=False)
    return 64


def measure_curve(
    model: DiffusionModel,
    size: int,
    batches: list[int],
    ratios: list[float],
    repeats: int,
    seed: int,
    device: str = "cpu",
) -> BatchCurve:
    """The step batcher's seconds a step for every (b, m) on ``model`` at ``size``; on a GPU
    each timed step ends in a synchronize (``gpu_profile.Clock``)."""
    from bench_edit_serving import region_rect
    from gpu_profile import Clock

    clock = Clock(device)
    rgb = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    steps = repeats + 2  # one step to join, ``repeats`` timed, one spare
    cache = EditCache(ActivationStore(8 * 2**30))

    def spec(index: int, ratio: float) -> GenerationSpec:
        edit = EditInput(rgb, region_rect(size, ratio), 1.0)
        return GenerationSpec(
            f"edit {index}", seed=index, height=size, width=size, steps=steps, edit=edit
        )

    points = []
    for ratio in ratios:
        key = cache.key(model, spec(0, ratio), adapters=False)
        assert key is not None, "the model's blocks cannot replay"
        if ratio < 1.0:  # the template's record, taken by a run alone
            use = cache.begin(model, spec(0, ratio), key, was_present=False)
            model.denoise(spec(0, ratio), predictor=use.predictor)
            use.finish()
        for b in batches:
            batcher = StepBatcher(model, b)

            chosen: list[str] = []  # Algorithm 1's choice for each joining edit

            def join(ratio: float = ratio, key: str = key, chosen: list[str] = chosen) -> Any:
                if ratio >= 1.0:
                    return None
                use = cache.begin(model, spec(0, ratio), key, was_present=True, batched=True)
                chosen.append(f"{use.blocks_cached}/{use.blocks}")
                return use.rows

            for index in range(b):
                batcher.submit(spec(index + 1, ratio), key=index, on_join=join)
            # the untimed first step: every request joins and runs its first step
            seconds = clock.time(batcher.step, repeats)
            batcher.run_until_idle()
            median = statistics.median(seconds)
            points.append(CurvePoint(b, ratio, median))
            replayed = f", blocks replayed {chosen[0]}" if chosen else ""
            print(
                f"{model.name} {size}px b={b} m={ratio:.2f}: {median * 1e3:.2f} ms{replayed}",
                flush=True,
            )
    return BatchCurve(model.name, size, size, tuple(points), steps)


# Mixed batches (``--mixed``): (label, the edits' mask ratios; 1.0 is a full run, no record)
MIXES = (
    ("2 replays, same", (0.11, 0.11)),
    ("2 replays, mixed", (0.02, 0.26)),
    ("1 full + 1 replay", (1.0, 0.11)),
    ("2 full", (1.0, 1.0)),
    ("4 replays, same", (0.11, 0.11, 0.11, 0.11)),
    ("4 replays, mixed", (0.02, 0.05, 0.11, 0.26)),
    ("2 full + 2 replays", (1.0, 1.0, 0.11, 0.11)),
    ("4 full", (1.0, 1.0, 1.0, 1.0)),
)


@dataclass(frozen=True)
class MixedRow:
    label: str
    mask_sum: float  # the edits' effective ratios (whole latent cells), a full run counting 1
    seconds: list[float]  # every timed step
    table_s: float  # the CPU table's price (nan: no curve for the model and size)


def measure_mixed(
    model: DiffusionModel, size: int, rounds: int, seed: int
) -> tuple[list[MixedRow], dict[str, int]]:
    """Step time of batches that mix mask ratios, or full runs with replays, against batches of
    copies of one edit (what the curve measures) and the CPU table's price for the same batch
    size and mask sum (``BatchCurve.step_s``). The mixes take turns, ``rounds`` times, so the
    machine's drift falls on all of them alike; two templates, each recorded once with a one-cell
    region (so an edit computes its own region's tokens only), the replays alternating between
    them. Each turn: one untimed step where every edit joins, then two timed steps. Returns a
    row per mix and the cache's counts (a replay is a hit)."""
    from bench_edit_serving import CPU_TABLE, region_rect

    curve = load_batch_table(CPU_TABLE).curve(model.name, size, size)
    rng = np.random.default_rng(seed)
    templates = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(2)]
    cache = EditCache(ActivationStore(8 * 2**30))
    cells = (size // 8) ** 2

    def spec(index: int, ratio: float, steps: int = 4) -> GenerationSpec:
        edit = EditInput(templates[index % 2], region_rect(size, ratio), 1.0)
        return GenerationSpec(
            f"edit {index}", seed=index, height=size, width=size, steps=steps, edit=edit
        )

    def effective(ratio: float) -> float:  # the ratio region_rect's whole cells give
        return 1.0 if ratio >= 1.0 else float(region_rect(size, ratio)[::8, ::8].sum()) / cells

    for index in range(2):
        first = spec(index, 1 / cells)
        key = cache.key(model, first, adapters=False)
        assert key is not None, "the model's blocks cannot replay"
        use = cache.begin(model, first, key, was_present=False)
        model.denoise(first, predictor=use.predictor)
        use.finish()
    seconds: dict[str, list[float]] = {label: [] for label, _ in MIXES}
    for _ in range(rounds):
        for label, ratios in MIXES:
            batcher = StepBatcher(model, len(ratios))
            for index, ratio in enumerate(ratios):
                edit = spec(index, ratio)
                key = cache.key(model, edit, adapters=False)

                def join(
                    edit: GenerationSpec = edit, key: Any = key, full: bool = ratio >= 1
                ) -> Any:
                    if full:
                        return None
                    return cache.begin(model, edit, key, was_present=True, batched=True).rows

                batcher.submit(edit, key=index, on_join=join)
            batcher.step()  # every edit joins
            for _ in range(2):
                start = time.perf_counter()
                batcher.step()
                seconds[label].append(time.perf_counter() - start)
            batcher.run_until_idle()
    rows = []
    for label, ratios in MIXES:
        mask_sum = sum(effective(r) for r in ratios)
        table = curve.step_s(len(ratios), mask_sum) if curve is not None else float("nan")
        rows.append(MixedRow(label, mask_sum, seconds[label], table))
    return rows, cache.counts()


def print_mixed(rows: list[MixedRow]) -> None:
    print(f"{'batch':22s} {'mask sum':>8s} {'median s':>9s} {'min s':>7s} {'table s':>8s}")
    for row in rows:
        print(
            f"{row.label:22s} {row.mask_sum:8.3f} {statistics.median(row.seconds):9.3f}"
            f" {min(row.seconds):7.3f} {row.table_s:8.3f}",
            flush=True,
        )


def run_batcher(args: argparse.Namespace, batches: list[int], ratios: list[float]) -> None:
    curves = []
    with torch.inference_mode():
        for name in args.batcher.split(","):
            try:  # one model that fails (memory, a kernel) leaves the others' curves
                model = batcher_model(name, args.device)
                size = model_size(name, args.size)
                curve = measure_curve(
                    model, size, batches, ratios, args.repeats, args.seed, args.device
                )
            except Exception:
                traceback.print_exc()
                print(f"{name}: failed, no curve", flush=True)
                continue
            fitted = curve.cost_model()
            print(
                f"{name}: bound {curve.bound()} at m=0.11 (knee, 10% more edits a second);"
                f" fit a={fitted.base_s * 1e3:.2f} p={fitted.per_edit_s * 1e3:.2f}"
                f" c={fitted.per_mask_s * 1e3:.2f} ms, R2={fitted.r2:.4f}",
                flush=True,
            )
            curves.append(curve)
            if args.write_table:  # after each model, so a run cut short keeps what it measured
                write_table(args, curves)
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


def write_table(args: argparse.Namespace, curves: list[BatchCurve]) -> None:
    size = f" --size {args.size}" if args.size else ""
    where = f" --device {args.device}" if args.device != "cpu" else ""
    source = (
        f"benchmarks/bench_edit_cost.py --batcher {args.batcher}{size}{where}"
        f" --batches {args.batches} --ratios {args.ratios} --repeats {args.repeats}"
    )
    if args.device.startswith("cuda"):
        gpu = f"{torch.cuda.get_device_name(args.device)}, float16, CUDA {torch.version.cuda}"
    else:
        gpu = f"{torch.get_num_threads()} threads"
    device = f"{machine_line()}; torch {torch.__version__}, {gpu}"
    Path(args.write_table).write_text(dump_batch_table(curves, source, device))
    print(f"wrote {args.write_table}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--size", type=int, default=None, help="image side (256; --batcher: the model's own)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--batches", default="1,2,4", help="batch sizes (edits, CFG 2 each)")
    parser.add_argument("--ratios", default="0.1,0.2,0.4,1.0", help="mask ratios")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batcher", help="models measured through the step batcher (see above)")
    parser.add_argument("--write-table", help="with --batcher: the table file to write")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--mixed", type=int, default=0, help="ROUNDS: mixed batches of sd15-arch at 64 px (above)"
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), flush=True)
    if args.mixed:
        with torch.inference_mode():
            rows, _ = measure_mixed(batcher_model("sd15-arch", "cpu"), 64, args.mixed, args.seed)
        print_mixed(rows)
        print(load_line("end"))
        return
    if args.batcher:
        run_batcher(args, batches, ratios)
        print(load_line("end"))
        return
    args.size = args.size or 256
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.size} px, CFG 2")
    unet = build_unet(args.seed)
    side = args.size // 8
    t = torch.tensor(500)
    points: list[tuple[int, float, float]] = []
    with torch.inference_mode():
        for b in batches:
            generator = torch.Generator().manual_seed(args.seed + b)
            latents = torch.randn(2 * b, 4, side, side, generator=generator)
            embeds = torch.randn(2 * b, 77, 768, generator=generator)

            def step(latents: torch.Tensor = latents, embeds: torch.Tensor = embeds) -> None:
                unet(latents, t, encoder_hidden_states=embeds, return_dict=False)

            step()  # warm-up
            record = ActivationRecord((side, side))
            with recording(unet, record, 0, None, keys_values=False):
                step()
            for ratio in ratios:
                seconds = []
                replay = Replay(unet, record, centred_region(side, side, ratio), keys_values=False)
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    if ratio >= 1.0:
                        step()
                    else:
                        with replay.step(0):
                            step()
                    seconds.append(time.perf_counter() - start)
                median = statistics.median(seconds)
                points.append((b, b * ratio, median))
                print(
                    f"b={b} m={ratio:.2f} sum_m={b * ratio:.2f}: {median * 1e3:.1f} ms", flush=True
                )
    model = fit_cost_model(points)
    print(
        f"fit t = a + p*b + c*sum_m: a={model.base_s * 1e3:.1f} ms, p={model.per_edit_s * 1e3:.1f} "
        f"ms, c={model.per_mask_s * 1e3:.1f} ms, R2={model.r2:.4f}"
    )
    print("points (b, sum_m, seconds):", [(b, round(s, 3), round(x, 4)) for b, s, x in points])
    print(load_line("end"))


if __name__ == "__main__":
    main()
