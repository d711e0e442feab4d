"""Step-level continuous batching over one :class:`~argus.worker.models.pipelines.DiffusionModel`
(InstGenIE §4.3).

:class:`StepBatcher` runs the denoising loop of several requests at once, one step at a time.
Every request (a generation, an img2img edit or an inpainting edit; any prompt, template, mask
ratio, start step and step count) keeps its own scheduler instance, latents, conditioning and
step index, exactly as :meth:`DiffusionModel.denoise` keeps them for one request. One call of
:meth:`StepBatcher.step` is one step boundary followed by one step:

1. **boundary**: requests whose :class:`~argus.worker.models.pipelines.CancelToken` says stop
   leave, running or waiting, and their futures fail with
   :class:`~argus.worker.models.pipelines.Cancelled`; then waiting requests are admitted while
   the batch has room (``bound``) and they are compatible with it, by
   :class:`argus.worker.editing.scheduler.ContinuousBatch`, the policy code the simulator runs
   too. An admitted request is prepared then (its text encoded, its scheduler set, its starting
   latents made);
2. **one batched UNet call** over every running request's rows (both CFG branches of each),
   with per-sample timesteps (requests sit at different steps); guidance scales may differ,
   guidance *mode* (CFG or not) may not. A request may bring its own transformer blocks
   (``on_join``'s answer: the activation cache's replay or recording), which run on its rows
   apart (:func:`~argus.worker.editing.packed_blocks.batched_blocks`), so a small mask makes
   its share of a step cheaper; a batch where none does runs the model's
   :meth:`~argus.worker.models.pipelines.DiffusionModel.fast_unet` (a CUDA graph per batch
   shape, or the compiled forward) when it has one;
3. per request, in joining order: guidance over its own rows, its own ``scheduler.step``, its
   hooks (inpainting's blend first, as in ``denoise``), ``on_step``;
4. requests that ran their last step leave; their final latents resolve their
   :class:`concurrent.futures.Future` as a :class:`BatchResult` (done callbacks run on the
   loop's thread, after the step, outside the model's lock). The caller decodes.

``bound`` 1 serves one request at a time, bit for bit the output of ``denoise``; in a larger
batch a request's latents equal its latents alone to a tolerance (a batched matmul may sum in
another order). ``static=True`` is static batching, InstGenIE's baseline: a batch forms only
when the running one has drained. A step or a preparation that raises fails its requests only.

**Not here**: adapters (the worker serves requests with adapters alone), latent capture for
the approximate cache, and cancellation inside a step (a batch shares its blocks, so a cancel
is seen at the next boundary). The worker drives a batcher from its edit lane
(:mod:`argus.worker.editing.lane`); the measured tolerances are in ``docs/worker-internals.md``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from argus.worker.editing.masked_blocks import transformer_blocks
from argus.worker.editing.packed_blocks import RowBlocks, RowPart, batched_blocks
from argus.worker.editing.scheduler import BatchEntry, ContinuousBatch
from argus.worker.models.cuda_graphs import call_unet
from argus.worker.models.pipelines import (
    NEVER_CANCELLED,
    Cancelled,
    CancelToken,
    Conditioning,
    DiffusionModel,
    GenerationSpec,
    StepHook,
    UNetCall,
)


@dataclass(frozen=True)
class BatchResult:
    """A finished request: its final latents (scheduler space, not decoded) and its times
    (the batcher's clock): when it was submitted, admitted and finished."""

    latents: torch.Tensor
    steps_run: int
    submitted_s: float
    joined_s: float
    finished_s: float
    joined_at_step: int  # the batcher's step counter when it joined
    prepared_s: float = 0.0  # when its text was encoded and its starting latents made


@dataclass
class StepStats:
    """What the batcher's steps cost, summed over every step it ran (seconds)."""

    steps: int = 0  # batched steps run
    rows: int = 0  # requests summed over the steps (mean batch = rows / steps)
    total_s: float = 0.0  # whole boundaries and steps, preparation included
    unet_s: float = 0.0  # inside the batched UNet calls
    scheduler_s: float = 0.0  # inside the requests' ``scheduler.step`` calls
    prepare_s: float = 0.0  # admitted requests' text encoding and starting latents
    rows_per_step: list[int] = field(default_factory=list)
    # by requests in the step (at most the bound): steps run and seconds in the UNet call
    steps_by_batch: dict[int, int] = field(default_factory=dict)
    unet_s_by_batch: dict[int, float] = field(default_factory=dict)

    @property
    def overhead_s(self) -> float:
        """Time in the batcher outside the UNet, the schedulers and preparation: admission,
        concatenation, splitting, guidance, hooks, bookkeeping."""
        return self.total_s - self.unet_s - self.scheduler_s - self.prepare_s

    @property
    def overhead_per_step_s(self) -> float:
        return self.overhead_s / self.steps if self.steps else 0.0


@dataclass
class _Request:
    key: Hashable
    spec: GenerationSpec
    cancel: CancelToken
    hooks: tuple[StepHook, ...]
    on_step: Callable[[int], None] | None
    future: Future[BatchResult]
    submitted_s: float
    on_join: Callable[[], RowBlocks | None] | None = None
    rows: RowBlocks | None = None  # its transformer blocks in the batch (on_join's)
    prepared_s: float = 0.0
    joined_s: float = 0.0
    joined_at_step: int = 0
    # set when admitted (prepare)
    cond: Conditioning | None = None
    scheduler: Any = None
    timesteps: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    step: int = 0  # index of the next step to run
    steps_run: int = 0


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` that does not copy a lone tensor (bound 1 and a batch of one)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def batch_group(model: DiffusionModel, spec: GenerationSpec) -> tuple[str, int, int, bool]:
    """What must match for two requests to share a batch: model, resolution, guidance mode."""
    scale = spec.guidance_scale or model.default_guidance
    return (model.name, spec.height, spec.width, scale > 1.0)


class StepBatcher:
    """A step-level continuous batcher over ``model`` (see the module's docstring).

    Thread-safe: :meth:`submit` and :meth:`cancel` may be called from any thread while one
    thread drives :meth:`step` (or :meth:`serve`). Each step holds the model's lock.
    """

    def __init__(
        self,
        model: DiffusionModel,
        bound: int,
        *,
        static: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        history: bool = True,
    ) -> None:
        self.model = model
        self.bound = bound
        self.static = static
        self.history = history  # keep each step's batch size in stats (not in a long-lived worker)
        self.clock = clock
        self.stats = StepStats()
        self._batch = ContinuousBatch(bound, static=static)
        self._requests: dict[Hashable, _Request] = {}
        self._running: list[_Request] = []  # joining order
        self._steps = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.draining = False
        """While True no request joins; the running ones finish (the worker's lane sets it
        when a request outside the batch waits for the device)."""

    # -- the caller's side --------------------------------------------------------------------

    def submit(
        self,
        spec: GenerationSpec,
        *,
        key: Hashable | None = None,
        cancel: CancelToken = NEVER_CANCELLED,
        hooks: Iterable[StepHook] = (),
        on_step: Callable[[int], None] | None = None,
        on_join: Callable[[], RowBlocks | None] | None = None,
        on_done: Callable[[Future[BatchResult]], None] | None = None,
    ) -> Future[BatchResult]:
        """Queue ``spec``; it joins the batch at a later boundary. ``hooks`` run after each of
        its steps (after inpainting's blend), ``on_step`` with the index of each step run.
        ``on_join`` is called on the loop's thread when the request joins, under the model's
        lock, before its preparation; what it returns runs the request's transformer blocks
        on its own rows (the mask-aware activation cache's replay or recording:
        :func:`~argus.worker.editing.packed_blocks.batched_blocks`; None: the blocks in full).
        ``on_done`` is the future's done callback, added before the request can run, so it
        always runs on the loop's thread (after the step the request finished in)."""
        if key is None:
            key = ("auto", next(self._keys))
        steps = spec.steps - spec.start_step
        ratio = 1.0 if spec.edit is None else spec.edit.mask_ratio
        entry = BatchEntry(key, steps, ratio, batch_group(self.model, spec))
        future: Future[BatchResult] = Future()
        if on_done is not None:
            future.add_done_callback(on_done)
        request = _Request(key, spec, cancel, tuple(hooks), on_step, future, self.clock(), on_join)
        with self._lock:
            self._batch.submit(entry)  # refuses a key already held
            self._requests[key] = request
            self._wake.notify_all()
        return future

    def cancel(self, key: Hashable, reason: str = "cancelled") -> None:
        """Cancel request ``key``: it leaves at the next boundary."""
        with self._lock:
            request = self._requests.get(key)
        if request is not None:
            request.cancel.cancel(reason)

    def withdraw(self, key: Hashable, reason: str = "cancelled") -> bool:
        """Take out request ``key`` at once if it is still waiting (its future fails with
        :class:`~argus.worker.models.pipelines.Cancelled`, stage "queued"); False when it has joined
        the batch (cancel its token: it leaves at the next boundary) or is unknown. For a
        caller whose request must not wait for the loop to reach a boundary (the loop may be
        waiting for the device)."""
        with self._lock:
            request = self._requests.get(key)
            if request is None or request.cond is not None or request in self._running:
                return False
            self._batch.leave(key)
            del self._requests[key]
        self._fail([(request, reason)])
        return True

    def abort_all(self, error: BaseException) -> None:
        """Every request, running or waiting, fails with ``error`` (a fault the loop cannot
        pin on one request)."""
        with self._lock:
            requests = list(self._requests.values())
        self._abort(requests, error)

    def idle(self) -> bool:
        with self._lock:
            return self._batch.idle()

    @property
    def running(self) -> tuple[Hashable, ...]:
        """Keys of the running requests, in joining order."""
        return tuple(r.key for r in self._running)

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> int:
        """One boundary and one batched step; the number of requests the step ran (0 when
        nothing was running after the boundary, and nothing was run)."""
        began = self.clock()
        prepare_s = 0.0
        model = self.model
        with model.lock, torch.inference_mode():
            admitted, gone = self._boundary()
            unprepared: list[tuple[_Request, Exception]] = []
            for request in admitted:
                start = self.clock()
                try:
                    self._prepare(request)
                except Exception as refused:  # this request fails; the batch goes on
                    unprepared.append((request, refused))
                prepare_s += self.clock() - start
            for request, problem in unprepared:
                self._abort([request], problem)
            running = self._running
            if not running:
                self.stats.prepare_s += prepare_s
                self.stats.total_s += self.clock() - began
                self._fail(gone)
                return 0
            inputs, times, embeds, added = [], [], [], []
            for r in running:
                assert r.cond is not None and r.timesteps is not None and r.latents is not None
                t = r.timesteps[r.step - r.spec.start_step]
                x = model.unet_input(r.latents, t, r.cond, r.scheduler)
                inputs.append(x)
                times.append(t.reshape(1).expand(x.shape[0]))
                embeds.append(r.cond.embeds)
                if r.cond.added is not None:
                    added.append(r.cond.added)
            extra = {name: _cat([a[name] for a in added]) for name in added[0]} if added else None
            unet_began = self.clock()
            patch, unet = self._unet(running, inputs)
            try:
                with patch:
                    noise = unet(_cat(inputs), _cat(times), _cat(embeds), extra)
            except Exception as error:  # the step failed: its requests fail, the loop goes on
                self._abort(list(running), error)
                self.stats.total_s += self.clock() - began
                self._fail(gone)
                return len(running)
            unet_s = self.clock() - unet_began
            scheduler_s = 0.0
            row = 0
            for r, x in zip(running, inputs, strict=True):
                assert r.cond is not None and r.timesteps is not None and r.latents is not None
                rows = x.shape[0]
                guided = model.guide(noise[row : row + rows], r.cond)
                row += rows
                t = r.timesteps[r.step - r.spec.start_step]
                start = self.clock()
                latents = r.scheduler.step(guided, t, r.latents, return_dict=False)[0]
                scheduler_s += self.clock() - start
                if r.on_step is not None:
                    r.on_step(r.step)
                r.step += 1
                r.steps_run += 1
                for hook in r.hooks:
                    replaced = hook(r.step, latents)
                    if replaced is not None:
                        latents = replaced
                r.latents = latents
            self._steps += 1
            finished = self._retire()
        stats = self.stats
        stats.steps += 1
        stats.rows += len(running)
        if self.history:
            stats.rows_per_step.append(len(running))
        stats.unet_s += unet_s
        size = len(running)
        stats.steps_by_batch[size] = stats.steps_by_batch.get(size, 0) + 1
        stats.unet_s_by_batch[size] = stats.unet_s_by_batch.get(size, 0.0) + unet_s
        stats.scheduler_s += scheduler_s
        stats.prepare_s += prepare_s
        stats.total_s += self.clock() - began
        self._fail(gone)
        now = self.clock()
        for r in finished:  # outside the model's lock: a callback may decode
            assert r.latents is not None
            r.future.set_result(
                BatchResult(
                    r.latents,
                    r.steps_run,
                    r.submitted_s,
                    r.joined_s,
                    now,
                    r.joined_at_step,
                    r.prepared_s,
                )
            )
        return len(running)

    def run_until_idle(self) -> None:
        """Step until nothing runs or waits (a test's or a benchmark's driver)."""
        while not self.idle():
            self.step()

    def serve(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Step while there is work, wait for submissions when idle, until ``stop`` is set
        (the loop of a device thread)."""
        while not stop.is_set():
            with self._lock:
                if self._batch.idle():
                    self._wake.wait(poll_s)
                    continue
            self.step()

    # -- inside -------------------------------------------------------------------------------

    def _boundary(self) -> tuple[list[_Request], list[tuple[_Request, str]]]:
        """Cancelled requests leave (returned with their reasons: their futures fail outside
        the model's lock); waiting ones join (returned). Under the model's lock."""
        gone: list[tuple[_Request, str]] = []
        admitted: list[_Request] = []
        with self._lock:
            for key, request in list(self._requests.items()):
                reason = request.cancel.reason()
                if reason is not None:
                    self._batch.leave(key)
                    del self._requests[key]
                    gone.append((request, reason))
            self._running = [r for r in self._running if r.key in self._requests]
            if not self.draining:  # static batching: the policy admits none while a batch runs
                now = self.clock()
                for joined in self._batch.join():
                    request = self._requests[joined.entry.key]
                    request.joined_s = now
                    request.joined_at_step = self._steps
                    admitted.append(request)
                    self._running.append(request)
        return admitted, gone

    @staticmethod
    def _fail(gone: list[tuple[_Request, str]]) -> None:
        for request, reason in gone:
            error = Cancelled(reason, request.steps_run)
            if request.cond is None:
                error.stage = "queued"  # it never joined the batch
            request.future.set_exception(error)

    def _unet(
        self, running: list[_Request], inputs: list[torch.Tensor]
    ) -> tuple[contextlib.AbstractContextManager[Any], UNetCall]:
        """The batched UNet call: when a running request brings its own blocks, the eager UNet
        inside their patch (:func:`~argus.worker.editing.packed_blocks.batched_blocks`); else
        the model's fast forward (its CUDA graphs or compiled forward) if it has one."""
        unet = self.model.pipeline.unet
        eager = functools.partial(call_unet, unet)
        if all(r.rows is None for r in running):
            fast = self.model.fast_unet()
            return contextlib.nullcontext(), eager if fast is None else fast
        parts = [RowPart(x.shape[0], r.rows, r.step) for r, x in zip(running, inputs, strict=True)]
        return batched_blocks(transformer_blocks(unet), parts), eager

    def _abort(self, requests: list[_Request], error: BaseException) -> None:
        """``requests`` leave, running or waiting, and their futures fail with ``error`` (a
        step or a preparation raised it)."""
        with self._lock:
            for r in requests:
                self._batch.leave(r.key)
                self._requests.pop(r.key, None)
            self._running = [r for r in self._running if r not in requests]
        for r in requests:
            r.future.set_exception(error)

    def _prepare(self, request: _Request) -> None:
        """An admitted request's conditioning, scheduler and starting latents, as
        :meth:`DiffusionModel.denoise` makes them."""
        model, spec = self.model, request.spec
        if request.on_join is not None:
            request.rows = request.on_join()
        request.cond = model.encode(spec)
        # its own scheduler, stepped by this request alone (an edit's own EditStart.scheduler
        # only noises the template: stepping it would move the index its add_noise reads)
        scheduler, timesteps, latents, hooks = model.start_run(
            spec, None, spec.start_step, request.hooks
        )
        order = int(getattr(scheduler, "order", 1))
        if order != 1:
            raise ValueError(
                f"scheduler {model.scheduler_name!r} of order {order}: one batched UNet call"
                " a step needs a first-order scheduler"
            )
        request.scheduler = scheduler
        request.timesteps = timesteps
        request.latents = latents
        request.hooks = hooks
        request.step = spec.start_step
        request.prepared_s = self.clock()

    def _retire(self) -> list[_Request]:
        """Requests that ran their last step leave (under the model's lock)."""
        with self._lock:
            left = {r.entry.key for r in self._batch.step()}
            finished = [r for r in self._running if r.key in left]
            for r in finished:
                del self._requests[r.key]
            self._running = [r for r in self._running if r.key not in left]
        for r in finished:
            assert r.step == r.spec.steps, (r.key, r.step, r.spec.steps)
        return finished
