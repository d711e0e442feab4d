"""The malloc arena cap of Argus's processes: with it, threads that allocate share two arenas
instead of taking one each (glibc's ``malloc_stats`` lists the arenas). Each case runs in a
fresh interpreter, since the cap only holds for arenas made after it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from argus.plumbing.heap import limit_malloc_arenas

pytestmark = pytest.mark.unit


# 12 threads each allocate and keep a few blocks; then glibc prints one "Arena N:" per arena
PROGRAM = """
import ctypes, sys, threading
from argus.plumbing.heap import limit_malloc_arenas
print(limit_malloc_arenas() if sys.argv[1] == "capped" else "uncapped", flush=True)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
started = threading.Barrier(12)
def allocate():
    started.wait()
    for _ in range(50):
        libc.malloc(4096)
threads = [threading.Thread(target=allocate) for _ in range(12)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.malloc_stats()
"""

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc",
)


def arenas(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    """(what the program printed first, how many arenas glibc reported)."""
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        check=True,
    )
    return done.stdout.strip(), done.stderr.count("Arena ")


@glibc_only
def test_capped_threads_share_two_arenas() -> None:
    printed, capped = arenas("capped")
    assert printed == "True"
    assert capped <= 2
    _, uncapped = arenas("uncapped")
    assert uncapped > 2  # without the cap the same threads take more (the test means something)


@glibc_only
def test_the_environment_wins() -> None:
    printed, count = arenas("capped", {"MALLOC_ARENA_MAX": "4"})
    assert printed == "False"
    assert 2 < count <= 4


def test_arenas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="arenas"):
        limit_malloc_arenas(0)
