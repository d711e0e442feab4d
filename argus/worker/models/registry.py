"""The models a worker holds: loading in the background, a memory guard, switching, unloading.

A worker knows a set of *sources* (model name → ``tiny:<variant>`` or a diffusers directory)
and holds some of them in device memory. Exactly one loaded model is *active*: it serves
requests whose level's model is not loaded (a substitution, counted by the worker).

Models are assembled from shared parts (:mod:`argus.worker.models.components`): a part whose
weights' digest is already resident (the text encoder and VAE SD-1.5 shares with SD-1.4 and
the small and tiny variants) is reused, never loaded twice, so a switch within a family loads
only the UNet. Each model's load reports the parts it loaded and the time of each.

Switching (Argus §4.6, and what a level change needs): :meth:`ModelRegistry.activate` starts
loading the new model's missing parts in a background thread while the current one keeps
serving; once the new one is ready it becomes active. Up to ``max_resident`` ready models stay
resident (1, the default, unloads the others as soon as the new one is ready; a switch then
holds two models at most); beyond that, and whenever a load would not fit, the least recently
used models other than the active one are unloaded first, so a switch back to a model still
resident loads nothing. Requests already running on an unloaded model finish on it: they hold
a reference, and its memory is released when the last one drops it.

The memory guard refuses a load (:class:`MemoryGuardError`) when the resident parts (each
counted once however many models share it), the parts being loaded, and the new model's
missing parts would exceed the budget even after unloading every evictable model. The memory
the resident models' CUDA graphs hold counts too, as does the edit cache's tier in the same
memory (the host tier on a CPU; on CUDA the device tier's bound, lowered for a load that would
not fit otherwise). Before a
source's digests are known (its first load computes them) all its parts count as missing. The
budget is the device's memory × ``memory_fraction`` on CUDA, and ``MemAvailable`` at start-up ×
``memory_fraction`` on the CPU, unless set explicitly.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from argus import defaults
from argus.contracts.worker_control import ComponentInfo, LoadState, ModelInfo
from argus.worker.models.compiled import (
    GRAPHED_MODES,
    check_compile_backend,
    check_compile_mode,
    compile_and_warm,
    warm_up,
)
from argus.worker.models.components import Component, ComponentStore, part_bytes, source_digests
from argus.worker.models.pipelines import DiffusionModel
from argus.worker.models.sources import (
    assemble_pipeline_dir,
    assemble_tiny_pipeline,
    build_tiny_part,
    estimate_part_bytes,
    is_tiny,
    load_pipeline_dir_part,
    tiny_spec,
    tiny_tokenizer,
)

log = logging.getLogger(__name__)


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


def default_cuda_graphs(device: str) -> int:
    """The graphs a worker keeps when its settings do not say (:data:`argus.defaults.CUDA_GRAPHS`
    None): :data:`argus.defaults.CUDA_GRAPHS_ON_CUDA` on a CUDA device, none elsewhere."""
    return defaults.CUDA_GRAPHS_ON_CUDA if str(device).startswith("cuda") else 0


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


def _naming(report: Callable[..., None] | None, model: str) -> Callable[..., None] | None:
    """``report`` with its first argument, the model's name, given (None stays None)."""
    return None if report is None else functools.partial(report, model)


@dataclass
class _Entry:
    source: str
    state: LoadState
    bytes: int  # the model's own weights (shared parts included): estimated, then measured
    pending: int = 0  # bytes of the parts its load adds, while it loads
    model: DiffusionModel | None = None
    load_s: float = 0.0
    error: str = ""
    future: Future[DiffusionModel] | None = None
    loaded_parts: dict[str, float] = field(default_factory=dict)  # part -> load seconds
    compile_s: float = 0.0  # torch.compile and its warm-up run (compiled.py), part of load_s
    used_at: int = 0  # a use counter's value at its last activation or use (LRU order)


class ModelRegistry:
    """Loaded models by name, assembled from shared parts; thread-safe."""

    def __init__(
        self,
        sources: Mapping[str, str],
        *,
        device: str = "auto",
        dtype: str = "auto",
        scheduler: str = "euler",
        memory_budget_bytes: int | None = None,
        memory_fraction: float = 0.9,
        max_resident: int = 1,
        cuda_graphs: int | None = None,
        on_load: Callable[[str, float, Mapping[str, float]], None] | None = None,
        on_capture: Callable[[str, str, float], None] | None = None,
        on_capture_failure: Callable[[str, str], None] | None = None,
        compile_mode: str | None = None,
        compile_backend: str = defaults.COMPILE_BACKEND,
        serving_size: int = defaults.DEFAULT_SIZE,
        on_compile: Callable[[str, float], None] | None = None,
    ) -> None:
        if not sources:
            raise ValueError("sources: at least one model is needed")
        if max_resident < 1:
            raise ValueError(f"max_resident {max_resident}: at least 1")
        if cuda_graphs is not None and cuda_graphs < 0:
            raise ValueError(f"cuda_graphs {cuda_graphs}: at least 0")
        self.sources = dict(sources)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.scheduler = scheduler
        self.budget = (
            memory_budget_bytes
            if memory_budget_bytes is not None
            else default_memory_budget(self.device, memory_fraction)
        )
        self.max_resident = max_resident
        self.cuda_graphs = default_cuda_graphs(self.device) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not str(self.device).startswith("cuda"):
            raise ValueError(f"cuda_graphs {cuda_graphs}: needs a CUDA device, not {self.device}")
        self._on_load = on_load
        self._on_capture = on_capture
        self._on_capture_failure = on_capture_failure
        self._entries: dict[str, _Entry] = {}
        self._parts = ComponentStore()
        self._digests: dict[str, dict[str, str]] = {}  # source -> part -> digest, once known
        self._active: str | None = None
        self._target: str | None = None  # the model the last activate() asked for
        self._last_load: tuple[str, dict[str, float]] = ("", {})  # model, part -> seconds
        self._uses = 0  # the LRU clock: bumped by every activation and use
        self._outside: Callable[[], int] = lambda: 0  # bytes held beside the models
        self._cede: Callable[[int], int] | None = None  # shrinks them for a load
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self._use_compile(compile_mode, compile_backend, serving_size, on_compile)

    def _use_compile(
        self,
        mode: str | None,
        backend: str,
        size: int,
        on_compile: Callable[[str, float], None] | None,
    ) -> None:
        """Compile every model this registry loads with ``torch.compile(mode=, backend=)``
        and warm it up at ``size`` × ``size`` (:mod:`argus.worker.models.compiled`); None:
        eager. Mode ``reduce-overhead`` replays CUDA graphs of its own, so the registry's own
        (``cuda_graphs``) are then not taken."""
        self.compile_mode = None if mode is None else check_compile_mode(mode)
        self.compile_backend = backend if mode is None else check_compile_backend(backend)
        if size < 1:
            raise ValueError(f"serving_size {size}: at least 1 pixel")
        self.serving_size = size
        self._on_compile = on_compile
        if mode in GRAPHED_MODES and self.cuda_graphs:
            log.info(
                "compile mode %s replays CUDA graphs of its own: the worker's own "
                "(cuda_graphs %d) are not taken",
                mode,
                self.cuda_graphs,
            )
            self.cuda_graphs = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def active_name(self) -> str | None:
        return self._active

    def get(self, name: str) -> DiffusionModel | None:
        """The model if it is loaded and ready, else None; a use for the LRU order."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state is not LoadState.READY:
                return None
            self._touch(entry)
            return entry.model

    def active(self) -> DiffusionModel | None:
        with self._lock:
            if self._active is None:
                return None
            return self._entries[self._active].model

    def used_bytes(self) -> int:
        with self._lock:
            return self._resident_bytes()

    def count_outside(
        self, held: Callable[[], int], cede: Callable[[int], int] | None = None
    ) -> None:
        """Count ``held()`` bytes, which the worker keeps outside its models in the memory
        this budget guards, as used: a load must fit beside them, and :meth:`used_bytes`
        reports them. On a CPU device that is the edit cache's host tier; on CUDA its device
        tier, which ``cede(n)`` shrinks by up to ``n`` bytes (returning how much) when a load
        would not fit otherwise: cached records give way to models, never the reverse."""
        with self._lock:
            self._outside = held
            self._cede = cede

    def _resident_bytes(self) -> int:
        """Resident parts, each once, plus the parts being loaded, the memory the resident
        models' CUDA graphs hold, and the bytes held outside the models (lock held)."""
        loading = sum(e.pending for e in self._entries.values() if e.state is LoadState.LOADING)
        graphs = sum(
            e.model.graphs.pool_bytes
            for e in self._entries.values()
            if e.model is not None and e.model.graphs is not None
        )
        return self._parts.bytes() + loading + graphs + self._outside()

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
                    loaded_parts=dict(e.loaded_parts),
                    compile_s=e.compile_s,
                )
                for name, e in sorted(self._entries.items())
            ]

    def last_load(self) -> tuple[str, dict[str, float]]:
        """The model the last finished load made ready ("" before any) and the parts that load
        loaded, each with its seconds (none when every part was resident already)."""
        with self._lock:
            name, parts = self._last_load
            return name, dict(parts)

    def components(self) -> list[ComponentInfo]:
        """The resident parts, each with the models that share it."""
        with self._lock:
            return self._parts.infos()

    # -- loading ---------------------------------------------------------------------------

    def index(self) -> Future[None]:
        """Compute every source's part digests in the background (once per process), so that
        the memory guard knows which parts of a model never loaded here are already resident
        and counts only the missing ones; without it a source's first load counts them all."""

        def learn() -> None:
            for source in self.sources.values():
                digests = source_digests(source)
                with self._lock:
                    self._digests[source] = digests

        return self._loader.submit(learn)

    def activate(self, name: str) -> Future[DiffusionModel]:
        """Load ``name``'s missing parts if needed (in the background), then make it active.

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
            if entry is not None:  # a failed load: try again
                del self._entries[name]
            source = self.sources[name]
            estimates = estimate_part_bytes(source, self.dtype)
            digests = self._digests.get(source)
            need = (
                sum(estimates.values())
                if digests is None
                else self._parts.missing_bytes(digests, estimates)
            )
            self._evict_until(lambda: self._resident_bytes() + need <= self.budget)
            held = self._resident_bytes()
            if held + need > self.budget and self._cede is not None:
                self._cede(held + need - self.budget)
                held = self._resident_bytes()
            if held + need > self.budget:
                raise MemoryGuardError(
                    f"variant {name!r}: needs {need / 2**20:.1f} MiB but "
                    f"{(self.budget - held) / 2**20:.1f} MiB of the "
                    f"{self.budget / 2**20:.1f} MiB budget is free"
                )
            entry = _Entry(
                source=source, state=LoadState.LOADING, bytes=sum(estimates.values()), pending=need
            )
            self._entries[name] = entry
            entry.future = self._loader.submit(self._load, name, entry)
            return entry.future

    def _load(self, name: str, entry: _Entry) -> DiffusionModel:
        began = time.perf_counter()
        try:
            digests = source_digests(entry.source)
            with self._lock:
                self._digests[entry.source] = digests
            parts: dict[str, Any] = {}
            for part, digest in digests.items():
                # resident, or loaded earlier in this load (SDXL's two tokenizers may be one)
                with self._lock:
                    if self._parts.get(digest) is not None:
                        parts[part] = self._parts.use(digest, name)
                        continue
                loaded_at = time.perf_counter()
                value = self._load_part(entry.source, part)
                seconds = time.perf_counter() - loaded_at
                entry.loaded_parts[part] = seconds
                component = Component(digest, part, value, part_bytes(value), seconds, users={name})
                with self._lock:
                    self._parts.add(component)
                parts[part] = value
            model = DiffusionModel(
                name, self._assemble(entry.source, parts), device=self.device, source=entry.source
            )
            if self.cuda_graphs:
                model.use_cuda_graphs(
                    self.cuda_graphs,
                    on_capture=self._capture_callback(name),
                    on_failure=self._failure_callback(name),
                )
            # one warm-up at the serving size compiles the forward and captures its graph (a
            # compile retakes the graphs over the compiled forward), not the first request
            if self.compile_mode is not None:
                entry.compile_s = compile_and_warm(
                    model,
                    self.compile_mode,
                    self.compile_backend,
                    self.serving_size,
                    self.serving_size,
                )
            elif self.cuda_graphs:
                warm_up(model, self.serving_size, self.serving_size)
        except Exception as err:
            with self._lock:
                entry.state = LoadState.FAILED
                entry.error = f"{type(err).__name__}: {err}"
                entry.pending = 0
                self._parts.release(name)
            raise
        elapsed = time.perf_counter() - began
        with self._lock:
            entry.model = model
            entry.bytes = model.parameter_bytes()
            entry.pending = 0
            entry.load_s = elapsed
            entry.state = LoadState.READY
            self._last_load = (name, dict(entry.loaded_parts))
            self._touch(entry)
            if self._target == name or self._active is None:
                self._make_active(name)
            else:  # superseded by a later activate(): resident, first to leave
                entry.used_at = 0
                self._trim()
        if self._on_load is not None:
            self._on_load(name, elapsed, dict(entry.loaded_parts))
        if self._on_compile is not None and self.compile_mode is not None:
            self._on_compile(name, entry.compile_s)
        return model

    def _load_part(self, source: str, part: str) -> Any:
        """One part of ``source`` on this registry's device and dtype."""
        if is_tiny(source):
            value = build_tiny_part(tiny_spec(source), part, tiny_tokenizer())
            if isinstance(value, torch.nn.Module):
                value.to(self.device, self.dtype).eval()
            return value
        value = load_pipeline_dir_part(Path(source), part, self.dtype)
        if isinstance(value, torch.nn.Module):
            value.to(self.device).eval()
        return value

    def _assemble(self, source: str, parts: dict[str, Any]) -> Any:
        if is_tiny(source):
            return assemble_tiny_pipeline(tiny_spec(source), parts, self.scheduler)
        pipeline = assemble_pipeline_dir(Path(source), parts, self.dtype)
        pipeline.to(self.device)
        return pipeline

    # -- residency -------------------------------------------------------------------------

    def _capture_callback(self, model: str) -> Callable[[str, float], None] | None:
        """``on_capture`` for ``model``'s graphs: the registry's callback with the model named."""
        return _naming(self._on_capture, model)

    def _failure_callback(self, model: str) -> Callable[[str], None] | None:
        """``on_failure`` for ``model``'s graphs: the registry's callback with the model named."""
        return _naming(self._on_capture_failure, model)

    def _touch(self, entry: _Entry) -> None:
        self._uses += 1
        entry.used_at = self._uses

    def _make_active(self, name: str) -> None:
        """Make ``name`` active, then unload failed models and the least recently used ready
        ones beyond ``max_resident`` (lock held)."""
        self._active = name
        self._touch(self._entries[name])
        failed = [n for n, e in self._entries.items() if e.state is LoadState.FAILED]
        for other in failed:
            del self._entries[other]
        self._trim()

    def _trim(self) -> None:
        """Unload least recently used models until at most ``max_resident`` are ready."""
        self._evict_until(
            lambda: (
                sum(e.state is LoadState.READY for e in self._entries.values()) <= self.max_resident
            )
        )

    def _evict_until(self, enough: Callable[[], bool]) -> None:
        """Unload ready models other than the active one and the last one asked for, least
        recently used first, until ``enough()`` holds or none is left to unload (lock held)."""
        evictable = sorted(
            (e.used_at, n)
            for n, e in self._entries.items()
            if e.state is LoadState.READY and n not in (self._active, self._target)
        )
        dropped = False
        for _, other in evictable:
            if enough():
                break
            entry = self._entries.pop(other)
            if entry.model is not None:
                entry.model.release()
            self._parts.release(other)
            dropped = True
        if dropped:
            gc.collect()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._entries.clear()
            self._active = None
