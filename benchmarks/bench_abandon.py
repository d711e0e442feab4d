"""Abandoned work on a worker (issue 29, point 2): a 2048×2048 request with a 2 s deadline.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_abandon.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_abandon.py --repeats 5 --no-baseline

The worker is the one ``argus up`` starts (tiny models with random weights, the approximate
cache on, default level ``ac-k0`` on ``tiny:sdxl``), on this machine's CPU, called through
:meth:`Worker.generate` (the gRPC servicer only adds a token whose deadline is the call's).
It first measures, on a 2048×2048 request of 2 steps without a deadline, one step's time, the
longest UNet block inside a step (the most a stop can wait for) and the decode (VAE and PNG).
Then, ``--repeats`` times per mode, it sends a 2048×2048 request of 50 steps whose deadline is
2 s away and, 0.1 s later, a 64×64 request of 10 steps that queues behind it, and prints:

* **freed after deadline**: when the large request's ``generate`` raised (the GPU slot is
  released before it does) minus its deadline; negative when it was refused before it;
* **next queue**: the 64×64 request's ``queue_ms``, its wait for the GPU slot;
* **next started after deadline**: when the 64×64 request got the slot, minus the deadline.

Modes:

* ``predicted``: the worker as it is; the 2048×2048 decode alone is predicted to need more
  than 2 s (:class:`~argus.worker.decode_times.DecodeTimes`), so the request is refused on arrival;
* ``checkpoints``: the decode prediction off (a fresh ``DecodeTimes`` with seed 0), so the
  request denoises until its deadline and stops at the next checkpoint (block) of its step;
* ``step-boundary`` (the baseline, off with ``--no-baseline``): also the checkpoints inside a
  step off, so the request stops only at the next step boundary, as before this change.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from _machine import load_line, machine_line

from argus.contracts.generate import GenerateCall, GenerateResult
from argus.worker.app import WorkerSettings, build_worker
from argus.worker.decode_times import DecodeTimes
from argus.worker.engine import Worker
from argus.worker.models.pipelines import CHECKPOINT_MODULES, CancelToken

SIZE = 2048
DEADLINE_S = 2.0
LARGE_STEPS = 50
NEXT_DELAY_S = 0.1  # the small request arrives this long after the large one


@dataclass(frozen=True)
class Trial:
    stopped: str  # how the large request ended: the exception's class and stage
    steps_done: int
    freed_after_s: float
    next_queue_s: float
    next_started_after_s: float


def step_figures(worker: Worker) -> tuple[float, float, float]:
    """(one step's time, the longest UNet block, the decode) at 2048×2048, in seconds."""
    model = worker.registry.active()
    assert model is not None
    blocks: list[float] = []
    began: dict[int, float] = {}

    def before(module: Any, args: Any) -> None:
        began[id(module)] = time.perf_counter()

    def after(module: Any, args: Any, out: Any) -> None:
        blocks.append(time.perf_counter() - began.pop(id(module)))

    handles = []
    for module in model.pipeline.unet.modules():
        if type(module).__name__ in CHECKPOINT_MODULES:
            handles += [
                module.register_forward_pre_hook(before),
                module.register_forward_hook(after),
            ]
    try:
        result = worker.generate(GenerateCall("a lighthouse", width=SIZE, height=SIZE, steps=2))
    finally:
        for handle in handles:
            handle.remove()
    t = result.timing_ms
    return t["denoise_ms"] / 2e3, max(blocks), t["decode_ms"] / 1e3


def trial(worker: Worker) -> Trial:
    """One large request with its deadline and one small request behind it."""
    ended: list[tuple[float, BaseException | GenerateResult]] = []
    token = CancelToken(deadline=time.monotonic() + DEADLINE_S)

    def large() -> None:
        call = GenerateCall("a huge lighthouse", width=SIZE, height=SIZE, steps=LARGE_STEPS)
        try:
            outcome: BaseException | GenerateResult = worker.generate(call, token)
        except Exception as err:
            outcome = err
        ended.append((time.monotonic(), outcome))

    thread = threading.Thread(target=large)
    thread.start()
    time.sleep(NEXT_DELAY_S)
    sent = time.monotonic()
    small = worker.generate(GenerateCall("next", width=64, height=64, steps=10))
    thread.join()
    assert token.deadline is not None
    ((at, outcome),) = ended
    queue_s = small.timing_ms["queue_ms"] / 1e3
    stage = getattr(outcome, "stage", "")
    return Trial(
        stopped=f"{type(outcome).__name__} ({stage})" if stage else type(outcome).__name__,
        steps_done=getattr(outcome, "steps_done", -1),
        freed_after_s=at - token.deadline,
        next_queue_s=queue_s,
        next_started_after_s=sent + queue_s - token.deadline,  # admission ≈ sending
    )


def report(mode: str, trials: list[Trial]) -> None:
    def figure(values: list[float]) -> str:
        return f"median {statistics.median(values):+.2f} s, max {max(values):+.2f} s"

    print(
        f"{mode}: {len(trials)} trials; large request: {sorted({t.stopped for t in trials})}"
        f", steps done {[t.steps_done for t in trials]}"
    )
    print(f"  freed after deadline:        {figure([t.freed_after_s for t in trials])}")
    print(f"  next started after deadline: {figure([t.next_started_after_s for t in trials])}")
    print(f"  next queue (queue_ms):       {figure([t.next_queue_s for t in trials])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip step-boundary mode")
    args = parser.parse_args()
    print(machine_line())
    began = time.perf_counter()
    worker = build_worker(WorkerSettings(model="tiny"))
    try:
        print(
            f"worker built in {time.perf_counter() - began:.1f} s; warm-up {worker.warm_up():.1f} s"
        )
        step_s, block_s, decode_s = step_figures(worker)
        print(
            f"at {SIZE}x{SIZE}: one step {step_s:.2f} s, longest UNet block {block_s:.2f} s, "
            f"decode (VAE and PNG) {decode_s:.2f} s; predicted decode now "
            f"{worker.decode_times.predict_s(SIZE * SIZE):.2f} s"
        )
        report("predicted", [trial(worker) for _ in range(args.repeats)])
        worker.decode_times = DecodeTimes(0.0)
        report("checkpoints", [trial(worker) for _ in range(args.repeats)])
        if not args.no_baseline:
            model = worker.registry.active()
            assert model is not None
            # the hooks check the watch they were installed with; runs now set a new one's
            # token, so the checkpoints inside a step never see it (private: a bench's switch)
            hooked, model._watch = model._watch, type(model._watch)()
            try:
                report("step-boundary", [trial(worker) for _ in range(args.repeats)])
            finally:
                model._watch = hooked
    finally:
        worker.close()
    print(load_line("end"))


if __name__ == "__main__":
    main()
