"""Load time of a template's activation record from each tier of
:class:`argus.worker.editing.activation_store.ActivationStore`.

A record of ``--mib`` MiB (``--tensors`` fp16 tensors, the shape of a per-block record) is
put into a store whose host tier is too small for it, so it goes to disk; then, ``--repeats``
times each:

* **write**: ``put`` (safetensors file, CRC always computed, atomic rename);
* **disk, cold**: ``get`` after the file's pages were dropped from the page cache
  (``posix_fadvise(DONTNEED)``; the kernel may keep some), with and without the CRC check;
* **disk, warm**: ``get`` with the file in the page cache (what a recently written record
  costs);
* **host**: ``get`` from a store with room for it (a dictionary lookup).

    .venv/bin/python benchmarks/bench_activation_store.py [--mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import drop_page_cache, load_line, machine_line

from argus.worker.editing.activation_store import SUFFIX, ActivationStore


def make_record(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    elems = mib * 2**20 // 2 // tensors
    return {f"s0.b{i}.y": torch.randn(elems).half() for i in range(tensors)}


def timed(fn: object, repeats: int, before: object = None) -> list[float]:
    seconds = []
    for _ in range(repeats):
        if callable(before):
            before()
        start = time.perf_counter()
        assert callable(fn)
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def report(label: str, seconds: list[float], nbytes: int) -> None:
    median = statistics.median(seconds)
    print(f"{label:28s} median {median * 1e3:9.1f} ms  {nbytes / median / 2**30:7.2f} GiB/s")


def measure_disk(root: Path, record: dict[str, torch.Tensor], verify: bool, repeats: int) -> None:
    """Write the record to a disk-only store, then time cold and warm reads."""
    nbytes = sum(t.numel() * t.element_size() for t in record.values())
    store = ActivationStore(1, root, 4 * nbytes, verify=verify)
    tag = "crc" if verify else "no crc"
    report(f"write ({tag} store)", timed(lambda: store.put("t", record), 2), nbytes)

    def get() -> None:
        assert store.get("t") is not None

    cold = timed(get, repeats, lambda: drop_page_cache(root, SUFFIX))
    report(f"disk, cold ({tag})", cold, nbytes)
    report(f"disk, warm ({tag})", timed(get, repeats), nbytes)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine_line())
    record = make_record(args.mib, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in record.values())
    print(f"record: {nbytes / 2**20:.0f} MiB in {len(record)} fp16 tensors")
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        for verify in (True, False):
            measure_disk(root / f"crc-{verify}", record, verify, args.repeats)
        host = ActivationStore(2 * nbytes)
        host.put("t", record)
        report("host", timed(lambda: host.get("t"), args.repeats), nbytes)
        host.close()
    print(load_line("end"))


if __name__ == "__main__":
    main()
