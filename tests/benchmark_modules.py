"""The benchmark scripts as modules, for their tests: ``benchmarks/`` is a folder of scripts
that import their siblings (``_machine``), so it is on ``sys.path`` while one is in use."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[Any]:
    """The module of ``benchmarks/NAME.py``, with the folder on ``sys.path`` until exit."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
