"""The worker's request path, without the transport: validate, queue, pick the model, use the
approximate cache, denoise, decode, count.

:meth:`Worker.generate` serves one request. It is checked (:meth:`Worker.validate`), waits in
a bounded queue for the GPU slot (:mod:`argus.worker.gpu_queue`; a full queue is refused at
once with :class:`QueueFullError`), then :meth:`Worker._run` serves it in numbered steps, as
diffusers' ``__call__`` does: pick the level's model (the active one in its place when it is
not loaded: the answer says ``substituted``), look the prompt up in the approximate cache
(:mod:`argus.worker.approx_cache.use`), denoise with the request's adapters
(:class:`~argus.worker.adapters.workflow.WorkerAdapters`), decode, feed the cache off the
request path, answer. The PNG is encoded on the caller's thread once the GPU slot is free
(:meth:`Worker._finish`). Edits (a call with an ``image``) take the same path, or the edit
lane's step batch, with the mask-aware activation cache
(:mod:`argus.worker.editing.worker_edits`).

Work nobody will wait for is not done. The transport hands :meth:`Worker.generate` a
:class:`~argus.worker.models.pipelines.CancelToken` (the call's deadline, and a flag its
client's going away sets): a request stops while it waits for the GPU, at the model's next
checkpoint while it runs, before its PNG, or without decoding when its decode cannot finish
in the time left (:mod:`argus.worker.decode_times`). It raises
:class:`~argus.worker.models.pipelines.Cancelled` and releases the GPU slot at once; stops are
counted by reason and stage in :meth:`Worker.stats`.

Timing (``GenerateResult.timing``): ``queue_ms`` is the wait for the GPU slot from the
request's admission; ``total_ms`` runs from the admission until :meth:`Worker.generate`
returns, so ``total_ms - queue_ms`` is the service time routers learn. Inside it: ``encode_ms``,
``denoise_ms``, ``decode_ms`` (VAE and PNG), ``search_ms`` and ``fetch_ms`` (the cache lookup),
and the adapters' waits.

One thread computes: every pipeline run happens on the worker's *device thread*, whichever
thread called :meth:`Worker.generate`, since torch keeps buffers and an OpenMP team per
calling thread. Progress events (:mod:`argus.worker.progress`) and the request and result
types are the Generate contract's (:mod:`argus.contracts.generate`). The stories behind these
choices, with their measurements, are in ``docs/worker-internals.md``.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from argus import defaults
from argus.contracts.generate import (
    CacheEvents,
    CacheKey,
    CacheOutcome,
    GenerateCall,
    GenerateResult,
    Timing,
)
from argus.contracts.progress import ProgressSink
from argus.contracts.worker_control import WorkerStats
from argus.plumbing.quoting import quoted
from argus.profiles.batch_curve import BatchTable
from argus.request_limits import (
    ImageLimits,
    InvalidRequestError,
    check_edit,
    check_edit_size,
    check_image,
    check_prompts,
    check_sampling,
)
from argus.types import Level, ProfileSet, Strategy
from argus.worker.adapters.workflow import NO_ADAPTERS, AdapterPlan, WorkerAdapters
from argus.worker.approx_cache.use import (
    CacheLookup,
    PromptEncoder,
    cache_key,
    capture_steps,
    feeds_cache,
    insert,
    look_up,
    router_vector,
)
from argus.worker.decode_times import DECODE_SEED_S_PER_PIXEL, DecodeSkipped, DecodeTimes
from argus.worker.editing.activation_cache import EditCache
from argus.worker.editing.lane import EditLane, LaneEvents
from argus.worker.editing.worker_edits import WorkerEdits
from argus.worker.gpu_queue import FifoSlot, wait_for_slot
from argus.worker.models.pipelines import (
    NEVER_CANCELLED,
    Cancelled,
    CancelToken,
    DenoiseResult,
    DiffusionModel,
    GenerationSpec,
    paste_unmasked,
)
from argus.worker.models.registry import ModelRegistry
from argus.worker.progress import Reporter

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class QueueFullError(RuntimeError):
    pass


class NoModelError(RuntimeError):
    """No model is loaded yet (the first load is still running or failed)."""


WARM_UP_PROMPT = "a warm-up image, never served"


@dataclass(frozen=True)
class _Ran:
    """A request's run up to its image (:meth:`Worker._run`): the answer without its PNG,
    the VAE's image and the seconds the VAE took."""

    result: GenerateResult
    image: Image.Image
    vae_s: float
    spec: GenerationSpec


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str = defaults.WORKER_ID
    default_width: int = defaults.DEFAULT_SIZE
    default_height: int = defaults.DEFAULT_SIZE
    default_steps: int = defaults.DEFAULT_STEPS
    max_pixels: int = defaults.MAX_IMAGE_PIXELS
    max_side: int = defaults.MAX_IMAGE_SIDE
    max_queue: int = defaults.MAX_QUEUE
    pending_inserts: int = 32
    decode_seed_s_per_pixel: float = DECODE_SEED_S_PER_PIXEL
    """The decode rate :class:`DecodeTimes` assumes before it has seen a decode as large; 0
    assumes decodes are free until measured (nothing is skipped for want of a measurement)."""
    edit_batch: int = defaults.EDIT_BATCH
    """Edits batched at most (:mod:`argus.worker.editing.lane`); 1: one request at a time."""
    decode_thread: bool = defaults.DECODE_THREAD
    """Batched edits decode on a thread of their own, off the denoising loop."""
    edit_batch_table: BatchTable | None = None
    """Measured latency-per-batch curves: each model's and size's bound is its knee, at most
    ``edit_batch``, and 1 where the table has none (:mod:`argus.profiles.batch_curve`)."""

    def __post_init__(self) -> None:
        if self.edit_batch < 1:
            raise ValueError(f"edit_batch: must be >= 1, got {self.edit_batch}")


def count_in_memory_guard(registry: ModelRegistry, edit_cache: EditCache) -> None:
    """Make ``registry``'s memory guard count the edit cache's tier in the memory it guards:
    the host tier on a CPU device, the device tier on CUDA (which gives way to a load)."""
    store, tier = edit_cache.store, edit_cache.device
    if registry.device == "cpu":
        registry.count_outside(lambda: store.host_bytes_used)
    elif tier is not None:
        registry.count_outside(lambda: tier.reserved_bytes, tier.cede)


class Worker:
    """Serves generation requests at the levels of ``profiles`` on the models in ``registry``."""

    def __init__(
        self,
        profiles: ProfileSet,
        registry: ModelRegistry,
        *,
        cache: Any | None = None,
        encoder: PromptEncoder | None = None,
        config: WorkerConfig | None = None,
        level: str | None = None,
        adapters: WorkerAdapters | None = None,
        edit_cache: EditCache | None = None,
        lane_events: LaneEvents | None = None,
    ) -> None:
        self.profiles = profiles
        self.registry = registry
        self.cache = cache
        self.encoder = encoder
        self.adapters = adapters
        self.edit_cache = edit_cache
        if edit_cache is not None:
            count_in_memory_guard(registry, edit_cache)
        self.config = config or WorkerConfig()
        self._levels = {lv.name: lv for lv in profiles.levels}
        ac_models = {lv.model for lv in profiles.levels if lv.strategy is Strategy.AC}
        # the model AC levels run on; its full generations feed the cache
        self.base_model = next(iter(ac_models)) if len(ac_models) == 1 else None
        initial = level or self._default_level()
        self.level = self._level(initial, "level")
        self.strategy = self.level.strategy
        self._slots = FifoSlot()  # the GPU, handed over in arrival order
        self._lock = threading.Lock()
        self._queued = 0
        self._finished = 0  # requests that left the queue (served, failed or stopped)
        self._counts: Counter[str] = Counter()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-insert")
        # every pipeline run, whoever holds the slot (see the module's docstring)
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        self._pending: set[Future[Any]] = set()
        self._warm = threading.Event()  # set by warm_up(): the pipeline has run once
        self.decode_times = DecodeTimes(self.config.decode_seed_s_per_pixel)
        lane, decoder = self._edit_lane(lane_events)
        self._edits = WorkerEdits(
            registry,
            edit_cache,
            adapters,
            lane,
            decoder,
            count=self._count,
            off_path=self._off_path,
            decode=self._decode_in_time,
            decode_fits=self._check_decode_fits,
        )

    def _edit_lane(
        self, events: LaneEvents | None
    ) -> tuple[EditLane | None, ThreadPoolExecutor | None]:
        """The lane that batches edits at step boundaries (argus/worker/editing/lane.py) and
        its decode thread; None: one request at a time, decodes on the device thread."""
        if self.config.edit_batch <= 1:
            return None, None
        table, cap = self.config.edit_batch_table, self.config.edit_batch
        bounds = None if table is None else functools.partial(table.bound, cap=cap)
        lane = EditLane(cap, self._slots, self._device, events, bounds)
        decoder = None
        if self.config.decode_thread:
            decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        return lane, decoder

    def _default_level(self) -> str:
        fastest_ac = [lv for lv in self.profiles.levels if lv.strategy is Strategy.AC]
        return (fastest_ac or list(self.profiles.levels))[0].name

    def _level(self, name: str, field_name: str) -> Level:
        if name not in self._levels:
            raise InvalidRequestError(field_name, f"unknown level {quoted(name)}")
        return self._levels[name]

    # -- configuration ---------------------------------------------------------------------

    def configure(
        self,
        *,
        strategy: Strategy | None = None,
        level: str = "",
        variant: str = "",
        wait: bool = False,
    ) -> Future[DiffusionModel]:
        """Set the default level and strategy; load and activate ``variant`` (or the level's
        model) in the background, or before returning with ``wait``. Returns the load."""
        new_level = self._level(level, "level") if level else self.level
        if strategy is not None and level and new_level.strategy is not strategy:
            raise InvalidRequestError(
                "level", f"{new_level.name} is an {new_level.strategy.value} level, not {strategy}"
            )
        model = variant or new_level.model
        future = self.registry.activate(model)  # raises on an unknown variant or no memory
        with self._lock:
            self.level = new_level
            self.strategy = strategy or new_level.strategy
        if wait:
            future.result()
        return future

    # -- readiness -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the worker should be sent requests: a model is loaded and :meth:`warm_up`
        has run it once (health and membership report this)."""
        return self._warm.is_set() and self.registry.active() is not None

    def warm_up(self) -> float:
        """Run the pipeline once at the current level, then report ready; returns seconds.

        Called once the first model is loaded, before the worker joins the cluster: the first
        run of a pipeline pays lazy start-up costs (kernel selection, allocator pools, the
        encoder's first call) that took 25 s on a loaded CPU, longer than a router deadline.
        The warm-up prompt is not stored in the cache and is not counted as a request.
        """
        spec, level, plan = self.validate(GenerateCall(prompt=WARM_UP_PROMPT))
        began = time.perf_counter()
        with self._slots:
            if self.encoder is not None:
                self._on_device(self.encoder.embed_one, WARM_UP_PROMPT)
            ran = self._on_device(self._run, spec, level, plan, "warm-up", feed_cache=False)
        self._finish(ran, NEVER_CANCELLED)
        self._warm.set()
        return time.perf_counter() - began

    # -- validation ------------------------------------------------------------------------

    def validate(self, call: GenerateCall) -> tuple[GenerationSpec, Level, AdapterPlan]:
        cfg = self.config
        limits = ImageLimits(cfg.max_side, cfg.max_pixels)
        check_prompts(call.prompt, call.negative_prompt)
        check_image(call.width, call.height, limits)
        edit = check_edit(call.image, call.mask, call.strength, limits)
        if edit is not None:
            check_edit_size(edit, call.width, call.height)
            width, height = edit.width, edit.height
        else:
            width = cfg.default_width if call.width is None else call.width
            height = cfg.default_height if call.height is None else call.height
            check_image(width, height, limits)
        steps = cfg.default_steps if call.steps is None else call.steps
        check_sampling(steps, call.guidance_scale, call.seed)
        if call.adapters and self.adapters is None:
            raise InvalidRequestError(
                "adapters", "this worker serves no adapters (no --lora-dir or --controlnet)"
            )
        level = self._level(call.level, "level") if call.level else self.level
        if level.skip_steps >= steps:
            raise InvalidRequestError(
                "level", f"{level.name} skips K={level.skip_steps} of N={steps} steps; K < N needed"
            )
        spec = GenerationSpec(
            prompt=call.prompt,
            negative_prompt=call.negative_prompt,
            seed=call.seed,
            height=height,
            width=width,
            steps=steps,
            guidance_scale=call.guidance_scale or 0.0,
            edit=edit,
        )
        plan = self.adapters.plan(call.adapters) if self.adapters is not None else NO_ADAPTERS
        return spec, level, plan

    # -- the request path ------------------------------------------------------------------

    def generate(
        self,
        call: GenerateCall,
        cancel: CancelToken = NEVER_CANCELLED,
        progress: ProgressSink | None = None,
    ) -> GenerateResult:
        """Serve one request. Raises :class:`Cancelled` when ``cancel`` says stop before the
        request got the GPU (it never runs) or at a checkpoint of its run, and
        :class:`DecodeSkipped` when its decode cannot finish before its deadline; either way
        the GPU slot is free when it raises. ``progress`` hears each :class:`Progress` event
        (see the module's docstring)."""
        spec, level, plan = self.validate(call)
        vector = router_vector(self.encoder, call.prompt_embedding, call.prompt_encoder)
        queued_edit = self._edits.queued(spec, level, plan)
        with self._lock:
            if self._queued >= self.config.max_queue:
                self._counts["rejected"] += 1
                raise QueueFullError(
                    f"queue full ({self._queued} requests waiting or running); retry later"
                )
            ahead, finished = self._queued, self._finished
            self._queued += 1
        admitted = time.perf_counter()
        report = (
            None
            if progress is None
            else Reporter(progress, admitted, call.previews, self.config.worker_id)
        )
        stage = "queued"
        try:
            pixels = spec.width * spec.height
            if report is not None:
                report.queued(ahead)
            if self._edits.batches(spec, plan):
                joined = threading.Event()
                try:
                    ran, started = self._run_batched(
                        spec, level, call.request_id, cancel, report, queued_edit, joined
                    )
                finally:
                    stage = "running" if joined.is_set() else "queued"
            else:
                if report is not None:
                    wait_for_slot(
                        self._slots,
                        cancel,
                        self.decode_times,
                        lambda: report.queued(self._ahead(ahead, finished)),
                        pixels,
                    )
                else:
                    wait_for_slot(self._slots, cancel, self.decode_times, pixels=pixels)
                try:
                    stage = "running"
                    started = time.perf_counter()
                    ran = self._on_device(
                        self._run,
                        spec,
                        level,
                        plan,
                        call.request_id,
                        cancel=cancel,
                        report=report,
                        queued_edit=queued_edit,
                        vector=vector,
                    )
                finally:
                    self._slots.release()
            result = self._finish(ran, cancel)
            timing = replace(
                result.timing,
                queue_ms=(started - admitted) * 1e3,
                total_ms=(time.perf_counter() - admitted) * 1e3,
            )
            result = replace(result, timing=timing, cache_events=self._cache_events(call))
            with self._lock:
                self._counts["completed"] += 1
                self._counts["substituted"] += result.substituted
            return result
        except Cancelled as stop:
            stop.stage = stage
            with self._lock:
                self._counts[f"stopped:{stop.reason}:{stage}"] += 1
                self._counts["decodes_skipped"] += isinstance(stop, DecodeSkipped)
            raise
        except Exception:
            with self._lock:
                self._counts["failed"] += 1
            raise
        finally:
            with self._lock:
                self._queued -= 1
                self._finished += 1

    def _cache_events(self, call: GenerateCall) -> CacheEvents | None:
        """The cache's changes after the call's cursor, for the caller's mirror of this
        worker's cache (:mod:`argus.worker.approx_cache.events`); None when the call sent no
        cursor or the worker has no cache. A run's own insert is written after its answer, so
        it rides on a later reply."""
        if call.cache_cursor is None or self.cache is None:
            return None
        events: CacheEvents = self.cache.events.since(call.cache_cursor)
        return events

    def _on_device(self, work: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``work`` on the device thread and wait for it; its exception is raised here."""
        return self._device.submit(work, *args, **kwargs).result()

    def _ahead(self, ahead: int, finished: int) -> int:
        """Requests still ahead of one that found ``ahead`` in the queue when ``finished``
        requests had left it: those that left since count as ahead of it. The GPU slot is
        handed over in arrival order (:class:`FifoSlot`), but a request behind this one that
        is cancelled or expires in the queue leaves it too, and batched edits leave in their
        lane's order: this is the expected position, not a promise."""
        with self._lock:
            return max(0, ahead - (self._finished - finished))

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _count_step(self, step: int) -> None:
        self._count("denoise_steps")

    def _run(
        self,
        spec: GenerationSpec,
        level: Level,
        plan: AdapterPlan,
        request_id: str,
        *,
        feed_cache: bool = True,
        cancel: CancelToken = NEVER_CANCELLED,
        report: Reporter | None = None,
        queued_edit: tuple[str, bool] | None = None,
        vector: npt.NDArray[np.float32] | None = None,
    ) -> _Ran:
        """Serve one checked request on the device thread (the GPU slot is held), in the
        numbered steps of diffusers' ``__call__``: 1. pick the model; 2. look the prompt up in
        the cache (a :class:`CacheLookup`); 3. decide whether the run feeds the cache; 4.
        denoise from where the lookup says; 5. decode with the VAE; 6. feed the cache, off the
        request path; 7. answer, without the PNG: :meth:`_finish` encodes it on the caller's
        thread once the GPU slot is free. ``feed_cache``: False for the warm-up.
        ``queued_edit``: the activation cache's key of an inpainting edit when it was queued,
        and whether a record was there then (:meth:`WorkerEdits.queued`). ``vector``: the
        prompt's embedding from the router (:func:`router_vector`), used in place of the
        encoder's by the lookup and the insert."""
        model, substituted = self._pick_model(level)  # 1
        # only an AC run, or a run on the cache's base model, outside an edit can look up or
        # feed the cache: no key (and no hash of the control images) for the others
        uses_cache = (
            self.cache is not None
            and (level.strategy is Strategy.AC or model.name == self.base_model)
            and spec.edit is None
        )
        key = cache_key(model, spec, plan) if uses_cache else None
        lookup = look_up(self.cache, self.encoder, spec, level, key, vector)  # 2
        feeds = (
            feed_cache
            and spec.edit is None
            and feeds_cache(self.cache, self.base_model, model, lookup)
        )
        capture = capture_steps(self.cache, spec.steps) if feeds else ()  # 3
        result, path, adapter_ms = self._denoise(  # 4
            model, spec, plan, request_id, lookup, capture, cancel, report, queued_edit
        )
        image, vae_s = self._decode_in_time(model, spec, result, cancel, report)  # 5
        if feeds and key is not None and result.captured:  # 6
            self._insert_later(spec.prompt, lookup.embedding, vector, key, result.captured)
        answer = self._answer(  # 7
            request_id, level, model, result, lookup, vae_s, substituted, path, adapter_ms
        )
        return _Ran(answer, image, vae_s, spec)

    def _pick_model(self, level: Level) -> tuple[DiffusionModel, bool]:
        """Step 1: the level's model, or the active one in its place (True: substituted);
        raises :class:`NoModelError` before any model is loaded."""
        model = self.registry.get(level.model)
        if model is not None:
            return model, False
        active = self.registry.active()
        if active is None:
            raise NoModelError("no model is loaded yet")
        return active, True

    def _denoise(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        plan: AdapterPlan,
        request_id: str,
        lookup: CacheLookup,
        capture: tuple[int, ...],
        cancel: CancelToken,
        report: Reporter | None,
        queued_edit: tuple[str, bool] | None = None,
    ) -> tuple[DenoiseResult, str, dict[str, float]]:
        """Step 4: denoise from the lookup's start with the request's adapters; returns the
        result, the adapter path and the adapters' timings. The progress report's step hook
        runs after the adapters' own. An inpainting edit without adapters replays its
        template's recorded activations, or records them
        (:mod:`argus.worker.editing.activation_cache`)."""
        with self._lock:
            self._counts["denoise_runs"] += 1
        hooks = () if report is None else (report.running(lookup.start_step, spec.steps),)

        def run(**extra: Any) -> DenoiseResult:
            step_hooks = (*extra.pop("hooks", ()), *hooks)
            return model.denoise(
                spec,
                start_latents=lookup.latent,
                start_step=lookup.start_step,
                capture=capture,
                cancel=cancel,
                on_step=self._count_step,
                hooks=step_hooks,
                **extra,
            )

        if self.adapters is None or (not plan and self.adapters.peer is None):
            return self._edits.denoise_alone(model, spec, plan, queued_edit, run), "", {}
        from argus.worker.adapters.latent_parallel import PeerFailedError

        try:
            with self.adapters.attach(model, spec, plan, request_id) as extras:
                result = run(**extras.kwargs())
            return result, extras.path, extras.timing_ms
        except PeerFailedError as err:  # the peer died: this request reruns on one device
            log.warning(
                "latent-parallel peer failed (%s); running %s on one device", err, request_id
            )
            self.adapters.note_peer_failure()
        with self.adapters.attach(model, spec, plan, request_id) as extras:
            result = run(**extras.kwargs())
        return result, extras.path, extras.timing_ms

    def _decode_in_time(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        result: DenoiseResult,
        cancel: CancelToken,
        report: Reporter | None,
    ) -> tuple[Image.Image, float]:
        """Step 5: the VAE's image and the seconds it took, unless the request was stopped or
        its decode (VAE and PNG) cannot finish before its deadline (then it raises without
        decoding)."""
        cancel.check(result.steps_run)  # decoding a large image is worth skipping too
        self._check_decode_fits(spec, cancel, result.steps_run)
        if report is not None:
            report.decoding(spec.steps)
        began = time.perf_counter()
        try:
            image = model.decode(result.latents, cancel)
        except Cancelled as stop:
            stop.steps_done = result.steps_run
            raise
        return image, time.perf_counter() - began

    def _check_decode_fits(self, spec: GenerationSpec, cancel: CancelToken, steps: int) -> None:
        """Raise :class:`DecodeSkipped` when the image's predicted decode takes longer than
        the time left before the deadline (none: it always fits)."""
        left = cancel.remaining_s()
        if left is None:
            return
        predicted = self.decode_times.predict_s(spec.width * spec.height)
        if predicted > left:
            raise DecodeSkipped(steps, predicted, left)

    def _answer(
        self,
        request_id: str,
        level: Level,
        model: DiffusionModel,
        result: DenoiseResult,
        lookup: CacheLookup,
        vae_s: float,
        substituted: bool,
        path: str = "",
        adapter_ms: dict[str, float] | None = None,
    ) -> GenerateResult:
        """A run's answer without its PNG (:meth:`_finish` adds it)."""
        adapter_ms = adapter_ms or {}
        return GenerateResult(
            request_id=request_id,
            png=b"",
            level=level.name,
            strategy=level.strategy,
            model=model.name,
            scheduler=model.scheduler_name,
            steps_run=result.steps_run,
            start_step=lookup.start_step,
            cache=lookup.outcome,
            cache_miss_reason=lookup.miss_reason,
            similarity=lookup.similarity,
            routed_step=level.skip_steps if level.strategy is Strategy.AC else 0,
            timing=Timing(
                search_ms=lookup.search_ms,
                fetch_ms=lookup.fetch_ms,
                encode_ms=result.encode_s * 1e3,
                denoise_ms=result.denoise_s * 1e3,
                decode_ms=vae_s * 1e3,
                lora_wait_ms=adapter_ms.get("lora_wait_ms", 0.0),
                controlnet_wait_ms=adapter_ms.get("controlnet_wait_ms", 0.0),
            ),
            worker_id=self.config.worker_id,
            substituted=substituted,
            adapter_path=path,
        )

    def _finish(self, ran: _Ran, cancel: CancelToken) -> GenerateResult:
        """The PNG of a run's image, encoded on the calling thread after the GPU slot was
        released (an SDXL image's PNG took 166-226 ms on an H200 host, docs/gpu.md, time the
        next request's denoising does not wait for); an inpainting edit's pixels outside
        its region are pasted back from its template first. Raises :class:`Cancelled` when
        ``cancel`` says stop before the encode starts (PIL's encoder cannot be interrupted:
        0.5 s at 2048×2048 on this project's CPU, measured). The decode time learned and
        reported is the VAE's plus the PNG's."""
        image = ran.image
        if ran.spec.edit is not None:
            image = paste_unmasked(image, ran.spec.edit)
        cancel.check(ran.result.steps_run)
        began = time.perf_counter()
        png = io.BytesIO()
        image.save(png, format="PNG")
        decode_s = ran.vae_s + time.perf_counter() - began
        self.decode_times.observe(ran.spec.width * ran.spec.height, decode_s)
        with self._lock:
            self._counts["decodes"] += 1
        timing = replace(ran.result.timing, decode_ms=decode_s * 1e3)
        return replace(ran.result, png=png.getvalue(), timing=timing)

    # -- the edit lane (argus/worker/editing/worker_edits.py) ------------------------------

    def _run_batched(
        self,
        spec: GenerationSpec,
        level: Level,
        request_id: str,
        cancel: CancelToken,
        report: Reporter | None,
        queued_edit: tuple[str, bool] | None,
        joined: threading.Event,
    ) -> tuple[_Ran, float]:
        """Serve an edit in the lane's step batch (:meth:`WorkerEdits.run_batched`); returns
        the run and when it joined the batch."""
        model, substituted = self._pick_model(level)
        edit = self._edits.run_batched(model, spec, cancel, report, queued_edit, joined)
        lookup = CacheLookup(CacheOutcome.NOT_USED, start_step=spec.start_step)
        answer = self._answer(
            request_id, level, model, edit.result, lookup, edit.vae_s, substituted
        )
        return _Ran(answer, edit.image, edit.vae_s, spec), edit.joined_s

    # -- off the request path -------------------------------------------------------------

    def _off_path(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the writer thread, off the request path (:meth:`flush` waits)."""
        with self._lock:
            self._pending.add(self._writer.submit(work))

    def _insert_later(
        self,
        prompt: str,
        embedding: npt.NDArray[np.float32] | None,
        given: npt.NDArray[np.float32] | None,
        key: CacheKey,
        latents: dict[int, torch.Tensor],
    ) -> None:
        """Step 6: hand a run's captured latents to the cache's writer thread, off the request
        path (:func:`insert`: ``embedding`` the lookup's, ``given`` the router's); a full
        backlog drops them, counted (``dropped_inserts``)."""
        with self._lock:
            self._pending = {f for f in self._pending if not f.done()}
            if len(self._pending) >= self.config.pending_inserts:
                self._counts["dropped_inserts"] += 1
                return
            future = self._writer.submit(self._insert, prompt, embedding, given, key, latents)
            self._pending.add(future)

    def _insert(
        self,
        prompt: str,
        embedding: npt.NDArray[np.float32] | None,
        given: npt.NDArray[np.float32] | None,
        key: CacheKey,
        latents: dict[int, torch.Tensor],
    ) -> None:
        if not insert(self.cache, self.encoder, prompt, embedding, key, latents, given):
            self._count("failed_inserts")

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the cache inserts submitted so far are written."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result(timeout=timeout_s)

    # -- stats and shutdown ----------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return self._queued

    def stats(self) -> WorkerStats:
        with self._lock:
            counts = dict(self._counts)
            queued = self._queued
            level, strategy = self.level.name, self.strategy
        return WorkerStats(
            worker_id=self.config.worker_id,
            strategy=strategy,
            level=level,
            queue_length=queued,
            completed=counts.get("completed", 0),
            failed=counts.get("failed", 0),
            substituted=counts.get("substituted", 0),
            models=self.registry.infos(),
            cache=self.cache.stats() if self.cache is not None else None,
            memory_budget_bytes=self.registry.budget,
            memory_used_bytes=self.registry.used_bytes(),
            dropped_inserts=counts.get("dropped_inserts", 0),
            stopped=_stopped(counts),
            denoise_runs=counts.get("denoise_runs", 0),
            denoise_steps=counts.get("denoise_steps", 0),
            decodes=counts.get("decodes", 0),
            decodes_skipped=counts.get("decodes_skipped", 0),
            components=self.registry.components(),
        )

    def close(self) -> None:
        self._edits.close_lane()
        self._device.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._edits.close()
        if self.adapters is not None:
            self.adapters.close()
        self.registry.close()
        if self.cache is not None:
            self.cache.close()


def _stopped(counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """The "stopped:<reason>:<stage>" counters as reason → stage → count."""
    stopped: dict[str, dict[str, int]] = {}
    for key, count in counts.items():
        if key.startswith("stopped:"):
            _, reason, stage = key.split(":")
            stopped.setdefault(reason, {})[stage] = count
    return stopped
