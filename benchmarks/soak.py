"""Soak: a local cluster (`argus up`'s processes) under overload for minutes, with the memory
of every process sampled as it runs.

Starts a :class:`~argus.tools.local_cluster.LocalCluster` on the embedded defaults, measures its
capacity closed-loop (four callers per worker, so no worker waits for work, for
``--capacity-s``; the allocator re-plans to faster levels as the queues build, so capacity is
the throughput over the last third of that time, once the plan has adapted), then offers
``--load`` × that capacity open-loop (Poisson arrivals, at most ``--max-outstanding`` calls in
flight; arrivals beyond that count as dropped by the client) for ``--minutes``. Every
``--sample-s`` it reads the resident memory (VmRSS) of every process of the cluster and their
children (the workers' LoRA loaders) and prints one row; at the end, the served / refused /
failed counts per minute and each process's memory growth: the slope of a least-squares line
over the run's second half (after warm-up), in MB per minute, with its standard error and the
samples' scatter around the line, and a verdict. A process is **flat** when that slope is at
most ``--flat-mb-per-min`` (0.2 MB/min: under 2 MB over a 10-minute run, the size of one
sample's scatter in a worker); a larger slope within two standard errors of it is reported
as not beyond the noise.

``--probe-dir DIR`` runs ``benchmarks/_memprobe`` in every process of the cluster (a
``sitecustomize`` on their ``PYTHONPATH``): every ``--probe-s`` it writes the resident memory,
what glibc's malloc has handed out and holds free, Python's live blocks and objects, and the
object types that grew since mid-run; the soak prints a summary per process. Growth of live
objects is a leak; RSS that grows while the live memory does not is the allocator's retention.
``--malloc-arena-max N`` sets ``MALLOC_ARENA_MAX`` for the cluster (the processes cap their
arenas at 2 themselves, :mod:`argus.plumbing.heap`, unless it is set).

The workers' approximate cache keeps every generated latent up to ``--cache-max-entries``
(the product's default is 100,000, many hours of this load): until it is full a worker's memory
grows by design. The soak bounds it low (1,000 by default) so that it fills in the first
minutes and what grows after that is a leak.

    python benchmarks/soak.py [--minutes 10] [--load 2.0] [--workers 2] [--sample-s 30]
        [--probe-dir DIR] [--malloc-arena-max N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _machine import machine_line

from argus import defaults
from argus.tools.client import Connection, RequestFailed, RouterClient
from argus.tools.local_cluster import ClusterSpec, LocalCluster

FLAT_MB_PER_MIN = 0.2  # see main's --flat-mb-per-min and the README's soak paragraph


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def memory(cluster: LocalCluster) -> dict[str, float]:
    """MB per process: each part, and its children as PART/child-N."""
    out: dict[str, float] = {}
    for name, part in cluster.parts.items():
        mb = rss_mb(part.process.pid)
        if mb is not None:
            out[name] = mb
        for i, child in enumerate(sorted(children(part.process.pid))):
            mb = rss_mb(child)
            if mb is not None:
                out[f"{name}/child-{i}"] = mb
    return out


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


class Offered:
    """Open-loop sender: outcomes per minute since ``start``."""

    def __init__(self, client: RouterClient, prompts: list[str], max_outstanding: int) -> None:
        self.client = client
        self.prompts = prompts
        self.slots = threading.BoundedSemaphore(max_outstanding)
        self.pool = ThreadPoolExecutor(max_outstanding, thread_name_prefix="soak")
        self.lock = threading.Lock()
        self.per_minute: dict[int, Counter[str]] = {}
        self.answer_bytes = 0  # serialized size of the served answers (what the router keeps)
        self.start = time.monotonic()

    def count(self, outcome: str, at: float) -> None:
        minute = int((at - self.start) // 60)
        with self.lock:
            self.per_minute.setdefault(minute, Counter())[outcome] += 1

    def send(self, i: int) -> None:
        try:
            answer = self.client.generate(
                self.prompts[i % len(self.prompts)], seed=i, timeout_s=60.0
            )
            with self.lock:
                self.answer_bytes += answer.ByteSize()
            outcome = "served"
        except RequestFailed as err:
            outcome = "refused" if err.code.name == "RESOURCE_EXHAUSTED" else err.code.name
        finally:
            self.slots.release()
        self.count(outcome, time.monotonic())

    def offer(self, rate: float, seconds: float, rng: random.Random) -> None:
        end = self.start + seconds
        at = self.start
        i = 0
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            if not self.slots.acquire(blocking=False):
                self.count("dropped by client", at)
                continue
            self.pool.submit(self.send, i)
            i += 1
        self.pool.shutdown(wait=True)


def capacity(client: RouterClient, prompts: list[str], callers: int, seconds: float) -> float:
    """Requests served per second with ``callers`` closed-loop callers, over the last third
    of ``seconds``."""
    served = 0
    lock = threading.Lock()
    began = time.monotonic()
    end = began + seconds
    counted_from = began + 2 * seconds / 3

    def caller(k: int) -> None:
        nonlocal served
        i = k
        while time.monotonic() < end:
            try:
                client.generate(prompts[i % len(prompts)], seed=i, timeout_s=60.0)
            except RequestFailed:
                time.sleep(0.05)
                continue
            if time.monotonic() >= counted_from:
                with lock:
                    served += 1
            i += callers

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return served / (time.monotonic() - counted_from)


@dataclass(frozen=True)
class Growth:
    """One process's memory over the second half of the run (after warm-up)."""

    slope: float  # least-squares slope, MB per minute
    stderr: float  # the slope's standard error from the fit's residuals, MB per minute
    noise: float  # standard deviation of the samples around the line, MB

    def verdict(self, flat_mb_per_min: float) -> str:
        """``flat`` when the slope is at most ``flat_mb_per_min``; a larger slope that two
        standard errors would bring under it is reported as within the noise."""
        if self.slope <= flat_mb_per_min:
            return "flat"
        if self.slope - 2.0 * self.stderr <= flat_mb_per_min:
            return "GROWS? (within 2 standard errors of flat)"
        return "GROWS"


def growth(samples: list[tuple[float, float]]) -> Growth:
    """Fit (seconds, MB) over the second half of the samples; NaN with fewer than 3."""
    half = samples[len(samples) // 2 :]
    if len(half) < 3:
        return Growth(float("nan"), float("nan"), float("nan"))
    t = np.array([s for s, _ in half]) / 60.0
    mb = np.array([m for _, m in half])
    slope, intercept = np.polyfit(t, mb, 1)
    residuals = mb - (slope * t + intercept)
    noise = float(np.sqrt(np.sum(residuals**2) / (len(half) - 2)))
    stderr = noise / float(np.sqrt(np.sum((t - t.mean()) ** 2)))
    return Growth(float(slope), stderr, noise)


def probe_summary(directory: Path) -> None:
    """Per process: the probe's first and last line, and the types that grew the most."""
    print(f"\nprobe ({directory}): first -> last sample per process")
    keys = (
        "rss_mb",
        "anon_mb",
        "malloc_used_mb",
        "malloc_free_mb",
        "mmap_mb",
        "py_blocks",
        "gc_objects",
    )
    for path in sorted(directory.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line]
        if not lines:
            continue
        first, last = lines[0], lines[-1]
        print(f"  {last['role']} (pid {path.stem}, t {first['t']:.0f} -> {last['t']:.0f} s)")
        for key in keys:
            if key in last:
                print(f"    {key:<16} {first[key]:>12} -> {last[key]:>12}")
        if "rss_after_trim_mb" in last:
            print(f"    rss after malloc_trim: {last['rss_after_trim_mb']} MB")
        print(f"    grown since mid-run: {last['types']}")
        if "trace" in last:
            print(f"    traced {last['traced_mb']} MB; since mid-run (KB): {last['trace']}")


def environment_for_cluster(args: argparse.Namespace) -> None:
    """Set what the cluster's processes inherit: the allocator's arena bound and the probe."""
    if args.malloc_arena_max is not None:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    if args.probe_dir is None:
        return
    args.probe_dir.mkdir(parents=True, exist_ok=True)
    probe = Path(__file__).resolve().parent / "_memprobe"
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{probe}{os.pathsep}{path}" if path else str(probe)
    os.environ["ARGUS_MEMPROBE_DIR"] = str(args.probe_dir)
    os.environ["ARGUS_MEMPROBE_S"] = str(args.probe_s)
    # growth counts from the middle of the run: the slope's half
    os.environ["ARGUS_MEMPROBE_BASE_S"] = str(args.capacity_s + 30.0 * args.minutes)
    os.environ["ARGUS_MEMPROBE_TRIM"] = "1" if args.probe_trim else "0"
    os.environ["ARGUS_MEMPROBE_TRACE"] = "1" if args.probe_trace else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=2.0, help="offered / measured capacity")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="denoising steps (argus up's)")
    parser.add_argument("--capacity-s", type=float, default=120.0)
    parser.add_argument("--cache-max-entries", type=int, default=1000)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--max-outstanding", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--period-s",
        type=float,
        default=defaults.PLANNING_PERIOD_S,
        help="the allocator's planning period (backlogs and load surges still re-plan)",
    )
    parser.add_argument(
        "--flat-mb-per-min",
        type=float,
        default=FLAT_MB_PER_MIN,
        help="the largest second-half slope a process may have and be called flat",
    )
    parser.add_argument(
        "--max-id-bytes",
        type=int,
        help="the router's --max-id-bytes (answers kept for retries; default: the router's)",
    )
    parser.add_argument(
        "--malloc-arena-max", type=int, help="MALLOC_ARENA_MAX for the cluster's processes"
    )
    parser.add_argument(
        "--probe-dir",
        type=Path,
        help="run benchmarks/_memprobe in every process, writing its JSON lines here",
    )
    parser.add_argument("--probe-s", type=float, default=30.0, help="seconds between probes")
    parser.add_argument("--probe-trim", action="store_true", help="malloc_trim(0) each probe")
    parser.add_argument("--probe-trace", action="store_true", help="tracemalloc, one frame")
    args = parser.parse_args()
    environment_for_cluster(args)

    from argus.cli.up import demo_prompts

    print(machine_line())
    print(f"start: {load_average()}")
    prompts = demo_prompts(200)
    with tempfile.TemporaryDirectory(prefix="argus-soak-") as tmp:
        spec = ClusterSpec(
            workdir=Path(tmp),
            workers=args.workers,
            default_steps=args.steps,
            metrics=False,
            period_s=args.period_s,
            worker_args=("--cache-max-entries", str(args.cache_max_entries)),
            router_args=()
            if args.max_id_bytes is None
            else ("--max-id-bytes", str(args.max_id_bytes)),
        )
        with LocalCluster(spec) as cluster, RouterClient(Connection(cluster.router)) as client:
            cap = capacity(client, prompts, 4 * args.workers, args.capacity_s)
            rate = args.load * cap
            print(
                f"capacity {cap:.2f} req/s ({args.workers} workers, {args.steps} steps, "
                f"cache bound {args.cache_max_entries}, "
                f"{4 * args.workers} closed-loop callers, last third of {args.capacity_s:.0f} s); "
                f"offering {rate:.2f} req/s ({args.load}x) for {args.minutes} min"
            )
            offered = Offered(client, prompts, args.max_outstanding)
            sender = threading.Thread(
                target=offered.offer,
                args=(rate, args.minutes * 60.0, random.Random(args.seed)),
            )
            sender.start()
            series: dict[str, list[tuple[float, float]]] = {}
            names: list[str] = []
            while sender.is_alive():
                now = time.monotonic() - offered.start
                sample = memory(cluster)
                for name, mb in sample.items():
                    series.setdefault(name, []).append((now, mb))
                    if name not in names:
                        names.append(name)
                if len(series[names[0]]) == 1:
                    print("t (s)  " + "  ".join(f"{n:>16}" for n in names) + "   (RSS, MB)")
                row = "  ".join(f"{sample.get(n, float('nan')):16.1f}" for n in names)
                print(f"{now:5.0f}  {row}", flush=True)
                sender.join(args.sample_s)
            print("\nminute  " + "  ".join(f"{k:>10}" for k in ("served", "refused", "other")))
            for minute in sorted(offered.per_minute):
                c = offered.per_minute[minute]
                other = sum(v for k, v in c.items() if k not in ("served", "refused"))
                print(f"{minute:6d}  {c['served']:10d}  {c['refused']:10d}  {other:10d}")
            totals: Counter[str] = sum(offered.per_minute.values(), Counter())
            print(f"totals over the run: {dict(totals)}")
            if totals["served"]:
                mean_kb = offered.answer_bytes / totals["served"] / 1024
                print(f"served answers: {mean_kb:.1f} KB each on average (serialized)")
            print(
                "\nmemory growth over the second half (MB/min, least squares; "
                f"flat: slope <= {args.flat_mb_per_min} MB/min):"
            )
            for name in names:
                samples = series[name]
                fit = growth(samples)
                print(
                    f"  {name:<20} {samples[0][1]:8.1f} -> {samples[-1][1]:8.1f} MB  "
                    f"slope {fit.slope:+.2f} ± {fit.stderr:.2f} MB/min "
                    f"(noise {fit.noise:.2f} MB)  {fit.verdict(args.flat_mb_per_min)}"
                )
            print("level switches (the workers' 'plan N: serving' log lines):")
            for name, part in cluster.parts.items():
                if name.startswith("worker"):
                    print(f"  {name:<20} {part.log_text().count(': serving ')}")
    print(f"end: {load_average()}")
    if args.probe_dir is not None:
        probe_summary(args.probe_dir)


if __name__ == "__main__":
    main()
