"""Bounded asynchronous loading (BAL) for one request: merge LoRAs at step boundaries.

Katz §6: the LoRAs a request asks for are loaded while the base model already denoises; the
effect of a LoRA on the first steps (the "semantics-planning" stage) is negligible, so the run
starts without them. A bound ``K`` caps the overlap: in the worst case, if a LoRA is still
loading when step ``K`` is about to run (the ``(K+1)``-th step), the run waits for it. So at
most the steps ``0 … K−1`` run without a LoRA, and every step from ``K`` on runs with all of
them. ``K`` comes from profiling (:mod:`argus.worker.adapters.lora.bound`); ``K = 0`` is
synchronous loading.

A :class:`LoraSession` plugs into :meth:`DiffusionModel.denoise
<argus.worker.models.pipelines.DiffusionModel.denoise>`::

    with loader.open_session(unet, requests, steps=spec.steps, lock=model.lock) as session:
        model.denoise(spec, before_step=[session.before_step], hooks=[session.after_step],
                      on_exit=[session.on_exit])
    session.stats  # load times, merge steps, wait at the bound

* :meth:`LoraSession.before_step` runs before each step, under the model's lock. It merges, in
  place, every requested LoRA whose load has finished since the last boundary (in request
  order), and at step ``K`` first waits for those still loading.
* :meth:`LoraSession.after_step` restores the base weights right after the last step, still
  under the model's lock, so the next request on the model never sees this request's LoRAs.
* :meth:`LoraSession.close` (or leaving the ``with``) restores them if that did not happen,
  e.g. after an exception. A failure inside :meth:`before_step` (a load error, a LoRA that
  does not fit) restores before it propagates, while the lock is still held.

The bound is clamped to the last step (``steps − 1``) so a requested LoRA always takes part
in at least one step; a run resumed at a step past the bound (approximate caching) waits at
its first step.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType

import torch

from argus.contracts.generate import Adapter, AdapterKind
from argus.worker.adapters.lora.errors import LoraError, LoraInvalidError, LoraLoadError
from argus.worker.adapters.lora.patch import LoadedLora, WeightBackup, merge


@dataclass(frozen=True)
class LoraRequest:
    """One LoRA a request asks for: its library name, its strength, the field that named it."""

    name: str
    scale: float = 1.0
    field: str = "adapters"  # request field quoted in errors, e.g. "adapters[1]"

    def check(self) -> None:
        """Raise :class:`LoraInvalidError` for a scale that is not a finite number."""
        if not math.isfinite(self.scale):
            raise LoraInvalidError(self.name, f"scale {self.scale} is not finite", field=self.field)


def requests_from_adapters(adapters: Sequence[Adapter]) -> tuple[LoraRequest, ...]:
    """The LoRA requests among a request's adapters (the Generate contract's values).

    Other kinds are skipped (ControlNets are the ControlNet executor's). Each request names its
    field as ``adapters[i]``, ``i`` the index in the full list. An unset scale (proto3's 0)
    means 1.0, diffusers' default, as for ControlNets; "no effect" is leaving the LoRA out.
    """
    return tuple(
        LoraRequest(adapter.name, adapter.scale or 1.0, field=f"adapters[{index}]")
        for index, adapter in enumerate(adapters)
        if adapter.kind is AdapterKind.LORA
    )


@dataclass(frozen=True)
class PendingLora:
    """A requested LoRA and its load: a future that ends in a LoadedLora or a LoraError."""

    request: LoraRequest
    load: Future[LoadedLora]
    submitted_at: float  # clock value when the request asked for it
    cached: bool = False  # served from the loader's cache (the future was done at once)


@dataclass(frozen=True)
class LoraMergeStats:
    """What happened to one requested LoRA in one request (seconds, step indices)."""

    name: str
    scale: float
    cached: bool  # came from the loader's cache
    load_s: float  # request start → load finished, as this request saw it (0 for cache hits)
    read_s: float  # time the loader process spent reading the file (0 if never loaded)
    merge_step: int  # index of the first step that ran with it; -1 if never merged
    merge_s: float  # time spent patching it in
    wait_s: float  # time the run blocked at the bound for it
    modules: int  # modules patched


@dataclass(frozen=True)
class LoraSessionStats:
    """Per request: the bound used and each LoRA's record (for metrics and benchmarks)."""

    bound: int  # the effective K: steps 0 … K−1 may run without the LoRAs
    loras: tuple[LoraMergeStats, ...]
    wait_s: float  # total time blocked at the bound
    restore_s: float  # time spent copying the base weights back

    @property
    def waited(self) -> bool:
        """True when loading did not fit in the bound and the run had to wait."""
        return any(lora.wait_s > 0 for lora in self.loras)


class _Slot:
    """Mutable bookkeeping for one requested LoRA inside a session."""

    def __init__(self, pending: PendingLora) -> None:
        self.pending = pending
        self.ready_at: float | None = None
        self.merge_step = -1
        self.merge_s = 0.0
        self.wait_s = 0.0
        self.modules = 0
        self.read_s = 0.0


class LoraSession:
    """The LoRAs of one request, merged into ``unet`` at step boundaries (see module doc)."""

    def __init__(
        self,
        unet: torch.nn.Module,
        pending: Sequence[PendingLora],
        *,
        steps: int,
        bound: int,
        lock: AbstractContextManager[object] | None = None,
        wait_timeout_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps {steps} must be positive")
        if bound < 0:
            raise ValueError(f"bound {bound} must be ≥ 0")
        self.unet = unet
        self.steps = steps
        self.bound = min(bound, steps - 1)
        self._lock = lock
        self._timeout = wait_timeout_s
        self._clock = clock
        self._backup = WeightBackup()
        self._restore_s = 0.0
        self._closed = False
        self._finished = False
        self._slots = [_Slot(p) for p in pending]
        self._guard = threading.Lock()
        for slot in self._slots:
            slot.pending.load.add_done_callback(self._ready_callback(slot))

    def _ready_callback(self, slot: _Slot) -> Callable[[Future[LoadedLora]], None]:
        def ready(_: Future[LoadedLora]) -> None:
            with self._guard:
                slot.ready_at = self._clock()

        return ready

    # -- the denoising loop's hooks ------------------------------------------------------------

    def before_step(self, step: int) -> None:
        """Merge every LoRA loaded by now; at the bound, first wait for the rest.

        Runs under the model's lock before step ``step``. Any failure restores the base
        weights before it propagates.
        """
        if self._closed or self._finished:
            raise RuntimeError("a LoRA session serves one run; it is finished or closed")
        try:
            if step >= self.bound:
                self._wait_for_all()
            for slot in self._slots:
                if slot.merge_step < 0 and slot.pending.load.done():
                    self._merge(slot, step)
        except BaseException:
            self._finished = True  # the run is over: it raises out of the denoising loop
            self._restore()
            raise

    def after_step(self, step: int, latents: torch.Tensor) -> None:
        """After the last step: restore the base weights while the model's lock is held."""
        if step >= self.steps:
            self._finished = True
            self._restore()

    def on_exit(self) -> None:
        """The run ended, normally or by any exception: restore now, under the model's lock.

        Pass it as ``denoise(on_exit=[session.on_exit])``: the weights are back before the lock
        is released, whatever stopped the run (an OOM, another hook's error).
        """
        self._finished = True
        self._restore()

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Restore the base weights if they are still patched (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if len(self._backup):
            with self._lock if self._lock is not None else nullcontext():
                self._restore()

    def __enter__(self) -> LoraSession:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def patched(self) -> bool:
        """True while some weight of the UNet differs from the base model because of us."""
        return len(self._backup) > 0

    @property
    def stats(self) -> LoraSessionStats:
        loras = []
        for slot in self._slots:
            p = slot.pending
            ready = slot.ready_at
            load_s = 0.0 if p.cached or ready is None else max(0.0, ready - p.submitted_at)
            loras.append(
                LoraMergeStats(
                    name=p.request.name,
                    scale=p.request.scale,
                    cached=p.cached,
                    load_s=load_s,
                    read_s=slot.read_s,
                    merge_step=slot.merge_step,
                    merge_s=slot.merge_s,
                    wait_s=slot.wait_s,
                    modules=slot.modules,
                )
            )
        return LoraSessionStats(
            bound=self.bound,
            loras=tuple(loras),
            wait_s=sum(s.wait_s for s in self._slots),
            restore_s=self._restore_s,
        )

    # -- internals -----------------------------------------------------------------------------

    def _wait_for_all(self) -> None:
        for slot in self._slots:
            load = slot.pending.load
            if load.done():
                continue
            began = self._clock()
            try:
                load.exception(timeout=self._timeout)
            except FutureTimeout:
                raise LoraLoadError(
                    slot.pending.request.name,
                    f"still loading after {self._timeout} s at the bound (step {self.bound})",
                    field=slot.pending.request.field,
                ) from None
            finally:
                slot.wait_s += self._clock() - began

    def _merge(self, slot: _Slot, step: int) -> None:
        request = slot.pending.request
        try:
            lora = slot.pending.load.result()
        except LoraError as err:
            raise err.at(request.field) from err
        began = self._clock()
        try:
            slot.modules = merge(self.unet, lora, request.scale, self._backup)
        except LoraError as err:
            raise err.at(request.field) from None
        slot.merge_s = self._clock() - began
        slot.merge_step = step
        slot.read_s = lora.read_s

    def _restore(self) -> None:
        if len(self._backup):
            began = self._clock()
            self._backup.restore()
            self._restore_s += self._clock() - began
