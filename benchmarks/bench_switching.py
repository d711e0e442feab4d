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
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass
from itertools import permutations

from _machine import load_line, machine_line

from argus.worker.models import TINY_PREFIX, TINY_VARIANTS
from argus.worker.registry import ModelRegistry

FAMILY = ("sd-1.5", "sd-1.4", "small-sd", "tiny-sd")  # one text encoder and VAE
THREE = ("sd-1.5", "sd-1.4", "small-sd")
SOURCES = {name: TINY_PREFIX + name for name in TINY_VARIANTS}


def registry(max_resident: int) -> ModelRegistry:
    return ModelRegistry(SOURCES, device="cpu", dtype="fp32", max_resident=max_resident)


@dataclass(frozen=True)
class Switch:
    seconds: float  # activate(B) until B is ready
    bytes: int  # the memory guard's count after it
    loaded: tuple[str, ...]  # the parts B's load loaded
    back_s: float  # then activate(A) until A is ready again (parts: A is still resident)


def switch(a: str, b: str, *, parts: bool) -> Switch:
    """Switch from ``a`` to ``b`` and back, whole pipelines or parts."""
    reg = registry(max_resident=len(SOURCES) if parts else 1)
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


def resident_bytes(names: tuple[str, ...], *, parts: bool) -> int:
    """Bytes held by ``names`` all resident (parts), or by one whole pipeline each."""
    if not parts:
        return sum(resident_bytes((name,), parts=True) for name in names)
    reg = registry(max_resident=len(SOURCES))
    try:
        for name in names:
            reg.activate(name).result()
        return reg.used_bytes()
    finally:
        reg.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="switches per pair and mode")
    parser.add_argument("--quick", action="store_true", help="3 rounds (a couple of minutes)")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "kept in float32" on every .to()

    print(machine_line())
    reg = registry(max_resident=1)
    began = time.perf_counter()
    reg.index().result()
    reg.close()
    print(f"part digests of {len(SOURCES)} sources: {time.perf_counter() - began:.2f} s (once)")
    switch("sd-1.5", "sd-1.4", parts=True)  # warm the builders' first-call costs

    pairs = list(permutations(SOURCES, 2))
    print(f"{len(pairs)} pairs, {rounds} rounds each, whole and parts interleaved\n")
    print(
        f"{'switch':22} {'whole s':>8} {'parts s':>8} {'parts %':>8} "
        f"{'whole MiB':>10} {'parts MiB':>10} {'back: whole s':>14} {'parts s':>8}  parts loaded"
    )
    ratios: dict[tuple[str, str], float] = {}
    for a, b in pairs:
        whole, parts = [], []
        for _ in range(rounds):
            whole.append(switch(a, b, parts=False))
            parts.append(switch(a, b, parts=True))
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
    three_whole = resident_bytes(THREE, parts=False)
    three_parts = resident_bytes(THREE, parts=True)
    print(
        f"three resident ({', '.join(THREE)}): {three_parts / 2**20:.2f} MiB as parts, "
        f"{three_whole / 2**20:.2f} MiB as three pipelines"
    )
    print(load_line("end"))
    family = [ratios[pair] for pair in permutations(FAMILY, 2)]
    print(f"within-family switch: {100 * statistics.median(family):.0f}% of a whole-pipeline load")
    print(f"three resident variants: {100 * three_parts / three_whole:.0f}% of three pipelines")


if __name__ == "__main__":
    main()
