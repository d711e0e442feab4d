"""The mark of a test that needs a CUDA device: skipped without one, and marked ``gpu`` so
that a GPU machine runs just these (``pytest -m gpu``, as ``benchmarks/gpu_device_check.sh``
does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T", bound=Callable[..., Any])

HAS_CUDA = torch.cuda.is_available()


def needs_cuda(test: T) -> T:
    """Mark ``test`` ``gpu`` and skip it where no CUDA device is."""
    skipped: T = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test)
    marked: T = pytest.mark.gpu(skipped)
    return marked


def cuda_param(*values: Any) -> Any:
    """A parametrization case on CUDA, marked ``gpu`` (listed only where a device is)."""
    return pytest.param(*values, marks=pytest.mark.gpu)
