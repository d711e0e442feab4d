"""One Poisson edit workload served by one in-process model, engines side by side (issue 33,
items 1-2): one request at a time (today's worker: ``DiffusionModel.denoise`` then decode),
static batching, step-level continuous batching (``argus/worker/step_batch.py``), and
continuous batching with decoding off the loop (a decode thread).

The workload: Poisson arrivals at ``--load`` times the rate one-at-a-time serving can sustain
(its service time measured first on the same model), inpainting edits whose mask ratios are
drawn as the simulator draws them (``argus/sim/edits.py``'s ``draw_mask_ratios``: Beta, mean
0.11 for ``--masks production``, 0.19 for ``public``) on a few templates of Zipf popularity,
and a share (``--img2img``) of img2img edits at strengths 0.5 and 0.75 (they run fewer steps:
requests of different lengths share a batch). Every engine serves the same requests at the
same arrival times in real time; an answer is done when its image is decoded, the template
pasted back outside the region and the PNG encoded (the post-processing a worker does).

Per engine: mean and P95 latency (arrival to PNG), mean and P95 queueing delay (arrival to
joining a batch, or to starting alone), time in service (``in svc``: from then to the
PNG), throughput (answers over the run's span), mean batch,
the batching overhead per step (``ovh``: time in the batcher outside the UNet call, the
schedulers' steps and the admitted requests' preparation; that is admission, concatenation,
splitting, guidance, hooks, bookkeeping) and the preparation per step (``prep``: text and
template encoding of the requests admitted, in the loop). ``continuous-b1`` is the step
batcher at bound 1, to compare with today's loop (the issue asks for it within 5%).

Every request runs the full UNet: the mask-aware cache's replay is not in the batch yet, so a
small mask does not make a step cheaper here, and on a CPU a batched UNet call costs about the
sum of its rows (little to gain from batching itself); what the engines change is who waits
for whom. ``--model sd15`` swaps in the editing benchmark's SD-1.5-architecture UNet
(``bench_editing.SD15_UNET``, random weights, with a 768-wide 2-layer text encoder and the tiny
VAE) at ``--size`` (default 128 for it: one 512 step is ~19 s on one core).

    .venv/bin/python benchmarks/bench_edit_serving.py --model tiny          # ~2-3 min
    .venv/bin/python benchmarks/bench_edit_serving.py --model sd15 --duration 120

Figures: 2 vCPU x86_64 shared with a CI run, torch 1 thread. Default run (``--model tiny``:
64 px, 10 steps, 25 s of arrivals, load 0.8, bound 4; 2 min 11 s; load average 0.62 1.06 1.38
at the start, 0.62 0.92 1.28 at the end); one inpainting alone 73 ms, 277 requests at
10.95/s, mask ratio mean 0.117; seconds, ``ovh`` and ``prep`` ms a step (this run predates
the ``in svc`` column):

    engine                    mean    P95     queue   q P95   req/s  batch  ovh   prep
    one-at-a-time             0.162   0.347   0.092   0.271   11.05  1      -     -
    static                    0.114   0.182   0.031   0.082   11.05  1.25   0.25  1.13
    continuous                0.097   0.143   0.004   0.013   11.04  1.54   0.27  1.40
    continuous+decode-thread  0.147   0.285   0.004   0.013   11.05  1.54   0.44  1.46
    continuous-b1             0.232   0.597   0.156   0.518   11.04  1.00   0.24  0.95

Continuous against static: P95 21% lower (23% in an earlier run: 0.144 against 0.186 s; the
issue's goal is 25%), mean queueing 13% of static's (goal: at most half), overhead 0.27 ms a
step (goal: at most 1.2 ms). Bound 1 against today: at load 0.8 one request's latency is
mostly queueing, which swings run to run (here 0.232 against 0.162 s; a paired 8 s run gave
0.188 and 0.188 against 0.196 and 0.178 s), so compare the time in service: 74-75 ms against
73-75 ms in that paired run, 75 against 71 ms in a 2 s smoke run, and 69.2 against 69.0 ms
(median of 10 sequential runs, no queue): within 0-6%, not settled by these short runs.
Decoding on a thread made things worse on this CPU: the decode thread takes the model's lock
between steps and competes for the same two cores and the GIL, where InstGenIE's
post-processing runs in another process beside a GPU that keeps stepping.

``--model sd15 --size 64 --steps 4 --duration 150 --load 0.9 --engines
one-at-a-time,static,continuous`` (8 min 24 s; load average 1.68 1.52 1.41 at the start, 0.82
0.99 1.18 at the end): one inpainting alone 5.99 s, 26 requests at 0.15/s. SD-1.5's UNet on
an 8×8 latent reads its 3.4 GB of weights for a few rows, so a batch costs much less than its
rows (one UNet call: 1.47 s for 1 request, 1.79 s for 2, 2.42 s for 4, measured):

    engine                    mean    P95     queue   q P95   in svc  req/s  batch  ovh   prep
    one-at-a-time             16.36   31.92   10.46   25.48   5.91    0.15   1      -     -
    static                     8.93   13.87    2.40    6.21   6.54    0.18   1.28   0.33  17.2
    continuous                 7.42    9.56    0.63    1.76   6.80    0.18   1.44   0.35  19.1

Continuous P95 31% below static's, mean queueing 26% of static's, overhead 0.35 ms a step:
the issue's goals hold here, on 26 requests (a P95 of 26 lies between the second and third
largest: read it as indicative). Bound 1 and the decode thread were not run on this model.
The goals' own setting, SD-1.5 at 512 px, is 19 s a step on this CPU: too slow to run a
workload here.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import load_line, machine_line

from argus.request_limits import EditInput
from argus.sim.edits import draw_mask_ratios, zipf_weights
from argus.worker.activation_store import ActivationStore
from argus.worker.edit_cache import EditCache, EditCacheUse
from argus.worker.pipelines import DiffusionModel, GenerationSpec, paste_unmasked
from argus.worker.step_batch import BatchResult, StepBatcher, StepStats

ENGINES = ("one-at-a-time", "static", "continuous", "continuous+decode-thread", "continuous-b1")


@dataclass(frozen=True)
class Arrival:
    at_s: float  # since the run's start
    spec: GenerationSpec


@dataclass
class Outcome:
    arrival_s: float
    started_s: float  # joined a batch, or started alone
    done_s: float  # PNG encoded


def build_model(kind: str) -> DiffusionModel:
    from argus.worker.models import (
        TINY_PREFIX,
        assemble_tiny_pipeline,
        build_tiny_part,
        build_tiny_pipeline,
        tiny_spec,
        tiny_tokenizer,
    )

    if kind.startswith("tiny"):  # "tiny" (the SD-1.5 stand-in) or "tiny:VARIANT"
        name = kind.partition(":")[2] or "sd-1.5"
        source = TINY_PREFIX + name
        return DiffusionModel(name, build_tiny_pipeline(source), device="cpu", source=source)
    source = TINY_PREFIX + "sd-1.5"
    from bench_editing import build_unet

    spec = dataclasses.replace(tiny_spec(source), text_hidden=768)
    tokenizer = tiny_tokenizer()
    parts = {part: build_tiny_part(spec, part, tokenizer) for part in spec.parts if part != "unet"}
    parts["unet"] = build_unet(0)  # SD-1.5's UNet: cross-attention 768, the text encoder's width
    pipeline = assemble_tiny_pipeline(spec, parts, "euler")
    return DiffusionModel("sd15-arch", pipeline, device="cpu", source="sd15-arch")


def region_rect(size: int, ratio: float) -> np.ndarray:
    """A top-left rectangle of about ``ratio`` of the image, whole 8-pixel latent cells."""
    cells = size // 8
    rows = max(1, min(cells, round(cells * np.sqrt(ratio))))
    cols = max(1, min(cells, round(cells * cells * ratio / rows)))
    region = np.zeros((size, size), dtype=bool)
    region[: rows * 8, : cols * 8] = True
    return region


def make_workload(args: argparse.Namespace, rate: float, rng: np.random.Generator) -> list[Arrival]:
    size = args.size
    templates = [
        rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(args.templates)
    ]
    popularity = zipf_weights(args.templates, 1.0)
    arrivals: list[Arrival] = []
    at = 0.0
    index = 0
    while True:
        at += float(rng.exponential(1.0 / rate))
        if at > args.duration:
            break
        template = templates[int(rng.choice(args.templates, p=popularity))]
        if rng.random() < args.img2img:
            edit = EditInput(template, None, float(rng.choice([0.5, 0.75])))
        else:
            ratio = float(draw_mask_ratios(args.masks, 1, rng)[0])
            edit = EditInput(template, region_rect(size, ratio), 1.0)
        spec = GenerationSpec(
            f"edit {index}", seed=index, height=size, width=size, steps=args.steps, edit=edit
        )
        arrivals.append(Arrival(at, spec))
        index += 1
    return arrivals


def finish(model: DiffusionModel, spec: GenerationSpec, latents: torch.Tensor) -> bytes:
    """Post-processing: decode, paste the template back outside the region, encode a PNG."""
    image = model.decode(latents)
    assert spec.edit is not None
    image = paste_unmasked(image, spec.edit)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def service_time(model: DiffusionModel, spec: GenerationSpec, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = model.denoise(spec, start_step=spec.start_step)
        finish(model, spec, result.latents)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def drive(arrivals: list[Arrival], submit: Callable[[int, float], None]) -> float:
    """Submit each request at its arrival time (real time); returns the run's start clock."""
    t0 = time.perf_counter()
    for index, arrival in enumerate(arrivals):
        delay = t0 + arrival.at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submit(index, t0 + arrival.at_s)
    return t0


def new_cache(enabled: bool) -> EditCache | None:
    """A fresh mask-aware activation cache for one engine's run (host memory, 4 GiB)."""
    return EditCache(ActivationStore(4 * 2**30)) if enabled else None


def cache_key(cache: EditCache | None, model: DiffusionModel, spec: GenerationSpec) -> str | None:
    return None if cache is None else cache.key(model, spec, adapters=False)


def run_alone(
    model: DiffusionModel, arrivals: list[Arrival], cache: EditCache | None
) -> tuple[list[Outcome], None]:
    """Today's worker: one request at a time, denoise (replaying or recording its template's
    activations when ``cache``) then post-process, on the device thread."""
    jobs: queue.Queue[tuple[int, float] | None] = queue.Queue()
    outcomes: list[Outcome | None] = [None] * len(arrivals)

    def device() -> None:
        while (job := jobs.get()) is not None:
            index, arrived = job
            spec = arrivals[index].spec
            started = time.perf_counter()
            key = cache_key(cache, model, spec)
            use = None
            if cache is not None and key is not None:
                use = cache.begin(model, spec, key, was_present=False)
            predictor = None if use is None else use.predictor
            result = model.denoise(spec, start_step=spec.start_step, predictor=predictor)
            finish(model, spec, result.latents)
            outcomes[index] = Outcome(arrived, started, time.perf_counter())
            if use is not None:
                use.finish()

    thread = threading.Thread(target=device)
    thread.start()
    drive(arrivals, lambda index, arrived: jobs.put((index, arrived)))
    jobs.put(None)
    thread.join()
    return [o for o in outcomes if o is not None], None


def run_batched(
    model: DiffusionModel,
    arrivals: list[Arrival],
    bound: int,
    cache: EditCache | None,
    *,
    static: bool,
    decode_thread: bool,
) -> tuple[list[Outcome], StepStats]:
    """The step batcher at ``bound``; with ``cache`` each inpainting edit replays or records
    its template's activations on its own rows of the batch, as the worker's edit lane does."""
    batcher = StepBatcher(model, bound, static=static)
    outcomes: list[Outcome | None] = [None] * len(arrivals)
    decodes: queue.Queue[tuple[int, float, BatchResult] | None] = queue.Queue()

    def post(index: int, arrived: float, result: BatchResult) -> None:
        finish(model, arrivals[index].spec, result.latents)
        outcomes[index] = Outcome(arrived, result.joined_s, time.perf_counter())

    def decoder() -> None:
        while (job := decodes.get()) is not None:
            post(*job)

    def submit(index: int, arrived: float) -> None:
        spec = arrivals[index].spec
        key = cache_key(cache, model, spec)
        uses: list[EditCacheUse] = []

        def join() -> Any:  # on the loop's thread
            if cache is None or key is None:
                return None
            uses.append(cache.begin(model, spec, key, was_present=False, batched=True))
            return uses[-1].rows

        future = batcher.submit(spec, key=index, on_join=join)

        def done(future: Any) -> None:  # runs on the loop's thread, after the step
            result = future.result()
            for use in uses:
                use.finish()
            if decode_thread:
                decodes.put((index, arrived, result))
            else:
                post(index, arrived, result)

        future.add_done_callback(done)

    stop = threading.Event()
    loop = threading.Thread(target=batcher.serve, args=(stop,))
    loop.start()
    helper = threading.Thread(target=decoder)
    if decode_thread:
        helper.start()
    drive(arrivals, submit)
    while sum(o is not None for o in outcomes) < len(arrivals):
        time.sleep(0.01)
    stop.set()
    loop.join()
    if decode_thread:
        decodes.put(None)
        helper.join()
    return [o for o in outcomes if o is not None], batcher.stats


def report(name: str, outcomes: list[Outcome], stats: StepStats | None) -> str:
    if not outcomes:
        return f"{name:26s} no requests (raise --duration)"
    latency = np.array([o.done_s - o.arrival_s for o in outcomes])
    queueing = np.array([max(0.0, o.started_s - o.arrival_s) for o in outcomes])
    service = np.array([o.done_s - max(o.started_s, o.arrival_s) for o in outcomes])
    span = max(o.done_s for o in outcomes) - min(o.arrival_s for o in outcomes)
    batch = f"{stats.rows / stats.steps:5.2f}" if stats and stats.steps else "    1"
    overhead = f"{stats.overhead_per_step_s * 1e3:6.2f}" if stats and stats.steps else "     -"
    prepare = f"{stats.prepare_s / stats.steps * 1e3:6.2f}" if stats and stats.steps else "     -"
    return (
        f"{name:26s} {latency.mean():7.3f} {np.percentile(latency, 95):7.3f}"
        f" {queueing.mean():7.3f} {np.percentile(queueing, 95):7.3f}"
        f" {service.mean():7.3f} {len(outcomes) / span:7.2f} {batch} {overhead} {prepare}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny (the SD-1.5 stand-in), tiny:VARIANT, or sd15"
    )
    parser.add_argument("--size", type=int, default=0, help="pixels (default 64 tiny, 128 sd15)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals")
    parser.add_argument("--load", type=float, default=0.8, help="of one-at-a-time's capacity")
    parser.add_argument("--bound", type=int, default=4)
    parser.add_argument("--masks", choices=("production", "public"), default="production")
    parser.add_argument("--img2img", type=float, default=0.2, help="share of img2img edits")
    parser.add_argument("--templates", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--no-edit-cache",
        action="store_true",
        help="every edit runs the full UNet (no mask-aware activation cache in any engine)",
    )
    args = parser.parse_args()
    args.size = args.size or (64 if args.model.startswith("tiny") else 128)
    torch.set_num_threads(args.threads)
    print(machine_line())
    model = build_model(args.model)
    rgb = np.random.default_rng(args.seed + 1).integers(0, 256, (args.size, args.size, 3), np.uint8)
    full = GenerationSpec(
        "probe",
        height=args.size,
        width=args.size,
        steps=args.steps,
        edit=EditInput(rgb, region_rect(args.size, 0.11), 1.0),
    )
    service_time(model, full, 1)  # warm up
    alone_s = service_time(model, full)
    # img2img runs fewer steps: the mean request is a little shorter than a full inpainting
    rate = args.load / alone_s
    arrivals = make_workload(args, rate, np.random.default_rng(args.seed))
    if not arrivals:
        raise SystemExit(f"no request arrives in {args.duration} s at {rate:.3f}/s")
    ratios = [
        a.spec.edit.mask_ratio
        for a in arrivals
        if a.spec.edit is not None and a.spec.edit.region is not None
    ]
    print(
        f"model {args.model} {args.size}px, {args.steps} steps, torch threads {args.threads};"
        f" one inpainting alone {alone_s * 1e3:.0f} ms (denoise + decode + PNG);"
        f" {len(arrivals)} requests over {args.duration:.0f} s at {rate:.2f}/s (load {args.load}"
        f" of one-at-a-time), mask ratio mean {np.mean(ratios):.3f}, {args.img2img:.0%} img2img;"
        f" batch bound {args.bound}; activation cache {'off' if args.no_edit_cache else 'on'}"
    )
    print(
        f"{'engine':26s} {'mean s':>7s} {'P95 s':>7s} {'queue':>7s} {'q P95':>7s}"
        f" {'in svc':>7s} {'req/s':>7s} {'batch':>5s} {'ovh ms':>6s} {'prep':>6s}"
    )
    for name in args.engines.split(","):
        cache = new_cache(not args.no_edit_cache)
        if name == "one-at-a-time":
            outcomes, stats = run_alone(model, arrivals, cache)
        else:
            bound = 1 if name == "continuous-b1" else args.bound
            outcomes, stats = run_batched(
                model,
                arrivals,
                bound,
                cache,
                static=name == "static",
                decode_thread=name == "continuous+decode-thread",
            )
        print(report(name, outcomes, stats), flush=True)
    print(load_line("end"))


if __name__ == "__main__":
    main()
