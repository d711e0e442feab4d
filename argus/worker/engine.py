"""The worker's request path, without the transport: validate, queue, pick the model, use the
approximate cache, denoise, decode, count.

One generation runs at a time (a diffusion model saturates its GPU; the paper finds batching
buys little, §4.4), so requests wait on a semaphore; the queue is bounded and a full queue is
refused at once (:class:`QueueFullError`) instead of growing without bound.

A request names a *level* of the worker's profile (or gets the configured one):

* AC level with K > 0: embed the prompt, find the nearest cached prompt with the same model,
  scheduler, resolution and steps, fetch its latent at step K and denoise the remaining N−K
  steps. A miss, or a missing or corrupt latent, falls back to a full generation, counted;
  it is never an error.
* AC level with K = 0, or a miss: a full generation. When it ran on the AC base model its
  latents at the cache's steps are stored, off the request path (a single writer thread with
  a bounded backlog; a full backlog drops the insert and counts it).
* SM level: a full generation on that level's model.

If the level's model is not loaded the active model serves the request at the same K (AC) or
from noise (SM) and the response says ``substituted``; loads are the job of ``configure``.

Deadlines and cancellation: the transport hands :meth:`Worker.generate` a
:class:`~argus.worker.models.pipelines.CancelToken` (the call's deadline, and a flag its client's
going away sets). Work nobody will wait for is not done:

* a request whose token says stop while it waits for the GPU is dropped without running;
* one that is denoising or decoding stops at the model's next checkpoint (before each step,
  each attention and ResNet block, each decoded tile: see :mod:`argus.worker.models.pipelines`), and
  the PNG is not encoded once the token says stop;
* a request whose decode cannot finish in the time left is stopped without decoding
  (:class:`DecodeSkipped`), and without running at all when that is already so on arrival or
  while it waits in the queue: the decode (VAE and PNG) is predicted by :class:`DecodeTimes`
  from this worker's own recent decodes, in seconds per pixel.

Before these, a 2048×2048 request whose deadline was 2 s held a worker of the tiny models 10 s
past its answer, since it stopped only between two steps and one step at that size takes 8 s
on two idle CPU cores (six self-attentions of about 1 s each; measured); its whole decode, had
it got that far, would have been 6.9 s more in one uninterruptible call.

Each raises :class:`~argus.worker.models.pipelines.Cancelled` (the transport answers
DEADLINE_EXCEEDED or CANCELLED) and releases the GPU slot at once, so the next request starts
as soon as the stopped one's current block ends. They are counted by reason ("cancelled",
"expired") and stage ("queued": never got the GPU; "running": got it) in :meth:`Worker.stats`,
skipped decodes also as ``decodes_skipped``.

Timing (``GenerateResult.timing``, a :class:`~argus.contracts.generate.Timing`): ``queue_ms``
is the wait for the GPU slot, from the request's admission to the queue until it took the
slot; ``total_ms`` is from the admission until :meth:`Worker.generate` returns (the gRPC
servicer replaces it with the time from the call's arrival at its handler until its reply is
ready). So ``total_ms - queue_ms`` is the worker's service time of the request, which routers
learn. Inside it: ``encode_ms`` (text encoding and the starting latents), ``denoise_ms`` (the
denoising loop), ``decode_ms`` (the VAE decode and the PNG), and on AC levels ``search_ms``,
``fetch_ms`` (the cache lookup); adapters add their waits (``lora_wait_ms``,
``controlnet_wait_ms``).

One thread computes: every pipeline run (the cache's prompt encoder, denoising, decoding)
happens on the worker's *device thread*, whichever thread called :meth:`Worker.generate` (the
caller holds the GPU slot and waits). Torch's CPU kernels keep state per calling thread:
MKL's buffers (about 2.3 MB a thread at the tiny models' sizes, measured) and an OpenMP team
for each thread that starts a parallel region (about 1.2 MB of resident memory more). Run on
the gRPC server's handler threads, every pool thread that ever won the slot kept its own: 16
threads' worth, gathered one by one as concurrency peaks created pool threads, which was the
soak's slow creep of a worker's memory. One device thread bounds it to one thread's worth.
The PNG is the exception: PIL encodes it on the caller's thread once the GPU slot is free
(:meth:`Worker._finish`), so the next request's denoising does not wait for it (166-226 ms
for an SDXL image on an H200 host, ``docs/gpu.md``).

The request, its result and its progress are the Generate contract's values
(:mod:`argus.contracts.generate`), the very ones the router sends and reads.

Progress: a caller that passes ``progress`` to :meth:`Worker.generate` hears where the request
stands (:class:`~argus.contracts.generate.Progress`): queued with the requests ahead of it,
running from its start step, each step done (with a low-resolution preview of the latent when
the call asked for some), decoding. The sink runs on the denoising thread, so it must only
hand the event over (the servicer puts it on a queue); the GPU slot is held while it runs.

Edits (a call with an ``image``): the image and mask are checked and decoded with the rest of
the request (:func:`~argus.request_limits.check_edit`) and ride on the spec; the model's
denoising loop runs img2img or inpainting (:meth:`DiffusionModel.start_edit`) on whichever
level's model the request names, AC base or SM variant, with the same queue, progress,
cancellation and deadlines as a generation; after the decode the pixels outside the edited
region are pasted back from the template. An edit never uses the approximate cache
(:attr:`CacheOutcome.NOT_USED`): the cache holds latents of other prompts generated from
noise, and resuming one at step K would replace the template by another image, while the
template's own steps are what an edit keeps; nor does an edit feed it, since its latents
carry its template into any prompt that would resume from them. An inpainting edit uses the
mask-aware activation cache instead (:mod:`argus.worker.editing.activation_cache`): the first edit
of a
template records its transformer blocks' outputs, later ones compute their region's tokens
only; a record on disk is read into memory while the edit waits in the queue.

Adapters (LoRAs, ControlNets) are checked with the rest of the request and run through
:class:`~argus.worker.adapters.workflow.WorkerAdapters` (see there for how they meet the cache: a
request with ControlNets never resumes from a cached latent, and no adapter request feeds it).
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from argus import defaults
from argus.contracts.generate import (
    CacheOutcome,
    GenerateCall,
    GenerateResult,
    Progress,
    Stage,
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
from argus.worker.editing.activation_cache import EditCache, EditCacheUse
from argus.worker.editing.lane import EditLane, LaneEvents
from argus.worker.editing.step_batch import BatchResult, StepBatcher
from argus.worker.models.pipelines import (
    NEVER_CANCELLED,
    Cancelled,
    CancelToken,
    DenoiseResult,
    DiffusionModel,
    GenerationSpec,
    StepHook,
    paste_unmasked,
)
from argus.worker.models.registry import ModelRegistry

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class QueueFullError(RuntimeError):
    pass


class NoModelError(RuntimeError):
    """No model is loaded yet (the first load is still running or failed)."""


WARM_UP_PROMPT = "a warm-up image, never served"
# how often a request waiting for the GPU looks at its token (client gone, deadline passed)
QUEUE_POLL_S = 0.05


class Ticket:
    """One request's place in the line for the GPU slot (:class:`FifoSlot`)."""

    __slots__ = ("granted", "turn")

    def __init__(self) -> None:
        self.granted = False  # the slot is this request's
        self.turn = threading.Event()  # set when it was handed the slot


class FifoSlot:
    """The GPU slot, handed to waiting requests in the order they arrived.

    A semaphore wakes whichever waiter polls first, so under a long queue some requests waited
    far longer than their place in line: the router predicts a request's completion from the
    requests ahead of it (it sends them in order), and on 2 tiny-model workers 16% of the
    requests it admitted at 3 × capacity with 30 s deadlines came back late. Here each request
    holds a :class:`Ticket` from :meth:`join` until it gets the slot or leaves the line
    (:meth:`leave`: cancelled, expired); :meth:`release` hands the slot to the oldest ticket.
    Thread-safe. ``with slot:`` waits for the slot without a deadline (the warm-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._line: deque[Ticket] = deque()

    def join(self) -> Ticket:
        """A place at the end of the line (the slot at once when it is free and nobody
        waits)."""
        ticket = Ticket()
        with self._lock:
            if not self._busy and not self._line:
                self._busy = ticket.granted = True
                ticket.turn.set()
            else:
                self._line.append(ticket)
        return ticket

    def acquire(self, ticket: Ticket, timeout: float | None = None) -> bool:
        """Whether ``ticket`` has the slot, waiting at most ``timeout`` seconds for its turn."""
        return ticket.turn.wait(timeout)

    def leave(self, ticket: Ticket) -> None:
        """``ticket`` gives up its place; if the slot reached it meanwhile, it is passed on."""
        with self._lock:
            if not ticket.granted:
                self._line.remove(ticket)
                return
        self.release()

    def waiting(self) -> int:
        """Tickets in line for the slot (the edit lane drains its batch while any waits)."""
        with self._lock:
            return len(self._line)

    def release(self) -> None:
        """The slot's holder is done: the oldest waiting ticket gets it."""
        with self._lock:
            if self._line:
                ticket = self._line.popleft()
                ticket.granted = True
                ticket.turn.set()
            else:
                self._busy = False

    def __enter__(self) -> FifoSlot:
        self.acquire(self.join())
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# the decode time (VAE and PNG) assumed before a worker has decoded an image of about a size:
# 2 µs a pixel, 8.4 s at 2048×2048. Slow on purpose, so that a worker does not start decodes it
# has no measure of and cannot finish: about three times the tiny models' tiled decode and PNG
# on two idle CPU cores (0.7 µs a pixel at 2048×2048; measured). Its own decodes replace it
DECODE_SEED_S_PER_PIXEL = 2e-6


class DecodeSkipped(Cancelled):
    """A request was stopped because its decode (predicted ``predicted_s``) cannot finish in
    the ``left_s`` seconds before its deadline; reason "expired"."""

    def __init__(self, steps_done: int, predicted_s: float, left_s: float) -> None:
        super().__init__("expired", steps_done)
        self.predicted_s = predicted_s
        self.left_s = left_s

    def __str__(self) -> str:
        return (
            f"deadline too close: decoding takes about {self.predicted_s:.2f} s, "
            f"{max(self.left_s, 0.0):.2f} s left ({self.steps_done} steps run)"
        )


class DecodeTimes:
    """How long this worker takes to decode an image (VAE and PNG), learned from its own
    decodes, to skip a decode that cannot finish before the deadline.

    Each decode gives a rate, seconds per pixel. A prediction for ``pixels`` is ``pixels ×``
    the ``quantile`` (a high one: a slow decode is likely to recur under the same load) of the
    rates of the last ``window`` decodes of images at least a quarter that size, each weighted
    by ``decay`` to the power of its age in decodes, so that a worker whose load changed is
    learned again within a few decodes. Smaller images are left out because a fixed cost per
    image dominates theirs (the tiny models decode 64×64 at 7 µs a pixel, 2048×2048 at 0.7 µs;
    measured); tiles keep the rate of large images flat (:meth:`DiffusionModel.decode`). With
    no decode that large yet, the rate is ``seed_s_per_pixel``, or the smaller images' rate
    when that is lower. Thread-safe.
    """

    def __init__(
        self,
        seed_s_per_pixel: float = DECODE_SEED_S_PER_PIXEL,
        *,
        window: int = 32,
        decay: float = 0.8,
        quantile: float = 0.9,
    ) -> None:
        if seed_s_per_pixel < 0.0:
            raise ValueError(f"seed_s_per_pixel: must be >= 0, got {seed_s_per_pixel}")
        if not 0.0 < decay <= 1.0 or not 0.0 < quantile <= 1.0:
            raise ValueError(f"decay and quantile: must be in (0, 1], got {decay}, {quantile}")
        self.seed_s_per_pixel = seed_s_per_pixel
        self.decay = decay
        self.quantile = quantile
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)  # (pixels, s/px)
        self._lock = threading.Lock()

    def observe(self, pixels: int, seconds: float) -> None:
        """A decode of ``pixels`` took ``seconds``."""
        if pixels > 0:
            with self._lock:
                self._samples.append((pixels, seconds / pixels))

    def predict_s(self, pixels: int) -> float:
        """Seconds a decode of ``pixels`` is expected to take (see the class's docstring)."""
        with self._lock:
            samples = list(self._samples)
        alike = [(i, r) for i, (p, r) in enumerate(samples) if 4 * p >= pixels]
        if alike:
            return pixels * self._quantile(alike, len(samples))
        rate = self.seed_s_per_pixel
        if samples:
            rate = min(rate, self._quantile(list(enumerate(r for _, r in samples)), len(samples)))
        return pixels * rate

    def _quantile(self, indexed: list[tuple[int, float]], count: int) -> float:
        """The weighted ``quantile`` of the rates; ``indexed`` pairs (position, rate), the
        newest of ``count`` samples at position ``count - 1``, weighted ``decay ** age``."""
        weighted = sorted((rate, self.decay ** (count - 1 - i)) for i, rate in indexed)
        goal = self.quantile * sum(w for _, w in weighted)
        total = 0.0
        for rate, weight in weighted:
            total += weight
            if total >= goal - 1e-12:
                return rate
        return weighted[-1][0]


class PromptEncoder(Protocol):
    def embed_one(self, prompt: str) -> npt.NDArray[np.float32]: ...


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


@dataclass(frozen=True)
class CacheLookup:
    """What the approximate cache gave a request (step 2 of :meth:`Worker._run`): a HIT
    resumes ``latent`` at ``start_step`` (the level's K); a MISS (``miss_reason`` says why)
    and NOT_USED (by design: SM, K = 0, no cache) start from noise at step 0, except an edit
    (NOT_USED), which starts at its own step from its image (:attr:`GenerationSpec.start_step`)."""

    outcome: CacheOutcome
    start_step: int = 0  # K on a hit
    latent: torch.Tensor | None = None  # the cached latent after K steps (hit)
    similarity: float = 0.0  # cosine similarity of the cached prompt (hit)
    miss_reason: str = (
        ""  # one of argus.worker.approx_cache.cache.MISS_REASONS, "controlnet", "no-encoder"
    )
    search_ms: float = 0.0  # in the vector index (0 when no search ran)
    fetch_ms: float = 0.0  # reading the latent (0 when none was read)
    # the prompt's embedding when the lookup made one; a run that feeds the cache reuses it
    embedding: npt.NDArray[np.float32] | None = None

    @classmethod
    def miss(
        cls,
        reason: str,
        search_ms: float = 0.0,
        fetch_ms: float = 0.0,
        embedding: npt.NDArray[np.float32] | None = None,
    ) -> CacheLookup:
        return cls(
            CacheOutcome.MISS,
            miss_reason=reason,
            search_ms=search_ms,
            fetch_ms=fetch_ms,
            embedding=embedding,
        )


NOT_LOOKED_UP = CacheLookup(CacheOutcome.NOT_USED)


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
        if edit_cache is not None and registry.device == "cpu":  # its host tier is this memory
            store = edit_cache.store
            registry.count_outside(lambda: store.host_bytes_used)
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
        # edits batched at step boundaries (argus/worker/editing/lane.py); None: one at a time
        self._lane: EditLane | None = None
        self._decoder: ThreadPoolExecutor | None = None
        self._batch_keys = itertools.count()
        if self.config.edit_batch > 1:
            table, cap = self.config.edit_batch_table, self.config.edit_batch
            bounds = None if table is None else functools.partial(table.bound, cap=cap)
            self._lane = EditLane(cap, self._slots, self._device, lane_events, bounds)
            if self.config.decode_thread:
                self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")

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
        queued_edit = self._edit_queued(spec, level, plan)
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
            else _Reporter(progress, admitted, call.previews, self.config.worker_id)
        )
        stage = "queued"
        try:
            pixels = spec.width * spec.height
            if report is not None:
                report.queued(ahead)
            if self._batches(spec, plan):
                joined = threading.Event()
                try:
                    ran, started = self._run_batched(
                        spec, level, call.request_id, cancel, report, queued_edit, joined
                    )
                finally:
                    stage = "running" if joined.is_set() else "queued"
            else:
                if report is not None:
                    self._wait_for_slot(
                        cancel, lambda: report.queued(self._ahead(ahead, finished)), pixels
                    )
                else:
                    self._wait_for_slot(cancel, pixels=pixels)
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
                    )
                finally:
                    self._slots.release()
            result = self._finish(ran, cancel)
            timing = replace(
                result.timing,
                queue_ms=(started - admitted) * 1e3,
                total_ms=(time.perf_counter() - admitted) * 1e3,
            )
            result = replace(result, timing=timing)
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

    def _on_device(self, work: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``work`` on the device thread and wait for it; its exception is raised here."""
        return self._device.submit(work, *args, **kwargs).result()

    def _ahead(self, ahead: int, finished: int) -> int:
        """Requests still ahead of one that found ``ahead`` in the queue when ``finished``
        requests had left it: those that left since count as ahead of it (the GPU slot is a
        semaphore, not a FIFO, so this is the expected position, not a promise)."""
        with self._lock:
            return max(0, ahead - (self._finished - finished))

    def _wait_for_slot(
        self,
        cancel: CancelToken,
        waiting: Callable[[], None] | None = None,
        pixels: int = 0,
    ) -> None:
        """Take the GPU slot, or raise :class:`Cancelled` without it once ``cancel`` says stop
        (a request whose deadline passed in the queue is never run), or
        :class:`DecodeSkipped` once the time left before the deadline is shorter than the
        predicted decode of an image of ``pixels`` (predicted again at each poll: a decode
        that finished meanwhile may have changed it). ``waiting`` is called each time the wait
        polls without the slot."""
        ticket = self._slots.join()
        try:
            self._wait_for_turn(ticket, cancel, waiting, pixels)
        except BaseException:
            self._slots.leave(ticket)  # hands the slot on if it was just handed to this one
            raise

    def _wait_for_turn(
        self,
        ticket: Ticket,
        cancel: CancelToken,
        waiting: Callable[[], None] | None,
        pixels: int,
    ) -> None:
        while True:
            cancel.check()
            remaining = cancel.remaining_s()
            decode_s = 0.0
            if remaining is not None and pixels:
                decode_s = self.decode_times.predict_s(pixels)
                if remaining < decode_s:
                    raise DecodeSkipped(0, decode_s, remaining)
            wait = (
                QUEUE_POLL_S
                if remaining is None
                else min(QUEUE_POLL_S, max(remaining - decode_s, 0.0))
            )
            if self._slots.acquire(ticket, timeout=wait):
                break
            if waiting is not None:
                waiting()
        cancel.check()  # it may have expired while the slot was being handed over

    def _count_step(self, step: int) -> None:
        with self._lock:
            self._counts["denoise_steps"] += 1

    def _run(
        self,
        spec: GenerationSpec,
        level: Level,
        plan: AdapterPlan,
        request_id: str,
        *,
        feed_cache: bool = True,
        cancel: CancelToken = NEVER_CANCELLED,
        report: _Reporter | None = None,
        queued_edit: tuple[str, bool] | None = None,
    ) -> _Ran:
        """Serve one checked request on the device thread (the GPU slot is held), in the
        numbered steps of diffusers' ``__call__``: 1. pick the model; 2. look the prompt up in
        the cache (a :class:`CacheLookup`); 3. decide whether the run feeds the cache; 4.
        denoise from where the lookup says; 5. decode with the VAE; 6. feed the cache, off the
        request path; 7. answer, without the PNG: :meth:`_finish` encodes it on the caller's
        thread once the GPU slot is free. ``feed_cache``: False for the warm-up.
        ``queued_edit``: the activation cache's key of an inpainting edit when it was queued,
        and whether a record was there then (:meth:`_edit_queued`)."""
        model, substituted = self._pick_model(level)  # 1
        key = self._cache_key(model, spec) if self.cache is not None else None
        lookup = self._look_up(spec, level, plan, key)  # 2
        feeds = feed_cache and spec.edit is None and self._feeds_cache(model, level, plan, lookup)
        capture = self._cache_steps(spec.steps) if feeds else ()  # 3
        result, path, adapter_ms = self._denoise(  # 4
            model, spec, plan, request_id, lookup, capture, cancel, report, queued_edit
        )
        image, vae_s = self._decode_in_time(model, spec, result, cancel, report)  # 5
        if feeds and result.captured:  # 6
            self._insert_later(spec.prompt, lookup.embedding, key, result.captured)
        answer = self._answer(  # 7
            request_id, level, model, result, lookup, vae_s, substituted, path, adapter_ms
        )
        return _Ran(answer, image, vae_s, spec)

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

    # -- the edit lane (argus/worker/editing/lane.py) -----------------------------------------

    def _batches(self, spec: GenerationSpec, plan: AdapterPlan) -> bool:
        """Whether ``spec`` is served by the edit lane: an edit without adapters (nor a
        latent-parallel peer), on a worker that batches edits."""
        if self._lane is None or spec.edit is None or plan:
            return False
        return self.adapters is None or self.adapters.peer is None

    def _run_batched(
        self,
        spec: GenerationSpec,
        level: Level,
        request_id: str,
        cancel: CancelToken,
        report: _Reporter | None,
        queued_edit: tuple[str, bool] | None,
        joined: threading.Event,
    ) -> tuple[_Ran, float]:
        """Serve an edit in the lane's step batch (on the device thread: its preparation, its
        steps, and its decode unless the decode thread takes it), waiting for its image on
        the calling thread; returns the run and when it joined the batch. ``joined`` is set
        when it joins. A request whose token says stop, or whose decode can no longer finish
        in time, leaves the queue at once; once in the batch it leaves at the next step
        boundary (:class:`Cancelled`)."""
        assert self._lane is not None
        model, substituted = self._pick_model(level)
        key = self._edit_key(model, spec, NO_ADAPTERS)
        uses: list[EditCacheUse] = []
        progress: list[StepHook] = []

        def on_join() -> Any:  # on the device thread, under the model's lock
            joined.set()
            with self._lock:
                self._counts["denoise_runs"] += 1
            if report is not None:
                progress.append(report.running(spec.start_step, spec.steps))
            if key is None or self.edit_cache is None:
                return None
            present = queued_edit is not None and queued_edit == (key, True)
            use = self.edit_cache.begin(model, spec, key, was_present=present, batched=True)
            uses.append(use)
            return use.rows

        def stepped(done: int, latents: torch.Tensor) -> None:
            for hook in progress:
                hook(done, latents)

        decoded: Future[tuple[Image.Image, float, BatchResult]] = Future()

        def finished(future: Future[BatchResult]) -> None:  # on the device thread, after the step
            error = future.exception()
            if error is not None:
                decoded.set_exception(error)
            elif self._decoder is not None:
                self._decoder.submit(decode, future.result())
            else:
                decode(future.result())

        def decode(batch: BatchResult) -> None:
            try:
                ran = DenoiseResult(batch.latents, steps_run=batch.steps_run)
                image, vae_s = self._decode_in_time(model, spec, ran, cancel, report)
                decoded.set_result((image, vae_s, batch))
            except BaseException as error:
                decoded.set_exception(error)

        name = ("edit", next(self._batch_keys))
        batcher, _ = self._lane.submit(
            model,
            spec,
            name,
            cancel=cancel,
            hooks=(stepped,) if report is not None else (),
            on_step=self._count_step,
            on_join=on_join,
            on_done=finished,
        )
        while True:
            try:
                image, vae_s, batch = decoded.result(timeout=QUEUE_POLL_S)
                break
            except FutureTimeout:
                if not joined.is_set():
                    self._leave_lane(batcher, name, cancel, spec)
        for use in uses:  # a recording reaches the store off the request path
            with self._lock:
                self._pending.add(self._writer.submit(self._finish_edit, use.finish))
        result = DenoiseResult(
            batch.latents,
            steps_run=batch.steps_run,
            encode_s=batch.prepared_s - batch.joined_s,
            denoise_s=batch.finished_s - batch.prepared_s,
        )
        lookup = CacheLookup(CacheOutcome.NOT_USED, start_step=spec.start_step)
        answer = self._answer(request_id, level, model, result, lookup, vae_s, substituted)
        return _Ran(answer, image, vae_s, spec), batch.joined_s

    def _leave_lane(
        self, batcher: StepBatcher, name: Any, cancel: CancelToken, spec: GenerationSpec
    ) -> None:
        """A request waiting in the lane leaves it at once when its token says stop, or with
        :class:`DecodeSkipped` when the time left is shorter than its predicted decode (as a
        request waiting for the slot does)."""
        reason = cancel.reason()
        if reason is not None:
            batcher.withdraw(name, reason)  # its future fails: the wait raises Cancelled
            return
        try:
            self._check_decode_fits(spec, cancel, 0)
        except DecodeSkipped:
            if batcher.withdraw(name, "expired"):  # it joined meanwhile: the batch decides
                raise

    def _finish(self, ran: _Ran, cancel: CancelToken) -> GenerateResult:
        """The PNG of a run's image, encoded on the calling thread after the GPU slot was
        released (an SDXL image's PNG took 166-226 ms on an H200 host, docs/gpu.md, time the
        next request's denoising no longer waits for); an inpainting edit's pixels outside
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

    def _look_up(
        self, spec: GenerationSpec, level: Level, plan: AdapterPlan, key: Any
    ) -> CacheLookup:
        """Step 2: where the run starts. An edit starts where its strength says, without the
        cache (see the module's docstring). An AC level with K > 0 looks the prompt up in the
        cache (embedding it); a request with ControlNets, or a worker without an encoder,
        misses without a search; every other request does not use the cache."""
        if spec.edit is not None:
            return CacheLookup(CacheOutcome.NOT_USED, start_step=spec.start_step)
        if level.strategy is not Strategy.AC or level.skip_steps == 0 or self.cache is None:
            return NOT_LOOKED_UP
        if plan.controls:  # the control's structure is set in the steps a hit would skip
            return CacheLookup.miss("controlnet")
        if self.encoder is None:
            return CacheLookup.miss("no-encoder")
        from argus.worker.approx_cache.cache import CacheHit

        embedding = self.encoder.embed_one(spec.prompt)
        found = self.cache.lookup(embedding, key, level.skip_steps)
        if isinstance(found, CacheHit):
            return CacheLookup(
                CacheOutcome.HIT,
                start_step=level.skip_steps,
                latent=found.latent,
                similarity=float(found.similarity),
                search_ms=found.search_s * 1e3,
                fetch_ms=found.fetch_s * 1e3,
                embedding=embedding,
            )
        return CacheLookup.miss(
            str(found.reason), found.search_s * 1e3, found.fetch_s * 1e3, embedding
        )

    def _feeds_cache(
        self, model: DiffusionModel, level: Level, plan: AdapterPlan, lookup: CacheLookup
    ) -> bool:
        """Step 3: whether the run's latents at the cache's steps are stored: a full run of
        an AC level on the base model, without adapters (the cache holds the base model's
        latents alone)."""
        return (
            lookup.start_step == 0
            and self.cache is not None
            and model.name == self.base_model
            and level.strategy is Strategy.AC
            and not plan
        )

    def _decode_in_time(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        result: DenoiseResult,
        cancel: CancelToken,
        report: _Reporter | None,
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

    def _denoise(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        plan: AdapterPlan,
        request_id: str,
        lookup: CacheLookup,
        capture: tuple[int, ...],
        cancel: CancelToken,
        report: _Reporter | None,
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
            key = self._edit_key(model, spec, plan)
            if key is None or self.edit_cache is None:
                return run(), "", {}
            was_present = queued_edit is not None and queued_edit == (key, True)
            use = self.edit_cache.begin(model, spec, key, was_present=was_present)
            result = run(predictor=use.predictor)
            with self._lock:  # a recording reaches the store off the request path
                self._pending.add(self._writer.submit(self._finish_edit, use.finish))
            return result, "", {}
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

    # -- the activation cache of edits -----------------------------------------------------

    def _edit_key(
        self, model: DiffusionModel, spec: GenerationSpec, plan: AdapterPlan
    ) -> str | None:
        """The activation cache's key of ``spec`` on ``model``; None when it cannot use it
        (no cache, not inpainting, adapters or a latent-parallel peer)."""
        if self.edit_cache is None or spec.edit is None or spec.edit.region is None:
            return None
        peer = self.adapters is not None and self.adapters.peer is not None
        return self.edit_cache.key(model, spec, adapters=bool(plan) or peer)

    def _finish_edit(self, finish: Callable[[], None]) -> None:
        try:
            finish()
        except Exception:
            log.exception("storing an edit's recorded activations failed")
            with self._lock:
                self._counts["failed_edit_records"] += 1

    def _edit_queued(
        self, spec: GenerationSpec, level: Level, plan: AdapterPlan
    ) -> tuple[str, bool] | None:
        """An inpainting edit joins the queue: start loading its template's record into host
        memory while it waits (InstGenIE §4.2). Returns its key and whether a record was
        there (a record gone by the run is counted ``evicted``); None when it cannot use the
        cache or no model is loaded yet."""
        if self.edit_cache is None or spec.edit is None or spec.edit.region is None:
            return None
        model = self.registry.get(level.model) or self.registry.active()
        if model is None:
            return None
        key = self._edit_key(model, spec, plan)
        return None if key is None else (key, self.edit_cache.queued(key))

    # -- the cache -------------------------------------------------------------------------

    def _cache_key(self, model: DiffusionModel, spec: GenerationSpec) -> Any:
        from argus.worker.approx_cache.cache import CacheKey

        return CacheKey(
            model=model.name,
            scheduler=model.scheduler_name,
            height=spec.height,
            width=spec.width,
            steps=spec.steps,
        )

    def _cache_steps(self, steps: int) -> tuple[int, ...]:
        assert self.cache is not None
        return tuple(k for k in self.cache.cache_steps if 0 < k < steps)

    def _insert_later(
        self,
        prompt: str,
        embedding: npt.NDArray[np.float32] | None,
        key: Any,
        latents: dict[int, torch.Tensor],
    ) -> None:
        """Step 6: hand a run's captured latents to the cache's writer thread, off the request
        path; a full backlog drops them, counted (``dropped_inserts``)."""
        with self._lock:
            self._pending = {f for f in self._pending if not f.done()}
            if len(self._pending) >= self.config.pending_inserts:
                self._counts["dropped_inserts"] += 1
                return
            future = self._writer.submit(self._insert, prompt, embedding, key, latents)
            self._pending.add(future)

    def _insert(
        self,
        prompt: str,
        embedding: npt.NDArray[np.float32] | None,
        key: Any,
        latents: dict[int, torch.Tensor],
    ) -> None:
        if self.encoder is None or self.cache is None:
            return
        vector = self.encoder.embed_one(prompt) if embedding is None else embedding
        try:
            self.cache.insert(vector, key, prompt, latents)
        except Exception:
            with self._lock:
                self._counts["failed_inserts"] += 1

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
        if self._lane is not None:
            self._lane.close()
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)
        self._device.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if self.edit_cache is not None:
            self.edit_cache.store.close()
        if self.adapters is not None:
            self.adapters.close()
        self.registry.close()
        if self.cache is not None:
            self.cache.close()


class _Reporter:
    """Turns one request's path through the worker into :class:`Progress` events."""

    def __init__(self, sink: ProgressSink, arrived: float, previews: int, worker_id: str) -> None:
        self._sink = sink
        self._arrived = arrived
        self._previews = previews
        self._worker_id = worker_id
        self._position: int | None = None

    def _send(self, stage: Stage, **fields: Any) -> None:
        elapsed_ms = (time.perf_counter() - self._arrived) * 1e3
        self._sink(Progress(stage, worker_id=self._worker_id, elapsed_ms=elapsed_ms, **fields))

    def queued(self, position: int) -> None:
        if position != self._position:  # the wait polls; say only what changed
            self._position = position
            self._send(Stage.QUEUED, queue_position=position)

    def running(self, start_step: int, total_steps: int) -> StepHook:
        """Send RUNNING; returns the hook that sends each STEP (a step hook of the model)."""
        self._send(Stage.RUNNING, step=start_step, total_steps=total_steps)
        run = total_steps - start_step
        wanted = min(self._previews, run)

        def stepped(done: int, latents: torch.Tensor) -> None:
            preview = b""
            i = done - start_step  # steps of this run done, 1..run
            if wanted and (i * wanted) // run > ((i - 1) * wanted) // run:
                preview = latent_preview(latents)
            self._send(Stage.STEP, step=done, total_steps=total_steps, preview_png=preview)

        return stepped

    def decoding(self, total_steps: int) -> None:
        self._send(Stage.DECODING, step=total_steps, total_steps=total_steps)


def latent_preview(latents: torch.Tensor) -> bytes:
    """A PNG of the latent at its own resolution: its first three channels (the first one
    repeated when it has fewer) min-max scaled to 0..255 as RGB. A glimpse of the layout, not a
    decoded image: no VAE runs."""
    x = latents[0].detach().to("cpu", torch.float32)
    if x.shape[0] < 3:
        x = torch.cat([x, x[:1].expand(3 - x.shape[0], *x.shape[1:])])
    x = x[:3]
    low, high = float(x.min()), float(x.max())
    scaled = (x - low) / (high - low) if high > low else torch.zeros_like(x)
    pixels = (scaled * 255.0).round().to(torch.uint8).permute(1, 2, 0).numpy()
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), mode="RGB").save(out, format="PNG")
    return out.getvalue()


def _stopped(counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """The "stopped:<reason>:<stage>" counters as reason → stage → count."""
    stopped: dict[str, dict[str, int]] = {}
    for key, count in counts.items():
        if key.startswith("stopped:"):
            _, reason, stage = key.split(":")
            stopped.setdefault(reason, {})[stage] = count
    return stopped
