"""The models a worker holds: loading in the background, a memory guard, switching, unloading.

A worker knows a set of *sources* (model name → ``tiny:<variant>`` or a diffusers directory)
and holds some of them in device memory. Exactly one loaded model is *active*: it serves
requests whose level's model is not loaded (a substitution, counted by the worker).

Switching (Argus §4.6, and what a level change needs): :meth:`ModelRegistry.activate` starts
loading the new model in a background thread while the current one keeps serving; once the
new one is ready it becomes active and the others are unloaded, so at most two models are
resident during a switch. Requests already running on an unloaded model finish on it: they
hold a reference, and its memory is released when the last one drops it.

The memory guard refuses a load (:class:`MemoryGuardError`) when the weights of the models
loaded or loading plus the new one would exceed the budget. The budget is the device's memory
× ``memory_fraction`` on CUDA, and ``MemAvailable`` at start-up × ``memory_fraction`` on the
CPU, unless set explicitly.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from argus.contracts.worker_control import LoadState, ModelInfo
from argus.worker.models import (
    build_tiny_pipeline,
    estimate_bytes,
    is_tiny,
    load_pipeline_dir,
)
from argus.worker.pipelines import DiffusionModel


class MemoryGuardError(RuntimeError):
    """A load that would not fit in the memory budget."""


class UnknownModelError(KeyError):
    """A model name the worker has no source for."""

    def __str__(self) -> str:
        return str(self.args[0])


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device {device!r}: expected auto, cpu or cuda[:N]")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r}: expected auto, fp32, fp16 or bf16")
    return table[dtype]


def default_memory_budget(device: str, fraction: float) -> int:
    if device.startswith("cuda"):
        _, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total * fraction)
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        available = 0
    return int((available or 8 << 30) * fraction)


@dataclass
class _Entry:
    source: str
    state: LoadState
    bytes: int
    model: DiffusionModel | None = None
    load_s: float = 0.0
    error: str = ""
    future: Future[DiffusionModel] | None = None


class ModelRegistry:
    """Loaded models by name; thread-safe."""

    def __init__(
        self,
        sources: Mapping[str, str],
        *,
        device: str = "auto",
        dtype: str = "auto",
        scheduler: str = "euler",
        memory_budget_bytes: int | None = None,
        memory_fraction: float = 0.9,
        on_load: Callable[[str, float], None] | None = None,
    ) -> None:
        if not sources:
            raise ValueError("sources: at least one model is needed")
        self.sources = dict(sources)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.scheduler = scheduler
        self.budget = (
            memory_budget_bytes
            if memory_budget_bytes is not None
            else default_memory_budget(self.device, memory_fraction)
        )
        self._on_load = on_load
        self._entries: dict[str, _Entry] = {}
        self._active: str | None = None
        self._target: str | None = None  # the model the last activate() asked for
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")

    # -- queries ---------------------------------------------------------------------------

    @property
    def active_name(self) -> str | None:
        return self._active

    def get(self, name: str) -> DiffusionModel | None:
        """The model if it is loaded and ready, else None."""
        with self._lock:
            entry = self._entries.get(name)
            return entry.model if entry is not None and entry.state is LoadState.READY else None

    def active(self) -> DiffusionModel | None:
        with self._lock:
            if self._active is None:
                return None
            return self._entries[self._active].model

    def used_bytes(self) -> int:
        with self._lock:
            return self._resident_bytes()

    def _resident_bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values() if e.state is not LoadState.FAILED)

    def infos(self) -> list[ModelInfo]:
        with self._lock:
            return [
                ModelInfo(
                    name=name,
                    source=e.source,
                    state=e.state,
                    load_s=e.load_s,
                    bytes=e.bytes,
                    active=name == self._active,
                    error=e.error,
                )
                for name, e in sorted(self._entries.items())
            ]

    # -- loading ---------------------------------------------------------------------------

    def activate(self, name: str) -> Future[DiffusionModel]:
        """Load ``name`` if needed (in the background), then make it active and unload the rest.

        Raises :class:`UnknownModelError` or :class:`MemoryGuardError` at once; a failure
        during the load itself is reported by the future and in :meth:`infos`.
        """
        if name not in self.sources:
            known = ", ".join(sorted(self.sources))
            raise UnknownModelError(f"variant {name!r}: no such model (known: {known})")
        with self._lock:
            self._target = name
            entry = self._entries.get(name)
            if entry is not None and entry.state is LoadState.READY:
                done: Future[DiffusionModel] = Future()
                assert entry.model is not None
                done.set_result(entry.model)
                self._make_active(name)
                return done
            if entry is not None and entry.state is LoadState.LOADING:
                assert entry.future is not None
                return entry.future
            source = self.sources[name]
            need = estimate_bytes(source, self.dtype)
            held = self._resident_bytes() - (entry.bytes if entry is not None else 0)
            if held + need > self.budget:
                raise MemoryGuardError(
                    f"variant {name!r}: needs {need / 2**20:.1f} MiB but "
                    f"{(self.budget - held) / 2**20:.1f} MiB of the "
                    f"{self.budget / 2**20:.1f} MiB budget is free"
                )
            entry = _Entry(source=source, state=LoadState.LOADING, bytes=need)
            self._entries[name] = entry
            entry.future = self._loader.submit(self._load, name, entry)
            return entry.future

    def _load(self, name: str, entry: _Entry) -> DiffusionModel:
        began = time.perf_counter()
        try:
            if is_tiny(entry.source):
                pipeline = build_tiny_pipeline(entry.source, self.scheduler)
                pipeline.to(self.device, self.dtype)
            else:
                pipeline = load_pipeline_dir(entry.source, self.dtype)
                pipeline.to(self.device)
            model = DiffusionModel(name, pipeline, device=self.device, source=entry.source)
        except Exception as err:
            with self._lock:
                entry.state = LoadState.FAILED
                entry.error = f"{type(err).__name__}: {err}"
            raise
        elapsed = time.perf_counter() - began
        with self._lock:
            entry.model = model
            entry.bytes = model.parameter_bytes()
            entry.load_s = elapsed
            entry.state = LoadState.READY
            if self._target == name or self._active is None:
                self._make_active(name)
            else:  # superseded by a later activate(): do not keep it resident
                del self._entries[name]
        if self._on_load is not None:
            self._on_load(name, elapsed)
        return model

    def _make_active(self, name: str) -> None:
        """Make ``name`` active and drop every other ready or failed model (lock held)."""
        self._active = name
        dropped = [
            other
            for other, e in self._entries.items()
            if other != name and e.state is not LoadState.LOADING
        ]
        for other in dropped:
            del self._entries[other]
        if dropped:
            gc.collect()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._entries.clear()
            self._active = None
