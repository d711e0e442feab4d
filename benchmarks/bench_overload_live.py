"""Overload on a real cluster: ``argus up``'s processes (allocator, ControlNet service, tiny-model
workers running diffusers on this CPU, the router with its default classifier), offered more
than they can serve. Unlike ``bench_overload.py`` (stub workers), the workers really denoise,
and the profile the router starts from (GPU latencies) is wrong for them: the run shows
whether the router learns their real speed in time to keep overload to fast refusals.

1. **Closed loop**: after ``--warmup-s`` of traffic, ``4 × workers`` clients send back to
   back for ``--capacity-s``: a first capacity.
2. **Settling**: Poisson arrivals at ``--load`` × that for ``--settle-s`` (longer than the
   allocator's 60 s period, so it plans for the overload). **Capacity** is then Σ over
   workers of 1 / their mean service time (``total_ms - queue_ms``) over the last 20 s.
3. **Overload**: Poisson arrivals at ``--load`` × capacity for ``--duration-s``, each with
   ``deadline_ms`` = ``--deadline-ms`` and a gRPC timeout 5 s longer (a DEADLINE_EXCEEDED is
   the router's answer, not the client giving up); then the open calls are waited for.

Per ``--window-s`` window (by completion) it prints served/s, its share of capacity and how
busy the workers were; then over the overload's requests: each worker's service times; the
refusals (RESOURCE_EXHAUSTED with a ``retry-after-ms`` hint, or DEADLINE_EXCEEDED in under
1 s) and their p50 / p95; the admitted (served, or failed after 1 s) and the share late; the
share of offered requests answered DEADLINE_EXCEEDED at the full deadline or never answered,
and refused only after more than 1 s; served throughput over the run as a share of capacity.
Targets: ≥ 90% of capacity in every window, late ≤ 1% of admitted, refusal p95 ≤ 50 ms, no
answer at the full deadline that the router could have refused at arrival.

Placement (the header says which ran): unpinned by default. ``--pin``: the router alone on
the first CPU; workers, ControlNet, allocator and this load generator on the others, as a
node honouring the Helm chart's CPU requests would (``_pinning``). ``--noisy-neighbour``: a
CPU-bound busy loop on the workers' CPUs (any CPU unpinned) at their nice, started before
the cluster, so the capacity is measured beside it; its CPU share is printed. With
``--neighbour-joins-s S`` it starts S s into the overload instead: the workers slow while
requests wait for them, the case the router's late binding is for.

    .venv/bin/python benchmarks/bench_overload_live.py [--workers 2] [--steps 30] [--load 3]
        [--duration-s 60] [--capacity-s 20] [--warmup-s 10] [--settle-s 90]
        [--deadline-ms 30000] [--window-s 10] [--no-controlnet] [--compute-nice 10] [--seed 0]
        [--late-binding-window N] [--pin] [--noisy-neighbour [--neighbour-joins-s S]]

Figures are for this machine: its processes share its cores; the load average is printed.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from _machine import load_line, machine_line
from _pinning import (
    NoisyNeighbour,
    add_window_argument,
    mode_line,
    pin_this_process,
    split_cpus,
)

from argus.plumbing import rpc
from argus.tools.client import generate_request, retry_after
from argus.tools.local_cluster import ClusterSpec, LocalCluster
from argus.traces import default_prompt_trace, load_prompts

router_pb2_grpc: Any = rpc.load("router_pb2_grpc")

EARLY_S = 1.0  # a DEADLINE_EXCEEDED sooner than this was refused at arrival, not run out


@dataclass
class Outcome:
    sent: float
    done: float = math.nan
    code: grpc.StatusCode | None = None
    retry_hint: bool = False
    worker: str = ""  # the worker that served it
    service_s: float = 0.0  # its time there from taking the worker's slot to the answer
    details: str = ""  # a refusal's or failure's words

    @property
    def latency_s(self) -> float:
        return self.done - self.sent


class Offered:
    """Requests sent through one stub, their outcomes recorded as they complete."""

    def __init__(self, stub: Any, prompts: list[str], steps: int | None, deadline_ms: int):
        self.stub = stub
        self.prompts = prompts
        self.steps = steps
        self.deadline_ms = deadline_ms
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._open = 0
        self._idle = threading.Condition(self._lock)
        self._sent = 0

    def send(self, on_done: Any = None) -> None:
        i = self._sent
        self._sent += 1
        request = generate_request(
            self.prompts[i % len(self.prompts)],
            seed=i,
            steps=self.steps,
            deadline_ms=self.deadline_ms,
        )
        outcome = Outcome(time.monotonic())
        with self._lock:
            self.outcomes.append(outcome)
            self._open += 1
        future = self.stub.Generate.future(request, timeout=self.deadline_ms / 1e3 + 5.0)

        def finished(done: Any) -> None:
            outcome.done = time.monotonic()
            err = done.exception()
            outcome.code = grpc.StatusCode.OK if err is None else err.code()
            outcome.retry_hint = err is not None and retry_after(err) is not None
            outcome.details = "" if err is None else str(err.details() or "")
            if err is None:
                response = done.result()
                timing = response.timing.worker
                outcome.worker = response.worker_id
                outcome.service_s = (timing.total_ms - timing.queue_ms) / 1e3
            with self._lock:
                self._open -= 1
                self._idle.notify_all()
            if on_done is not None:
                on_done()

        future.add_done_callback(finished)

    def wait_all(self, timeout_s: float) -> None:
        with self._lock:
            self._idle.wait_for(lambda: self._open == 0, timeout=timeout_s)


def measure_capacity(offered: Offered, clients: int, seconds: float) -> float:
    """Answers a second with ``clients`` requests always open (closed loop)."""
    stop_at = time.monotonic() + seconds
    start = time.monotonic()
    first = len(offered.outcomes)

    def again() -> None:
        if time.monotonic() < stop_at:
            offered.send(again)

    for _ in range(clients):
        offered.send(again)
    offered.wait_all(seconds + offered.deadline_ms / 1e3 + 10.0)
    outcomes = offered.outcomes[first:]
    served = sum(1 for o in outcomes if o.code is grpc.StatusCode.OK and o.done <= stop_at)
    return served / (stop_at - start)


def served_capacity(outcomes: list[Outcome], lo: float, hi: float) -> float:
    """Requests a second the workers could serve at the levels they ran between ``lo`` and
    ``hi``: Σ over workers of 1 / their mean service time on the requests they served then."""
    by_worker: dict[str, list[float]] = {}
    for o in outcomes:
        if o.code is grpc.StatusCode.OK and lo <= o.done < hi and o.service_s > 0:
            by_worker.setdefault(o.worker, []).append(o.service_s)
    return sum(len(times) / sum(times) for times in by_worker.values())


def overload(offered: Offered, rate: float, seconds: float, seed: int) -> float:
    """Poisson arrivals at ``rate`` a second for ``seconds``; returns the start time."""
    rng = random.Random(seed)
    start = time.monotonic()
    at = start
    while True:
        at += rng.expovariate(rate)
        if at - start >= seconds:
            break
        pause = at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        offered.send()
    return start


def served_some(capacity: float, when: str) -> None:
    """SystemExit unless ``capacity`` > 0: with no request served there is no rate to offer
    a multiple of (the phase was shorter than one request on this machine)."""
    if not capacity > 0:
        raise SystemExit(
            f"no request was served {when}: a request takes longer than that phase here; "
            "give --warmup-s, --capacity-s and --settle-s more seconds (or --steps fewer)"
        )


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def report(
    every: list[Outcome], first: int, start: float, seconds: float, window_s: float,
    capacity: float, deadline_s: float,
) -> dict[str, Any]:  # fmt: skip
    """The windows over every answer (the settling phase's too, by completion), the rest over
    the requests sent from ``first`` on."""
    ok = grpc.StatusCode.OK
    outcomes = every[first:]
    windows = []
    print(
        f"{'window':>10} {'offered/s':>10} {'served/s':>9} {'of capacity':>12} {'workers busy':>13}"
    )
    for k in range(math.ceil(seconds / window_s)):
        lo, hi = start + k * window_s, start + min((k + 1) * window_s, seconds)
        offered_n = sum(1 for o in outcomes if lo <= o.sent < hi)
        served_n = sum(1 for o in every if o.code is ok and lo <= o.done < hi)
        span = hi - lo
        share = served_n / span / capacity
        windows.append(share)
        busy = served_n / span / max(served_capacity(every, lo, hi), 1e-9)
        print(
            f"{k * window_s:>4.0f}-{(k * window_s + span):<4.0f}s {offered_n / span:>10.2f} "
            f"{served_n / span:>9.2f} {share:>11.0%} {busy:>12.0%}"
        )

    def refused(o: Outcome) -> bool:
        early_deadline = o.code is grpc.StatusCode.DEADLINE_EXCEEDED and o.latency_s < EARLY_S
        return o.code is grpc.StatusCode.RESOURCE_EXHAUSTED or early_deadline

    refusals = [o for o in outcomes if refused(o)]
    admitted = [o for o in outcomes if o.code is not None and not refused(o)]
    late = [
        o for o in admitted if (o.code is ok and o.latency_s > deadline_s) or (o.code is not ok)
    ]
    at_deadline = [
        o
        for o in outcomes
        if o.code is grpc.StatusCode.DEADLINE_EXCEEDED and o.latency_s >= 0.9 * deadline_s
    ]
    served = [o for o in admitted if o.code is ok]
    unanswered = [o for o in outcomes if o.code is None]
    slow_refusals = [o for o in refusals if o.latency_s > EARLY_S]
    served_in_run = sum(1 for o in every if o.code is ok and start <= o.done < start + seconds)
    answers = Counter(
        f"{'?' if o.code is None else o.code.name}{'+hint' if o.retry_hint else ''}"
        for o in outcomes
    )
    print("answers: " + ", ".join(f"{name} {n}" for name, n in sorted(answers.items())))
    for worker in sorted({o.worker for o in served}):
        times = [o.service_s for o in served if o.worker == worker]
        print(
            f"{worker}: {len(times)} served, service time mean {sum(times) / len(times):.3f} s, "
            f"p50 {pct(times, 50):.3f}, p90 {pct(times, 90):.3f}, max {max(times):.3f}"
        )

    def of_offered(n: int) -> float:
        return n / len(outcomes) if outcomes else 0.0

    figures = {
        "requests": len(outcomes),
        "served": len(served),
        "served_p50_s": pct([o.latency_s for o in served], 50),
        "served_p95_s": pct([o.latency_s for o in served], 95),
        "refused": len(refusals),
        "refused_with_hint": sum(o.retry_hint for o in refusals),
        "refusal_p50_ms": pct([o.latency_s * 1e3 for o in refusals], 50),
        "refusal_p95_ms": pct([o.latency_s * 1e3 for o in refusals], 95),
        "admitted": len(admitted),
        "late": len(late),
        "late_share": len(late) / len(admitted) if admitted else 0.0,
        "deadline_exceeded_at_full_deadline": len(at_deadline),
        "at_full_deadline_or_unanswered_share": of_offered(len(at_deadline) + len(unanswered)),
        "refused_after_1s": len(slow_refusals),
        "refused_after_1s_share": of_offered(len(slow_refusals)),
        "min_window_share": min(windows) if windows else math.nan,
        "served_share_of_capacity": served_in_run / seconds / capacity,
        "unanswered": len(unanswered),
    }
    print(
        f"served {figures['served']} of {figures['requests']} (latency p50 "
        f"{figures['served_p50_s']:.2f} s, p95 {figures['served_p95_s']:.2f} s); refused "
        f"{figures['refused']} ({figures['refused_with_hint']} with a retry hint), refusal p50 "
        f"{figures['refusal_p50_ms']:.1f} ms, p95 {figures['refusal_p95_ms']:.1f} ms; admitted "
        f"{figures['admitted']}, late {figures['late']} ({figures['late_share']:.2%}); "
        f"DEADLINE_EXCEEDED at the full deadline: {figures['deadline_exceeded_at_full_deadline']}"
        f"; unanswered {figures['unanswered']}; lowest window {figures['min_window_share']:.0%} "
        "of capacity"
    )
    print(
        f"of the {figures['requests']} offered: at the full deadline or never answered "
        f"{len(at_deadline) + len(unanswered)} "
        f"({figures['at_full_deadline_or_unanswered_share']:.2%}); refused after more than "
        f"{EARLY_S:g} s {figures['refused_after_1s']} ({figures['refused_after_1s_share']:.2%}); "
        f"served {served_in_run / seconds:.2f} requests/s over the {seconds:.0f} s = "
        f"{figures['served_share_of_capacity']:.0%} of the capacity"
    )
    for o in slow_refusals[:5]:  # why the router refused them so late
        print(f"  refused after {o.latency_s:.1f} s: {o.details[:160]}")
    return figures


def router_refusals(metrics_port: int | None) -> str:
    """The router's own time per refusal (``argus_router_refusal_seconds``, the whole run), as
    the bucket bounds its p50 and p95 fall in: what of a refusal's latency is the router's."""
    if metrics_port is None:
        return "router metrics off"
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    buckets = [
        (float(m.group(1)), float(m.group(2)))
        for m in re.finditer(r'argus_router_refusal_seconds_bucket\{le="([^"]+)"\} (\S+)', text)
    ]
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return "no refusal in the router's histogram"

    def bound(q: float) -> str:
        edge = next(le for le, count in buckets if count >= q * total)
        return "> 1 s" if math.isinf(edge) else f"≤ {edge * 1e3:g} ms"

    return f"in the router's core: {total:.0f} refusals, p50 {bound(0.5)}, p95 {bound(0.95)}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="the workers' default steps")
    parser.add_argument("--load", type=float, default=3.0, help="offered load × capacity")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=90.0,
        help="overload before measuring capacity (longer than a planning period: the plan "
        "the allocator makes for the overload sets the capacity)",
    )
    parser.add_argument("--deadline-ms", type=int, default=30_000)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--no-controlnet", action="store_true", help="as argus up --no-controlnet")
    parser.add_argument(
        "--compute-nice",
        type=int,
        default=ClusterSpec.compute_nice,
        help="as argus up --compute-nice (0: the workers compete with the router as equals)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--neighbour-joins-s",
        type=float,
        default=None,
        metavar="S",
        help="with --noisy-neighbour: start it S seconds into the overload instead of before "
        "the cluster, so the workers slow while requests wait for them",
    )
    add_window_argument(parser)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the router on the first CPU alone; workers, ControlNet, allocator and this load "
        "generator on the others",
    )
    parser.add_argument(
        "--noisy-neighbour",
        action="store_true",
        help="a CPU-bound busy loop on the workers' CPUs at their nice value, the whole run",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts = [record.prompt for record in load_prompts(default_prompt_trace())]
    random.Random(args.seed).shuffle(prompts)
    pinned = split_cpus() if args.pin else None
    neighbour = NoisyNeighbour(None if pinned is None else pinned[1], args.compute_nice)
    print(mode_line(pinned, "workers, ControlNet, allocator and the load generator"))
    joins = args.neighbour_joins_s if args.noisy_neighbour else None
    when = "" if joins is None else f", joining {joins:g} s into the overload"
    print(neighbour.describe() + when if args.noisy_neighbour else "noisy neighbour: none")
    window = "default" if args.late_binding_window is None else args.late_binding_window
    print(f"router late-binding window: {window}")
    with tempfile.TemporaryDirectory(prefix="argus-overload-") as workdir:
        spec = ClusterSpec(
            workdir=Path(workdir),
            workers=args.workers,
            default_steps=args.steps,
            controlnet=not args.no_controlnet,
            router_http_port=None,
            compute_nice=args.compute_nice,
            router_args=()
            if args.late_binding_window is None
            else ("--late-binding-window", str(args.late_binding_window)),
            router_cpus=None if pinned is None else pinned[0],
            compute_cpus=None if pinned is None else pinned[1],
        )
        if pinned is not None:
            pin_this_process(pinned[1])  # before the cluster's channels start their threads
        began = time.monotonic()
        with (
            neighbour if args.noisy_neighbour and joins is None else nullcontext(),
            LocalCluster(spec) as cluster,  # started, every worker ready
        ):
            print(f"cluster ready in {time.monotonic() - began:.1f} s; {machine_line()}")
            with cluster.channel() as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                offered = Offered(stub, prompts, None, args.deadline_ms)
                clients = 4 * args.workers
                measure_capacity(offered, clients, args.warmup_s)
                closed = measure_capacity(offered, clients, args.capacity_s)
                print(
                    f"closed-loop capacity {closed:.2f} requests/s ({clients} clients back to "
                    f"back, {args.capacity_s:.0f} s, {args.steps} steps, 64 × 64)"
                )
                served_some(closed, "in --capacity-s")
                start = overload(offered, args.load * closed, args.settle_s, args.seed)
                settled = time.monotonic()
                capacity = served_capacity(offered.outcomes, settled - 20.0, settled)
                print(
                    f"capacity under overload {capacity:.2f} requests/s (Σ 1 / mean service time "
                    f"of each worker's last 20 s, after {args.settle_s:.0f} s at "
                    f"{args.load:g} × {closed:.2f})"
                )
                served_some(capacity, "in the settling's last 20 s")
                first = len(offered.outcomes)
                late_neighbour = None if joins is None else threading.Timer(joins, neighbour.start)
                if late_neighbour is not None:
                    late_neighbour.start()
                try:
                    start = overload(offered, args.load * capacity, args.duration_s, args.seed + 1)
                    offered.wait_all(args.deadline_ms / 1e3 + 15.0)
                    if args.noisy_neighbour:
                        print(neighbour.usage_line())
                finally:
                    if late_neighbour is not None:
                        late_neighbour.cancel()
                        late_neighbour.join()
                        neighbour.stop()
                print(
                    f"{args.load:g} × {capacity:.2f} requests/s for {args.duration_s:.0f} s, "
                    f"deadline {args.deadline_ms} ms; {load_line('end')}"
                )
                print(router_refusals(cluster.parts["router"].metrics_port))
                figures = report(
                    offered.outcomes, first, start, args.duration_s, args.window_s, capacity,
                    args.deadline_ms / 1e3,
                )  # fmt: skip
        placement = {"pinned": pinned, "noisy_neighbour": args.noisy_neighbour}
        return {"closed_loop_capacity": closed, "capacity": capacity, **placement, **figures}


if __name__ == "__main__":
    main()
