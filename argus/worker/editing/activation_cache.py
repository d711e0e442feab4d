"""The worker's mask-aware activation cache (InstGenIE §3.1, §4.2): which edits use it, under
what key, and how a run records or replays a template's activations.

An inpainting edit of a template the worker has seen replays the template's recorded
transformer-block outputs for the tokens outside its region
(:mod:`argus.worker.editing.masked_blocks`) and computes attention and feed-forward for its
region only. The first edit of a template runs in full and records them (its own region
excepted: a later edit computes those tokens too); records live in an
:class:`~argus.worker.editing.activation_store.ActivationStore` (host memory, LRU by bytes,
then disk).

* **Who uses it**: inpainting edits (a mask) without adapters, on a UNet whose transformer
  blocks the masked forward implements (:func:`~argus.worker.editing.masked_blocks.check_block`).
  img2img changes every token, and a LoRA or ControlNet changes what the blocks compute.
* **The key** names everything a record depends on besides the prompt: the template's pixels
  (:attr:`~argus.request_limits.EditInput.template_digest`, which also seeds the noise outside
  the region), the model, its scheduler, the size, the steps and whether CFG runs (two
  branches or one). The prompt is not in it: the unedited tokens' outputs of an edit of one
  prompt stand in for another's, InstGenIE's approximation (§3.1, Fig. 6); the pixels outside
  the region are pasted back from the template whatever the blocks computed.
* **Queued**: :meth:`EditCache.queued` starts loading a record on disk into host memory while
  the request waits for the GPU (§4.2), and notes where the record was. A record evicted
  between then and the run makes the run a full one that records again, counted as
  ``evicted``; never an error.
* **The device tier** (:class:`~argus.worker.editing.activation_store.DeviceTier`, optional),
  looked up before the store: a recording keeps its rows on the device while they fit, and a
  replay from the host keeps the rows it brought; so a template's later edits cross no PCIe.
* **Staging**: a replay brings each step's rows to the device while the step before runs
  (:class:`~argus.worker.editing.masked_blocks.RowStager`; on CUDA from pinned memory on a side
  stream).
* **Which blocks replay** (Algorithm 1,
  :func:`~argus.worker.editing.activation_store.plan_cache_use`): from measured costs. A block's
  full compute time is learned from the recording runs (forward hooks on each block, one UNet
  call's worth per step, averaged); its time with the cache is that × the share of its tokens
  the edit computes (Table 1: linear in the mask ratio); its load time is the bytes of its
  cached rows per step over the host-to-device copy rate, measured once per worker on the
  model's device and dtype (on a CPU worker that is the fp16-to-fp32 copy a replay makes), and
  0 for a record held on a CUDA device.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from argus.worker.editing.activation_store import ActivationStore, CachePlan, DeviceTier
    from argus.worker.editing.masked_blocks import ActivationRecord, Replay
    from argus.worker.editing.packed_blocks import RowBlocks
    from argus.worker.models.pipelines import DiffusionModel, GenerationSpec, NoisePredictor

OUTCOMES = ("hit", "miss", "evicted")
"""How an edit that may use the cache met it: its template's record replayed; none (the run
records one); or one that was there when the edit was queued and gone when it ran."""

COPY_PROBE_BYTES = 16 * 2**20  # the copy measured once per device and dtype


class EditCacheEvents:
    """What the cache tells metrics (:class:`~argus.worker.metrics.EditCacheMetrics`)."""

    def on_outcome(self, outcome: str) -> None:
        """An edit met the cache: one of :data:`OUTCOMES`."""

    def on_record(self, nbytes: int) -> None:
        """A recording run recorded a template's activations: their bytes."""


@dataclass(frozen=True)
class EditCacheUse:
    """One run's use of the cache (:meth:`EditCache.begin`): the predictor to denoise with
    alone, or the blocks to run in a batch (:class:`~argus.worker.editing.packed_blocks.RowBlocks`,
    for the step batcher), and what to call once the run finished (it stores what a recording
    run recorded, and puts a record a replay gathered on the device in the device tier)."""

    outcome: str  # one of OUTCOMES
    predictor: NoisePredictor | None
    finish: Callable[[], None]
    blocks_cached: int = 0  # blocks replayed from the record (Algorithm 1's choice)
    blocks: int = 0
    rows: RowBlocks | None = None  # the run's blocks inside a batch (``begin(batched=True)``)


class EditCache:
    """The activation cache of one worker: keys, queue-time prefetch, record or replay.
    ``device``: the device tier in front of ``store`` (None: none)."""

    def __init__(
        self,
        store: ActivationStore,
        events: EditCacheEvents | None = None,
        device: DeviceTier | None = None,
    ) -> None:
        self.store = store
        self.device = device
        self._events = events or EditCacheEvents()
        self._lock = threading.Lock()
        self._supported: dict[int, bool] = {}  # id(unet) -> whether its blocks can replay
        self._block_s: dict[tuple[Any, ...], list[float]] = {}  # shape key -> seconds per block
        self._block_tokens: dict[tuple[Any, ...], list[int]] = {}
        self._copy_rate: dict[tuple[str, torch.dtype], float] = {}  # bytes per second
        self._counts = dict.fromkeys(OUTCOMES, 0)

    # -- keys ------------------------------------------------------------------------------

    def key(self, model: DiffusionModel, spec: GenerationSpec, *, adapters: bool) -> str | None:
        """The record key of ``spec`` on ``model``; None when the run cannot use the cache
        (not inpainting, adapters, or blocks the masked forward does not implement)."""
        edit = spec.edit
        if edit is None or edit.region is None or adapters or not self.supports(model):
            return None
        branches = 2 if (spec.guidance_scale or model.default_guidance) > 1.0 else 1
        return ":".join(
            (
                edit.template_digest,
                model.name,
                model.scheduler_name,
                f"{spec.width}x{spec.height}",
                str(spec.steps),
                f"cfg{branches}",
            )
        )

    def supports(self, model: DiffusionModel) -> bool:
        from argus.worker.editing.masked_blocks import (
            UnsupportedBlockError,
            check_block,
            transformer_blocks,
        )

        unet = model.pipeline.unet
        with self._lock:
            known = self._supported.get(id(unet))
        if known is not None:
            return known
        blocks = transformer_blocks(unet)
        try:
            for block in blocks:
                check_block(block)
            supported = bool(blocks)
        except UnsupportedBlockError:
            supported = False
        with self._lock:
            self._supported[id(unet)] = supported
        return supported

    # -- the request path ------------------------------------------------------------------

    def queued(self, key: str) -> bool:
        """A request of ``key`` joined the queue: start loading its record from disk into
        host memory while it waits (unless the device tier holds it). Returns whether a
        record was there."""
        if self.device is not None and key in self.device:
            return True
        present = self.store.tier(key) is not None
        if present:
            self.store.prefetch(key)
        return present

    def begin(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        key: str,
        *,
        was_present: bool,
        batched: bool = False,
    ) -> EditCacheUse:
        """How the run of ``spec`` (under ``key``) denoises: replaying the template's record,
        or in full while recording one. ``was_present``: a record was there at queue time.
        ``batched``: the run is one request of a step batch, which takes the use's ``rows``
        (a recording there learns no block times: the batch's blocks run as one). Called on
        the device thread, before the run."""
        from argus.worker.editing.masked_blocks import (
            ActivationRecord,
            RecordingPredictor,
            ReplayPredictor,
        )
        from argus.worker.editing.packed_blocks import RowRecorder

        region = model.edit_region(spec)
        assert region is not None  # key() let only inpainting through
        found, on_device = self._find(model, key)
        if found is not None:
            record = ActivationRecord.from_tensors(dict(found))
            use = self.plan(model, spec, record, region)
            self._count("hit")
            collect = not on_device and self._room_on_device(model, record)
            predictor = ReplayPredictor(model, record, region, use_cache=use, collect=collect)
            replay = predictor.replay
            kept = functools.partial(self._keep_on_device, key, replay) if collect else _nothing
            return EditCacheUse("hit", predictor, kept, sum(use), len(use), rows=replay)
        outcome = "evicted" if was_present else "miss"
        self._count(outcome)
        device_bytes = self._device_bound(model)
        if batched:
            rows = RowRecorder(region, device_bytes=device_bytes)
            return EditCacheUse(
                outcome,
                None,
                lambda: self._store(key, rows.record, rows.device_copy.tensors()),
                rows=rows,
            )
        recorder = RecordingPredictor(model, region, device_bytes=device_bytes)
        timed = _TimedBlocks(model)

        def predict(
            latents: torch.Tensor, t: torch.Tensor, cond: Any, scheduler: Any, step: int
        ) -> torch.Tensor:
            with timed:
                return recorder(latents, t, cond, scheduler, step)

        def finish() -> None:
            self._learn(self._shape_key(model, spec), timed)
            self._store(key, recorder.record, recorder.device_copy.tensors())

        return EditCacheUse(outcome, predict, finish)

    def _find(self, model: DiffusionModel, key: str) -> tuple[Mapping[str, Any] | None, bool]:
        """The record of ``key`` and whether it came from the device tier (looked up first);
        the store's lookup counts a miss."""
        if self.device is not None and self._device_bound(model) > 0:
            held = self.device.get(key)
            if held is not None:
                return held, True
        return self.store.get(key), False

    def _device_bound(self, model: DiffusionModel) -> int:
        """The device tier's bound on ``model``'s device (0: no tier)."""
        return 0 if self.device is None else self.device.bound(model.device)

    def _room_on_device(self, model: DiffusionModel, record: ActivationRecord) -> bool:
        """Whether a replay of ``record`` from the host gathers it on the device: the tier
        takes a record of its size, and has made room for it beside what it holds."""
        if self._device_bound(model) == 0:
            return False
        assert self.device is not None
        return self.device.make_room(record.nbytes)

    def _keep_on_device(self, key: str, replay: Replay) -> None:
        """After a replay that gathered its record on the device: put it in the device tier
        (a run stopped before its last step gathered only part of it, and is not kept)."""
        tensors = replay.device_record()
        if tensors is not None and self.device is not None:
            self.device.put(key, tensors)

    def _store(
        self,
        key: str,
        record: ActivationRecord,
        on_device: dict[str, torch.Tensor] | None = None,
    ) -> None:
        tensors = record.to_tensors()
        self._events.on_record(sum(t.nbytes for t in tensors.values()))
        self.store.put(key, tensors)
        if on_device is not None and self.device is not None:
            self.device.put(key, on_device)

    # -- Algorithm 1 -----------------------------------------------------------------------

    def plan(
        self,
        model: DiffusionModel,
        spec: GenerationSpec,
        record: ActivationRecord,
        region: torch.Tensor,
    ) -> list[bool]:
        """Per block, replay it from ``record`` or compute all its tokens: Algorithm 1 on the
        measured costs (see the module's docstring); every block replays while no recording
        run of this shape has been timed in this process (a record from disk after a
        restart)."""
        from argus.worker.editing.activation_store import plan_cache_use
        from argus.worker.editing.masked_blocks import plan_tokens, transformer_blocks

        blocks = len(transformer_blocks(model.pipeline.unet))
        shape = self._shape_key(model, spec)
        with self._lock:
            seconds = list(self._block_s.get(shape, ()))
            tokens = list(self._block_tokens.get(shape, ()))
        if len(seconds) != blocks:
            return [True] * blocks
        plans = plan_tokens(region, record)
        rate = self.copy_rate(model)
        step = min(record.steps, default=0)
        with_cache, load = [], []
        for index, (block_s, count) in enumerate(zip(seconds, tokens, strict=True)):
            token_plan = plans.get(count)
            computed = 1.0 if token_plan is None else token_plan.computed.numel() / count
            with_cache.append(block_s * computed)
            rows = record.outputs.get((step, index))
            resident = rows is not None and rows.device.type == "cuda"  # the device tier's
            load.append(0.0 if rows is None or resident else rows.nbytes / rate)
        chosen: CachePlan = plan_cache_use(seconds, with_cache, load)
        return list(chosen.use)

    def copy_rate(self, model: DiffusionModel) -> float:
        """Bytes per second of bringing a float16 record to the model's device and dtype,
        measured once per (device, dtype)."""
        where = (str(model.device), model.dtype)
        with self._lock:
            rate = self._copy_rate.get(where)
        if rate is not None:
            return rate
        probe = torch.zeros(COPY_PROBE_BYTES // 2, dtype=torch.float16)
        _synchronize(model.device)
        began = time.perf_counter()
        probe.to(model.device, model.dtype)
        _synchronize(model.device)
        rate = probe.nbytes / max(time.perf_counter() - began, 1e-9)
        with self._lock:
            self._copy_rate[where] = rate
        return rate

    # -- counts ----------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1
        self._events.on_outcome(outcome)

    @staticmethod
    def _shape_key(model: DiffusionModel, spec: GenerationSpec) -> tuple[Any, ...]:
        cfg = (spec.guidance_scale or model.default_guidance) > 1.0
        return (model.name, spec.width, spec.height, cfg)

    def _learn(self, shape: tuple[Any, ...], timed: _TimedBlocks) -> None:
        seconds, tokens = timed.per_call()
        if not seconds:
            return
        with self._lock:
            known = self._block_s.get(shape)
            if known is not None and len(known) == len(seconds):
                seconds = [(a + b) / 2.0 for a, b in zip(known, seconds, strict=True)]
            self._block_s[shape] = seconds
            self._block_tokens[shape] = tokens


class _TimedBlocks:
    """Times every transformer block of a model's UNet while entered (one UNet call per
    entry), summing over calls: :meth:`per_call` gives the mean seconds per call and each
    block's token count."""

    def __init__(self, model: DiffusionModel) -> None:
        from argus.worker.editing.masked_blocks import transformer_blocks

        self.device = model.device
        self.blocks = transformer_blocks(model.pipeline.unet)
        self.seconds = [0.0] * len(self.blocks)
        self.tokens = [0] * len(self.blocks)
        self.calls = 0
        self._handles: list[Any] = []
        self._began = 0.0

    def __enter__(self) -> _TimedBlocks:
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._start))
            self._handles.append(block.register_forward_hook(self._stop(index)))
        self.calls += 1
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        _synchronize(self.device)
        self._began = time.perf_counter()

    def _stop(self, index: int) -> Callable[..., None]:
        def stop(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            _synchronize(self.device)
            self.seconds[index] += time.perf_counter() - self._began
            self.tokens[index] = int(output.shape[1])

        return stop

    def per_call(self) -> tuple[list[float], list[int]]:
        if not self.calls:
            return [], []
        return [s / self.calls for s in self.seconds], list(self.tokens)


def _nothing() -> None:
    """A use's finish that has nothing to store."""


def _synchronize(device: Any) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
